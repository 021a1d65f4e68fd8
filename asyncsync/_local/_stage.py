"""Staging on a worker: from the sender's slot to a set of weights the commit can apply.

The receiver hands each ``Receive`` to :class:`SlotStaging`. It says whether the version
can be applied at all (a layout the model fits, a mapped slot that is large enough), then
gives the weights either straight from the slot (CPU, the model's dtypes: nothing to
copy) or as a private set on the worker's device, copied off the event loop (a cast from
``transfer_dtype``, a host-to-device copy). It never writes the model: only the commit
does, in one step, after staging.

Which set is being written is kept by :class:`~asyncsync._core._ownership.BufferRoles`:
a staging copy cancelled before it ended (the receiver closes mid-copy) keeps its set in
the ``staging`` role until the copy has really ended, under the rule of
:mod:`asyncsync._core._offload`. Only then is the set freed, and only then are the slots
the copy reads unregistered and unmapped; the event loop never waits for the copy.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from .._core._layout import Layout
from .._core._ownership import BufferRoles, Weights
from .._io._shm import Segment
from .._io._staging import Stager, copy_tensors
from .._wire._local import MapSlots, Receive
from ._commit import Binding
from ._slotmap import SlotMap, check_segments

__all__ = ["SlotStaging"]

logger = logging.getLogger("asyncsync")


class SlotStaging:
    """The slots a worker mapped, and the staging of each version from them.

    ``bind`` it at each ``Setup``; then, per ``Receive``: :meth:`refusal`, and either
    :meth:`from_slot` (when :attr:`reads_slot`) or :meth:`stage` / :meth:`stage_now`,
    which return the staged set or why it could not be staged.

    Example (what the receiver does with one ``Receive``)::

        refusal = staging.refusal(msg)
        if refusal is None:
            staged = staging.from_slot(msg) if staging.reads_slot else await staging.stage(msg)
    """

    def __init__(self, worker_idx: int) -> None:
        self.worker_idx = worker_idx
        self.slots = SlotMap()
        self.layout: Layout | None = None
        self.error: str | None = None  # why no version can be applied (the model does not fit)
        self.roles: BufferRoles | None = None
        self.reads_slot = False
        self.device = torch.device("cpu")
        self._targets: dict[str, torch.Tensor] = {}
        self._inference = False
        self._stager: Stager | None = None
        self._copying: asyncio.Future[None] | None = None  # a copy whose caller left, until it ends
        self._closing = False

    # ----------------------------------------------------------------- setup

    def bind(self, layout: Layout, binding: Binding | str, version: int) -> BufferRoles | None:
        """A new layout: stage into *binding*'s tensors (the model runs *version*); return
        the roles of the worker's sets. A string *binding* says why the model cannot take
        this layout: every version is refused with it (and None is returned)."""
        self.layout = layout
        self.slots.forget_views()
        if isinstance(binding, str):
            self.error = binding
            return None
        self.error = None
        self.device = binding.device
        self.reads_slot = binding.reads_slot
        self._targets = binding.targets
        self._inference = binding.inference
        live = Weights(version, {k: t.data for k, t in binding.targets.items()})
        self.roles = BufferRoles(live, self._allocate_set, keep_free=binding.recyclable)
        return self.roles

    def retarget(self, binding: Binding) -> None:
        """The model's tensors were bound again (:func:`~._commit.rebind_model`: the same
        dtypes, device and inference mode): new private sets are shaped like these."""
        self._targets = binding.targets

    def _allocate_set(self) -> dict[str, torch.Tensor]:
        """A private set of device buffers shaped like the model (inference tensors where
        the model's are)."""
        targets = self._targets
        out = {k: torch.empty_like(t, device=self.device) for k, t in targets.items() if not t.is_inference()}
        if len(out) < len(targets):
            with torch.inference_mode():
                out.update({k: torch.empty_like(t, device=self.device) for k, t in targets.items() if t.is_inference()})
            out = {k: out[k] for k in targets}
        return out

    async def map_slots(self, msg: MapSlots, fds: list[int]) -> None:
        """Map the segments *msg* announces (their descriptors: *fds*)."""
        check_segments(msg, fds)
        for sid, nbytes, fd in zip(msg.slot_ids, msg.nbytes, fds):
            # Mapping pre-faults every page: off the loop for large slots.
            segment = await self._get_stager().run(nbytes, Segment.attach, fd, nbytes, discard=Segment.close)
            self.slots.add(sid, segment, msg.transient)

    # ----------------------------------------------------------------- per version

    def refusal(self, msg: Receive) -> str | None:
        """Why this worker cannot apply *msg* (it then keeps its weights), or None."""
        if self.layout is None or self.error is not None or self.roles is None:
            return self.error or "no layout received"
        seg = self.slots.get(msg.slot)
        if seg is None:
            return f"slot {msg.slot} was never mapped"
        if seg.nbytes < self.layout.nbytes:
            return f"slot {msg.slot} holds {seg.nbytes} bytes, the layout needs {self.layout.nbytes}"
        return None

    def from_slot(self, msg: Receive) -> Weights:
        """*msg*'s weights as views of its slot (when :attr:`reads_slot`: nothing to copy)."""
        assert self.layout is not None
        return Weights(msg.version, self.slots.views(msg.slot, self.layout), msg.slot)

    def waits_for(self, slot: int) -> bool:
        """True while *slot* cannot be staged from without awaiting: it is not mapped yet,
        or a staging copy still writes (a poll then leaves it to the receiver task)."""
        return self.roles is not None and self.error is None and (self.slots.get(slot) is None or self.roles.staging is not None)

    async def stage(self, msg: Receive) -> Weights | str:
        """Copy *msg*'s slot into a private set, off the loop; return the set, or why not.

        Cancelled mid-copy, it leaves at once; the set stays ``staging`` until the copy has
        ended (the next :meth:`stage` waits for that), then it is freed.
        """
        if self._copying is not None:
            await asyncio.wait((self._copying,))  # a copy whose caller left still writes its set
        assert self.layout is not None and self.roles is not None
        roles = self.roles
        seg = self.slots.segments[msg.slot]
        t0 = time.perf_counter()
        staging, dst, src = self._begin(msg)
        left = False

        def keep() -> None:  # the copy goes on without us: it owns the set until it ends
            nonlocal left
            left = True
            self._copying = asyncio.get_running_loop().create_future()

        def release() -> None:  # on the loop, once the copy has ended
            copying, self._copying = self._copying, None
            roles.end_staging(False)
            if copying is not None:
                copying.set_result(None)
            if self._closing:
                self._close_now()

        try:
            stager = self._get_stager()
            await stager.pin(seg.buf)
            await stager.copy(dst, src, self.layout.nbytes, inference=self._inference, keep=keep, release=release)
        except Exception as exc:  # only private buffers were written: the model is untouched
            return self._failed(msg, exc)
        except BaseException:
            if not left:
                roles.end_staging(False)  # no copy of ours is running: the set is free now
            raise
        return self._done(staging, t0)

    def stage_now(self, msg: Receive) -> Weights | str:
        """:meth:`stage` without awaiting (a poll): the copy runs on this thread."""
        t0 = time.perf_counter()
        staging, dst, src = self._begin(msg)
        try:
            with torch.inference_mode(self._inference):
                copy_tensors(dst, src)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except Exception as exc:  # only a private set was written: the model is untouched
            return self._failed(msg, exc)
        return self._done(staging, t0)

    def _begin(self, msg: Receive) -> tuple[Weights, list[torch.Tensor], list[torch.Tensor]]:
        """A free set becomes ``staging`` for *msg*: it, and the copy's destinations and sources."""
        assert self.layout is not None and self.roles is not None
        views = self.slots.views(msg.slot, self.layout)
        staging = self.roles.begin_staging(msg.version)
        keys = list(views)
        return staging, [staging.tensors[k] for k in keys], [views[k] for k in keys]

    def _done(self, staging: Weights, t0: float) -> Weights:
        assert self.roles is not None
        self.roles.end_staging(True)
        staging.stage_s = time.perf_counter() - t0
        return staging

    def _failed(self, msg: Receive, exc: Exception) -> str:
        assert self.roles is not None
        self.roles.end_staging(False)
        logger.error("worker %d: staging version %d failed", self.worker_idx, msg.version, exc_info=exc)
        return f"staging failed: {type(exc).__name__}: {exc}"

    # ----------------------------------------------------------------- the end

    def release_transient(self, live: set[int]) -> None:
        """Unmap transient slots that no role in *live* views any more."""
        self.slots.release_transient(live, self._stager.unpin if self._stager is not None else None)

    def close(self) -> None:
        """Unregister and unmap the slots, and end the staging thread: now, or once a copy
        whose caller left has ended (:meth:`wait_closed` waits for that)."""
        if self._copying is not None:
            self._closing = True
            return
        self._close_now()

    async def wait_closed(self) -> None:
        """Until :meth:`close` is done (the loop goes on meanwhile); cancellable, the close
        still completes."""
        if self._copying is not None:
            await asyncio.wait((self._copying,))

    def _close_now(self) -> None:
        self._closing = False
        if self._stager is not None:
            self._stager.close()  # unregisters page-locked slots: before they are unmapped
            self._stager = None
        self.slots.close()

    def _get_stager(self) -> Stager:
        if self._stager is None:
            self._stager = Stager(self.device)  # Setup, which fixes the device, comes first
        return self._stager
