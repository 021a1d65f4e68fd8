"""asyncsync.torchrl.AsyncSyncScheme driven as torchrl's collectors drive a scheme, without a collector.

The trainer calls ``init_on_sender``, starts spawned processes with the scheme pickled in,
``connect()``s, then ``send()``s; each worker (``tests._torchrl_targets.held_worker``) calls
``init_on_receiver`` and ``connect(worker_idx=)`` on its main thread, as torchrl's runner does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl")

from asyncsync import SyncTimeoutError, WorkerLeftError  # noqa: E402
from asyncsync.torchrl import AsyncSyncScheme  # noqa: E402
from tests._torchrl_targets import VersionNet, held_worker, set_version  # noqa: E402

# The suite's forkserver (torch preloaded, tests/conftest.py), or spawn with
# ASYNCSYNC_START_METHOD=spawn: the scheme pickles the same way under both.
CTX = mp.get_context(os.environ.get("ASYNCSYNC_START_METHOD", "spawn"))
REPLY_S = 120.0  # a spawned worker imports torch and torchrl first: slow on a loaded machine

pytestmark = pytest.mark.timeout(300)


class Worker:
    def __init__(self, scheme: AsyncSyncScheme, idx: int) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=held_worker, args=(scheme, child, idx), name=f"torchrl-held-{idx}")
        self.proc.start()
        child.close()

    def ask(self, cmd: str) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(REPLY_S):
            raise AssertionError(f"no answer to {cmd!r}")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.ask("exit")
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self.conn.close()


def start(n: int, params_map: dict[int, Any] | None = None, **options: Any) -> tuple[AsyncSyncScheme, torch.nn.Module, list[Worker]]:
    """A connected scheme sending *policy* (or each worker its *params_map* entry) to *n* held workers."""
    policy = VersionNet(n=4)
    scheme = AsyncSyncScheme(timeout=REPLY_S, **options)
    if params_map is None:
        scheme.init_on_sender(model_id="policy", model=policy, num_workers=n, ctx=CTX)
    else:
        scheme.init_on_sender(model_id="policy", params_map=params_map, ctx=CTX)
    workers = [Worker(scheme, i) for i in range(n)]
    scheme.connect()  # returns before the workers have applied version 0
    for w in workers:
        assert w.conn.poll(REPLY_S) and w.conn.recv() == "connected"
    return scheme, policy, workers


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Worker):
            thing.stop()
        else:
            thing.shutdown()


def test_import_asyncsync_does_not_import_torchrl() -> None:
    code = "import sys, asyncsync; assert 'torchrl' not in sys.modules, 'torchrl imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_without_torchrl_names_a_pinned_install_that_works() -> None:
    code = "import sys; sys.modules['torchrl'] = None; import asyncsync.torchrl"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "pip install torch==2.13.0 torchrl==0.14.1 tensordict==0.14.3" in done.stderr
    assert "tensordict<0.15" in done.stderr


def test_pickled_scheme_is_small_and_holds_no_tensor() -> None:
    scheme = AsyncSyncScheme()
    state = scheme.__getstate__()
    data = pickle.dumps(state)
    assert len(data) < 4096
    assert b"torch._utils" not in data and b"_rebuild_tensor" not in data


def test_slow_worker_gets_only_the_newest_version_and_the_trainer_never_waits(cleanup: list[Any]) -> None:
    scheme, policy, workers = start(1, sync=False)
    cleanup += [scheme, *workers]
    (w,) = workers
    assert w.ask("hold") == "held"  # as a long forward pass would: no commit until it ends
    for v in range(1, 6):
        set_version(policy, v)
        assert scheme.send() == v  # sync=False: returns once the snapshot is taken
    assert w.ask("state")[0] == 0  # still version 0: nothing committed inside the hold
    assert w.ask("release") == "released"
    scheme.wait_async(5)
    version, updates, skipped, lo, hi = w.ask("state")
    assert (version, lo, hi) == (5, 5.0, 5.0)
    assert updates <= 3 and skipped >= 3  # version 0, at most one staged version, then 5: latest wins
    stats = scheme.statistics()
    assert [(s.worker_idx, s.applied_version, s.lag) for s in stats.workers] == [(0, 5, 0)]


def test_send_timeout_names_the_worker_that_holds_and_receive_inside_a_hold_commits_nothing(cleanup: list[Any]) -> None:
    scheme, policy, workers = start(1)
    cleanup += [scheme, *workers]
    (w,) = workers
    assert w.ask("hold") == "held"
    set_version(policy, 1)
    with pytest.raises(SyncTimeoutError) as info:
        scheme.send(timeout=0.5)
    assert info.value.pending == {0: 0}
    assert w.ask("receive_held") == (None, True)  # inside a forward (or hold): never commits
    assert w.ask("release") == "released"
    scheme.wait_async(1)  # the version that timed out lands once the hold ends
    assert w.ask("state")[:1] == (1,)
    set_version(policy, 2)
    assert scheme.send() == 2


def test_repointed_model_gets_every_later_version_and_worker_shutdown_affects_only_itself(cleanup: list[Any]) -> None:
    scheme, policy, workers = start(2)
    cleanup += [scheme, *workers]
    assert workers[1].ask("repoint") == "repointed"  # the runner re-points at the policy it really calls
    set_version(policy, 1)
    assert scheme.send() == 1
    assert workers[1].ask("state")[3:] == (1.0, 1.0)
    tag, values = workers[0].ask("shutdown")
    assert (tag, values) == ("closed", [1.0] * 4)  # keeps the version it runs
    set_version(policy, 2)
    with pytest.raises(WorkerLeftError, match="worker 0") as left:
        scheme.send()  # it still reaches the living worker
    assert left.value.applied_by == (1,)
    assert workers[1].ask("state")[3:] == (2.0, 2.0)
    assert scheme.send(worker_ids=[1]) == 3


def test_policy_the_worker_calls_gets_each_version_after_its_tensors_are_replaced(cleanup: list[Any]) -> None:
    scheme, policy, workers = start(1)
    cleanup += [scheme, *workers]
    (w,) = workers
    assert w.ask("wrap") == "wrapped"  # it calls the received module itself
    set_version(policy, 1)
    scheme.send()
    assert w.ask("state")[3:] == (1.0, 1.0)
    for step, cmd in enumerate(["swap_inner", "assign"], start=2):  # then a copy; then new tensors in it
        w.ask(cmd)
        set_version(policy, step)
        assert scheme.send() == step
        assert w.ask("state")[3:] == (float(step), float(step)), cmd


def test_worker_whose_policy_cannot_hold_the_weights_leaves_instead_of_acking_them(cleanup: list[Any]) -> None:
    scheme, policy, workers = start(1)
    cleanup += [scheme, *workers]
    (w,) = workers
    assert w.ask("repoint") == "repointed"
    assert w.ask("reshape") == "reshaped"
    set_version(policy, 1)
    with pytest.raises(WorkerLeftError, match=r"worker 0 .*ps\.0\[3\], which cannot hold the weights it receives ps\.0\[8\]"):
        scheme.send()


def test_repointing_the_policy_inside_a_hold_is_refused_and_commits_go_on(cleanup: list[Any]) -> None:
    scheme, policy, workers = start(1)
    cleanup += [scheme, *workers]
    (w,) = workers
    assert w.ask("repoint_held") == "RuntimeError"
    set_version(policy, 1)
    assert scheme.send() == 1
    assert w.ask("state")[3:] == (1.0, 1.0)


def test_per_worker_params_map_gives_each_worker_its_entry_until_a_per_worker_send_replaces_one(cleanup: list[Any]) -> None:
    from tensordict import TensorDict

    own = [VersionNet(n=4), VersionNet(n=4)]
    for i, net in enumerate(own):
        set_version(net, 10 + i)
    entries = {i: TensorDict.from_module(net) for i, net in enumerate(own)}
    scheme, _, workers = start(2, params_map=entries, per_worker_weights=True)
    cleanup += [scheme, *workers]
    assert [w.ask("state")[3:] for w in workers] == [(10.0, 10.0), (11.0, 11.0)]
    set_version(own[0], 7)
    assert scheme.send({1: entries[0]}) == 1  # worker 1 only: worker 0's own entry is left as it is
    assert [w.ask("state")[3:] for w in workers] == [(10.0, 10.0), (7.0, 7.0)]
    set_version(own[1], 12)
    assert scheme.send() == 2  # each worker its own entry again, read now
    assert [w.ask("state")[3:] for w in workers] == [(7.0, 7.0), (12.0, 12.0)]


def test_bound_policy_whose_tensors_are_replaced_gets_each_version(cleanup: list[Any]) -> None:
    scheme, policy, workers = start(1)
    cleanup += [scheme, *workers]
    (w,) = workers
    assert w.ask("assign") == "assigned"  # the module the receiver was given, re-parameterised
    set_version(policy, 1)
    assert scheme.send() == 1
    assert w.ask("state")[3:] == (1.0, 1.0)
