"""The core guarantees across real spawned processes, on two shared workers."""

from __future__ import annotations

import asyncio

import pytest
import torch
from anyio import wait_all_tasks_blocked
from tensordict import TensorDict

from asyncsync import WeightsError
from asyncsync._ownership import slot_bound
from tests._targets import fill_, make_model
from tests.conftest import Cluster, assert_same

pytestmark = pytest.mark.asyncio(loop_scope="module")


def bump_(model: torch.nn.Module, by: float = 1.0) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


async def test_initial_weights_equal_trainer(cluster2: Cluster) -> None:
    for i in range(2):
        version, sd = await cluster2.state(i)
        assert version >= 0
        assert_same(cluster2.model, sd)


async def test_send_none_reads_model_and_versions_increase(cluster2: Cluster) -> None:
    bump_(cluster2.model)
    v1 = await cluster2.scheme.send()
    bump_(cluster2.model)
    v2 = await cluster2.scheme.send()
    assert v2 == v1 + 1
    for i in range(2):
        version, sd = await cluster2.state(i)
        assert version == v2
        assert_same(cluster2.model, sd)
    assert cluster2.scheme.sender.applied_versions() == {0: v2, 1: v2}


@pytest.mark.parametrize("form", ["module", "tensordict", "state_dict", "nested_dict"])
async def test_every_weights_form(cluster2: Cluster, form: str) -> None:
    other = make_model()
    fill_(other, 0.25)
    weights = {
        "module": other,
        "tensordict": TensorDict.from_module(other),
        "state_dict": other.state_dict(),
        "nested_dict": TensorDict.from_module(other).to_dict(),
    }[form]
    v = await cluster2.scheme.send(weights=weights)
    for i in range(2):
        version, sd = await cluster2.state(i)
        assert version == v
        assert_same(other, sd)


async def test_send_weights_does_not_touch_trainer_model(cluster2: Cluster) -> None:
    before = {k: t.clone() for k, t in cluster2.model.state_dict().items()}
    other = make_model()
    fill_(other, -3.0)
    await cluster2.scheme.send(weights=TensorDict.from_module(other))
    assert_same(cluster2.model, before)


async def test_snapshot_isolation(cluster2: Cluster) -> None:
    fill_(cluster2.model, 7.0)
    v = await cluster2.scheme.send()
    fill_(cluster2.model, 8.0)  # after the send: must not reach any worker
    for i in range(2):
        version, sd = await cluster2.state(i)
        assert version == v
        assert all(bool((t == 7.0).all()) for t in sd.values())


async def test_worker_ids_subset_leaves_others_alone(cluster2: Cluster) -> None:
    fill_(cluster2.model, 1.5)
    v_all = await cluster2.scheme.send()
    fill_(cluster2.model, 2.5)
    v1 = await cluster2.scheme.send(worker_ids=[1])
    v0, sd0 = await cluster2.state(0)
    ver1, sd1 = await cluster2.state(1)
    assert (v0, ver1) == (v_all, v1)
    assert all(bool((t == 1.5).all()) for t in sd0.values())
    assert all(bool((t == 2.5).all()) for t in sd1.values())
    v0b = await cluster2.scheme.send(worker_ids=0)  # an int works too
    assert (await cluster2.state(0))[0] == v0b
    stats = cluster2.scheme.statistics()
    assert stats.worker(1).applied_version == v1


async def test_send_async_then_wait_async(cluster2: Cluster) -> None:
    versions = []
    for k in range(3):
        fill_(cluster2.model, 10.0 + k)
        versions.append(await cluster2.scheme.send_async())
    assert versions == sorted(versions) and len(set(versions)) == 3
    await cluster2.scheme.wait_async()
    for i in range(2):
        version, sd = await cluster2.state(i)
        assert version == versions[-1]
        assert all(bool((t == 12.0).all()) for t in sd.values())


async def test_sync_send_after_async_sends_waits_for_its_own_version(cluster2: Cluster) -> None:
    # torchrl returned at once on a stale ack here: acks must name their version.
    for k in range(3):
        fill_(cluster2.model, 20.0 + k)
        await cluster2.scheme.send_async()
    fill_(cluster2.model, 30.0)
    v = await cluster2.scheme.send()
    for i in range(2):
        version, sd = await cluster2.state(i)
        assert version == v
        assert all(bool((t == 30.0).all()) for t in sd.values())


async def test_no_mixed_versions_while_updates_land(cluster2: Cluster) -> None:
    for i in range(2):
        assert await cluster2.probes[i].ask("forward_start") == "started"
    for k in range(40):
        fill_(cluster2.model, float(100 + k))
        await cluster2.scheme.send()
    for i in range(2):
        report = await cluster2.probes[i].ask("forward_stop")
        assert report["passes"] > 0
        assert report["mixed"] == 0, report


async def test_cancelled_send_leaves_no_half_state(cluster2: Cluster) -> None:
    fill_(cluster2.model, 50.0)
    task = asyncio.ensure_future(cluster2.scheme.send())
    await wait_all_tasks_blocked()  # published; cancel while it waits for acks
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fill_(cluster2.model, 51.0)
    v = await cluster2.scheme.send()
    for i in range(2):
        version, sd = await cluster2.state(i)
        assert version == v
        assert all(bool((t == 51.0).all()) for t in sd.values())


async def test_bad_weights_rejected_before_sending(cluster2: Cluster) -> None:
    before = cluster2.scheme.version
    sd = {k: t.clone() for k, t in cluster2.model.state_dict().items()}
    bad_shape = dict(sd, **{"0.weight": torch.zeros(3, 3)})
    with pytest.raises(WeightsError, match=r"'0.weight' has shape \(3, 3\), expected \(16, 4\)"):
        await cluster2.scheme.send(weights=bad_shape)
    missing = {k: v for k, v in sd.items() if k != "2.bias"}
    with pytest.raises(WeightsError, match="missing keys '2.bias'"):
        await cluster2.scheme.send(weights=missing)
    with pytest.raises(WeightsError, match="unexpected keys 'extra'"):
        await cluster2.scheme.send(weights=dict(sd, extra=torch.zeros(1)))
    with pytest.raises(WeightsError, match="dtype"):
        await cluster2.scheme.send(weights={k: v.double() for k, v in sd.items()})
    with pytest.raises(WeightsError, match="not a tensor"):
        await cluster2.scheme.send(weights=dict(sd, **{"2.bias": [1, 2, 3]}))
    with pytest.raises(ValueError, match="unknown worker id 5"):
        await cluster2.scheme.send(worker_ids=[5])
    with pytest.raises(TypeError):
        await cluster2.scheme.send(weights=3)
    assert cluster2.scheme.version == before  # nothing was sent


async def test_statistics_and_callbacks(cluster2: Cluster) -> None:
    v = await cluster2.scheme.send()
    stats = cluster2.scheme.statistics()
    assert stats.version == v
    assert all(w.applied_version == v and w.lag == 0 and w.state == "connected" for w in stats.workers)
    updates = await cluster2.probes[0].ask("updates")
    assert updates[-1] == v and updates == sorted(updates)
    rstats = await cluster2.probes[0].ask("stats")
    assert rstats.version == v and rstats.updates == len(updates)


async def test_fast_sender_burst_latest_wins_never_backwards(cluster2: Cluster) -> None:
    for i in range(2):
        assert await cluster2.probes[i].ask("forward_start") == "started"
    first = cluster2.scheme.version + 1
    slots = cluster2.scheme.statistics().slots
    for k in range(30):  # no waiting: the workers fall behind and skip
        fill_(cluster2.model, float(1000 + k))
        await cluster2.scheme.send_async()
    last = cluster2.scheme.version
    await cluster2.scheme.wait_async()
    for i in range(2):
        report = await cluster2.probes[i].ask("forward_stop")
        assert report["mixed"] == 0, report
        updates = [u for u in await cluster2.probes[i].ask("updates") if u >= first]
        assert updates == sorted(set(updates)) and updates[-1] == last
        version, sd = await cluster2.state(i)
        assert version == last and all(bool((t == 1029.0).all()) for t in sd.values())
    # Memory is bounded whatever the number of sends: each lagging worker holds at most its
    # live slot and one in flight, plus the newest version and the one being written.
    assert slots <= cluster2.scheme.statistics().slots <= slot_bound(2, manual=False, latest=1, writing=1)
    skipped = [(await cluster2.probes[i].ask("stats")).skipped for i in range(2)]
    assert sum(skipped) > 0, skipped  # the workers fell behind and skipped to the newest
