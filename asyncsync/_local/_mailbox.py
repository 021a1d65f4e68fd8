"""A polled worker's mailbox: the newest version sent to it, and the worker's ack, in
version words in shared memory; and the wake that tells the sender an ack is there.

The sender writes ``(version, slot, count, base)`` into a 128-byte memfd segment of the
worker's connection instead of sending a ``Receive``; the worker reads it between two
steps (:meth:`Receiver.poll_nowait`) with no system call. The first version of a
connection still goes as a ``Receive``: the worker's connect waits for it without
polling. The mailbox names the one version in flight to this worker, and its slot stays
held until the worker's ack. Latest wins without the sender's loop: a send that finds the
version in the mailbox unanswered writes the newer one over it (see *Claims*).

The worker writes the ack of a version it applied into the mailbox's second cache line,
then writes the :class:`Wake`, one eventfd shared by every polled worker of the sender.
The sender's loop reads the wake once and then scans the ack words of every polled
worker: one wake-up for many acks, no message; a send reads them too. Rejections, ``Bye``
and liveness (EOF) stay on the socket. An ack may be written over one the sender has not
read: the newer one says what the worker holds now, which is all the sender needs.

Words (native int64, 8-byte aligned in a page-aligned mapping)::

    sender -> worker, line 0: [0] sequence  [1] version  [2] slot id  [3] count: versions
                              sent to the worker up to this one  [4] the count of the
                              newest version the sender knows it answered
    worker -> sender, line 1: [8] sequence  [9] version  [10] slot it runs from (-1: its
                              own memory)  [11] staging ns  [12] commit ns
                              [15] claim: the sequence of the last version it claimed

The worker's versions skipped are ``count - max(base, count of the last one it took) - 1``:
exact whether or not it took a version that was written over.

Each line is a seqlock with one writer (the sender's event loop for line 0, the worker
for line 1) and one reader. The writer makes the sequence odd, writes the fields, then
makes it even (written last); the reader reads the sequence, the fields, then the
sequence again, and keeps the fields only if both reads are the same even number. Each
word is one aligned 8-byte load or store (``memoryview`` of format ``q`` copies the 8
bytes with one instruction on x86-64 and AArch64, where such an access is single-copy
atomic), so no word is ever torn. The two lines are written by different processes and
never share a cache line.

Memory order: the slot's bytes (written by the sender's copy) must be visible before the
sequence that announces them, and the worker must read the slot only after it saw that
sequence. On x86-64 (TSO) stores are not reordered with older stores and loads not with
older loads, so program order is enough and :func:`fence` does nothing. AArch64 may
reorder both: there :func:`fence` is a full barrier (C11 ``atomic_thread_fence``
through libatomic), issued by the writer between the odd store, the fields and the even
store, and by the reader between its three reads. An empty poll (the sequence is the one
already seen) is a single load with no barrier: at worst it sees a new version one poll
late. The wake needs no fence: the worker's ``write`` to the eventfd follows its even
store, the sender's scan follows its ``read`` of the eventfd, and a system call orders
the memory accesses around it. A wake is never lost: an ack written after the sender's
read is followed by its own write, which makes the eventfd readable again; a scan that
finds a line being written skips it, and that write's wake comes next.

Claims: the sender may write a version over one the worker has not answered, while the
worker takes that one. The worker claims a version before it reads the slot: it stores
the version's sequence in its claim word, then, after a store-load barrier (on x86-64,
whose TSO lets a load pass an older store, a locked instruction), reads the sequence
again, and keeps the version only if it is still there (else it claims the newer one).
The sender writes the newer version, then, after the same barrier, reads the claim, then
the ack words. Of two such store-then-load sequences at least one sees the other's store
(Dekker): a claim older than the replaced version means the worker never took it and
never will (its re-read sees the new sequence), so its slot is free; a claim of that
version means it may be applying it, and the sender keeps its slot until the worker's
next answer says what it holds; a newer claim means it is past it, and any ack it wrote
for it (before that claim) is in the ack words the sender reads next. A claim is a
store and a barrier on a poll that finds a version, never on an empty poll.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
from collections.abc import Callable

from .._io._shm import Segment

__all__ = ["MAILBOX_BYTES", "Mailbox", "Wake", "fence"]

MAILBOX_BYTES = 128  # two cache lines: one per writer
_SEQ = 0  # the sender's line: sequence, version, slot, count, base
_ACK = 8  # the worker's line: sequence, version, holds, stage ns, commit ns
_CLAIM = 15  # the worker's line, last word: the sequence of the version it last claimed

def _make_fence() -> Callable[[], None]:
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return lambda: None  # TSO: see the module docstring
    name = ctypes.util.find_library("atomic")
    if name is not None:
        try:
            fn = ctypes.CDLL(name).atomic_thread_fence
            fn.argtypes = [ctypes.c_int]
            fn.restype = None
            return lambda: fn(5)  # memory_order_seq_cst
        except (OSError, AttributeError):
            pass
    lock = threading.Lock()

    def locked() -> None:  # no libatomic: a lock's acquire and release are barriers too
        with lock:
            pass

    return locked


fence: Callable[[], None] = _make_fence()


def _make_full_fence() -> Callable[[], None]:
    """A store-load barrier too (a claim, see the module docstring): :func:`fence` on
    weakly ordered machines; on x86-64, whose TSO lets a load pass an older store, a
    locked instruction: the acquire of a lock of its own (uncontended: no system call)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return fence  # a full barrier there already (or the lock fallback)
    lock = threading.Lock()
    acquire, release = lock.acquire, lock.release

    def locked() -> None:
        acquire()
        release()

    return locked


def _store(w: memoryview, base: int, fields: tuple[int, ...]) -> int:
    """Seqlock writer: the line at *base* gets *fields* after its sequence; returns the new sequence."""
    seq = w[base] + 1
    w[base] = seq  # odd: being written
    fence()
    i = base
    for value in fields:
        i += 1
        w[i] = value
    fence()
    w[base] = seq + 1  # even, and last
    return seq + 1


def _load(w: memoryview, base: int, seq: int) -> tuple[int, tuple[int, int, int, int]] | None:
    """Seqlock reader: ``(sequence, fields)`` of the line at *base* (four fields), whose
    sequence was just read as *seq*; None while it is being written (the next read sees it)."""
    for _ in range(64):  # the writer is a few stores long: retry a few times
        if not seq & 1:
            fence()
            # one load per word (a slice's copy is not promised to be word by word)
            fields = (w[base + 1], w[base + 2], w[base + 3], w[base + 4])
            fence()
            again = w[base]
            if again == seq:
                return seq, fields
            seq = again
        else:
            seq = w[base]
    return None


class Wake:
    """One eventfd shared by a sender's polled workers: each writes it after an ack in its
    mailbox; the sender's loop reads it once, then scans every mailbox's ack words."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd: int | None = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if fd is None else fd

    def ring(self) -> None:
        """Worker: an ack is in the mailbox (one system call)."""
        if self.fd is not None:
            try:
                os.eventfd_write(self.fd, 1)
            except OSError:
                pass  # cannot overflow while the sender reads it; the sender gone: nobody to tell

    def clear(self) -> None:
        """Sender: take every ring so far (before the scan)."""
        if self.fd is not None:
            try:
                os.eventfd_read(self.fd)
            except BlockingIOError:
                pass  # read already (a spurious readiness)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Mailbox:
    """One connection's version and ack words; made by the sender, mapped by the worker (:meth:`attach`)."""

    def __init__(self, segment: Segment, wake: Wake | None = None) -> None:
        self.segment = segment
        mm = segment._mmap
        assert mm is not None
        self._words: memoryview | None = memoryview(mm).cast("B").cast("q")
        self.wake = wake  # the worker's copy of the group's wake (None: the sender's side)
        self.seen = 0  # reader of line 0 (worker): the sequence of the last version taken
        self._taken = 0  # worker: the count of the last version taken
        self._peeked = (0, 0)  # worker: (sequence, count) of the version its last peek claimed
        self.acked = 0  # reader of line 1 (sender): the sequence of the last ack taken
        self._full_fence = _make_full_fence()  # its own: the sender's and the worker's never contend

    @classmethod
    def create(cls) -> Mailbox:
        return cls(Segment(MAILBOX_BYTES))

    @classmethod
    def attach(cls, fd: int, nbytes: int, wake_fd: int) -> Mailbox:
        """Worker: map the mailbox *fd*; *wake_fd* is the group's wake (both are kept)."""
        wake = Wake(wake_fd)
        if nbytes < MAILBOX_BYTES:
            os.close(fd)
            wake.close()
            raise ValueError(f"a mailbox needs {MAILBOX_BYTES} bytes, got {nbytes}")
        try:
            return cls(Segment.attach(fd, nbytes), wake)
        except BaseException:
            wake.close()
            raise

    @property
    def fd(self) -> int:
        assert self.segment.fd is not None
        return self.segment.fd

    def publish(self, version: int, slot: int, count: int, base: int) -> int:
        """Sender: announce *version* in *slot* (its bytes are complete), the *count*-th
        version sent to this worker; *base*: the count of the newest one it answered.
        Returns the sequence that names it (0: closed)."""
        w = self._words
        if w is None:
            return 0  # closed: the connection is gone
        return _store(w, _SEQ, (version, slot, count, base))

    def claimed(self) -> int:
        """Sender, after :meth:`publish`: the sequence of the last version the worker claimed
        (see the module docstring); the ack words read after it are at least as new."""
        w = self._words
        if w is None:
            return 0
        self._full_fence()  # the publish's stores before this load
        claim = w[_CLAIM]
        fence()  # the ack words after the claim
        return claim

    def peek(self) -> tuple[int, int, int, int] | None:
        """Worker: ``(sequence, version, slot, skipped)`` if something new was published
        since :attr:`seen`, else None (a single load). A version returned is claimed: the
        sender keeps its slot until the next ack, so it may be read now. Call :meth:`take`
        once it is applied (or refused)."""
        w = self._words
        if w is None:
            return None
        seq = w[_SEQ]
        if seq == self.seen:
            return None  # the empty poll: no barrier, no system call
        got = _load(w, _SEQ, seq)
        while got is not None:  # (None: being written; the next poll sees it)
            seq, (version, slot, count, base) = got
            w[_CLAIM] = seq  # (after the load's fences: after the last ack's stores too)
            self._full_fence()  # the claim before the re-read
            again = w[_SEQ]
            if again == seq:
                self._peeked = (seq, count)
                taken = self._taken
                return seq, version, slot, count - (base if base > taken else taken) - 1
            got = _load(w, _SEQ, again)  # written over meanwhile (one send each): claim the newer one
        return None

    def take(self, seq: int) -> None:
        """Worker: the version :meth:`peek` returned as *seq* is handled."""
        self.seen = seq
        if self._peeked[0] == seq:
            self._taken = self._peeked[1]

    def ack(self, version: int, holds: int | None, stage_s: float, commit_s: float) -> None:
        """Worker: *version* is applied (the model runs from slot *holds*, or its own
        memory); tell the sender through the ack words and the group's wake."""
        w = self._words
        if w is None:
            return
        _store(w, _ACK, (version, -1 if holds is None else holds, int(stage_s * 1e9), int(commit_s * 1e9)))
        if self.wake is not None:
            self.wake.ring()

    def take_ack(self) -> tuple[int, int | None, float, float] | None:
        """Sender: ``(version, holds, stage_s, commit_s)`` of an ack written since the last
        one taken, else None."""
        w = self._words
        if w is None:
            return None
        seq = w[_ACK]
        if seq == self.acked:
            return None
        got = _load(w, _ACK, seq)
        if got is None:
            return None  # being written: its wake follows
        self.acked, (version, holds, stage_ns, commit_ns) = got
        return version, None if holds < 0 else holds, stage_ns / 1e9, commit_ns / 1e9

    def close(self) -> None:
        if self._words is not None:
            self._words.release()  # before the mapping goes
            self._words = None
        self.segment.close(unmap=True)
        if self.wake is not None:
            self.wake.close()
            self.wake = None
