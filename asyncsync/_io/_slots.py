"""Shared-memory slots: where a send's weights sit until no worker holds them.

``SlotPool(reuse=True)`` (the ``"shm"`` transport) allocates ``num_slots`` slots at
connect and reuses them: no allocation, no new file, no descriptor passing per send.
When lagging workers hold them all, it adds a slot (up to ``max_slots``, and never more
than the ownership bound) and keeps it for reuse: a lag pattern costs its memory once.
``reuse=False`` (the ``"queue"`` transport) gives every send a fresh, *transient* segment,
as torch's shared-memory pickling does, freed (and unmapped by the workers) once released.
Who holds which slot is the :class:`~._ownership.SlotLedger`'s business.
"""

from __future__ import annotations

import asyncio

import torch

from .._core._layout import Layout
from .._core._ownership import SlotLedger
from ._shm import Segment

__all__ = ["Slot", "SlotPool"]


class Slot:
    """One segment holding one version of the weights."""

    def __init__(self, slot_id: int, nbytes: int, transient: bool) -> None:
        self.id = slot_id
        self.nbytes = nbytes
        self.transient = transient  # freed (and unmapped by workers) once nobody holds it
        self.segment = Segment(nbytes)
        self.views: dict[str, torch.Tensor] | None = None
        self.buffer: torch.Tensor | None = None  # the whole slot as uint8 (made once)
        self.copying = False  # a cancelled send's copy thread still writes it
        self.writer: asyncio.Future[None] | None = None  # an abandoned network receive still writes it, until done

    @property
    def fd(self) -> int:
        assert self.segment.fd is not None
        return self.segment.fd

    def close(self) -> None:
        writer = self.writer
        if writer is not None and not writer.done():
            # Unmapping now would let the backend write into freed memory: unmap once it is done
            # (never, if this process ends first: the kernel frees the mapping then).
            writer.add_done_callback(lambda _f: self.close())
            return
        self.views = self.buffer = None
        self.segment.close(unmap=True)


class SlotPool:
    """Allocates and frees slots; never more than ``max_slots`` at once."""

    def __init__(self, layout: Layout, *, num_slots: int, max_slots: int | None, reuse: bool) -> None:
        # num_slots >= 1 and max_slots >= num_slots: checked by the scheme's constructor
        self.layout = layout
        self.reuse = reuse
        self.num_slots = num_slots
        self.max_slots = max_slots
        self.slots: dict[int, Slot] = {}
        self.ledger: SlotLedger | None = None
        self._next_id = 0

    def open(self, ledger: SlotLedger) -> None:
        """Allocate (and pre-fault) the reusable slots: once, at connect."""
        self.ledger = ledger
        if self.reuse:
            while len(self.slots) < self.num_slots:
                self._allocate(transient=False)

    def _allocate(self, transient: bool) -> Slot:
        assert self.ledger is not None
        slot = Slot(self._next_id, self.layout.nbytes, transient)
        self._next_id += 1
        self.slots[slot.id] = slot
        self.ledger.add_slot(slot.id)
        return slot

    def get(self, slot_id: int) -> Slot:
        return self.slots[slot_id]

    def views(self, slot: Slot) -> dict[str, torch.Tensor]:
        if slot.views is None:
            slot.views = self.layout.views(slot.segment.buf)
        return slot.views

    def views_buffer(self, slot: Slot) -> torch.Tensor:
        """The whole slot as one uint8 tensor of ``layout.nbytes`` (it views the shared memory)."""
        if slot.buffer is None:
            slot.buffer = slot.segment.buf[: self.layout.nbytes]
        return slot.buffer

    def acquire(self) -> Slot | None:
        """Reserve a slot nobody holds (allocating one if allowed), or None: wait for releases."""
        assert self.ledger is not None
        free = self.ledger.free()
        if free:
            slot = self.slots[min(free)]
        elif self.max_slots is None or len(self.slots) < self.max_slots:
            # Every slot is held: one more is needed, and the bound must allow it.
            self.ledger.check(len(self.slots) + 1, adding=1)
            slot = self._allocate(transient=not self.reuse)
        else:
            return None
        self.ledger.reserve(slot.id)
        return slot

    def release_unused(self) -> None:
        """Free transient slots that nobody holds any more (reusable slots are kept)."""
        if self.reuse:
            return
        assert self.ledger is not None
        used = self.ledger.in_use()
        for sid in [s for s, slot in self.slots.items() if slot.transient and s not in used]:
            self.ledger.remove_slot(sid)
            self.slots.pop(sid).close()
        self.ledger.check(len(self.slots))

    def close(self) -> None:
        for s in self.slots.values():
            s.close()
        self.slots = {}
