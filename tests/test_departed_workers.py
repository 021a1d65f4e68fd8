"""A worker that is gone keeps its last applied version visible, with its state, and that
version never satisfies a wait: locally across processes, and across hosts on the loopback."""

from __future__ import annotations

import pytest

from asyncsync import HostLostError, WorkerLeftError, spawn_workers
from asyncsync.testing import open_loopback_hosts
from tests._targets import make_model, probe_worker
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
        await trainer.sender.wait_lost(1, timeout=30)
        assert trainer.sender.applied_versions() == {(1, 0): v, (1, 1): 0}
        assert trainer.statistics().worker((1, 0)).state == "dead"
        with pytest.raises(HostLostError):
            await trainer.wait_async(v, worker_ids=[(1, 0)], timeout=30)
        with pytest.raises(HostLostError):
            await trainer.wait_async(v, worker_ids=[(1, 0)], quorum=1, timeout=30)
