"""The slot-publishing half of the local sender: shared-memory slots, their writes, and
the landing API through which a relay puts network bytes straight into a slot.

A send reserves a free slot (:meth:`Publisher.acquire`), writes the weights into it
(:meth:`Publisher.write`), and the sender publishes it to its targets; a send that
publishes nothing gives the slot back (:meth:`Publisher.unreserve`). A writer that cannot
be stopped (the copy thread, a network receive left to its backend) keeps the slot
reserved until it is done (:meth:`Publisher.keep_until`, :meth:`Publisher.written_late`):
a slot is never handed out while something still writes it.

A writer outside the sender (a relay) uses :class:`Reservation`, from ``LocalTransport.reserve``::

    async with transport.reserve(version, targets, base_version=None) as landing:
        if await receive_into(landing.buffer):      # writes the slot, in place
            landing.publish()                       # the targets' newest version
        else:                                       # gave up; the receive still writes it
            landing.abandon(still_writing=receive_done)
    # not published: the slot is free again (or once receive_done resolves)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Literal

import torch

from .._core._acks import Lifecycle, WorkerRecord
from .._core._deadline import Deadline, locked_within
from .._core._flat import SpanCopier
from .._core._layout import Layout
from .._core._offload import THREAD_COPY_BYTES, Offload
from .._core._ownership import SlotLedger
from .._core._signal import Signal
from .._core._weights import KnownSource
from .._errors import CapacityError, ClosedError, SyncTimeoutError, WeightsError
from .._io._slots import Slot, SlotPool
from .._io._staging import copy_tensors

__all__ = ["Publisher", "Reservation"]


class Publisher:
    """Reserves, writes and frees the sender's shared-memory slots (who holds which slot is
    the :class:`~.._core._ownership.SlotLedger`'s business; the sender publishes them)."""

    def __init__(
        self,
        pool: SlotPool,
        ledger: SlotLedger,
        layout: Layout,
        *,
        records: Mapping[int, WorkerRecord],
        copier: Offload,
        changed: Signal,
        life: Lifecycle,
    ) -> None:
        self.pool = pool
        self.ledger = ledger
        self._layout = layout
        self._records = records  # for the versions a slot timeout reports
        self._copier = copier
        self._changed = changed
        self._life = life  # the sender's phase
        self._spans = SpanCopier(layout)  # one copy per span of a flattened source
        self.bytes = 0  # bytes written into slots so far
        self.last_copy_s = 0.0

    async def acquire(self, deadline: Deadline) -> Slot:
        """A free slot, reserved for the caller: at once, or once an answer frees one."""
        slot = self.pool.acquire()
        if slot is not None:  # the common case: no closure, no wait
            return slot
        got: list[Slot] = []

        def free_slot() -> bool:
            if self._life.phase != "running":
                raise ClosedError("the sender was closed while waiting for a free slot")
            slot = self.pool.acquire()
            if slot is not None:
                got.append(slot)
                return True
            if not self.can_free_a_slot():
                raise CapacityError(
                    f"no free shared-memory slot among max_slots={self.pool.max_slots} and no answer pending "
                    "that would free one; held: "
                    + "; ".join(f"slot {s}: {', '.join(self.ledger.owners(s))}" for s in sorted(self.pool.slots))
                )
            return False

        timeout = deadline.remaining()
        if not await self._changed.wait_until(free_slot, timeout):
            pending = {i: w.applied for i, w in self._records.items() if (lk := self.ledger.links.get(i)) and lk.in_flight}
            raise SyncTimeoutError("waiting for a free shared-memory slot", pending, timeout)
        return got[0]

    def can_free_a_slot(self) -> bool:
        """Whether an outstanding answer or a finishing copy can still free a slot."""
        if self._copier.busy:
            return True
        return any(link.in_flight is not None or link.staged is not None for link in self.ledger.links.values())

    async def write(self, slot: Slot, flat: Mapping[str, torch.Tensor], base: int | None, known: KnownSource | None = None) -> None:
        """Copy *flat* into *slot*; with *base* (a slot id), the keys *flat* lacks come from there.

        *known*: the configured source *flat* was read from (a flattened model's send then
        copies its flat buffers without a pass over its tensors). A large copy runs in the
        copy thread; if the caller is cancelled meanwhile, the slot stays reserved until
        the copy is done (``slot.copying``)."""
        keys = self._layout.keys
        if base is None:
            fused, src = self._spans.plan(self.pool.views_buffer(slot), flat, known)
            dst = fused if fused is not None else list(map(self.pool.views(slot).__getitem__, keys))
        else:
            dst = list(map(self.pool.views(slot).__getitem__, keys))
            base_views = self.pool.views(self.pool.get(base))
            src = [flat[k] if k in flat else base_views[k] for k in keys]
        t0 = time.perf_counter()

        def keep() -> None:  # the copy thread still writes it: reserved until it is done
            slot.copying = True

        await self._copier.run(copy_tensors, dst, src, inline=self._layout.nbytes < THREAD_COPY_BYTES, keep=keep, release=lambda: self.written_late(slot))
        self.last_copy_s = time.perf_counter() - t0
        self.bytes += self._layout.nbytes

    def base_slot(self, targets: list[int], base_version: int) -> int:
        """The one slot holding every target's newest version, *base_version*."""
        refs = {i: self.ledger.latest.get(i) for i in targets}
        slots = {r.slot for r in refs.values() if r is not None and r.version == base_version}
        if len(slots) != 1 or any(r is None or r.version != base_version for r in refs.values()):
            have = {i: (r.version if r is not None else None) for i, r in refs.items()}
            raise WeightsError(f"cannot complete a partial update from version {base_version}: the targets' newest versions are {have}")
        slot = slots.pop()
        assert slot is not None
        return slot

    def unreserve(self, slots: list[Slot]) -> None:
        """Give back slots reserved by a send that publishes nothing."""
        for slot in slots:
            self.ledger.unreserve(slot.id)
        self.pool.release_unused()
        self._changed.notify()

    def keep_until(self, slot: Slot, writer: asyncio.Future[None]) -> None:
        """*slot* was given up while *writer* (a network receive) still writes it: it stays
        reserved, off the books, and mapped, until *writer* is done."""
        slot.copying = True
        slot.writer = writer
        writer.add_done_callback(lambda _f: self.written_late(slot))

    def written_late(self, slot: Slot) -> None:
        """The writer a failed send left behind (copy thread, network receive) is done: free its slot."""
        slot.copying = False
        self.ledger.unreserve(slot.id)
        if self._life.phase != "closed":
            self.pool.release_unused()
        self._changed.notify()


class Reservation:
    """One slot reserved for *version*, written by its holder, then published or given back.

    Made by ``LocalTransport.reserve()``; use it as ``async with``. Entering takes the sender's send
    lock (one writer at a time) and a free slot; for a partial update (*base_version*) the
    slot first gets a copy of the targets' newest version. :attr:`buffer` and :attr:`views`
    write the slot in place. Leaving without :meth:`publish` gives the slot back, also on an
    exception or a cancellation, unless :meth:`abandon` named a writer that still runs: then
    the slot stays reserved until that writer is done.

    Example::

        async with transport.reserve(3, [0, 1]) as landing:
            landing.buffer.copy_(wire_bytes)
            landing.publish()
    """

    def __init__(
        self,
        publisher: Publisher,
        lock: asyncio.Lock,
        *,
        version: int,
        targets: list[int],
        base_version: int | None,
        timeout: float | None,
        check: Callable[[], None],
        publish: Callable[[Slot, bool], None],
    ) -> None:
        self.version = version
        self.targets = targets
        self.base_version = base_version
        self._publisher = publisher
        self._lock = lock
        self._timeout = timeout
        self._check = check  # raises if the sender cannot take this version now
        self._publish = publish  # (slot, whether it holds a copied base): the sender's bookkeeping
        self._slot: Slot | None = None
        self._based = False
        self.published = False
        self._state: Literal["new", "reserved", "published", "abandoned", "done"] = "new"
        self._writer: asyncio.Future[None] | None = None

    async def __aenter__(self) -> Reservation:
        if self._state != "new":
            raise RuntimeError("a reservation is entered once")
        deadline = Deadline(self._timeout)
        await locked_within(self._lock, deadline, "waiting for another send's snapshot")
        try:
            self._check()  # for sure, now that no other send runs
            p = self._publisher
            base = None if self.base_version is None else p.base_slot(self.targets, self.base_version)
            slot = await p.acquire(deadline)
            try:
                if base is not None:
                    await p.write(slot, {}, base)
            except BaseException:
                if not slot.copying:  # else the copy thread frees it when it is done
                    p.unreserve([slot])
                raise
        except BaseException:
            self._lock.release()
            self._state = "done"
            raise
        self._slot = slot
        self._based = base is not None
        self._state = "reserved"
        return self

    @property
    def slot(self) -> Slot:
        if self._slot is None:
            raise RuntimeError("the reservation holds no slot: use it as `async with`")
        return self._slot

    @property
    def buffer(self) -> torch.Tensor:
        """The whole slot as one uint8 tensor of the wire layout's size (shared memory)."""
        return self._publisher.pool.views_buffer(self.slot)

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """The slot as one tensor per key of the wire layout (shared memory)."""
        return self._publisher.pool.views(self.slot)

    def publish(self) -> None:
        """Make the slot's contents every target's newest version, and send it to them."""
        if self._state != "reserved":
            raise RuntimeError(f"cannot publish a reservation that is {self._state}")
        self._publish(self.slot, self._based)
        self._state = "published"
        self.published = True

    def abandon(self, still_writing: asyncio.Future[None] | None = None) -> None:
        """Publish nothing. With *still_writing*, something still writes the slot: it stays
        reserved until that future is done, then it is free again."""
        if self._state != "reserved":
            raise RuntimeError(f"cannot abandon a reservation that is {self._state}")
        self._writer = still_writing
        self._state = "abandoned"

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._state in ("reserved", "abandoned"):  # nothing published
                slot = self.slot
                writer = self._writer
                if writer is not None and not writer.done():
                    self._publisher.keep_until(slot, writer)
                else:
                    self._publisher.unreserve([slot])
        finally:
            self._state = "done"
            self._lock.release()
