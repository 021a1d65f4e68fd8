"""The receiver: a task in the worker's own event loop that stages and commits weights.

Per instruction: take the newest ``Receive`` waiting (latest wins), stage its weights on
the worker's device off the loop, then commit in one step between two awaits (a pointer
swap or an in-place copy), then acknowledge. A forward pass that does not await in the
middle therefore never sees two versions mixed.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
import warnings
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch
from torch import nn

from ._errors import BrokenChannelError, ClosedError, SenderDiedError, SyncTimeoutError, WouldBlock
from ._layout import Layout
from ._protocol import Ack, Hello, MapSlots, Receive, Setup, Staged, Stop
from ._queues import AsyncQueue
from ._shm import Segment
from ._signal import Signal
from ._staging import Stager, copy_tensors
from ._stats import ReceiverStatistics
from ._strategy import Strategy, as_user_weights, named_tensors

__all__ = ["Receiver"]

logger = logging.getLogger("asyncsync")

Commit = Literal["swap", "copy"]
CommitMode = Literal["auto", "manual"]
OnUpdate = Callable[[Any, int], "Awaitable[None] | None"]


class _Staged:
    """One version staged and ready to commit."""

    def __init__(self, version: int, tensors: dict[str, torch.Tensor], holds: int | None, stage_s: float, skipped: int) -> None:
        self.version = version
        self.tensors = tensors
        self.holds = holds
        self.stage_s = stage_s
        self.skipped = skipped


class Receiver:
    """Worker side of a scheme; created by ``init_on_receiver``."""

    def __init__(
        self,
        conn: Connection,
        *,
        worker_idx: int,
        model: nn.Module | None,
        strategy: Strategy,
        context: Any,
        on_update: OnUpdate | None,
        commit: Commit,
        commit_mode: CommitMode,
        timeout: float | None,
        device: torch.device | str | None = None,
    ) -> None:
        self.worker_idx = worker_idx
        self.model = model
        self.strategy = strategy
        self.context = context
        self.on_update = on_update
        self.commit_kind = commit
        self.commit_mode = commit_mode
        self.timeout = timeout
        self._device_override = torch.device(device) if device is not None else None
        self._queue: AsyncQueue[Any] = AsyncQueue(conn)
        self._segments: dict[int, Segment] = {}
        self._transient: set[int] = set()
        self._slot_views: dict[int, dict[str, torch.Tensor]] = {}
        self._layout: Layout | None = None
        self._layout_error: str | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._reads_slot = False
        self._slot_versions: list[int] = []
        self._spare: dict[str, torch.Tensor] | None = None
        self._device = torch.device("cpu")
        self._stager: Stager | None = None
        self._version = -1
        self._holds: int | None = None
        self._pending: _Staged | None = None
        self._updates = 0
        self._skipped = 0
        self._rejected = 0
        self._responded = -1
        self.last_error: str | None = None
        self._stage_s = 0.0
        self._commit_s = 0.0
        self._changed = Signal()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._state = "new"

    # ----------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        """Version the model runs now (-1 before the first weights arrive)."""
        return self._version

    @property
    def update_pending(self) -> bool:
        """True when a staged version waits for :meth:`commit` (``commit_mode="manual"``)."""
        return self._pending is not None

    @property
    def device(self) -> torch.device:
        return self._device

    async def connect(self, timeout: float | None | object = ...) -> int:
        """Start the receiver task; return once the initial weights are applied."""
        if self._state != "new":
            raise RuntimeError("connect() was already called") if self._state != "closed" else ClosedError("the receiver is closed")
        self._state = "running"
        self._queue.put_nowait(Hello(self.worker_idx, os.getpid()))
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"asyncsync-receiver-{self.worker_idx}")
        limit = self.timeout if timeout is ... else timeout
        # Done once the first instruction is answered: applied, staged (manual mode), or
        # rejected (then the worker keeps its own weights and keeps running; the sender raises).
        if not await self._changed.wait_until(lambda: self._responded >= 0 or self._pending is not None or self._ended(), limit):  # type: ignore[arg-type]
            raise SyncTimeoutError(f"worker {self.worker_idx} waiting for its initial weights", {self.worker_idx: self._version}, limit)  # type: ignore[arg-type]
        return self._version

    async def wait_for_version(self, version: int, *, timeout: float | None | object = ...) -> int:
        """Wait until the model runs *version* or newer; return the version it runs."""
        limit = self.timeout if timeout is ... else timeout

        def reached() -> bool:
            staged = self._pending is not None and self._pending.version >= version
            return self._version >= version or staged or self._ended()

        if not await self._changed.wait_until(reached, limit):  # type: ignore[arg-type]
            raise SyncTimeoutError(f"worker {self.worker_idx} waiting for version {version}", {self.worker_idx: self._version}, limit)  # type: ignore[arg-type]
        return self._version

    def commit(self) -> int | None:
        """Commit the staged version now (manual mode); return it, or None if none waits.

        Call it at a safe point (between env steps or batches). It does not await, so
        it is atomic with respect to everything else on the loop.
        """
        staged, self._pending = self._pending, None
        if staged is None:
            return None
        self._commit(staged)
        return staged.version

    async def wait_stopped(self) -> None:
        """Wait for the receiver task to end; raise :class:`SenderDiedError` if the sender died."""
        if self._task is None:
            raise RuntimeError("the receiver was not connected")
        await asyncio.wait([self._task])
        if self._error is not None:
            raise self._error

    @property
    def stopped(self) -> bool:
        return self._task is not None and self._task.done()

    def statistics(self) -> ReceiverStatistics:
        return ReceiverStatistics(
            worker_idx=self.worker_idx,
            version=self._version,
            pending_version=None if self._pending is None else self._pending.version,
            updates=self._updates,
            skipped=self._skipped,
            rejected=self._rejected,
            last_stage_ms=self._stage_s * 1e3,
            last_commit_ms=self._commit_s * 1e3,
        )

    async def aclose(self) -> None:
        """End the receiver task and close the channel (idempotent). The model keeps its weights."""
        if self._state == "closed":
            return
        self._state = "closed"
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        self._close_resources()

    def __del__(self) -> None:
        task = getattr(self, "_task", None)
        if task is not None and not task.done():
            warnings.warn(
                f"asyncsync receiver of worker {self.worker_idx} was not closed: use `async with scheme` or `await scheme.aclose()`",
                ResourceWarning,
                stacklevel=1,
            )

    # ----------------------------------------------------------------- the task

    def _ended(self) -> bool:
        """False while the receiver task runs; raises why it ended otherwise."""
        if self._task is not None and not self._task.done():
            return False
        if self._error is not None:
            raise self._error
        raise ClosedError(f"receiver of worker {self.worker_idx} stopped")

    async def _run(self) -> None:
        try:
            while True:
                batch = [await self._queue.get()]
                # Drain what is already waiting (latest wins), but stop at MapSlots: its
                # descriptors follow on the socket and must be read before any message.
                while not isinstance(batch[-1], (MapSlots, Stop)):
                    try:
                        batch.append(self._queue.get_nowait())
                    except WouldBlock:
                        break
                if await self._handle(batch):
                    return
        except BrokenChannelError as exc:
            self._error = SenderDiedError(f"worker {self.worker_idx}: the sender is gone ({exc}); keeping version {self._version}")
        except ClosedError:
            pass
        except Exception as exc:  # a bug: make it visible to whoever awaits the receiver
            self._error = exc
            raise
        finally:
            self._close_resources()
            self._changed.notify()

    async def _handle(self, batch: list[Any]) -> bool:
        """Process messages in order; of several Receives only the newest is applied."""
        newest = max((i for i, m in enumerate(batch) if isinstance(m, Receive)), default=-1)
        skipped = sum(isinstance(m, Receive) for m in batch) - (newest >= 0)
        for i, msg in enumerate(batch):
            if isinstance(msg, Setup):
                self._on_setup(msg)
            elif isinstance(msg, MapSlots):
                fds = self._queue.recv_fds(len(msg.slot_ids))
                for sid, nbytes, fd in zip(msg.slot_ids, msg.nbytes, fds):
                    # Mapping pre-faults every page: off the loop for large slots.
                    self._segments[sid] = await self._get_stager().run(nbytes, Segment.attach, fd, nbytes)
                    if msg.transient:
                        self._transient.add(sid)
            elif isinstance(msg, Receive) and i == newest:
                await self._on_receive(msg, skipped)
            elif isinstance(msg, Stop):
                return True
        return False

    def _on_setup(self, msg: Setup) -> None:
        self._layout = msg.layout
        self._layout_error = None
        self._spare = None
        self._slot_views.clear()
        if self.model is None:
            self._layout_error = "the worker has no model to apply weights to"
            return
        targets = named_tensors(self.model)
        device = self._device_override or (torch.device(msg.device) if msg.device else None)
        if device is None:
            device = next(iter(targets.values())).device if targets else torch.device("cpu")
        self._device = device
        problems = []
        wire = {s.key: s for s in msg.layout.specs}
        for key, spec in wire.items():
            t = targets.get(key)
            if t is None:
                problems.append(f"unexpected key {msg.layout.describe(key)}")
            elif tuple(t.shape) != spec.shape:
                problems.append(f"{key!r}: sent shape {spec.shape}, model has {tuple(t.shape)}")
            elif t.dtype != spec.dtype and not (t.dtype.is_floating_point and spec.dtype.is_floating_point):
                problems.append(f"{key!r}: sent dtype {spec.dtype}, model has {t.dtype}")
        missing = [k for k in targets if k not in wire]
        if missing:
            problems.append("model keys not sent: " + ", ".join(f"{k}: {tuple(targets[k].shape)}" for k in missing[:8]))
        if problems:
            self._layout_error = "payload does not fit the model: " + "; ".join(problems[:16])
            return
        for t in targets.values():
            if t.device != device:
                with torch.no_grad():
                    t.data = t.data.to(device)
        self._targets = {k: targets[k] for k in wire}
        # The slot already holds the model's dtypes on the model's device (CPU): commit
        # straight from it, by pointer swap (zero copy) or by an in-place copy. Otherwise
        # stage into device buffers first (a CUDA copy, or a cast from transfer_dtype).
        self._reads_slot = device.type == "cpu" and all(self._targets[s.key].dtype == s.dtype for s in msg.layout.specs)

    def _get_stager(self) -> Stager:
        if self._stager is None:
            self._stager = Stager(self._device)  # Setup, which fixes the device, comes first
        return self._stager

    async def _on_receive(self, msg: Receive, skipped: int) -> None:
        if self._layout is None or self._layout_error is not None:
            self._rejected += 1
            self._ack(Ack(self.worker_idx, msg.version, False, self._layout_error or "no layout received", self._holds))
            return
        seg = self._segments.get(msg.slot)
        if seg is None:
            self._rejected += 1
            self._ack(Ack(self.worker_idx, msg.version, False, f"slot {msg.slot} was never mapped", self._holds))
            return
        views = self._slot_views.get(msg.slot)
        if views is None:
            views = self._slot_views[msg.slot] = self._layout.views(seg.buf)
        t0 = time.perf_counter()
        if self._reads_slot:
            staged = _Staged(msg.version, views, msg.slot, 0.0, skipped)
        else:
            buffers = self._staging_buffers()
            stager = self._get_stager()
            keys = list(views)
            stager.pin(seg.buf)
            await stager.copy([buffers[k] for k in keys], [views[k] for k in keys], self._layout.nbytes)
            staged = _Staged(msg.version, buffers, None, time.perf_counter() - t0, skipped)
        if self._pending is not None:
            self._skipped += 1
        if self.commit_mode == "manual":
            self._pending = staged
            self._send(Staged(self.worker_idx, staged.version, staged.holds))  # older slots go back
            self._changed.notify()
        else:
            self._commit(staged)
        self._release_transient()

    def _staging_buffers(self) -> dict[str, torch.Tensor]:
        """A second set of device buffers shaped like the model (allocated once)."""
        if self._spare is None:
            self._spare = {k: torch.empty_like(t, device=self._device) for k, t in self._targets.items()}
        return self._spare

    def _commit(self, staged: _Staged) -> None:
        t0 = time.perf_counter()
        holds: int | None
        targets = self._targets
        tensors = staged.tensors
        if self._holds is not None:
            self._check_untouched()
        if self.commit_kind == "swap":
            with torch.no_grad():
                if staged.holds is None and self._holds is None:
                    # The model's former private buffers become the next staging area.
                    previous = {}
                    for key, t in targets.items():
                        previous[key] = t.data
                        t.data = tensors[key]
                    self._spare = previous
                else:
                    for key, t in targets.items():
                        t.data = tensors[key]
                    if staged.holds is None:
                        self._spare = None  # the former buffers were a shared slot's views
            holds = staged.holds
        else:
            keys = list(targets)
            copy_tensors([targets[k] for k in keys], [tensors[k] for k in keys])
            holds = None
        self._holds = holds
        if holds is not None:
            # Parameters now view a shared slot: remember their version counters to notice
            # in-place writes (they would reach every worker reading that slot).
            self._slot_versions = [t._version for t in targets.values()]
        self._version = staged.version
        self._commit_s = time.perf_counter() - t0
        self._stage_s = staged.stage_s
        self._updates += 1
        self._skipped += staged.skipped
        self._ack(Ack(self.worker_idx, staged.version, True, None, holds, staged.stage_s, self._commit_s))
        self._changed.notify()
        self._run_callbacks(staged.version)

    def _check_untouched(self) -> None:
        written = [k for (k, t), v in zip(self._targets.items(), self._slot_versions) if t._version != v]
        if written:
            logger.error(
                "worker %d wrote in place into weights that view a shared slot (%s): other workers on "
                "the same slot see those writes; keep the model read-only (eval mode) or use commit='copy'",
                self.worker_idx,
                ", ".join(written[:8]),
            )

    def _run_callbacks(self, version: int) -> None:
        if self.on_update is None and not hasattr(self.context, "update_policy_weights_"):
            return
        weights = as_user_weights({k: t.data for k, t in self._targets.items()}, self.strategy)
        if self.context is not None and hasattr(self.context, "update_policy_weights_"):
            self.context.update_policy_weights_(weights)
        if self.on_update is not None:
            result = self.on_update(weights, version)
            if inspect.isawaitable(result):
                asyncio.ensure_future(result)

    def _release_transient(self) -> None:
        live = {self._holds, None if self._pending is None else self._pending.holds}
        for sid in [s for s in self._transient if s not in live]:
            self._transient.discard(sid)
            self._slot_views.pop(sid, None)
            seg = self._segments.pop(sid, None)
            if seg is not None:
                seg.close()

    def _ack(self, ack: Ack) -> None:
        self._responded = max(self._responded, ack.version)
        if not ack.ok:
            self.last_error = ack.error
            logger.warning("worker %d rejected version %d: %s", self.worker_idx, ack.version, ack.error)
            self._changed.notify()
        self._send(ack)

    def _send(self, msg: Ack | Staged) -> None:
        try:
            self._queue.put_nowait(msg)
        except (BrokenChannelError, ClosedError):
            pass  # the read side notices the sender's death

    def _close_resources(self) -> None:
        self._queue.close()
        for seg in self._segments.values():
            seg.close()  # mappings the model still points into stay alive with it
        self._segments.clear()
        self._slot_views.clear()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
