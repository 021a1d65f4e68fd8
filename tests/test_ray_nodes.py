"""Ray actors on two Ray nodes for a ``DistributedWeightSyncScheme`` (``python -m pytest -m ray``).

``ray.cluster_utils.Cluster`` starts a head and a second node on this machine, each a raylet
with a node id of its own: a host placed on the second node gets its relay and workers
there, and its bytes cross the multi-host scheme (gloo, on this machine's address) as they
would between machines. One host goes on the trainer's own node too.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import psutil
import pytest

from asyncsync import DistributedWeightSyncScheme, HostLostError, WorkerDiedError
from asyncsync.ray import RayHostGroup, start_workers
from asyncsync.testing import no_leaks
from tests._dist_cluster import free_port
from tests._ray_targets import assert_exited, assert_versions_then_the_latest, recording_worker, send_versions_then_a_burst
from tests._targets import fill_, make_model

ray = pytest.importorskip("ray")  # only where CI installed the `ray` extra for this module
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(480)]  # 2 raylets, actors importing torch


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[str, str]]:
    """(the trainer's node, the other node): a two-node Ray cluster on this machine."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        here = ray.get_runtime_context().get_node_id()
        others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
        assert len(others) == 1
        yield here, others[0]
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(autouse=True)
def _no_leaked_children() -> Iterator[None]:
    """Replaces the suite's check: the raylets are this process's children. What is ours,
    the actors and the scheme's sockets and threads, is checked by :func:`assert_released`;
    /dev/shm entries here."""
    with no_leaks(processes=False, descriptors=False):
        yield


def trainer_scheme(**options: object) -> DistributedWeightSyncScheme:
    # The address Ray knows this node by: the one the other node's relay reaches.
    return DistributedWeightSyncScheme(timeout=120, token="ray-nodes", master_addr=ray.util.get_node_ip_address(), master_port=free_port(), **options)  # type: ignore[arg-type]


def listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def ours() -> tuple[set[int], set[threading.Thread]]:
    """What the trainer's side may leak: listening ports, asyncsync's threads."""
    return listening_ports(), {t for t in threading.enumerate() if t.name.startswith("asyncsync")}


def assert_released(group: RayHostGroup, before: tuple[set[int], set[threading.Thread]]) -> None:
    """Every actor process exited; the trainer's store and control ports closed, and every
    thread the trainer's scheme started ended (a daemon thread dropping a group may still
    be finishing: joined, bounded)."""
    ports, threads = before
    for t in {t for t in threading.enumerate() if t.name.startswith("asyncsync")} - threads:
        t.join(timeout=60)
        assert not t.is_alive(), f"thread {t.name} still runs after the scheme closed"
    assert_exited(group.pids)
    assert_exited(group.relay_pids, "host {}'s relay")
    assert listening_ports() <= ports, f"ports still listening: {sorted(listening_ports() - ports)}"


async def exited(pid: int) -> None:
    """Until process *pid* (on this machine) has ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, ready.set)
        try:
            await asyncio.wait_for(ready.wait(), 60)
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)


async def test_workers_on_two_nodes_receive_every_version_and_the_latest_wins(nodes: tuple[str, str]) -> None:
    here, other = nodes
    before = ours()
    model = make_model()
    fill_(model, 0.0)
    scheme = trainer_scheme()
    scheme.init_on_sender(model=model, hosts={1: 1, 2: 1})
    async with start_workers(recording_worker, scheme, nodes={1: other, 2: here}) as group:
        assert isinstance(group, RayHostGroup)
        assert group.node_ids == {(1, 0): other, (2, 0): here}, "each host's worker runs on its host's node"
        async with scheme:
            await send_versions_then_a_burst(scheme, model)  # a busy host skips to the newest too
            assert scheme.sender.applied_versions() == {(1, 0): 11, (2, 0): 11}
    assert set(group.results) == {(1, 0), (2, 0)}
    assert_versions_then_the_latest(group.results)
    assert_released(group, before)


async def test_a_killed_worker_is_named_and_replaced_and_a_killed_relay_is_a_lost_host(nodes: tuple[str, str]) -> None:
    here, other = nodes
    before = ours()
    model = make_model()
    scheme = trainer_scheme()
    scheme.init_on_sender(model=model, hosts={1: 2, 2: 1})
    async with start_workers(recording_worker, scheme, nodes=[other, here]) as group:  # host 1 on the other node
        assert group.nodes == {1: other, 2: here}
        async with scheme:
            fill_(model, 1.0)
            await scheme.send()
            group.kill((1, 1))  # a worker on the other node: its relay names it
            await exited(group.pids[(1, 1)])
            fill_(model, 2.0)
            with pytest.raises(WorkerDiedError, match=r"worker \(1, 1\)") as died:
                await scheme.send()
            assert died.value.worker_idx == (1, 1) and not isinstance(died.value, HostLostError)
            sent_to_it = scheme.version  # 2, or 1 if the trainer knew before it copied anything
            fill_(model, 3.0)
            v3 = await scheme.send(worker_ids=[(1, 0), (2, 0)])
            await group.restart((1, 1), timeout=120)  # a new actor next to host 1's relay
            assert scheme.sender.applied_versions()[(1, 1)] == sent_to_it, "the replacement starts at the newest version it was sent"
            fill_(model, 3.5)
            v4 = await scheme.send()
            assert scheme.sender.applied_versions() == {(1, 0): v4, (1, 1): v4, (2, 0): v4}
            group.kill_host(1)  # the other node's relay
            await exited(group.relay_pids[1])
            await scheme.wait_lost(1, timeout=60)
            fill_(model, 4.0)
            with pytest.raises(HostLostError, match="host 1") as lost:
                await scheme.send(worker_ids=[(1, 0), (2, 0)])
            assert lost.value.host == 1
            fill_(model, 5.0)
            v5 = await scheme.send(worker_ids=(2, 0))
            assert v5 > v4 > v3 and scheme.sender.applied_versions()[(2, 0)] == v5
    assert set(group.results) == {(2, 0)}, "the killed host's workers are not reported"
    seen = group.results[(2, 0)]
    assert seen[1] == (1, [1.0]) and seen[-1] == (v5, [5.0]) and (v3, [3.0]) in seen and (v4, [3.5]) in seen
    assert [v for v, _ in seen] == sorted({v for v, _ in seen})
    assert_released(group, before)


async def test_a_placement_the_cluster_cannot_run_is_refused_before_anything_starts(nodes: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    here, other = nodes
    scheme = trainer_scheme()
    scheme.init_on_sender(model=make_model(), hosts={1: 1, 2: 1})
    try:
        with pytest.raises(ValueError, match=r"names hosts \[1\], but the scheme's hosts are \[1, 2\]"):
            start_workers(recording_worker, scheme, nodes={1: other})
        with pytest.raises(ValueError, match="lists 1 nodes for the scheme's 2 hosts"):
            start_workers(recording_worker, scheme, nodes=[other])
        with pytest.raises(ValueError, match="host 2: 'f00d' is not a living node"):
            start_workers(recording_worker, scheme, nodes={1: other, 2: "f00d"})
        with pytest.raises(ValueError, match="2 hosts .* 1 other living nodes"):
            start_workers(recording_worker, scheme)  # by default, only the nodes other than the trainer's
    finally:
        await scheme.aclose()
    loopback = DistributedWeightSyncScheme(timeout=30, token="ray-nodes", master_addr="127.0.0.1", master_port=free_port())
    loopback.init_on_sender(model=make_model(), hosts={1: 1})
    real = ray.nodes()
    elsewhere = [dict(n, NodeManagerAddress="198.51.100.7") if n["NodeID"] == other else n for n in real]
    monkeypatch.setattr(ray, "nodes", lambda: elsewhere)  # as if the other node were another machine
    try:
        with pytest.raises(ValueError, match=r"node .* \(198.51.100.7\) cannot reach the trainer at 127.0.0.1: .*get_node_ip_address"):
            start_workers(recording_worker, loopback, nodes=[other])
        start_workers(recording_worker, loopback, nodes=[here])  # its own machine reaches it (nothing started yet)
    finally:
        await loopback.aclose()

