"""The polled worker's mailbox and the sender's wake, in one process.

Two mappings of one mailbox (the sender's and the worker's): versions go one way, acks
the other, each line a seqlock that never hands out a line being written; the worker's
ack makes the shared wake readable, and one read of the wake takes every ring so far.
"""

from __future__ import annotations

import os
import select

import pytest

from asyncsync._local._poll import MAILBOX_BYTES, Mailbox, Wake


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@pytest.fixture
def pair() -> tuple[Mailbox, Mailbox, Wake]:
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
    sender.publish(7, 2, 1)
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
    sender.publish(8, 3, 0)
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
        sender.publish(3, 1, 0)
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
