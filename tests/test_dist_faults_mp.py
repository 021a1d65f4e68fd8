"""Multi-host faults on loopback: a killed relay is named and the group re-forms with the
survivors, a restarted host rejoins with the latest weights, a killed trainer leaves every
relay and worker with SenderDiedError and its last weights."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import AsyncIterator

import psutil
import pytest
import pytest_asyncio

from asyncsync import AsyncQueue, HostLostError, WorkerDiedError, spawn_workers
from asyncsync._workers import START_TIMEOUT
from tests._dist_cluster import TOKEN, DistCluster, free_port
from tests._dist_targets import dist_trainer, relay_host
from tests._targets import fill_
from tests.conftest import Probe

CTX = mp.get_context("spawn")
# One loop for the module: the shared cluster's heartbeats must keep flowing during every test.
# The module's cluster starts within its first test: spawned workers import torch (slow on a busy machine).
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fc() -> AsyncIterator[DistCluster]:
    """One cluster for the two steps below, which run in order: a relay dies; its host
    comes back, then one of its workers dies."""
    # A 4 MB model in 64 KiB chunks: a broadcast is 64 operations, and host 2 dies in the
    # middle of the first one after version 0.
    c = DistCluster({1: 1, 2: 1}, kind="big", chunk_bytes=64 << 10)
    try:
        await c.start(opts={2: {"die_in_broadcast_of": 1}})
        yield c
    finally:
        await c.close()


async def test_1_relay_killed_mid_broadcast_is_named_and_group_reforms(fc: DistCluster) -> None:
    c = fc
    first_generation = c.scheme.statistics().generation
    fill_(c.model, 2.0)
    with pytest.raises(HostLostError) as info:
        await c.scheme.send()  # host 2 SIGKILLs itself once the first chunk of this broadcast arrived
    assert info.value.host == 2 and info.value.worker_idx == (2, 0)
    assert "host 2" in str(info.value) and "(2, 0)" in str(info.value)
    assert info.value.applied_by == ((1, 0),)  # host 1 got that version all the same
    await c.hosts[2].probes[0].q.put(("exit",))  # its orphaned worker: let it go now
    stats = c.scheme.statistics()
    assert stats.host(2).state == "dead" and stats.worker((2, 0)).state == "dead"
    # a send that targets the dead host reaches the living one, then names the dead host; one
    # to the living goes through: the group was re-formed without host 2, and host 1, left
    # inside the broken broadcast, was released from it
    v = c.scheme.version + 1
    with pytest.raises(HostLostError) as again:
        await c.scheme.send()
    assert again.value.applied_by == ((1, 0),) and (await c.state((1, 0)))[0] == v
    fill_(c.model, 3.0)
    v = await c.scheme.send(worker_ids=[(1, 0)])
    version, sd = await c.state((1, 0))
    assert version == v and all(bool((t == 3.0).all()) for t in sd.values())
    stats = c.scheme.statistics()
    assert stats.members == (1,) and stats.generation > first_generation


async def test_2_restarted_host_rejoins_with_the_latest_weights_then_its_worker_dies(fc: DistCluster) -> None:
    c = fc
    assert c.scheme.statistics().host(2).state == "dead"
    # The options are fixed when the scheme is made ("raise", which test 1 needs): the send
    # goes on to the living host and names the dead one; it is host 2's newest version all the same.
    fill_(c.model, 4.0)
    with pytest.raises(HostLostError) as lost:
        await c.scheme.send()
    v_latest = c.scheme.version
    assert lost.value.host == 2 and lost.value.applied_by == ((1, 0),)
    assert c.scheme.sender.sent_version((2, 0)) == v_latest
    await c.hosts[2].aclose()
    c.spawn_host(2)
    await c.hosts[2].started()
    await c.hosts[2].joined()
    await c.scheme.wait_host_joined(2, timeout=30)
    version, sd = await c.state((2, 0))
    assert version == v_latest and all(bool((t == 4.0).all()) for t in sd.values())
    assert await c.hosts[2].probes[0].ask("updates") == [v_latest]  # nothing older, ever
    stats = c.scheme.statistics()
    assert stats.members == (1, 2) and stats.host(2).connections == 2
    fill_(c.model, 5.0)
    v = await c.scheme.send()  # a broadcast to both again
    assert set(c.scheme.sender.applied_versions().values()) == {v}

    # then a remote worker dies: its relay tells the trainer, which names host and worker
    relay = psutil.Process(c.hosts[2].group.processes[2].pid)
    (worker,) = [p for p in relay.children() if "resource_tracker" not in " ".join(p.cmdline())]
    worker.kill()
    fill_(c.model, 6.0)
    with pytest.raises(WorkerDiedError) as died:
        await c.scheme.send()
    assert died.value.worker_idx == (2, 0) and died.value.exitcode == -9
    assert died.value.applied_by == ((1, 0),) and (await c.state((1, 0)))[0] == c.scheme.version
    assert "on host 2" in str(died.value) and "(2, 0)" in str(died.value)
    assert c.scheme.statistics().host(2).state == "connected"  # the host itself lives on
    await c.hosts[2].probes[0].q.aclose()  # its probe is gone with it
    c.hosts[2].probes = []
    v = await c.scheme.send(worker_ids=[(1, 0)])
    assert (await c.state((1, 0)))[0] == v
    # this test's processes end with it
    c.hosts[2].group.kill(2)
    await c.scheme.wait_lost(2, timeout=30)
    await c.hosts[2].aclose()


async def test_killed_trainer_leaves_relays_and_workers_with_sender_died() -> None:
    port = free_port()
    report_a, report_b = CTX.Pipe()
    probe_a, probe_b = CTX.Pipe()
    ctrl_a, ctrl_b = CTX.Pipe()
    host = spawn_workers(relay_host, worker_ids=[1], args=(port, TOKEN, [probe_b], ctrl_b, None))
    host.start()
    for end in (probe_b, ctrl_b):
        end.close()
    trainer = spawn_workers(dist_trainer, worker_ids=[0], args=(port, TOKEN, report_b))
    report: AsyncQueue[object] = AsyncQueue(report_a)
    ctrl: AsyncQueue[object] = AsyncQueue(ctrl_a)
    probe = Probe(probe_a)
    try:
        # the trainer's connect timeout counts from its start: once the relay's worker runs
        assert await ctrl.get(timeout=START_TIMEOUT) == ("started",)
        trainer.start()
        report_b.close()
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
