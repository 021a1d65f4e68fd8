"""The polled worker's mailbox and the sender's wake, in one process.

Two mappings of one mailbox (the sender's and the worker's): versions go one way, acks
the other, each line a seqlock that never hands out a line being written; the worker's
ack makes the shared wake readable, and one read of the wake takes every ring so far.
A version written over one the worker has not taken: the worker's claim and the sender's
read of it, in each order they can interleave; the ledger keeps the replaced slot exactly
while the worker may hold it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from asyncsync import MultiProcessWeightSyncScheme
from asyncsync._core import _ownership
from asyncsync._core._ownership import InvariantError, Ref, SlotLedger, slot_bound
from asyncsync._local import _mailbox as _poll
from asyncsync._local._mailbox import MAILBOX_BYTES, Mailbox, Wake
from asyncsync.testing import loopback_worker
from tests._targets import make_model


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@pytest.fixture
def pair() -> Iterator[tuple[Mailbox, Mailbox, Wake]]:
    sender = Mailbox.create()
    wake = Wake()
    assert wake.fd is not None
    worker = Mailbox.attach(os.dup(sender.fd), MAILBOX_BYTES, os.dup(wake.fd))
    yield sender, worker, wake
    worker.close()
    sender.close()
    wake.close()


def test_a_version_goes_to_the_worker_and_its_ack_comes_back_through_the_wake(pair: tuple[Mailbox, Mailbox, Wake]) -> None:
    sender, worker, wake = pair
    assert worker.peek() is None and sender.take_ack() is None
    sender.publish(7, 2, 3, 1)  # the 3rd version sent to it; it answered the 1st
    seq, version, slot, skipped = worker.peek()  # type: ignore[misc]
    assert (version, slot, skipped) == (7, 2, 1)
    assert worker.peek() is not None  # not taken yet: still new
    worker.take(seq)
    assert worker.peek() is None
    assert wake.fd is not None and not _readable(wake.fd)
    worker.ack(7, 2, 0.25, 0.5)
    assert _readable(wake.fd)
    wake.clear()
    assert not _readable(wake.fd)
    assert sender.take_ack() == (7, 2, 0.25, 0.5)
    assert sender.take_ack() is None  # taken once
    sender.publish(8, 3, 4, 3)
    worker.take(worker.peek()[0])  # type: ignore[index]
    worker.ack(8, None, 0.0, 0.0)  # the model runs from the worker's own memory
    assert sender.take_ack() == (8, None, 0.0, 0.0)


def test_one_read_of_the_wake_takes_the_rings_of_many_acks(pair: tuple[Mailbox, Mailbox, Wake]) -> None:
    sender, worker, wake = pair
    other = Mailbox.create()
    assert wake.fd is not None
    second = Mailbox.attach(os.dup(other.fd), MAILBOX_BYTES, os.dup(wake.fd))
    try:
        worker.ack(1, 0, 0.0, 0.0)
        second.ack(1, 1, 0.0, 0.0)
        assert _readable(wake.fd)
        wake.clear()
        assert not _readable(wake.fd)
        assert sender.take_ack() == (1, 0, 0.0, 0.0) and other.take_ack() == (1, 1, 0.0, 0.0)
        wake.clear()  # nothing rang since: no error, nothing to take
    finally:
        second.close()
        other.close()


def test_a_line_being_written_is_never_handed_out(pair: tuple[Mailbox, Mailbox, Wake]) -> None:
    sender, worker, _wake = pair
    words = memoryview(worker.segment._mmap).cast("B").cast("q")  # type: ignore[arg-type]
    try:
        sender.publish(3, 1, 1, 0)
        words[0] += 1  # the sender's line: odd, as in the middle of a write
        assert worker.peek() is None
        words[0] += 1
        assert worker.peek() is not None
        words[8] = 1  # the worker's line: odd
        assert sender.take_ack() is None
    finally:
        words.release()


def test_a_mailbox_too_small_is_refused_and_its_descriptors_closed() -> None:
    sender = Mailbox.create()
    wake = Wake()
    assert wake.fd is not None
    fd, wake_fd = os.dup(sender.fd), os.dup(wake.fd)
    try:
        with pytest.raises(ValueError, match="needs 128 bytes"):
            Mailbox.attach(fd, 64, wake_fd)
        for closed in (fd, wake_fd):
            with pytest.raises(OSError):
                os.fstat(closed)
    finally:
        sender.close()
        wake.close()


# ------------------------------------------------------------------ written over, claimed


def _interleave(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, sender_step: Callable[[], None]) -> None:
    """Run *sender_step* once, right after the worker's next call of ``owner.<name>``."""
    real = getattr(owner, name)
    done = False

    def step(*args: object) -> object:
        nonlocal done
        out = real(*args)
        if not done:
            done = True
            sender_step()
        return out

    monkeypatch.setattr(owner, name, step)


def test_a_version_written_over_before_the_worker_polls_is_never_taken(pair: tuple[Mailbox, Mailbox, Wake]) -> None:
    sender, worker, _wake = pair
    first = sender.publish(1, 1, 1, 0)
    sender.publish(2, 2, 2, 0)  # over the first: the worker answered nothing since version 0 (count 0)
    assert sender.claimed() < first  # its slot is free: the worker never takes it
    seq, version, slot, skipped = worker.peek()  # type: ignore[misc]
    assert (version, slot, skipped) == (2, 2, 1)  # the first one counts as skipped
    worker.take(seq)
    assert sender.claimed() == seq


def test_a_version_the_worker_claimed_before_it_was_written_over_is_its_own(pair: tuple[Mailbox, Mailbox, Wake]) -> None:
    sender, worker, _wake = pair
    first = sender.publish(1, 1, 1, 0)
    seq, version, slot, _ = worker.peek()  # type: ignore[misc]
    assert (seq, version, slot) == (first, 1, 1)  # claimed: the worker reads slot 1 now
    sender.publish(2, 2, 2, 0)
    assert sender.claimed() == first  # so the sender keeps slot 1 until the worker's next answer
    worker.take(seq)
    seq, version, slot, skipped = worker.peek()  # type: ignore[misc]
    assert (version, slot, skipped) == (2, 2, 0)  # it took the first: nothing skipped


@pytest.mark.parametrize("after", ["_load", "_full_fence"], ids=["after-its-read", "after-its-claim"])
def test_a_version_written_over_while_the_worker_claims_it_is_given_up_by_the_worker(
    pair: tuple[Mailbox, Mailbox, Wake], monkeypatch: pytest.MonkeyPatch, after: str
) -> None:
    """The sender writes version 2 over version 1, then reads the claim, in the middle of
    the worker's poll: after the worker read version 1's words, the claim the sender reads
    is older (slot 1 is free at once); after the worker stored its claim, the sender sees
    it (and keeps slot 1 until the worker's next answer). Either way the worker's re-read
    sees version 2, and it claims that one: it never reads slot 1."""
    sender, worker, _wake = pair
    first = sender.publish(1, 1, 1, 0)
    seen: list[int] = []
    _interleave(monkeypatch, _poll if after == "_load" else worker, after, lambda: (sender.publish(2, 2, 2, 0), seen.append(sender.claimed())))
    seq, version, slot, skipped = worker.peek()  # type: ignore[misc]
    assert seen == [0 if after == "_load" else first]
    assert (version, slot, skipped) == (2, 2, 1)
    assert sender.claimed() == seq


# ------------------------------------------------------------------ the sender's side of a race


@contextlib.asynccontextmanager
async def _polled_loopback() -> AsyncIterator[tuple[MultiProcessWeightSyncScheme, Any]]:
    """A trainer and a polled loopback worker in this loop, connected: ``(scheme, receiver)``.
    Four slots, all mapped when polling starts: every poll can commit at once."""
    scheme = MultiProcessWeightSyncScheme(timeout=30, num_slots=4)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    worker = loopback_worker(scheme, 0)
    worker.init_on_receiver(worker_idx=0, model=make_model(), poll=True)
    try:
        await asyncio.gather(scheme.connect(), worker.connect())
        yield scheme, worker.receiver
    finally:
        await scheme.aclose()
        await worker.aclose()


async def test_a_worker_that_takes_the_new_version_while_the_sender_replaces_the_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the sender's write of version 2 over version 1 and its read of the claim,
    the worker polls: it takes version 2, commits it and acks it. The sender sees a claim
    past version 1 (whose slot it lets go) and that ack, in that order."""
    async with _polled_loopback() as (scheme, receiver):
        await scheme.send_async()  # version 1: in the mailbox
        mailbox = scheme._transport._workers[0].link.mailbox
        real = mailbox.claimed

        def worker_polls_first() -> int:
            assert receiver.poll_nowait() == 2
            return real()  # type: ignore[no-any-return]

        monkeypatch.setattr(mailbox, "claimed", worker_polls_first)
        assert await scheme.send_async() == 2
        link = scheme._transport.ledger.links[0]
        assert link.in_flight is None and link.maybe is None and link.live is not None and link.live.version == 2
        assert scheme.sender.applied_versions() == {0: 2}


async def test_a_version_the_worker_is_taking_keeps_its_slot_until_the_worker_answers() -> None:
    """The worker has claimed version 1 (in the middle of a poll) when versions 2 and 3 are
    written over it: version 1's slot is kept, never written for version 3, until the
    worker's next answer; version 2's is let go at once."""
    async with _polled_loopback() as (scheme, receiver):
        await scheme.send_async()
        assert receiver._mailbox.peek() is not None  # claimed, as a poll does before it reads the slot
        ledger = scheme._transport.ledger
        await scheme.send_async()
        taking = ledger.links[0].maybe
        assert taking is not None and taking.version == 1
        await scheme.send_async()
        assert ledger.links[0].maybe == taking and ledger.latest[0].slot != taking.slot
        assert receiver.poll_nowait() == 3
        await scheme.wait_async(3)
        assert ledger.links[0].maybe is None and taking.slot in ledger.free()
        assert receiver.statistics().skipped == 2  # versions 1 (claimed, never committed) and 2


# ------------------------------------------------------------------ the ledger's maybe


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> SlotLedger:
    """Worker 0, polled, runs version 0 from slot 0 and has version 1 (slot 1) in its mailbox."""
    monkeypatch.setattr(_ownership, "_debug", True)
    ledger = SlotLedger(manual=False)
    for s in range(4):
        ledger.add_slot(s)
    ledger.connect(0)
    ledger.poll(0)
    for version in (0, 1):
        ledger.reserve(version)
        ledger.publish(version, version, [0])
        assert ledger.next_delivery(0) == Ref(version, version)
        if version == 0:
            ledger.on_ack(0, 0, True, 0)
    return ledger


def _replace_with(ledger: SlotLedger, version: int, slot: int, claimed: bool, still_claimed: bool = False) -> bool:
    ledger.reserve(slot)
    ledger.publish(slot, version, [0])
    return ledger.replace(0, claimed, still_claimed)


def test_the_replaced_slot_is_free_at_once_when_the_worker_never_claimed_it(ledger: SlotLedger) -> None:
    assert not _replace_with(ledger, 2, 2, claimed=False)
    assert ledger.links[0].in_flight == Ref(2, 2) and ledger.links[0].maybe is None
    assert 1 in ledger.free()


def test_a_claimed_replaced_slot_is_held_until_the_workers_next_answer(ledger: SlotLedger) -> None:
    assert _replace_with(ledger, 2, 2, claimed=True)
    assert ledger.links[0].maybe == Ref(1, 1) and 1 not in ledger.free()
    assert ledger.owners(1) == ["worker 0 maybe"]
    ledger.on_ack(0, 0, False, 0)  # an older answer (a refusal on the socket) says nothing of it
    assert ledger.links[0].maybe == Ref(1, 1)
    ledger.on_ack(0, 1, True, 1)  # it did take it: now live
    assert ledger.links[0].maybe is None and ledger.links[0].live == Ref(1, 1) and ledger.links[0].in_flight == Ref(2, 2)
    ledger.on_ack(0, 2, True, 2)
    assert set(ledger.free()) == {0, 1, 3}


def test_at_most_one_maybe_and_the_bound_counts_it(ledger: SlotLedger) -> None:
    assert _replace_with(ledger, 2, 2, claimed=True)
    # Written over again while the claim still names version 1: version 2 is let go.
    ledger.reserve(3)
    ledger.publish(3, 3, [0])
    assert not ledger.replace(0, claimed=False, still_claimed=True)
    assert ledger.links[0].maybe == Ref(1, 1) and 2 in ledger.free()
    # Live 0, maybe 1, in flight 3 (also latest), one being written: within k·W + P + L + G + 1.
    ledger.reserve(2)
    assert len(ledger.in_use()) == 4 <= slot_bound(1, False, 1, 1, polled=1)
    ledger.unreserve(2)
    # The worker claimed past version 1 (an answer for it was taken before): it goes.
    ledger.reserve(2)
    ledger.publish(2, 4, [0])
    assert ledger.replace(0, claimed=True, still_claimed=False)
    assert ledger.links[0].maybe == Ref(3, 3) and 1 in ledger.free()
    with pytest.raises(InvariantError, match="may hold version"):
        ledger.links[0].maybe = Ref(4, 2)  # never beside an in-flight version as new
        ledger.check()
