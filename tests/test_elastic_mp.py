"""Elastic membership on one host, across processes: workers that join after start (a new
index attaching by address, or a process started for ``add_worker``), catch up to the
newest version before their first ack, leave and come back, and are retired."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, SyncTimeoutError, WorkerLeftError, loopback_worker, spawn_workers
from tests._targets import make_model
from tests.test_attach_mp import fill_, programs

pytestmark = pytest.mark.timeout(120)


def versions_seen(events: list[dict[str, Any]]) -> list[tuple[int, list[float]]]:
    return [(e["version"], e["values"]) for e in events if "version" in e]


async def test_workers_with_new_indices_join_catch_up_leave_and_come_back() -> None:
    model = nn.Linear(4, 4)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=model, num_workers=0, elastic=True)
    address = await scheme.listen()
    events: list[tuple[str, int]] = []

    async def watch() -> None:
        async for event in scheme.sender.membership():
            events.append((event.kind, event.worker_id))

    async with programs() as start:
        async with scheme:  # no member yet: returns at once
            watcher = asyncio.ensure_future(watch())
            fill_(model, 1.0)
            assert await scheme.send() == 1  # to nobody: held for those that join
            first = await start(0, address)
            assert (await first.event())["version"] == 1  # version 1 is its first: never 0
            await scheme.sender.wait_joined(0)
            fill_(model, 2.0)
            assert await scheme.send() == 2
            second = await start(1, address)
            await scheme.sender.wait_joined(1)
            assert scheme.sender.members == [0, 1]
            fill_(model, 3.0)
            assert await scheme.send() == 3  # every member
            assert scheme.sender.applied_versions() == {0: 3, 1: 3}

            first.proc.kill()  # a member dies: later sends to all leave it out, without an error
            await scheme.sender.wait_dead(0)
            fill_(model, 4.0)
            assert await scheme.send() == 4
            assert scheme.sender.members == [1]
            row = scheme.statistics().worker(0)
            assert (row.state, row.applied_version) == ("dead", 3)  # still visible

            again = await start(0, address)  # the same id comes back: it catches up to version 4
            assert versions_seen([await again.event()]) == [(4, [4.0])]
            await scheme.sender.wait_joined(0)
            fill_(model, 5.0)
            assert await scheme.send() == 5
            assert scheme.sender.applied_versions() == {0: 5, 1: 5}

        for w in (second, again):
            done = await w.events_until("stopped")
            assert done[-1] == {"stopped": 5}
        await asyncio.wait_for(watcher, 10)  # the sender closed: the iterator ends
    assert events[:4] == [("joined", 0), ("joined", 1), ("dead", 0), ("joined", 0)]


async def test_a_send_waits_only_for_the_members_it_started_with_and_a_duplicate_is_refused() -> None:
    model = nn.Linear(4, 4)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=model, num_workers=1, elastic=True)
    address = await scheme.listen()
    async with programs() as start:
        zero = await start(0, address)
        async with scheme:
            fill_(model, 1.0)
            version = await scheme.send_async()  # its targets: worker 0 alone
            late = await start(1, address)
            await scheme.sender.wait_joined(1)
            await scheme.wait_async(version)  # worker 1 got it by catching up, but was never waited for
            assert scheme.sender.applied_versions() == {0: 1, 1: 1}
            taken = await start(1, address)  # a second process claims a live member's id
            refused = await taken.events_until("error")
            assert refused[-1]["error"] == "ValueError" and "already connected" in refused[-1]["message"]
            assert scheme.sender.members == [0, 1]
            fill_(model, 2.0)
            assert await scheme.send() == 2
        for w in (zero, late):
            assert (await w.events_until("stopped"))[-1] == {"stopped": 2}


async def elastic_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
    model = make_model()
    scheme.init_on_receiver(worker_idx=worker_idx, model=model)
    async with scheme:
        await scheme.wait_stopped()
    return scheme.version


async def leaving_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, until: int) -> int:
    """Runs until its model runs version *until*, then leaves (a scale-down)."""
    scheme.init_on_receiver(worker_idx=worker_idx, model=make_model())
    async with scheme:
        await scheme.wait_for_version(until)
    return scheme.version


async def test_a_worker_started_for_add_worker_joins_and_one_that_leaves_can_be_retired() -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=model, num_workers=1, elastic=True)
    async with spawn_workers(elastic_worker, worker_ids=[0], args=(scheme,), scheme=scheme, start_method="forkserver") as first:
        async with scheme:
            for v in (1, 2):
                fill_(model, float(v))
                await scheme.send()
            scheme.add_worker(1)
            assert scheme.sender.members == [0, 1]  # a member from now on (waiting: not connected yet)
            with pytest.raises(SyncTimeoutError):
                await scheme.sender.wait_joined(1, timeout=0.2)  # nobody started it yet
            async with spawn_workers(leaving_worker, worker_ids=[1], args=(scheme, 3), scheme=scheme, start_method="forkserver") as second:
                await scheme.sender.wait_joined(1)
                assert scheme.sender.applied_versions() == {0: 2, 1: 2}  # caught up before its first ack
                with pytest.raises(ValueError, match="connected"):
                    scheme.sender.retire(1)  # a connected member leaves first
                fill_(model, 3.0)
                assert await scheme.send() == 3  # then worker 1 leaves
                await scheme.sender.wait_dead(1)
                assert scheme.statistics().worker(1).state == "left"
                scheme.sender.retire(1)
                assert scheme.statistics().worker(1).state == "retired"
                with pytest.raises(ValueError, match="retired"):
                    await scheme.send(worker_ids=[1])
                fill_(model, 4.0)
                assert await scheme.send() == 4
            assert scheme.sender.members == [0]
            assert second.results == {1: 3}
    assert first.results == {0: 4}


async def test_new_indices_are_refused_without_elastic() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    with pytest.raises(ValueError, match="elastic=True"):
        scheme.add_worker(1)
    with pytest.raises(ValueError, match="params_map"):
        MultiProcessWeightSyncScheme().init_on_sender(params_map={0: nn.Linear(4, 4)}, elastic=True)
    await scheme.aclose()


async def test_a_member_that_leaves_cleanly_stops_being_a_target_and_the_send_reaches_the_others() -> None:
    from asyncsync.testing import open_loopback

    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=model, num_workers=2, elastic=True)
    async with open_loopback(scheme, make_model) as lb:
        await lb.workers[0].aclose()
        await scheme.sender.wait_dead(0)
        fill_(model, 1.0)
        assert await scheme.send() == 1  # no WorkerLeftError: worker 0 is no member any more
        assert scheme.sender.applied_versions() == {0: 0, 1: 1}
    fixed = MultiProcessWeightSyncScheme(timeout=30)
    fixed.init_on_sender(model=model, num_workers=2)
    async with open_loopback(fixed, make_model) as lb:
        await lb.workers[0].aclose()
        await fixed.sender.wait_dead(0)
        with pytest.raises(WorkerLeftError):
            await fixed.send()  # the default keeps its fixed workers: a gone one is an error
    assert torch.equal(lb.models[1][0].weight, model[0].weight)


@pytest.mark.parametrize(
    "options, poll",
    [
        ({}, False),
        ({"commit": "copy", "commit_mode": "manual"}, False),
        ({"transfer_dtype": torch.bfloat16}, False),
        ({}, True),
    ],
    ids=["swap", "manual-copy", "bf16", "polled"],
)
async def test_options_keep_their_meaning_with_a_worker_that_joins(options: dict[str, Any], poll: bool) -> None:
    """A joiner catches up under every commit option, then takes partial updates and
    counts in quorum waits like the first members."""
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30, **options)
    scheme.init_on_sender(model=model, num_workers=1, elastic=True)
    workers, models = [], []

    def join(idx: int) -> MultiProcessWeightSyncScheme:
        worker = loopback_worker(scheme, idx)
        models.append(make_model())
        worker.init_on_receiver(worker_idx=idx, model=models[-1], poll=poll)
        workers.append(worker)
        return worker

    def settle() -> None:  # what a worker's loop does between two steps
        for w in workers:
            if poll:
                w.poll_nowait()
            elif w.update_pending:
                w.commit()

    async def sent(version: int) -> None:
        while min(scheme.sender.applied_versions().values()) < version:
            settle()
            await asyncio.sleep(0)  # the loopback workers run in this loop

    try:
        connecting = asyncio.ensure_future(scheme.connect())
        await join(0).connect()
        while not connecting.done():  # a manual worker acks version 0 once it commits it
            settle()
            await asyncio.sleep(0)
        await connecting
        fill_(model, 1.0)
        await scheme.send_async()
        scheme.add_worker(1)
        newcomer = join(1)
        await newcomer.connect()
        await sent(1)
        assert torch.equal(models[1][0].weight, model[0].weight)  # caught up to version 1
        with torch.no_grad():
            model[0].bias.fill_(7.0)
        version = await scheme.send_async({"0.bias": model[0].bias.detach()}, partial=True)
        await sent(version)
        assert float(models[1][0].bias.detach()[0]) == 7.0  # the partial update, on top of what it caught up to
        assert float(models[1][2].weight.detach()[0, 0]) == 1.0
        fill_(model, 3.0)
        version = await scheme.send_async()
        settle_task = asyncio.ensure_future(sent(version))
        await scheme.wait_async(version, quorum=1)  # one of the two members, whichever is first
        await settle_task
        assert scheme.sender.applied_versions() == {0: version, 1: version}
    finally:
        await scheme.aclose()
        for w in workers:
            await w.aclose()
