"""The local transport's interface to a relay (``scheme._transport`` on the trainer):
``reserve()`` a slot, write it in place, ``publish()`` it or give it back, and
``observe()`` the workers' answers and losses.

Loopback workers: the same sockets, shared memory and protocol as worker processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import torch

from asyncsync import MultiProcessWeightSyncScheme, Sender, WeightsError, WorkerDiedError, WorkerGoneError
from asyncsync._local._transport import LocalTransport
from asyncsync._wire._local import Ack
from asyncsync.testing import LoopbackWorkers, open_loopback
from tests._targets import fill_, make_model


@asynccontextmanager
async def two_workers(model: torch.nn.Module | None = None) -> AsyncIterator[tuple[Sender, LocalTransport, LoopbackWorkers]]:
    """The trainer's sender, its transport (what a relay lands into), and two loopback workers."""
    scheme = MultiProcessWeightSyncScheme(timeout=20)
    scheme.init_on_sender(model=model if model is not None else make_model(), num_workers=2)
    async with open_loopback(scheme, make_model) as lb:
        assert scheme._transport is not None
        yield scheme.sender, scheme._transport, lb


def writing(transport: LocalTransport) -> set[int]:
    """The slots reserved for a write (by a send, a reservation or a writer left behind)."""
    return {s for s, st in transport.ledger.slots.items() if st.writing}


def fill_views(views: dict[str, torch.Tensor], value: float) -> None:
    for t in views.values():
        t.fill_(value)


def runs(lb: LoopbackWorkers, value: float) -> bool:
    return all(bool((t == value).all()) for m in lb.models.values() for t in m.state_dict().values())


async def test_a_published_reservation_is_every_targets_newest_version() -> None:
    async with two_workers() as (sender, transport, lb):
        async with transport.reserve(1) as landing:
            assert writing(transport) == {landing.slot.id}
            assert landing.buffer.dtype == torch.uint8 and landing.buffer.numel() == sender.layout.nbytes
            fill_views(landing.views, 7.0)
            landing.publish()
        assert landing.published and writing(transport) == set()
        assert sender.version == 1 and sender.sent_version(0) == sender.sent_version(1) == 1
        await sender.wait_async(1, timeout=10)
        assert runs(lb, 7.0)
        assert sender.statistics().bytes_copied == 2 * sender.layout.nbytes  # version 0's copy, this landing


async def test_an_exception_inside_a_reservation_frees_its_slot_and_publishes_nothing() -> None:
    async with two_workers() as (sender, transport, lb):
        with pytest.raises(RuntimeError, match="the network broke"):
            async with transport.reserve(1, [0]) as landing:
                slot = landing.slot.id
                fill_views(landing.views, 9.0)
                raise RuntimeError("the network broke")
        assert not landing.published
        assert writing(transport) == set() and slot in transport.ledger.free()
        assert sender.version == 0 and sender.sent_version(0) == 0
        assert await sender.send_async() == 1  # the send lock was released
        await sender.wait_async(1, timeout=10)
        assert lb.workers[0].version == 1


async def test_a_cancellation_inside_a_reservation_frees_its_slot() -> None:
    async with two_workers() as (sender, transport, lb):
        inside = asyncio.Event()
        slots: list[int] = []

        async def land() -> None:
            async with transport.reserve(1) as landing:
                slots.append(landing.slot.id)
                inside.set()
                await asyncio.Event().wait()  # a receive that never ends

        task = asyncio.ensure_future(land())
        await asyncio.wait_for(inside.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert writing(transport) == set() and slots[0] in transport.ledger.free()
        assert sender.version == 0
        assert await sender.send_async(timeout=10) == 1
        await sender.wait_async(1, timeout=10)


async def test_a_cancellation_while_entering_a_reservation_holds_nothing() -> None:
    async with two_workers() as (sender, transport, lb):
        async with transport.reserve(1) as first:
            entering = asyncio.ensure_future(transport.reserve(2).__aenter__())
            await anyio.wait_all_tasks_blocked()  # parked on the send lock the first one holds
            assert not entering.done()
            entering.cancel()
            with pytest.raises(asyncio.CancelledError):
                await entering
            assert writing(transport) == {first.slot.id}
        assert writing(transport) == set()
        assert await sender.send_async(timeout=10) == 1  # the lock is free


async def test_an_abandoned_reservation_keeps_its_slot_until_its_writer_is_done() -> None:
    model = make_model()
    async with two_workers(model) as (sender, transport, lb):
        still_writing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        async with transport.reserve(1) as landing:
            kept = landing.slot.id
            landing.abandon(still_writing=still_writing)
        assert not landing.published and sender.version == 0
        assert writing(transport) == {kept} and kept not in transport.ledger.free()
        assert "being written" in transport.ledger.owners(kept)
        # Sends go on in the other slots; the kept one is never handed out meanwhile.
        for v in (1, 2, 3):
            fill_(model, float(v))
            assert await sender.send(timeout=10) == v
            assert all(ref.slot != kept for ref in transport.ledger.latest.values())
        assert runs(lb, 3.0)
        still_writing.set_result(None)  # the writer is done: the slot is free again
        assert await transport._delivery.changed.wait_until(lambda: kept in transport.ledger.free(), 10)
        assert writing(transport) == set()


async def test_an_abandoned_reservation_whose_writer_is_already_done_frees_its_slot() -> None:
    async with two_workers() as (sender, transport, lb):
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        async with transport.reserve(1) as landing:
            kept = landing.slot.id
            landing.abandon(still_writing=done)
        assert writing(transport) == set() and kept in transport.ledger.free()


async def test_a_partial_reservation_starts_from_the_base_version() -> None:
    async with two_workers() as (sender, transport, lb):
        async with transport.reserve(1) as landing:
            fill_views(landing.views, 1.0)
            landing.publish()
        await sender.wait_async(1, timeout=10)
        first_key = sender.layout.keys[0]
        async with transport.reserve(2, base_version=1) as landing:
            assert all(bool((t == 1.0).all()) for t in landing.views.values())  # a copy of version 1
            landing.views[first_key].fill_(2.0)  # only what changed
            landing.publish()
        await sender.wait_async(2, timeout=10)
        for m in lb.models.values():
            state = m.state_dict()
            assert bool((state[first_key] == 2.0).all())
            assert all(bool((t == 1.0).all()) for k, t in state.items() if k != first_key)


async def test_a_reservation_refuses_what_it_cannot_publish_before_taking_a_slot() -> None:
    async with two_workers() as (sender, transport, lb):
        with pytest.raises(WeightsError, match="cannot complete a partial update from version 5"):
            async with transport.reserve(1, base_version=5):
                raise AssertionError("not entered")
        with pytest.raises(ValueError, match="not newer"):
            transport.reserve(0)
        with pytest.raises(ValueError, match="unknown worker id 7"):
            transport.reserve(1, [7])
        assert writing(transport) == set()
        async with transport.reserve(1) as landing:
            landing.publish()
            with pytest.raises(RuntimeError, match="published"):
                landing.abandon()
        with pytest.raises(RuntimeError, match="done"):
            landing.publish()
        await sender.wait_async(1, timeout=10)


class Recorder:
    def __init__(self) -> None:
        self.answers: list[tuple[int, int, bool]] = []
        self.lost: list[tuple[int, WorkerGoneError]] = []

    def worker_answered(self, worker_idx: int, ack: Ack) -> None:
        self.answers.append((worker_idx, ack.version, ack.ok))

    def worker_lost(self, worker_idx: int, death: WorkerGoneError) -> None:
        self.lost.append((worker_idx, death))


async def test_the_observer_sees_every_answer_and_loss() -> None:
    async with two_workers() as (sender, transport, lb):
        seen = Recorder()
        transport.observe(seen)
        with pytest.raises(RuntimeError, match="already has an observer"):
            transport.observe(Recorder())
        assert await sender.send(timeout=10) == 1
        await sender.wait_async(1, timeout=10)
        assert sorted(seen.answers) == [(0, 1, True), (1, 1, True)]
        await lb.faults.kill(1)
        assert [(i, type(d)) for i, d in seen.lost] == [(1, WorkerDiedError)] and seen.lost[0][1].worker_idx == 1
        transport.observe(None)
        assert await sender.send(worker_ids=[0], timeout=10) == 2
        assert sorted(seen.answers) == [(0, 1, True), (1, 1, True)]  # not told any more


async def test_an_observer_that_fails_changes_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def worker_answered(self, worker_idx: int, ack: Ack) -> None:
            raise RuntimeError("observer bug")

        def worker_lost(self, worker_idx: int, death: WorkerGoneError) -> None:
            raise RuntimeError("observer bug")

    async with two_workers() as (sender, transport, lb):
        transport.observe(Broken())
        with caplog.at_level(logging.ERROR, logger="asyncsync"):
            assert await sender.send(timeout=10) == 1
        assert sender.applied_versions() == {0: 1, 1: 1}
        assert "observer failed on its answer" in caplog.text
