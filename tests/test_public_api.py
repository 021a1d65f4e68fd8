"""The public names, pinned (as anyio's ``test_all_attributes`` and httpx's
``test_exported_members`` do): a name added or removed is a decision, made here."""

from __future__ import annotations

import asyncsync
import asyncsync.testing
from asyncsync import DistributedWeightSyncScheme, MultiProcessWeightSyncScheme, Receiver, Sender

ASYNCSYNC = {
    "AsyncQueue", "AsyncSyncError", "AuthenticationError", "BrokenChannelError", "CapacityError", "ClosedError",
    "DEFAULT", "DistributedStatistics", "DistributedWeightSyncScheme", "HostLostError", "HostStatistics", "Layout", "MembershipEvent",
    "MultiProcessWeightSyncScheme", "ProtocolError", "Receiver", "ReceiverStatistics", "Sender", "SenderDiedError",
    "SenderStatistics", "SyncTimeoutError", "TensorSpec", "WeightsError", "WorkerAddress", "WorkerDiedError",
    "WorkerError", "WorkerGoneError", "WorkerGroup", "WorkerLeftError", "WorkerProcessError", "WorkerStatistics",
    "WouldBlock", "flatten_parameters", "loopback_worker", "spawn_workers",
}  # fmt: skip
TESTING = {"Faults", "LeakError", "LoopbackHosts", "LoopbackWorkers", "ProcessWorkers", "no_leaks", "open_loopback", "open_loopback_hosts", "open_workers"}
SENDER = {
    "aclose", "applied_versions", "connect", "layout", "members", "membership", "retire", "send", "send_async",
    "sent_version", "statistics", "version", "wait_async", "wait_dead", "wait_joined", "worker_ids",
}  # fmt: skip
RECEIVER = {
    "aclose", "commit", "connect", "context", "device", "model", "on_update", "poll_nowait", "statistics", "stopped",
    "strategy", "update_pending", "version", "wait_for_version", "wait_stopped",
}  # fmt: skip
BOTH_SCHEMES = {
    "aclose", "check_finite", "commit", "commit_kind", "commit_mode", "connect", "init_on_receiver", "init_on_sender",
    "listen", "on_worker_error", "options", "poll_nowait", "receiver", "send", "send_async", "sender", "statistics",
    "strategy", "sync", "timeout", "transfer_dtype", "update_pending", "version", "wait_async", "wait_for_version",
    "wait_stopped",
}  # fmt: skip
LOCAL_SCHEME = BOTH_SCHEMES | {"add_worker", "attach", "listener", "max_slots", "num_slots", "transport", "watch_process"}
DIST_SCHEME = BOTH_SCHEMES | {
    "hosts", "init_on_relay", "local", "master_addr", "master_port", "rank", "relay", "wait_host_joined", "wait_lost",
    "worker", "world_size",
}  # fmt: skip


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_the_packages_export_exactly_their_public_names() -> None:
    assert set(asyncsync.__all__) == ASYNCSYNC
    assert set(asyncsync.testing.__all__) == TESTING
    for module in (asyncsync, asyncsync.testing):
        for name in module.__all__:
            assert getattr(module, name).__module__.startswith("asyncsync"), name


def test_the_sender_has_only_what_users_call() -> None:
    assert public(Sender) == SENDER


def test_the_receiver_and_the_schemes_have_their_pinned_attributes() -> None:
    assert public(Receiver) == RECEIVER
    assert public(MultiProcessWeightSyncScheme) == LOCAL_SCHEME
    assert public(DistributedWeightSyncScheme) == DIST_SCHEME


def test_the_errors_form_one_tree() -> None:
    errors = [getattr(asyncsync, n) for n in ASYNCSYNC if isinstance(getattr(asyncsync, n), type) and issubclass(getattr(asyncsync, n), BaseException)]
    assert all(issubclass(e, asyncsync.AsyncSyncError) for e in errors)
    gone = {asyncsync.WorkerDiedError, asyncsync.WorkerLeftError, asyncsync.HostLostError}
    assert {e for e in errors if issubclass(e, asyncsync.WorkerGoneError) and e is not asyncsync.WorkerGoneError} == gone
    assert not issubclass(asyncsync.WorkerLeftError, asyncsync.WorkerDiedError)  # a clean leave is not a death
    assert not issubclass(asyncsync.HostLostError, asyncsync.WorkerDiedError)
