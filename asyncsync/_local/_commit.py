"""The one commit path of a receiver: binding the model, swap or copy, the untouched
check, the callbacks; and noticing that the model's tensors were replaced since they were
bound (:class:`ModelWatch`), to bind the new ones before a commit (:func:`rebind_model`).

Both the receiver task and :meth:`Receiver.poll_nowait` commit through
:meth:`Committer.commit`, which never awaits: a forward pass that does not await in the
middle never sees two versions mixed. A commit is all or nothing: a swap that fails half
way is undone, and what a copy cannot write is refused at setup (:func:`copy_problems`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import operator
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import nn

from .._core._layout import Layout
from .._core._options import Commit, Strategy, device_problem
from .._core._ownership import BufferRoles, Weights, debug_enabled
from .._core._weights import as_user_weights, bind_targets
from .._io._shm import Segment
from .._io._staging import copy_tensors
from ._bucket import SlotBucket

__all__ = ["Committer", "ModelWatch", "OnUpdate", "bind_model", "copy_problems", "rebind_model"]

logger = logging.getLogger("asyncsync")

_version_of = operator.attrgetter("_version")  # a tensor's in-place write counter

OnUpdate = Callable[[Any, int], "Awaitable[None] | None"]


class Committer:
    """Makes a staged set what the model runs, and tells the worker's callbacks."""

    def __init__(self, worker_idx: int, kind: Commit, strategy: Strategy, context: Any, on_update: OnUpdate | None) -> None:
        self.worker_idx = worker_idx
        self.kind = kind
        self.strategy = strategy
        self.context = context
        self.on_update = on_update
        self.targets: dict[str, torch.Tensor] = {}
        self.inference = False  # the model holds inference tensors (built under inference_mode)
        self.commit_s = 0.0
        self.callback_errors = 0
        self.last_callback_error: str | None = None
        self.callback_tasks: set[asyncio.Task[Any]] = set()
        self._slot_versions: list[int] = []
        self._unchecked: tuple[bool, bool] | None = None  # a commit's (viewed a slot, views one) until check_writes
        self.bucket: SlotBucket | None = None  # swap commits from slots: one storage swap
        self.segments: Mapping[int, Segment] = {}

    def bind(
        self,
        targets: dict[str, torch.Tensor],
        inference: bool,
        bucket: SlotBucket | None = None,
        segments: Mapping[int, Segment] | None = None,
    ) -> None:
        """Commit into *targets*; with a *bucket*, swap commits from a slot of *segments*
        move the whole model in one storage swap."""
        self.targets = targets
        self.inference = inference
        self.bucket = bucket
        self.segments = segments if segments is not None else {}
        self._slot_versions = []  # (counters of other tensors: no in-place write to report)

    def commit(self, roles: BufferRoles, staged: Weights) -> str | None:
        """Make *staged* what the model runs; return None, or why it could not (the model
        then keeps its version and *staged* is freed)."""
        t0 = time.perf_counter()
        targets = self.targets
        viewed_slot = roles.live.slot is not None  # (for check_writes, once acknowledged)
        try:
            if self.inference:
                with torch.inference_mode():
                    self._write(roles, staged)
            else:
                self._write(roles, staged)
        except Exception as exc:
            return self._failed(roles, staged, exc)
        if self.kind == "swap":
            roles.committed(staged, consumed=None)
        else:
            roles.committed(Weights(staged.version, roles.live.tensors, None), consumed=staged)
        if debug_enabled():
            roles.check({k: t.data for k, t in targets.items()})
        self._unchecked = (viewed_slot, roles.live.slot is not None)
        self.commit_s = time.perf_counter() - t0
        return None

    def check_writes(self) -> None:
        """After a commit's ack (off the path to it): say if the worker wrote in place into
        weights that viewed a shared slot since the commit before, and remember the version
        counters of those that view one now. Nothing ran between the commit and this call,
        and ``.data =`` and a storage swap keep each parameter's own counter, so the answer
        is the one a check before the commit would give."""
        unchecked, self._unchecked = self._unchecked, None
        if unchecked is None:
            return
        viewed_slot, views_slot = unchecked
        recorded = viewed_slot and self._check_untouched()
        if views_slot and not (recorded and self.kind == "swap"):
            # Parameters now view a shared slot: remember their version counters to notice
            # in-place writes (they would reach every worker reading that slot).
            self._slot_versions = list(map(_version_of, self.targets.values()))

    def _write(self, roles: BufferRoles, staged: Weights) -> None:
        """Point the model's tensors at *staged* (swap) or copy *staged* into them; raise
        :class:`_WriteFailed` naming the key where it failed."""
        targets = self.targets
        tensors = staged.tensors
        if self.kind == "swap":
            if self.bucket is not None and staged.slot is not None:
                # the whole model in one storage swap, or views of a fresh storage to arrange it
                bucket_views = self.bucket.commit(self.segments[staged.slot])
                if bucket_views is None:
                    return
                tensors = bucket_views
            done: list[torch.Tensor] = []
            key = ""
            try:
                for key, t in targets.items():
                    t.data = tensors[key]  # ``.data`` is never recorded by autograd: no no_grad needed
                    done.append(t)
            except Exception as exc:
                live = roles.live.tensors
                for k, t in zip(targets, done):
                    t.data = live[k]  # back to the version it ran: all or nothing
                raise _WriteFailed(key, False) from exc
            return
        keys = list(targets)
        try:
            copy_tensors([targets[k] for k in keys], [tensors[k] for k in keys])
        except Exception:
            with torch.no_grad():
                for i, key in enumerate(keys):  # the same copies again, one by one, to find the culprit
                    try:
                        targets[key].copy_(tensors[key])
                    except Exception as exc:
                        raise _WriteFailed(key, i > 0) from exc
            # (every copy went through the second time: the commit is whole)

    def _failed(self, roles: BufferRoles, staged: Weights, exc: Exception) -> str:
        """A commit raised (what setup checks makes this unexpected): refuse the version.

        A swap is undone; a copy that already wrote some tensors cannot be: say so.
        """
        roles.committed(roles.live, consumed=staged)  # the staged set is freed
        cause = exc.__cause__ if isinstance(exc, _WriteFailed) and exc.__cause__ is not None else exc
        where = f" at {exc.key!r}" if isinstance(exc, _WriteFailed) else ""
        error = f"commit={self.kind!r} failed{where} ({type(cause).__name__}: {cause}); "
        if isinstance(exc, _WriteFailed) and exc.torn:
            error += f"the tensors before it already hold version {staged.version}, the others version {roles.live.version}"
        else:
            error += f"the model keeps version {roles.live.version}"
        logger.error("worker %d: %s", self.worker_idx, error, exc_info=cause)
        return error

    def _check_untouched(self) -> bool:
        """True if nothing wrote into the weights since the last commit; else say so (and False)."""
        if list(map(_version_of, self.targets.values())) == self._slot_versions:
            return True  # the common case, in C
        written = [k for (k, t), v in zip(self.targets.items(), self._slot_versions) if t._version != v]
        if written:
            logger.error(
                "worker %d wrote in place into weights that view a shared slot (%s): other workers on "
                "the same slot see those writes; keep the model read-only (eval mode) or use commit='copy'",
                self.worker_idx,
                ", ".join(written[:8]),
            )
        return False

    # ------------------------------------------------------------------ callbacks

    def run_callbacks(self, version: int, layout: Layout | None) -> None:
        """Call ``update_policy_weights_`` and ``on_update``; an exception is logged and counted,
        never allowed to end the receiver."""
        has_cascade = self.context is not None and hasattr(self.context, "update_policy_weights_")
        if self.on_update is None and not has_cascade:
            return
        weights = as_user_weights({k: t.data for k, t in self.targets.items()}, self.strategy, layout)
        try:
            if has_cascade:
                self.context.update_policy_weights_(weights)
            if self.on_update is not None:
                result = self.on_update(weights, version)
                if inspect.isawaitable(result):
                    task = asyncio.ensure_future(result)
                    self.callback_tasks.add(task)
                    task.add_done_callback(self._callback_done)
        except Exception as exc:
            self._callback_failed(exc)

    def _callback_done(self, task: asyncio.Task[Any]) -> None:
        self.callback_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._callback_failed(task.exception())  # type: ignore[arg-type]

    def _callback_failed(self, exc: BaseException) -> None:
        self.callback_errors += 1
        self.last_callback_error = f"{type(exc).__name__}: {exc}"
        logger.error("worker %d: on_update callback raised (the receiver goes on)", self.worker_idx, exc_info=exc)

    async def aclose(self) -> None:
        """Cancel async callbacks still running, and wait for them."""
        for t in list(self.callback_tasks):
            t.cancel()
        if self.callback_tasks:
            await asyncio.wait(list(self.callback_tasks))


@dataclass(frozen=True)
class Binding:
    """What a commit writes: the model's tensors for a layout, on their device."""

    targets: dict[str, torch.Tensor]
    device: torch.device
    inference: bool  # the model holds inference tensors (built under inference_mode)
    reads_slot: bool  # commit straight from a shared slot (no staging)
    recyclable: bool  # private staging sets may be kept for reuse
    placed: dict[str, tuple[torch.dtype, torch.device]] = field(default_factory=dict)  # each target's dtype and device when bound

    def __post_init__(self) -> None:
        if not self.placed:
            self.placed.update({k: (t.dtype, t.device) for k, t in self.targets.items()})


def bind_model(model: nn.Module, layout: Layout, device: torch.device | None, kind: Commit) -> Binding | str:
    """Bind *model*'s tensors to *layout* on *device* (default: the model's), moving the
    model there; or say why its weights cannot be applied (then nothing was written)."""
    targets, problems = bind_targets(model, layout)
    if problems:
        return "payload does not fit the model: " + "; ".join(problems[:16])
    if device is None:
        device = next(iter(targets.values())).device if targets else torch.device("cpu")
    unusable = device_problem(device)
    if unusable is not None:
        return f"cannot place the model on {device}: {unusable}"
    # A model built under torch.inference_mode() holds inference tensors: they are
    # written only inside inference mode, and only by tensors that are inference tensors
    # themselves (a plain tensor swapped in leaves a parameter no forward can use).
    inference = any(t.is_inference() for t in targets.values())
    try:
        if any(t.device != device for t in targets.values()):
            with torch.inference_mode(inference):
                model.to(device)  # keeps Parameter identity; moves unsent buffers too
            targets, problems = bind_targets(model, layout)  # ``to()`` replaces buffers
    except Exception as exc:  # e.g. a CUDA device this process cannot use
        return f"cannot place the model on {device}: {exc}"
    if problems:
        return f"payload does not fit the model on {device}: " + "; ".join(problems[:16])
    unwritable = copy_problems(targets) if kind == "copy" else []
    if unwritable:  # refused before anything is written: a copy that fails half way tears the model
        return (
            "commit='copy' writes the model's tensors in place, and these cannot hold the sent values: "
            + "; ".join(unwritable[:8])
            + ". Give each its own memory (e.g. `.clone()`), or use commit='swap'"
        )
    # The slot already holds the model's dtypes on the model's device (CPU): commit
    # straight from it, by pointer swap (zero copy) or by an in-place copy. Otherwise
    # stage into device buffers first (a CUDA copy, or a cast from transfer_dtype), and
    # so does a swap into inference tensors (slot views are not inference tensors).
    reads_slot = device.type == "cpu" and all(targets[s.key].dtype == s.dtype for s in layout.specs) and not (inference and kind == "swap")
    # Reading straight from slots, no private set is ever staged into: the model's own
    # initial tensors are freed at the first swap instead of being kept for reuse.
    # (Nor can a set holding overlapping memory be staged into: the model's own, with
    # commit="swap"; then every staging set is a fresh one.)
    recyclable = not reads_slot and not copy_problems(targets)
    return Binding(targets, device, inference, reads_slot, recyclable)


def rebind_model(model: nn.Module, layout: Layout, bound: Binding, kind: Commit) -> Binding | str:
    """*model*'s current tensors for *layout*, once they changed since *bound* was made (a
    new parameter, submodule or model); or why they cannot take the weights (then nothing
    was written). Each must have the dtype, device and inference mode of the tensor it
    replaces: the staging of the worker was set up for those (the model is not moved)."""
    targets, problems = bind_targets(model, layout)
    for key, t in targets.items():
        dtype, device = bound.placed[key]
        if t.dtype != dtype or t.device != device:
            problems.append(f"{key!r}: the model's tensor is now {t.dtype} on {t.device}, the worker connected with {dtype} on {device}")
        elif t.is_inference() != bound.inference:
            made = "under" if t.is_inference() else "outside"
            problems.append(f"{key!r}: the model's tensor is now made {made} torch.inference_mode(), unlike the one it replaces")
    unwritable = copy_problems(targets)
    if kind == "copy":
        problems.extend(unwritable)
    if problems:
        return "the model's tensors changed since the worker connected, and do not fit the weights: " + "; ".join(problems[:16])
    return Binding(targets, bound.device, bound.inference, bound.reads_slot, bound.recyclable and not unwritable, bound.placed)


class ModelWatch:
    """Notices cheaply that a model no longer holds the tensors bound to it: a parameter or
    buffer replaced (``load_state_dict(..., assign=True)``, ``module.weight = ...``), a
    submodule replaced, one registered or deleted, or another model given.

    Example (what the receiver does before each commit)::

        watch = ModelWatch(model, targets)
        model[2] = nn.Linear(16, 3)
        print(watch.unchanged(model))      # False: bind the model's tensors again

    A check is one pass in C over what the model's module, parameter and buffer tables hold,
    compared by identity: for 256 tensors, about the cost of reading their data pointers. A
    tensor whose memory or values change in place (``.data =``, ``copy_``) is still the one
    a commit writes. A non-persistent buffer that no key binds (a cache a model may reassign
    at every forward) is left out; one registered or deleted still counts.
    """

    def __init__(self, model: nn.Module, targets: Mapping[str, torch.Tensor]) -> None:
        self.model = model
        bound = set(map(id, targets.values()))
        self._tables: list[dict[str, Any]] = []  # compared whole, value by value
        self._loose: list[dict[str, Any]] = []  # buffer tables holding caches: their size, and
        self._owners: list[dict[str, Any]] = []  # ... each other entry (table, name, value)
        self._names: list[str] = []
        self._entries: list[Any] = []
        for _, mod in model.named_modules(remove_duplicate=False):
            self._tables += (mod._modules, mod._parameters)
            buffers = mod._buffers
            caches = {n for n in mod._non_persistent_buffers_set if n in buffers and id(buffers[n]) not in bound}
            if not caches:
                self._tables.append(buffers)
                continue
            self._loose.append(buffers)
            for name, value in buffers.items():
                if name not in caches:
                    self._owners.append(buffers)
                    self._names.append(name)
                    self._entries.append(value)
        self._empty = [t for t in self._tables if not t]  # (cheaper to check apart: most are)
        self._tables = [t for t in self._tables if t]
        self._values = list(chain.from_iterable(map(dict.values, self._tables)))
        self._sizes = list(map(len, self._loose))

    def unchanged(self, model: nn.Module | None) -> bool:
        """True if *model* is the watched one and holds what it held when watched."""
        if model is not self.model:
            return False
        now = list(chain.from_iterable(map(dict.values, self._tables)))
        if len(now) != len(self._values) or not all(map(operator.is_, now, self._values)) or any(map(len, self._empty)):
            return False
        if self._loose:
            return list(map(len, self._loose)) == self._sizes and all(
                map(operator.is_, map(dict.get, self._owners, self._names), self._entries)
            )
        return True


def copy_problems(targets: dict[str, torch.Tensor]) -> list[str]:
    """Why an in-place copy cannot write some of *targets* (one line each), before it writes any."""
    out = []
    for key, t in targets.items():
        if t.layout != torch.strided:
            out.append(f"{key!r} {tuple(t.shape)} has layout {t.layout}")
        elif t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:  # 1: its elements overlap
            out.append(f"{key!r} {tuple(t.shape)} has overlapping memory (strides {t.stride()}, as made by expand())")
    return out


class _WriteFailed(Exception):
    """A commit failed writing *key*; *torn*: tensors before it were already written."""

    def __init__(self, key: str, torn: bool) -> None:
        super().__init__(key)
        self.key = key
        self.torn = torn
