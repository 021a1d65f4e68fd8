"""Polled receivers (``init_on_receiver(..., poll=True)``), across real processes.

The sender announces each version in the worker's shared-memory mailbox; the worker commits
it at ``poll_nowait()`` and acks it there too, then writes the sender's wake (one eventfd
for all its polled workers). An empty poll touches no socket (counted by a wrapper around
the receiver's socket), nor does a poll that commits; every version sent with ``send()``
is committed by a poll, in order, and the newest wins, also when the trainer's loop reads
no ack in between (versions sent while one waits in the mailbox replace it, and the
worker's next poll commits the newest); a version the worker cannot apply
keeps its own weights and reaches the sender as a :class:`WorkerError`; a cancelled wait
on the sender loses nothing; the ack of a worker that leaves right after its commit is
not lost; a polled worker that is killed is named at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from anyio import wait_all_tasks_blocked

from asyncsync import (
    MultiProcessWeightSyncScheme,
    SyncTimeoutError,
    WorkerDiedError,
    WorkerError,
    WorkerProcessError,
    spawn_workers,
)
from asyncsync._core._ownership import slot_bound
from asyncsync._io._queues import AsyncQueue
from asyncsync._wire._local import Mailbox, Poll, decode_from_worker, decode_to_worker, encode
from tests._targets import fill_, make_model

# Spawned workers import torch: on a loaded machine that alone can take most of a minute.
pytestmark = pytest.mark.timeout(240)
START_S = 120.0  # the scheme's bound on every wait, connect included
EMPTY_POLLS = 10_000


class _CountingSocket:
    """Delegates to a socket and counts every call made through it."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._sock, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def _value(model: torch.nn.Module) -> float:
    values = {v for p in model.parameters() for v in p.detach().flatten().tolist()}
    return values.pop() if len(values) == 1 else float("nan")


async def polled_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, ctrl: Any, kind: str = "mlp") -> dict[str, Any]:
    """A polled worker driven by commands on *ctrl*; its background poller yields to the
    loop every 64 polls (so that the loop can read commands and map slots)."""
    torch.set_num_threads(1)
    model = make_model(kind)
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    scheme.init_on_receiver(worker_idx=worker_idx, model=model, poll=True)
    q: AsyncQueue[Any] = AsyncQueue(ctrl)
    committed: list[int] = []
    polling = asyncio.Event()
    stop = asyncio.Event()

    async def poller() -> None:
        while not stop.is_set():
            await polling.wait()
            for _ in range(64):
                version = scheme.poll_nowait()
                if version is not None:
                    committed.append(version)
            await asyncio.sleep(0)

    async with scheme:
        task = asyncio.ensure_future(poller())
        try:
            while True:
                req = await q.get()
                cmd = req[0]
                if cmd == "empty":  # polls with nothing new, none of them touching the socket
                    receiver = scheme.receiver
                    queue = receiver._queue._end  # the framed pipe under the queue
                    counter = _CountingSocket(queue._sock)
                    queue._sock = counter  # type: ignore[assignment]
                    try:
                        results = {scheme.poll_nowait() for _ in range(EMPTY_POLLS)}
                    finally:
                        queue._sock = counter._sock
                    await q.put((sorted(results, key=repr), counter.calls, scheme.version))
                elif cmd == "commit":  # the poll that commits the next version, its socket calls counted
                    queue = scheme.receiver._queue._end
                    while True:
                        counter = _CountingSocket(queue._sock)
                        queue._sock = counter  # type: ignore[assignment]
                        try:
                            got = scheme.poll_nowait()
                        finally:
                            queue._sock = counter._sock
                        if got is not None:
                            break
                        await asyncio.sleep(0.001)  # its slot may still need mapping by the loop
                    await q.put((got, counter.calls))
                elif cmd == "commit-and-leave":  # commit, then end at once: no await between
                    while (got := scheme.poll_nowait()) is None:
                        await asyncio.sleep(0.001)
                    committed.append(got)
                    break
                elif cmd == "poll":
                    polling.set()
                    await q.put("polling")
                elif cmd == "pause":
                    polling.clear()
                    await asyncio.sleep(0)  # the poller ends its round of 64 polls first
                    await q.put(scheme.version)
                elif cmd == "skipped":
                    await q.put(scheme.statistics().skipped)  # type: ignore[union-attr]
                elif cmd == "report":
                    same_as_own = all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
                    stats = scheme.statistics()
                    await q.put((list(committed), scheme.version, _value(model), same_as_own, stats.rejected))  # type: ignore[union-attr]
                elif cmd == "wait_for":  # the newcomer's wait: no poll meanwhile
                    try:
                        await q.put(await scheme.wait_for_version(req[1], timeout=req[2]))
                    except SyncTimeoutError as exc:
                        await q.put(str(exc))
                elif cmd == "exit":
                    break
        finally:
            stop.set()
            polling.set()
            await task
    return {"version": scheme.version}


async def _ask(q: AsyncQueue[Any], *cmd: Any) -> Any:
    await q.put(cmd)
    return await asyncio.wait_for(q.get(), START_S)


class _Ctrl:
    def __init__(self, n: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        pairs = [ctx.Pipe(duplex=True) for _ in range(n)]
        self.theirs = [b for _, b in pairs]
        self.ours = [AsyncQueue(a) for a, _ in pairs]

    async def aclose(self) -> None:
        for q in self.ours:
            await q.aclose()
        for c in self.theirs:
            c.close()


def test_the_poll_messages_round_trip() -> None:
    assert decode_from_worker(encode(Poll(3))) == Poll(3)
    assert decode_to_worker(encode(Mailbox(64))) == Mailbox(64)
    with pytest.raises(ValueError, match="Mailbox"):
        encode(Mailbox(0))


def test_poll_needs_auto_commit() -> None:
    scheme = MultiProcessWeightSyncScheme(commit_mode="manual")
    scheme.init_on_sender(model=make_model(), num_workers=1)
    from asyncsync.testing import loopback_worker

    worker = loopback_worker(scheme, 0)
    with pytest.raises(ValueError, match="commit_mode='auto'"):
        worker.init_on_receiver(worker_idx=0, model=make_model(), poll=True)


@contextlib.asynccontextmanager
async def _polled_cluster(kinds: list[str], **options: Any) -> AsyncIterator[tuple[torch.nn.Module, MultiProcessWeightSyncScheme, list[AsyncQueue[Any]], Any]]:
    """A trainer's scheme and one spawned :func:`polled_worker` per entry of *kinds* (its
    model), with their command queues; the channels are closed at the end."""
    trainer = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=START_S, **options)
    scheme.init_on_sender(model=trainer, num_workers=len(kinds))
    ctrl = _Ctrl(len(kinds))
    try:
        async with spawn_workers(_kinded_worker, len(kinds), args=(scheme, ctrl.theirs, kinds), scheme=scheme) as workers:
            yield trainer, scheme, ctrl.ours, workers
    finally:
        await ctrl.aclose()


async def _kinded_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, ctrls: list[Any], kinds: list[str]) -> dict[str, Any]:
    return await polled_worker(worker_idx, scheme, ctrls[worker_idx], kinds[worker_idx])


@pytest.mark.parametrize(
    "options",
    [{}, {"commit": "copy"}, {"transfer_dtype": torch.bfloat16}, {"transport": "queue"}],
    ids=["swap", "copy", "bf16-staged", "queue-transient-slots"],
)
async def test_an_empty_poll_touches_no_socket_and_every_version_is_committed_by_a_poll(options: dict[str, Any]) -> None:
    async with _polled_cluster(["mlp"], **options) as (trainer, scheme, (q,), workers):
        async with scheme:
            results, socket_calls, version = await _ask(q, "empty")
            assert results == [None] and socket_calls == 0 and version == 0
            await _ask(q, "poll")
            sent = []
            for value in range(1, 21):
                fill_(trainer, float(value))
                sent.append(await scheme.send())  # returns once a poll committed it
            # A burst: versions sent while one is in flight are skipped, the newest wins.
            for value in range(21, 31):
                fill_(trainer, float(value))
                last = await scheme.send_async()
            await scheme.wait_async(last)
            committed, version, value_now, _, rejected = await _ask(q, "report")
            assert version == last and value_now == 30.0 and rejected == 0
            assert committed == sorted(set(committed)) and committed[-1] == last
            assert set(sent) <= set(committed)  # each send() waited for its commit
            assert scheme.sender.applied_versions() == {0: last}
            assert scheme.statistics().worker(0).in_flight_version is None
            await q.put(("exit",))
        assert await workers.join(START_S) == {0: {"version": last}}


async def test_a_polled_worker_commits_the_newest_of_the_versions_sent_since_its_last_poll() -> None:
    """Several ``send_async()`` while the worker does not poll (the version in its mailbox
    unanswered; the trainer's loop has no ack to read): each writes the newest over the
    one waiting, and the worker's next poll commits the newest, the others skipped. The
    replaced versions' slots are free again at once: no slot is added for the burst."""
    async with _polled_cluster(["mlp"]) as (trainer, scheme, (q,), workers):
        async with scheme:
            for value in (1.0, 2.0, 3.0):
                fill_(trainer, value)
                await scheme.send_async()
            # its polls commit nothing while a new slot is still being mapped, then the newest
            assert await _ask(q, "commit") == (3, 0)
            # slots: live (version 0), version 1's (replaced, then reused for 3), version 2's
            assert scheme.statistics().slots == 3
            for value in (4.0, 5.0):  # version 3's ack may still be unread: then the send takes it
                fill_(trainer, value)
                await scheme.send_async()
            assert await _ask(q, "commit") == (5, 0)
            await scheme.wait_async(5)
            assert scheme.sender.applied_versions() == {0: 5}
            assert scheme.statistics().worker(0).in_flight_version is None
            committed, version, value_now, _, rejected = await _ask(q, "report")
            assert (version, value_now, rejected) == (5, 5.0, 0)
            assert await _ask(q, "skipped") == 3  # versions 1, 2 and 4
            await q.put(("exit",))
        assert await workers.join(START_S) == {0: {"version": 5}}


async def _checking_poller(worker_idx: int, scheme: MultiProcessWeightSyncScheme, ctrls: list[Any]) -> int:
    """Spins on ``poll_nowait()`` (yielding to its loop every 64 polls) until its channel
    says stop, then answers ``(versions committed, polls that found the model changed)``:
    before each poll the model must still be the version last committed (version k is
    filled with the value k), else the trainer wrote a slot the worker ran from."""
    torch.set_num_threads(1)
    model = make_model()
    scheme.init_on_receiver(worker_idx=worker_idx, model=model, poll=True)
    q: AsyncQueue[Any] = AsyncQueue(ctrls[worker_idx])
    committed: list[int] = []
    changed = 0
    async with scheme:
        stop = asyncio.ensure_future(q.get())
        while not stop.done():
            for _ in range(64):
                if committed and _value(model) != committed[-1]:
                    changed += 1
                got = scheme.poll_nowait()
                if got is not None:
                    committed.append(got)
            await asyncio.sleep(0)
        await q.put((committed, changed))
    return scheme.version


async def test_a_spinning_polled_worker_under_a_burst_of_sends_never_runs_from_a_slot_being_rewritten() -> None:
    """Sends as fast as the trainer can, the worker polling all the while: versions in its
    mailbox are replaced while it may be claiming them (each interleaving of the claim),
    and a replaced slot is written again only once the worker cannot be running from it
    (the ledger's invariants are checked at every step, the memory bound included)."""
    trainer = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=START_S)
    scheme.init_on_sender(model=trainer, num_workers=1)
    ctrl = _Ctrl(1)
    try:
        async with spawn_workers(_checking_poller, 1, args=(scheme, ctrl.theirs), scheme=scheme) as workers:
            async with scheme:
                for k in range(1, 301):
                    fill_(trainer, float(k))
                    await scheme.send_async()
                    if k % 3 == 0:
                        await asyncio.sleep(0)  # now and then the loop reads acks between two sends
                await scheme.wait_async(300)
                committed, changed = await _ask(ctrl.ours[0], "stop")
                assert changed == 0
                assert committed == sorted(set(committed)) and committed[-1] == 300
                assert scheme.statistics().slots <= slot_bound(1, manual=False, latest=1, writing=1, polled=1)
            assert await workers.join(START_S) == {0: 300}
    finally:
        await ctrl.aclose()


def _eventfds() -> int:
    """Eventfds open in this process."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    return n


async def test_a_committing_poll_acks_without_the_socket_and_all_polled_workers_share_one_wake() -> None:
    before = _eventfds()
    async with _polled_cluster(["mlp", "mlp"]) as (trainer, scheme, qs, workers):
        async with scheme:
            assert _eventfds() == before + 1  # one wake for both polled workers
            for value in (1.0, 2.0):
                fill_(trainer, value)
                version = await scheme.send_async()
                for q in qs:
                    got, socket_calls = await _ask(q, "commit")
                    assert (got, socket_calls) == (version, 0)
                await scheme.wait_async(version)  # the acks came through shared memory
                assert scheme.sender.applied_versions() == {0: version, 1: version}
            stats = scheme.statistics()
            assert all(w.commit_ms > 0 for w in stats.workers)  # the ack words carry the timings
            for q in qs:
                await q.put(("exit",))
        assert _eventfds() == before  # closed with the sender
        await workers.join(START_S)


async def test_the_ack_of_a_polled_worker_that_leaves_right_after_its_commit_is_not_lost() -> None:
    async with _polled_cluster(["mlp"]) as (trainer, scheme, (q,), workers):
        async with scheme:
            fill_(trainer, 4.0)
            version = await scheme.send_async()
            await q.put(("commit-and-leave",))  # commits it, then closes: its Bye follows the ack
            await scheme.sender.wait_dead(0, timeout=START_S)
            assert scheme.statistics().worker(0).state == "left"
            assert scheme.sender.applied_versions() == {0: version}
        assert await workers.join(START_S) == {0: {"version": version}}


async def test_a_version_the_polled_worker_cannot_apply_keeps_its_weights_and_raises_on_the_sender() -> None:
    # worker 1's model does not fit the sent layout
    async with _polled_cluster(["mlp", "wide"]) as (trainer, scheme, qs, workers):
        with pytest.raises(WorkerError, match="worker 1"):
            await scheme.connect()  # version 0 is refused by worker 1 (through its task)
        for q in qs:
            await _ask(q, "poll")
        fill_(trainer, 5.0)
        with pytest.raises(WorkerError, match="worker 1") as info:
            await scheme.send()  # version 1: worker 1 refuses it at a poll
        assert info.value.worker_idx == 1 and "does not fit" in str(info.value)
        # the send raised at worker 1's refusal; worker 0 commits version 1 at its own next poll
        await scheme.wait_async(1, worker_ids=[0])
        committed0, version0, value0, _, rejected0 = await _ask(qs[0], "report")
        committed1, version1, _, same_as_own1, rejected1 = await _ask(qs[1], "report")
        assert (committed0, version0, value0, rejected0) == ([1], 1, 5.0, 0)
        assert (committed1, version1, same_as_own1, rejected1) == ([], -1, True, 2)
        fill_(trainer, 6.0)
        version = await scheme.send(worker_ids=[0])  # the good worker goes on
        assert (await _ask(qs[0], "report"))[:3] == ([1, version], version, 6.0)
        for q in qs:
            await q.put(("exit",))
        await scheme.aclose()
        await workers.join(START_S)


async def test_a_cancelled_wait_loses_nothing_and_a_timed_out_one_names_the_polled_worker() -> None:
    async with _polled_cluster(["mlp"]) as (trainer, scheme, (q,), workers):
        async with scheme:
            fill_(trainer, 2.0)
            version = await scheme.send_async()  # the worker does not poll: nothing commits it
            waiter = asyncio.ensure_future(scheme.wait_async(version))
            await asyncio.sleep(0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            with pytest.raises(SyncTimeoutError, match="0") as info:
                await scheme.wait_async(version, timeout=0.05)
            assert "worker 0 is polled (poll=True): a polled worker applies a version only when its loop calls receiver.poll_nowait()" in str(info.value)
            assert scheme.sender.applied_versions() == {0: 0}
            await _ask(q, "poll")
            await scheme.wait_async(version)  # the ack the cancelled waiter missed is not lost
            assert (await _ask(q, "report"))[:3] == ([version], version, 2.0)
            await q.put(("exit",))
        await workers.join(START_S)


async def test_a_polled_workers_wait_for_version_that_times_out_says_to_poll() -> None:
    async with _polled_cluster(["mlp"]) as (trainer, scheme, (q,), workers):
        async with scheme:
            fill_(trainer, 3.0)
            version = await scheme.send_async()  # nothing polls in the worker: nothing commits it
            message = await _ask(q, "wait_for", version, 0.2)
            assert message == (
                f"worker 0 waiting for version {version} timed out after 0.2 s; no answer from worker 0 (at version 0). "
                "Worker 0 is polled (init_on_receiver(..., poll=True)): its model takes a new version only in poll_nowait(), "
                "which wait_for_version() does not call. Call scheme.poll_nowait() between the worker's steps (and wait in "
                "another task), or poll until it returns the version (see docs/polling.md)"
            ), message
            await _ask(q, "poll")
            assert await _ask(q, "wait_for", version, START_S) == version  # with a poller beside it, it returns
            await scheme.wait_async(version)
            await q.put(("exit",))
        await workers.join(START_S)


async def test_a_killed_polled_worker_is_named() -> None:
    with pytest.raises(WorkerProcessError, match="worker 0.*-9"):  # the group reports it too
        async with _polled_cluster(["mlp"]) as (trainer, scheme, (q,), workers):
            async with scheme:
                await _ask(q, "poll")
                fill_(trainer, 3.0)
                await scheme.send()
                workers.kill(0)
                await scheme.sender.wait_dead(0, timeout=START_S)
                fill_(trainer, 4.0)
                with pytest.raises(WorkerDiedError, match="worker 0") as info:
                    await scheme.send()
                assert info.value.exitcode == -signal.SIGKILL
                assert scheme.statistics().worker(0).state == "dead"


@pytest.mark.timeout(600)
def test_the_local_state_machine_drives_a_polled_worker() -> None:
    from hypothesis import HealthCheck, settings

    from asyncsync import _stateful

    machine = type("PolledMachine", (_stateful.ClusterMachine,), {"transports": ("local",), "always_poll": True})
    _stateful.ClusterMachine.steps = 0
    quick = settings(max_examples=12, stateful_step_count=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    _stateful.run_without_leaks(machine, quick)
    assert _stateful.ClusterMachine.steps >= 12


def test_the_polled_env_server_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``python examples/polled_env_server.py --updates 5 --envs 2``, run in this process
    (its worker comes from the suite's forkserver)."""
    from pathlib import Path

    from tests._script_runner import run_here

    run_here(Path(__file__).resolve().parents[1] / "examples" / "polled_env_server.py", "--updates", "5", "--envs", "2")
    out = capsys.readouterr().out
    assert "sent 5 versions" in out and "ends at version 5" in out, out


@pytest.mark.timeout(300)
def test_the_bench_measures_publish_to_commit_for_polled_workers() -> None:
    from asyncsync.bench._run import run_rows

    (row,) = run_rows(["shm-poll"], ["10k"], [1], 5, echo=False, floors=False, memory=False)
    assert row["transport"] == "shm-poll" and row["repeats"] == 5
    # timed versions were committed by polls (NaN: none), each poll ending after it began;
    # the trainer's stamp comes after send_async returned, so a poll may begin before it
    assert math.isfinite(row["publish_to_commit_us"]) and row["commit_poll_us"] > 0
    assert row["publish_to_poll_us"] <= row["publish_to_commit_us"] <= row["publish_to_commit_p90_us"]


def _attached_poller(address: str, until: int, report: Any) -> None:
    """A program asyncsync does not start: attaches by *address* as worker 0, polls until
    its model runs version *until*, then reports the versions its polls committed."""

    async def main() -> list[int]:
        model = make_model()
        scheme = MultiProcessWeightSyncScheme.attach(address, worker_idx=0)
        scheme.init_on_receiver(model=model, poll=True)
        committed: list[int] = []
        async with scheme:
            deadline = asyncio.get_running_loop().time() + START_S
            while scheme.version < until and asyncio.get_running_loop().time() < deadline:
                got = scheme.poll_nowait()
                if got is not None:
                    committed.append(got)
                await asyncio.sleep(0.001)
        return committed

    report.send(asyncio.run(main()))
    report.close()


async def test_a_polled_worker_that_attaches_by_address_acks_through_shared_memory() -> None:
    import multiprocessing as mp

    trainer = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=START_S)
    scheme.init_on_sender(model=trainer, num_workers=1)
    address = await scheme.listen()
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_attached_poller, args=(str(address), 3, theirs))
    process.start()
    theirs.close()
    try:
        async with scheme:  # the program attached and applied version 0
            for value in (1.0, 2.0, 3.0):
                fill_(trainer, value)
                await scheme.send()  # returns once its poll committed it and its ack came back
            assert scheme.sender.applied_versions() == {0: 3}
            link = scheme._transport._workers[0].link  # type: ignore[union-attr]
            assert link is not None and link.polled is not None and list(link.polled.links) == [link]  # on the shared wake
            committed = await asyncio.wait_for(asyncio.to_thread(ours.recv), START_S)
        assert committed == [1, 2, 3]
        await asyncio.to_thread(process.join, START_S)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(10)
        ours.close()


async def _worker_that_says_hello_first(worker_idx: int, scheme: MultiProcessWeightSyncScheme, hello_sent: Any, n_in: int) -> int:
    """A polled worker whose ``Hello`` and ``Poll`` reach the trainer before the trainer's
    connect: they are sent at once when its connect starts, then it tells the test."""
    torch.set_num_threads(1)
    scheme.init_on_receiver(worker_idx=worker_idx, model=torch.nn.Linear(n_in, 2), poll=True)
    connecting = asyncio.ensure_future(scheme.connect())
    await wait_all_tasks_blocked()  # connect() waits for its first weights: Hello and Poll are written
    hello_sent.set()
    try:
        await connecting  # returns only if the initial version arrived without a poll
        while not scheme.receiver.stopped:
            scheme.poll_nowait()
            await asyncio.sleep(0.001)
    finally:
        await scheme.aclose()
    return scheme.version


async def test_a_polled_worker_connects_when_its_mailbox_exists_before_the_initial_version() -> None:
    """The trainer handles the worker's ``Hello`` and ``Poll`` (so it has a mailbox) while
    its connect copies the initial version on a thread (a model above the thread-copy
    size). The worker's connect waits for that version without polling: it must come as a
    message, not in the mailbox, or the worker waits for it until its timeout."""
    import multiprocessing as mp

    from asyncsync._core._offload import THREAD_COPY_BYTES

    n_in = 2 * THREAD_COPY_BYTES // (2 * 4)  # Linear(n_in, 2): twice the thread-copy size
    hello_sent = mp.get_context("spawn").Event()
    trainer = torch.nn.Linear(n_in, 2)
    scheme = MultiProcessWeightSyncScheme(strategy="tensordict", timeout=START_S)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with spawn_workers(_worker_that_says_hello_first, 1, args=(scheme, hello_sent, n_in), scheme=scheme, start_timeout=START_S) as workers:
        assert await asyncio.to_thread(hello_sent.wait, START_S)
        async with scheme:
            fill_(trainer, 2.0)
            version = await scheme.send()
            assert scheme.sender.applied_versions() == {0: version}  # and later ones through the mailbox
        assert await workers.join(START_S) == {0: version}


async def test_the_soak_drives_polled_workers_beside_event_driven_ones() -> None:
    """``python -m asyncsync.soak --poll``, briefly: worker 1 polls, worker 0 does not; kills,
    restarts and cancelled sends; every kill detected, the final weights right, no leak."""
    from asyncsync.soak import soak

    c = await soak(minutes=0.1, workers=2, n_params=10_000, kill_every=2.0, poll=True)
    assert c["sends"] > 0 and c["detected"] == c["faults"], c
    assert c["wrong"] == 0 and c["leaks"] == 0, c
