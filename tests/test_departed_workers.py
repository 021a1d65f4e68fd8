"""A worker that is gone keeps its last applied version visible, with its state, and that
version never satisfies a wait: locally across processes, and across hosts on the loopback.
A target that is gone never keeps the living targets from a version, whenever it went: the
call raises its error once they answered, naming those that applied it."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Awaitable, Callable

import pytest

from asyncsync import HostLostError, WorkerDiedError, WorkerGoneError, WorkerLeftError, spawn_workers
from asyncsync.testing import open_loopback_hosts
from tests._targets import fill_, make_model, probe_worker
from tests.conftest import CTX, Cluster, Probe


@pytest.mark.timeout(300)  # (spawned workers import torch: slow on a busy machine)
async def test_a_worker_that_left_keeps_its_applied_version_and_waits_do_not_count_it() -> None:
    c = Cluster.of(["mlp", "mlp"], timeout=120)
    replacement = None
    try:
        await c.start()
        assert await c.probes[1].ask("leave") == 0  # closes its receiver at version 0
        await c.scheme.sender.wait_dead(1, timeout=30)
        assert c.scheme.sender.applied_versions() == {0: 0, 1: 0}
        stats = c.scheme.statistics().worker(1)
        assert (stats.state, stats.applied_version, stats.sent_version, stats.generation) == ("left", 0, 0, 1)
        # Its old answer does not count, with or without a quorum.
        with pytest.raises(WorkerLeftError, match="worker 1"):
            await c.scheme.wait_async(0, worker_ids=[1])
        with pytest.raises(WorkerLeftError, match="worker 1"):
            await c.scheme.wait_async(0, worker_ids=[0, 1], quorum=2)
        v = await c.scheme.send(worker_ids=[0])
        assert c.scheme.sender.applied_versions() == {0: v, 1: 0}
        assert c.scheme.statistics().worker(1).lag == v

        # A replacement attaches on a new connection: it starts from nothing, and gets version 0
        # (the newest sent to worker 1), not a credit for the old connection's answer.
        a, b = CTX.Pipe()
        replacement = (Probe(a), spawn_workers(probe_worker, worker_ids=[1], args=(c.scheme, b, "mlp", None), scheme=c.scheme))
        replacement[1].start()
        b.close()
        await c.scheme.sender.wait_joined(1, timeout=120)
        stats = c.scheme.statistics().worker(1)
        assert (stats.state, stats.applied_version, stats.generation) == ("connected", 0, 2)
        v2 = await c.scheme.send()
        assert c.scheme.sender.applied_versions() == {0: v2, 1: v2}
    finally:
        await c.kill_close()
        if replacement is not None:
            await replacement[0].q.aclose()
            await replacement[1].aclose(grace=5.0)


async def test_a_remote_worker_that_left_keeps_its_applied_version_and_waits_do_not_count_it() -> None:
    async with open_loopback_hosts(make_model(), make_model, hosts={1: 2}, timeout=30) as lh:
        trainer = lh.trainer
        await lh.workers[1, 1].aclose()  # worker (1, 1) closes its receiver at version 0
        # Its relay reports it; a send to it fails either way (refused, or while waiting).
        with pytest.raises(WorkerLeftError, match=r"worker \(1, 1\)"):
            await trainer.send(worker_ids=[(1, 1)])
        assert trainer.sender.applied_versions() == {(1, 0): 0, (1, 1): 0}
        stats = trainer.statistics().worker((1, 1))
        assert (stats.state, stats.applied_version) == ("left", 0)
        with pytest.raises(WorkerLeftError):
            await trainer.wait_async(0, worker_ids=[(1, 1)])
        with pytest.raises(WorkerLeftError):
            await trainer.wait_async(0, worker_ids=[(1, 0), (1, 1)], quorum=2)
        v = await trainer.send(worker_ids=[(1, 0)])
        assert trainer.sender.applied_versions() == {(1, 0): v, (1, 1): 0}
        # On the relay, its local sender says the same about its worker.
        local = lh.hosts[1].statistics().worker(1)
        assert (local.state, local.applied_version) == ("left", 0)

        # The host goes: its workers are lost, and keep what they applied.
        await lh.hosts[1].aclose()
        await trainer.wait_lost(1, timeout=30)
        assert trainer.sender.applied_versions() == {(1, 0): v, (1, 1): 0}
        assert trainer.statistics().worker((1, 0)).state == "dead"
        with pytest.raises(HostLostError):
            await trainer.wait_async(v, worker_ids=[(1, 0)], timeout=30)
        with pytest.raises(HostLostError):
            await trainer.wait_async(v, worker_ids=[(1, 0)], quorum=1, timeout=30)


async def _release(probe: Probe) -> None:
    await probe.q.put(("release",))
    assert await probe.q.get(timeout=30) == "released"


async def _holds(c: Cluster, i: int, version: int, value: float) -> bool:
    v, sd = await c.state(i)
    return v == version and all(bool((t == value).all()) for t in sd.values())


async def _during_then_before(c: Cluster, depart: Callable[[], Awaitable[object]], error: type[WorkerGoneError]) -> WorkerGoneError:
    """Worker 0 departs (*depart*) while a send to every worker waits (worker 1's loop is
    stuck), then another send goes out: each raises *error* naming worker 0 once workers 1
    and 2 applied its version, which they hold. Returns the second error."""
    assert await c.probes[1].ask("block") == "blocked"
    fill_(c.model, 1.0)
    sending = asyncio.ensure_future(c.scheme.send())
    await depart()
    await c.scheme.sender.wait_dead(0, timeout=30)
    await _release(c.probes[1])
    with pytest.raises(error) as during:
        await sending
    fill_(c.model, 2.0)
    with pytest.raises(error) as before:
        await c.scheme.send()
    for info, v in ((during, 1), (before, 2)):
        assert info.value.worker_idx == 0 and info.value.applied_by == (1, 2), info.value
        assert str(info.value).endswith(f"; workers 1, 2 applied version {v}"), info.value
    assert await _holds(c, 1, 2, 2.0) and await _holds(c, 2, 2, 2.0)
    return before.value


@pytest.mark.timeout(300)
async def test_a_send_reaches_the_living_whether_a_worker_left_before_or_during_it() -> None:
    c = Cluster.of(["mlp", "mlp", "mlp"], timeout=120)
    try:
        await c.start()
        await _during_then_before(c, lambda: c.probes[0].ask("leave"), WorkerLeftError)

        # A subset, and send_async + wait_async: the same rule.
        fill_(c.model, 3.0)
        with pytest.raises(WorkerLeftError) as subset:
            await c.scheme.send(worker_ids=[0, 1])
        assert subset.value.applied_by == (1,) and "worker 1 applied version 3" in str(subset.value)
        assert await _holds(c, 1, 3, 3.0) and await _holds(c, 2, 2, 2.0)
        fill_(c.model, 4.0)
        v = await c.scheme.send_async()  # does not raise: the version goes out to the living
        with pytest.raises(WorkerLeftError) as waited:
            await c.scheme.wait_async(v)
        assert waited.value.applied_by == (1, 2)
        assert await _holds(c, 1, v, 4.0) and await _holds(c, 2, v, 4.0)

        # At the timeout, the departure is what is raised, naming who did not answer.
        assert await c.probes[1].ask("block") == "blocked"
        with pytest.raises(WorkerLeftError, match=r"; no other target applied version 5; worker 1 did not answer within 0\.5 s$") as late:
            await c.scheme.send(worker_ids=[0, 1], timeout=0.5)
        assert late.value.applied_by == ()
        await _release(c.probes[1])
    finally:
        await c.kill_close()


@pytest.mark.timeout(300)
async def test_a_send_reaches_the_living_whether_a_worker_died_before_or_during_it() -> None:
    c = Cluster.of(["mlp", "mlp", "mlp"], timeout=120)
    try:
        await c.start()

        async def kill() -> None:
            c.groups[0].kill(0)

        died = await _during_then_before(c, kill, WorkerDiedError)
        assert isinstance(died, WorkerDiedError) and died.exitcode == -9
        # (pickled, as an error travels between processes, it says the same)
        copy = pickle.loads(pickle.dumps(died))
        assert (type(copy), copy.applied_by, str(copy)) == (WorkerDiedError, (1, 2), str(died))
    finally:
        await c.kill_close()


async def test_a_send_across_hosts_reaches_the_living_when_a_remote_worker_left_or_a_host_is_lost() -> None:
    async with open_loopback_hosts(make_model(), make_model, hosts={1: 2, 2: 1}, timeout=30) as lh:
        trainer = lh.trainer
        await lh.workers[1, 1].aclose()
        await trainer.sender.wait_dead((1, 1), timeout=30)
        with pytest.raises(WorkerLeftError) as left:
            await trainer.send()
        assert left.value.worker_idx == (1, 1) and left.value.applied_by == ((1, 0), (2, 0))
        assert str(left.value).endswith("; workers (1, 0), (2, 0) applied version 1"), left.value
        v = await trainer.send_async()
        with pytest.raises(WorkerLeftError) as waited:
            await trainer.wait_async(v)
        assert waited.value.applied_by == ((1, 0), (2, 0))
        assert trainer.sender.applied_versions() == {(1, 0): v, (1, 1): 0, (2, 0): v}

        await lh.hosts[2].aclose()
        await trainer.wait_lost(2, timeout=30)
        with pytest.raises(HostLostError) as lost:
            await trainer.send(worker_ids=[(2, 0), (1, 0)])
        assert (lost.value.host, lost.value.applied_by) == (2, ((1, 0),))
        with pytest.raises(WorkerLeftError, match=r"; worker \(1, 0\) applied version 4; worker \(2, 0\) is gone too$"):
            await trainer.send()
        assert trainer.sender.applied_versions() == {(1, 0): 4, (1, 1): 0, (2, 0): v}
