"""A polled worker's mailbox: the newest version sent to it, in a version word in shared memory.

The sender writes ``(version, slot, skipped)`` into a 64-byte memfd segment of the
worker's connection instead of sending a ``Receive``; the worker reads it between two
steps (:meth:`Receiver.poll_nowait`) with no system call. Ownership is as for ``Receive``:
the mailbox names the one version in flight to this worker, written only once the
previous one was answered, and its slot stays held until the worker's ``Ack``.

Words (native int64, 8-byte aligned in a page-aligned mapping)::

    [0] sequence: even when stable, odd while the sender writes
    [1] version   [2] slot id   [3] versions skipped (latest wins)

It is a seqlock with one writer (the sender's event loop) and one reader (the worker).
The writer makes the sequence odd, writes the fields, then makes it even (written last);
the reader reads the sequence, the fields, then the sequence again, and keeps the fields
only if both reads are the same even number. Each word is one aligned 8-byte load or
store (``memoryview`` of format ``q`` copies the 8 bytes with one instruction on x86-64
and AArch64, where such an access is single-copy atomic), so no word is ever torn.

Memory order: the slot's bytes (written by the sender's copy) must be visible before the
sequence that announces them, and the worker must read the slot only after it saw that
sequence. On x86-64 (TSO) stores are not reordered with older stores and loads not with
older loads, so program order is enough and :func:`fence` does nothing. AArch64 may
reorder both: there :func:`fence` is a full barrier (C11 ``atomic_thread_fence``
through libatomic), issued by the writer between the odd store, the fields and the even
store, and by the reader between its three reads. An empty poll (the sequence is the one
already seen) is a single load with no barrier: at worst it sees a new version one poll
late.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading
from collections.abc import Callable

from .._io._shm import Segment

__all__ = ["MAILBOX_BYTES", "Mailbox", "fence"]

MAILBOX_BYTES = 64  # one cache line
_SEQ, _VERSION, _SLOT, _SKIPPED = range(4)


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


class Mailbox:
    """One connection's version word; made by the sender, mapped by the worker (:meth:`attach`)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        mm = segment._mmap
        assert mm is not None
        self._words: memoryview | None = memoryview(mm).cast("B").cast("q")
        self.seen = 0  # reader: the sequence of the last version taken

    @classmethod
    def create(cls) -> Mailbox:
        return cls(Segment(MAILBOX_BYTES))

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> Mailbox:
        if nbytes < MAILBOX_BYTES:
            raise ValueError(f"a mailbox needs {MAILBOX_BYTES} bytes, got {nbytes}")
        return cls(Segment.attach(fd, nbytes))

    @property
    def fd(self) -> int:
        assert self.segment.fd is not None
        return self.segment.fd

    def publish(self, version: int, slot: int, skipped: int) -> None:
        """Writer: announce *version* in *slot* (its bytes are complete)."""
        w = self._words
        if w is None:
            return  # closed: the connection is gone
        seq = w[_SEQ] + 1
        w[_SEQ] = seq  # odd: being written
        fence()
        w[_VERSION] = version
        w[_SLOT] = slot
        w[_SKIPPED] = skipped
        fence()
        w[_SEQ] = seq + 1  # even, and last

    def peek(self) -> tuple[int, int, int, int] | None:
        """Reader: ``(sequence, version, slot, skipped)`` if something new was published since
        :attr:`seen`, else None (a single load). Call :meth:`take` once it is applied."""
        w = self._words
        if w is None:
            return None
        seq = w[_SEQ]
        if seq == self.seen:
            return None  # the empty poll: no barrier, no system call
        for _ in range(64):  # the writer is a few stores long: retry a few times
            if not seq & 1:
                fence()
                version, slot, skipped = w[_VERSION], w[_SLOT], w[_SKIPPED]
                fence()
                again = w[_SEQ]
                if again == seq:
                    return seq, version, slot, skipped
                seq = again
            else:
                seq = w[_SEQ]
        return None  # still being written: the next poll sees it

    def take(self, seq: int) -> None:
        self.seen = seq

    def close(self) -> None:
        if self._words is not None:
            self._words.release()  # before the mapping goes
            self._words = None
        self.segment.close(unmap=True)
