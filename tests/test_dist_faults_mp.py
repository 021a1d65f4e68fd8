"""Multi-host faults on loopback: a killed relay is named and the group re-forms with the
survivors, a restarted host rejoins with the latest weights, a killed trainer leaves every
relay and worker with SenderDiedError and its last weights."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest

from asyncsync import AsyncQueue, HostLostError, spawn_workers
from tests._dist_cluster import TOKEN, DistCluster, free_port
from tests._dist_targets import dist_trainer, relay_host
from tests._targets import fill_
from tests.conftest import Probe

CTX = mp.get_context("spawn")


async def test_killed_relay_is_named_group_reforms_restarted_host_rejoins() -> None:
    c = DistCluster({1: 1, 2: 1})
    try:
        await c.start()
        first_generation = c.scheme.statistics().generation
        # Worker (2, 0) blocks its loop: the next send waits for its ack, then host 2 dies.
        blocked = c.hosts[2].probes[0]
        assert await blocked.ask("block") == "blocked"
        fill_(c.model, 2.0)
        send = c.scheme.send()
        task = asyncio.ensure_future(send)
        await c.scheme.sender.wait_async(c.scheme.version, worker_ids=[(1, 0)])  # host 1 applied it
        t0 = time.monotonic()
        c.hosts[2].group.kill(2)
        with pytest.raises(HostLostError) as info:
            await task
        print(f"killed relay named after {(time.monotonic() - t0) * 1e3:.0f} ms")
        assert info.value.host == 2 and info.value.worker_idx == (2, 0)
        assert "host 2" in str(info.value) and "(2, 0)" in str(info.value)
        await blocked.q.put("go")  # let the orphaned worker go: it ends on its own
        assert await blocked.q.get(timeout=30) == "released"
        await blocked.q.put(("exit",))
        stats = c.scheme.statistics()
        assert stats.host(2).state == "dead" and stats.worker((2, 0)).state == "dead"
        # a send that targets the dead host fails at once; one to the living goes through
        with pytest.raises(HostLostError):
            await c.scheme.send()
        fill_(c.model, 3.0)
        v = await c.scheme.send(worker_ids=[(1, 0)])
        version, sd = await c.state((1, 0))
        assert version == v and all(bool((t == 3.0).all()) for t in sd.values())
        stats = c.scheme.statistics()
        assert stats.members == (1,) and stats.generation > first_generation
        # with on_worker_error="skip", sends go on to the living
        c.scheme.sender.on_worker_error = "skip"
        fill_(c.model, 4.0)
        v_latest = await c.scheme.send()
        # host 2 comes back: its worker gets the newest version before anything else
        await c.hosts[2].aclose()
        c.spawn_host(2)
        msg = await c.hosts[2].ctrl.get(timeout=30)
        assert msg[0] == "joined", msg
        await c.scheme.sender.wait_joined(2, timeout=30)
        version, sd = await c.state((2, 0))
        assert version == v_latest and all(bool((t == 4.0).all()) for t in sd.values())
        assert await c.hosts[2].probes[0].ask("updates") == [v_latest]
        stats = c.scheme.statistics()
        assert stats.members == (1, 2) and stats.host(2).connections == 2
        fill_(c.model, 5.0)
        v = await c.scheme.send()  # a broadcast to both again
        assert set(c.scheme.sender.applied_versions().values()) == {v}
    finally:
        await c.close()


async def test_killed_trainer_leaves_relays_and_workers_with_sender_died() -> None:
    port = free_port()
    report_a, report_b = CTX.Pipe()
    probe_a, probe_b = CTX.Pipe()
    ctrl_a, ctrl_b = CTX.Pipe()
    trainer = spawn_workers(dist_trainer, worker_ids=[0], args=(port, TOKEN, report_b))
    trainer.start()
    host = spawn_workers(relay_host, worker_ids=[1], args=(port, TOKEN, [probe_b], ctrl_b, None))
    host.start()
    for end in (report_b, probe_b, ctrl_b):
        end.close()
    report: AsyncQueue[object] = AsyncQueue(report_a)
    ctrl: AsyncQueue[object] = AsyncQueue(ctrl_a)
    probe = Probe(probe_a)
    try:
        assert await report.get(timeout=60) == ("trainer-ready", 1)
        joined = await ctrl.get(timeout=30)
        assert joined[0] == "joined", joined
        assert (await probe.ask("wait_version", 1)) == 1
        trainer.kill(0)
        outcome = await ctrl.get(timeout=30)
        assert outcome[0] == "stopped" and "SenderDiedError" in str(outcome[1]) and "host 1: the trainer is gone" in str(outcome[1]), outcome
        version, sd = await probe.ask("state")  # the worker kept its last complete weights
        assert version == 1 and all(bool((t == 6.0).all()) for t in sd.values())
        await probe.q.put(("wait_stopped",))
        said = await probe.q.get(timeout=30)
        assert "SenderDiedError" in str(said) and "keeping version 1" in str(said), said
        await host.join(timeout=30)
    finally:
        await host.aclose()
        await trainer.aclose(grace=0.0)
        for q in (report, ctrl, probe.q):
            await q.aclose()
