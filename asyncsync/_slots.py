"""Shared-memory slots: where a send's weights sit until every reader released them.

``SlotPool(reuse=True)`` (the ``"shm"`` transport) allocates its slots once and reuses
them: no allocation, no new file, no descriptor passing per send. ``reuse=False``
(the ``"queue"`` transport) gives every send a fresh segment that travels with the
instruction, as torch's shared-memory pickling does; it is freed once released.
"""

from __future__ import annotations

import torch

from ._layout import Layout
from ._shm import Segment

__all__ = ["Slot", "SlotPool"]


class Slot:
    """One segment holding one version of the weights."""

    def __init__(self, slot_id: int, nbytes: int, transient: bool) -> None:
        self.id = slot_id
        self.nbytes = nbytes
        self.transient = transient
        self.segment = Segment(nbytes)
        self.version = -1
        self.writing = False
        self.writing_elsewhere = False
        self.views: dict[str, torch.Tensor] | None = None

    @property
    def fd(self) -> int:
        assert self.segment.fd is not None
        return self.segment.fd


class SlotPool:
    """Allocates, hands out and frees slots; never more than ``max_slots`` at once."""

    def __init__(self, layout: Layout, *, num_slots: int, max_slots: int, reuse: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.layout = layout
        self.reuse = reuse
        self.max_slots = max(max_slots, num_slots)
        self.num_slots = num_slots
        self.slots: list[Slot] = []
        self._next_id = 0

    def open(self) -> None:
        """Allocate (and pre-fault) the reusable slots: once, at connect."""
        if self.reuse:
            while len(self.slots) < self.num_slots:
                self._allocate()

    def _allocate(self) -> Slot:
        slot = Slot(self._next_id, self.layout.nbytes, transient=not self.reuse)
        self._next_id += 1
        self.slots.append(slot)
        return slot

    def get(self, slot_id: int) -> Slot:
        for s in self.slots:
            if s.id == slot_id:
                return s
        raise KeyError(slot_id)

    def views(self, slot: Slot) -> dict[str, torch.Tensor]:
        if slot.views is None:
            slot.views = self.layout.views(slot.segment.buf)
        return slot.views

    def acquire(self, in_use: set[int], *, can_wait: bool) -> Slot | None:
        """A slot nobody reads, or None if the caller should wait for releases."""
        if not self.reuse:
            return self._allocate()
        for s in self.slots:
            if s.id not in in_use and not s.writing:
                return s
        if can_wait or len(self.slots) >= self.max_slots:
            return None
        return self._allocate()

    def release_unused(self, in_use: set[int]) -> None:
        """Free transient slots that nobody reads any more."""
        if self.reuse:
            return
        keep: list[Slot] = []
        for s in self.slots:
            if s.id in in_use or s.writing or s.writing_elsewhere:
                keep.append(s)
            else:
                s.views = None
                s.segment.close(unmap=True)
        self.slots = keep

    def close(self) -> None:
        for s in self.slots:
            s.views = None
            s.segment.close(unmap=True)
        self.slots = []
