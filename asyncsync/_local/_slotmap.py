"""The receiver's mapped segments: which sender slot is which mapping, and its tensor views.

Slots of the ``"shm"`` transport are mapped once and kept; the ``"queue"`` transport's
slots are *transient*: unmapped as soon as no role of the receiver views them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch

from .._core._layout import Layout
from .._errors import ProtocolError
from .._io._shm import Segment
from .._wire._local import MapSlots

__all__ = ["SlotMap", "check_segments"]


class SlotMap:
    """Segments mapped from the sender, by slot id, and the layout's views of each."""

    def __init__(self) -> None:
        self.segments: dict[int, Segment] = {}
        self.transient: set[int] = set()
        self._views: dict[int, dict[str, torch.Tensor]] = {}

    def get(self, slot_id: int) -> Segment | None:
        return self.segments.get(slot_id)

    def add(self, slot_id: int, segment: Segment, transient: bool) -> None:
        self.segments[slot_id] = segment
        if transient:
            self.transient.add(slot_id)

    def views(self, slot_id: int, layout: Layout) -> dict[str, torch.Tensor]:
        """The layout's tensors viewing slot *slot_id* (made once per slot)."""
        views = self._views.get(slot_id)
        if views is None:
            views = self._views[slot_id] = layout.views(self.segments[slot_id].buf)
        return views

    def forget_views(self) -> None:
        """A new layout: views are made again from it."""
        self._views.clear()

    def release_transient(self, live: Iterable[int], unpin: Callable[[torch.Tensor], None] | None) -> None:
        """Unmap transient slots that no role views any more (*live*)."""
        keep = set(live)
        for sid in [s for s in self.transient if s not in keep]:
            self.transient.discard(sid)
            self._views.pop(sid, None)
            seg = self.segments.pop(sid, None)
            if seg is not None:
                if unpin is not None:
                    unpin(seg.buf)  # page-locked memory is unregistered before it is unmapped
                seg.close()

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()  # weights still viewing a slot were copied out before
        self.segments.clear()
        self._views.clear()


def check_segments(msg: MapSlots, fds: list[int]) -> None:
    """Raise :class:`ProtocolError` (closing *fds*) unless each segment holds the bytes announced.

    Mapping more than a memfd holds would kill the worker with SIGBUS at the first touch.
    """
    for sid, nbytes, fd in zip(msg.slot_ids, msg.nbytes, fds):
        size = os.fstat(fd).st_size
        if size < nbytes:
            for d in fds:
                os.close(d)
            raise ProtocolError(f"MapSlots: field 'nbytes': slot {sid} announces {nbytes} bytes, its segment holds {size}")
