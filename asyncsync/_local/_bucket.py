"""A worker's swap commit in one storage swap instead of one ``p.data = view`` per tensor.

With ``commit="swap"`` on CPU a worker's tensors view the slot they run. Pointing them at a
new slot one by one costs a Python step per tensor and version (about 1.5 us each: 0.4 ms
for 256 tensors). A :class:`SlotBucket` keeps the model's tensors as views of *one* storage
laid out exactly as a slot (:meth:`~.._core._layout.Layout.views`), so that a commit is one
``torch.UntypedStorage._swap_data_ptr_`` between that storage and a fresh storage object
over the new slot's bytes: every tensor viewing the model's storage follows in one C call.

- The fresh storage (:meth:`~.._io._shm.Segment.share`) is never the slot's own: the slot's
  cached views (the receiver's live and pending sets) keep pointing at their slot. What the
  model's storage held before (its reference to the previous slot's mapping) moves into the
  fresh storage object and is released with it. The model's own initial memory goes at the
  first commit, as with per-tensor swaps. Which slot the model holds is what the receiver's
  ledger says either way.
- The swap is a commit's last step and either happens whole or raises with nothing moved:
  there is nothing to undo.
- The first commit, and any commit after the arrangement was disturbed (a tensor
  re-pointed since, ``p.data = other``; a per-tensor commit undone half way), is per tensor,
  onto views of a fresh storage: that arranges the model again. Which one applies is
  checked before each commit by every tensor's data pointer (a C-level ``map``) and the
  identity of the model's storage.
- Only plain tensors and ``nn.Parameter`` are swapped: a tensor subclass may intercept
  ``.data =`` (``__torch_function__``), which a swap would bypass; it commits per tensor.
- ``nn.Parameter`` objects, ``requires_grad``, shapes, strides and ``state_dict()`` are
  what a per-tensor swap gives: the tensors are the same objects, only their memory moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from .._core._layout import Layout
from .._io._shm import Segment

__all__ = ["SlotBucket", "swap_supported"]

_ptr = torch.Tensor.data_ptr


def swap_supported() -> bool:
    """True if this torch can swap two storages' memory (``UntypedStorage._swap_data_ptr_``)."""
    return callable(getattr(torch.UntypedStorage, "_swap_data_ptr_", None))


class SlotBucket:
    """The model's tensors (in layout order) as views of one storage in the slot layout.

    Example (what the receiver does at each ``commit="swap"`` from a slot)::

        bucket = SlotBucket(layout, list(targets.values()))
        views = bucket.commit(segment)     # first commit: views to assign one by one
        for key, t in targets.items():
            t.data = views[key]
        print(bucket.commit(segment2))     # None: the whole model moved in one swap
    """

    def __init__(self, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(layout.specs):
            raise ValueError(f"{len(tensors)} tensors for a layout of {len(layout.specs)}")
        self.layout = layout
        self.tensors = list(tensors)
        # data_ptr() of each view relative to the buffer's start; an empty tensor's is 0
        self._offsets = [s.offset if s.numel else None for s in layout.specs]
        self._expected: list[int] | None = None  # the tensors' data pointers once arranged
        self._storage_id = 0  # the model storage's StorageImpl address once arranged
        self._by_base: dict[int, list[int]] = {}
        self.swaps = 0  # commits done in one swap
        self.per_tensor = 0  # commits that handed out views to assign one by one

    @staticmethod
    def usable(layout: Layout, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether a bucket can commit *layout* into *tensors*: this torch swaps storages, the
        layout has bytes, and every tensor is a plain tensor or ``nn.Parameter`` (a subclass
        may intercept ``.data =``, which a swap would bypass)."""
        plain = (torch.Tensor, nn.Parameter)
        return swap_supported() and layout.nbytes > 0 and bool(layout.specs) and all(type(t) in plain for t in tensors)

    def arranged(self) -> bool:
        """True if every tensor still views the model storage at its place in the layout."""
        expected = self._expected
        if expected is None or list(map(_ptr, self.tensors)) != expected:
            return False
        return self.tensors[0].untyped_storage()._cdata == self._storage_id

    def commit(self, segment: Segment) -> dict[str, torch.Tensor] | None:
        """Point the model at *segment*'s weights: None if done (one swap), else views of a
        fresh storage over the segment to assign per tensor (``t.data = views[key]``).

        Assigning every view arranges the model for the next commit. Assigning only some (a
        failure undone) leaves it unarranged: :meth:`arranged` notices it, by data pointer.
        """
        buf = segment.share(self.layout.nbytes)
        base = buf.data_ptr()
        expected = self._by_base.get(base)
        if expected is None:
            if len(self._by_base) >= 64:  # transient segments: a new address per send
                self._by_base.clear()
            expected = self._by_base[base] = [0 if o is None else base + o for o in self._offsets]
        fresh = buf.untyped_storage()
        if self.arranged():
            self.tensors[0].untyped_storage()._swap_data_ptr_(fresh)  # type: ignore[attr-defined]
            self._expected = expected
            self.swaps += 1
            return None  # *fresh* now holds what the model held, and goes with *buf*
        self._expected = expected
        self._storage_id = fresh._cdata
        self.per_tensor += 1
        return self.layout.views(buf)
