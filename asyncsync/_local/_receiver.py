"""The receiver: a task in the worker's own event loop that stages and commits weights.

Per instruction: take the ``Receive`` (the sender keeps at most one outstanding and sends
the newest next), stage its weights on the worker's device off the loop, then commit in
one step between two awaits (a pointer swap or an in-place copy), then acknowledge. A
forward pass that does not await in the middle therefore never sees two versions mixed.
Which tensors are live, pending or being staged is kept by :class:`~._ownership.BufferRoles`:
a set is never two of these at once, so staging never writes what the model runs or what
waits for ``commit()``. When the receiver ends, for any reason, weights that view a shared
slot are copied into the worker's own memory first: later sends never change the model.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import operator
import os
import time
import warnings
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch
from torch import nn

from .._core._layout import Layout
from .._core._ownership import BufferRoles, Weights, debug_enabled
from .._core._signal import Signal
from .._core._strategy import Strategy, as_user_weights, bind_targets
from .._errors import BrokenChannelError, ClosedError, ProtocolError, SenderDiedError, SyncTimeoutError, WouldBlock
from .._io._queues import AsyncQueue
from .._io._shm import Segment
from .._io._staging import Stager, copy_tensors, device_problem
from .._options import DEFAULT, UseDefault, resolve_timeout
from .._stats import ReceiverStatistics
from .._wire._protocol import Ack, Bye, Hello, MapSlots, Message, Receive, Setup, Staged, Stop, decode, encode
from ._bucket import SlotBucket
from ._faults import installed as _installed_faults

__all__ = ["Receiver"]

logger = logging.getLogger("asyncsync")

_version_of = operator.attrgetter("_version")  # a tensor's in-place write counter

Commit = Literal["swap", "copy"]
CommitMode = Literal["auto", "manual"]
OnUpdate = Callable[[Any, int], "Awaitable[None] | None"]


class Receiver:
    """Worker side of a scheme; created by ``init_on_receiver``.

    Example (``commit_mode="manual"``: the worker switches versions where it chooses)::

        scheme = MultiProcessWeightSyncScheme(commit_mode="manual", timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        receiver = worker.receiver             # the worker side
        connecting = asyncio.gather(scheme.connect(), receiver.connect())
        await receiver.wait_for_version(0)     # version 0 is staged ...
        receiver.commit()                      # ... and committed here
        await connecting
        version = await scheme.send_async()
        await receiver.wait_for_version(version)
        print(receiver.version, receiver.update_pending)  # 0 True: staged, not running yet
        print(receiver.commit())               # 1: e.g. between two episodes
        await scheme.wait_async(version)
        await scheme.aclose()
        await worker.aclose()
    """

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
        self._roles: BufferRoles | None = None
        self._reads_slot = False
        self._bucket: SlotBucket | None = None  # swap commits from slots: one storage swap
        self._slot_versions: list[int] = []
        self._device = torch.device("cpu")
        self._inference = False  # the model holds inference tensors (built under inference_mode)
        self._stager: Stager | None = None
        self._updates = 0
        self._skipped = 0
        self._rejected = 0
        self._responded = -1
        self.last_error: str | None = None
        self._callback_errors = 0
        self._last_callback_error: str | None = None
        self._callback_tasks: set[asyncio.Task[Any]] = set()
        self._stage_s = 0.0
        self._commit_s = 0.0
        self._changed = Signal()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._no_bye = False  # the sender stopped us or is gone, or a test kills us: say no Bye
        self._released = False
        self._state = "new"
        self._faults = _installed_faults.get()  # asyncsync.testing's fault injection, else None

    # ----------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        """Version the model runs now (-1 before the first weights arrive)."""
        return self._version

    @property
    def _version(self) -> int:
        return self._roles.live.version if self._roles is not None else -1

    @property
    def _pending(self) -> Weights | None:
        return self._roles.pending if self._roles is not None else None

    @property
    def update_pending(self) -> bool:
        """True when a staged version waits for :meth:`commit` (``commit_mode="manual"``)."""
        return self._pending is not None

    @property
    def device(self) -> torch.device:
        return self._device

    async def connect(self, timeout: float | None | UseDefault = DEFAULT) -> int:
        """Start the receiver task; return once the initial weights are applied."""
        if self._state != "new":
            raise RuntimeError("connect() was already called") if self._state != "closed" else ClosedError("the receiver is closed")
        self._state = "running"
        self._queue.put_bytes_nowait(encode(Hello(self.worker_idx, os.getpid())))
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"asyncsync-receiver-{self.worker_idx}")
        limit = resolve_timeout(timeout, self.timeout)
        # Done once the first instruction is answered: applied, staged (manual mode), or
        # rejected (then the worker keeps its own weights and keeps running; the sender raises).
        if not await self._changed.wait_until(lambda: self._responded >= 0 or self._pending is not None or self._ended(), limit):
            raise SyncTimeoutError(f"worker {self.worker_idx} waiting for its initial weights", {self.worker_idx: self._version}, limit)
        return self._version

    async def wait_for_version(self, version: int, *, timeout: float | None | UseDefault = DEFAULT) -> int:
        """Wait until the model runs *version* or newer, or has it staged (manual mode);
        return the version the model runs."""
        limit = resolve_timeout(timeout, self.timeout)

        def reached() -> bool:
            pending = self._pending
            staged = pending is not None and pending.version >= version
            return self._version >= version or staged or self._ended()

        if not await self._changed.wait_until(reached, limit):
            raise SyncTimeoutError(f"worker {self.worker_idx} waiting for version {version}", {self.worker_idx: self._version}, limit)
        return self._version

    def commit(self) -> int | None:
        """Commit the staged version now (manual mode); return it, or None if none waits
        (or it could not be applied: the model keeps its version and the sender is told why).

        Call it at a safe point (between env steps or batches). It does not await, so
        it is atomic with respect to everything else on the loop.
        """
        staged = self._roles.take_pending() if self._roles is not None else None
        if staged is None:
            return None
        return staged.version if self._commit(staged) else None

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
        pending = self._pending
        return ReceiverStatistics(
            worker_idx=self.worker_idx,
            version=self._version,
            pending_version=None if pending is None else pending.version,
            updates=self._updates,
            skipped=self._skipped,
            rejected=self._rejected,
            last_stage_ms=self._stage_s * 1e3,
            last_commit_ms=self._commit_s * 1e3,
            callback_errors=self._callback_errors,
            last_callback_error=self._last_callback_error,
        )

    async def aclose(self) -> None:
        """End the receiver task and close the channel (idempotent).

        The model keeps its weights: any that view a shared slot are first copied into
        this process's memory, so the sender's later sends never change them.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        self._release("the worker closed its receiver")
        for t in list(self._callback_tasks):
            t.cancel()
        if self._callback_tasks:
            await asyncio.wait(list(self._callback_tasks))

    async def _kill(self) -> None:
        """End as a worker whose process died: no ``Bye``, the channel just closes.

        For ``asyncsync.testing``'s loopback workers; the model keeps its weights (copied
        out of shared memory, as at any end).
        """
        self._no_bye = True
        await self.aclose()

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
        if self._state == "new" or (self._task is not None and not self._task.done()):
            return False  # not started yet (a waiter may wait for connect), or running
        if self._error is not None:
            raise self._error
        raise ClosedError(f"receiver of worker {self.worker_idx} stopped")

    async def _run(self) -> None:
        reason = "the worker closed its receiver"
        try:
            while True:
                batch = [await self._next_slow_message()]
                # Drain what is already waiting, but stop at MapSlots: its descriptors
                # follow on the socket and must be read before any message.
                while not isinstance(batch[-1], (MapSlots, Stop)):
                    try:
                        batch.append(decode(self._queue.get_bytes_nowait()))
                    except WouldBlock:
                        break
                if await self._handle(batch):
                    self._no_bye = True
                    return
        except ProtocolError as exc:  # the sender is out of step: end here, and say why in the Bye
            reason = f"its receiver got a malformed message from the sender ({exc})"
            self._error = ProtocolError(f"worker {self.worker_idx}: the sender sent a malformed message ({exc}); keeping version {self._version}")
            self._error.__cause__ = exc
        except BrokenChannelError as exc:
            self._error = SenderDiedError(f"worker {self.worker_idx}: the sender is gone ({exc}); keeping version {self._version}")
            self._no_bye = True
        except ClosedError:
            pass
        except Exception as exc:  # a bug: make it visible to whoever awaits the receiver
            self._error = exc
            reason = f"its receiver task failed: {exc!r}"
            raise
        finally:
            self._release(reason)
            self._changed.notify()

    async def _next_slow_message(self) -> Message:
        """Listen on the channel until a message needs this task; return it.

        A ``Receive`` that commits straight from its slot is handled in the loop's reader
        callback (a callback runs between two awaits of every task, as a commit must).
        Anything that awaits (mapping slots, staging a copy, ``Stop``) comes back here.
        """
        waiter: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

        def on_frame(data: bytes) -> bool:
            msg = decode(data)
            if type(msg) is Receive and (self._faults is None or self._faults.idle) and self._receive_now(msg, 0):
                return True
            waiter.set_result(msg)
            return False

        def on_end(exc: Exception) -> None:
            if not waiter.done():
                waiter.set_exception(exc)

        self._queue._listen(on_frame, on_end)
        try:
            return await waiter
        finally:
            self._queue._unlisten()

    async def _handle(self, batch: list[Message]) -> bool:
        """Process messages in order; of several Receives only the newest is applied."""
        newest = max((i for i, m in enumerate(batch) if isinstance(m, Receive)), default=-1)
        skipped = sum(isinstance(m, Receive) for m in batch) - (newest >= 0)
        for i, msg in enumerate(batch):
            if isinstance(msg, Setup):
                self._on_setup(msg)
            elif isinstance(msg, MapSlots):
                fds = await self._queue.receive_fds(len(msg.slot_ids))
                _check_segments(msg, fds)
                for sid, nbytes, fd in zip(msg.slot_ids, msg.nbytes, fds):
                    # Mapping pre-faults every page: off the loop for large slots.
                    self._segments[sid] = await self._get_stager().run(nbytes, Segment.attach, fd, nbytes)
                    if msg.transient:
                        self._transient.add(sid)
            elif isinstance(msg, Receive) and i == newest:
                await self._on_receive(msg, skipped)
            elif isinstance(msg, Stop):
                return True
            elif not isinstance(msg, Receive):
                raise ProtocolError(f"{type(msg).__name__}: a sender never sends this message")
        return False

    def _on_setup(self, msg: Setup) -> None:
        self._layout = msg.layout
        self._layout_error = None
        self._slot_views.clear()
        self._bucket = None
        if self.model is None:
            self._layout_error = "the worker has no model to apply weights to"
            return
        targets, problems = bind_targets(self.model, msg.layout)
        if problems:
            self._layout_error = "payload does not fit the model: " + "; ".join(problems[:16])
            return
        device = self._device_override or (torch.device(msg.device) if msg.device else None)
        if device is None:
            device = next(iter(targets.values())).device if targets else torch.device("cpu")
        unusable = device_problem(device)
        if unusable is not None:
            self._layout_error = f"cannot place the model on {device}: {unusable}"
            return
        # A model built under torch.inference_mode() holds inference tensors: they are
        # written only inside inference mode, and only by tensors that are inference tensors
        # themselves (a plain tensor swapped in leaves a parameter no forward can use).
        inference = any(t.is_inference() for t in targets.values())
        try:
            if any(t.device != device for t in targets.values()):
                with torch.inference_mode(inference):
                    self.model.to(device)  # keeps Parameter identity; moves unsent buffers too
                targets, problems = bind_targets(self.model, msg.layout)  # ``to()`` replaces buffers
        except Exception as exc:  # e.g. a CUDA device this process cannot use
            self._layout_error = f"cannot place the model on {device}: {exc}"
            return
        if problems:
            self._layout_error = f"payload does not fit the model on {device}: " + "; ".join(problems[:16])
            return
        unwritable = _copy_problems(targets) if self.commit_kind == "copy" else []
        if unwritable:  # refused before anything is written: a copy that fails half way tears the model
            self._layout_error = (
                "commit='copy' writes the model's tensors in place, and these cannot hold the sent values: "
                + "; ".join(unwritable[:8])
                + ". Give each its own memory (e.g. `.clone()`), or use commit='swap'"
            )
            return
        self._device = device
        self._targets = targets
        self._inference = inference
        # The slot already holds the model's dtypes on the model's device (CPU): commit
        # straight from it, by pointer swap (zero copy) or by an in-place copy. Otherwise
        # stage into device buffers first (a CUDA copy, or a cast from transfer_dtype), and
        # so does a swap into inference tensors (slot views are not inference tensors).
        self._reads_slot = (
            device.type == "cpu"
            and all(self._targets[s.key].dtype == s.dtype for s in msg.layout.specs)
            and not (inference and self.commit_kind == "swap")
        )
        if self._reads_slot and self.commit_kind == "swap" and SlotBucket.usable(msg.layout, targets.values()):
            self._bucket = SlotBucket(msg.layout, list(targets.values()))
        # Reading straight from slots, no private set is ever staged into: the model's own
        # initial tensors are freed at the first swap instead of being kept for reuse.
        # (Nor can a set holding overlapping memory be staged into: the model's own, with
        # commit="swap"; then every staging set is a fresh one.)
        live = Weights(self._version, {k: t.data for k, t in targets.items()})
        recyclable = not self._reads_slot and not _copy_problems(targets)
        self._roles = BufferRoles(live, self._allocate_set, keep_free=recyclable)

    def _allocate_set(self) -> dict[str, torch.Tensor]:
        """A private set of device buffers shaped like the model (inference tensors where
        the model's are)."""
        out = {k: torch.empty_like(t, device=self._device) for k, t in self._targets.items() if not t.is_inference()}
        if len(out) < len(self._targets):
            with torch.inference_mode():
                out.update({k: torch.empty_like(t, device=self._device) for k, t in self._targets.items() if t.is_inference()})
            out = {k: out[k] for k in self._targets}
        return out

    def _get_stager(self) -> Stager:
        if self._stager is None:
            self._stager = Stager(self._device)  # Setup, which fixes the device, comes first
        return self._stager

    async def _on_receive(self, msg: Receive, skipped: int) -> None:
        if self._faults is not None:  # a test's fault: hold the update, or refuse it
            refusal = await self._faults.before_apply(msg.version)
            if refusal is not None:
                self._reject(msg, refusal)
                return
        if self._receive_now(msg, skipped):
            return
        assert self._layout is not None and self._roles is not None
        roles = self._roles
        seg = self._segments[msg.slot]
        views = self._views_of(msg.slot, seg)
        t0 = time.perf_counter()
        staging = roles.begin_staging(msg.version)
        done = False
        failure = ""
        try:
            stager = self._get_stager()
            keys = list(views)
            await stager.pin(seg.buf)
            await stager.copy([staging.tensors[k] for k in keys], [views[k] for k in keys], self._layout.nbytes, inference=self._inference)
            done = True
        except Exception as exc:  # only private buffers were written: the model is untouched
            logger.error("worker %d: staging version %d failed", self.worker_idx, msg.version, exc_info=exc)
            failure = f"staging failed: {type(exc).__name__}: {exc}"
        finally:
            staged = roles.end_staging(done)
        if staged is None:
            self._reject(msg, failure)
            return
        staged.stage_s = time.perf_counter() - t0
        self._apply(staged, msg.skipped + skipped)

    def _receive_now(self, msg: Receive, skipped: int) -> bool:
        """Handle *msg* without awaiting if it can be (a refusal, or weights read straight
        from the slot); False if it needs staging first."""
        seg = self._segments.get(msg.slot)
        refusal = self._refusal(msg, seg)
        if refusal is not None:
            self._reject(msg, refusal)
            return True
        if not self._reads_slot:
            return False
        assert seg is not None
        self._apply(Weights(msg.version, self._views_of(msg.slot, seg), msg.slot), msg.skipped + skipped)
        return True

    def _views_of(self, slot_id: int, seg: Segment) -> dict[str, torch.Tensor]:
        """The layout's tensors viewing slot *slot_id* (made once per slot)."""
        views = self._slot_views.get(slot_id)
        if views is None:
            assert self._layout is not None
            views = self._slot_views[slot_id] = self._layout.views(seg.buf)
        return views

    def _reject(self, msg: Receive, error: str) -> None:
        self._rejected += 1
        self._ack(Ack(self.worker_idx, msg.version, False, error, self._roles.live.slot if self._roles is not None else None))

    def _apply(self, staged: Weights, skipped: int) -> None:
        """Commit *staged* now, or (manual mode) make it the pending set."""
        self._skipped += skipped
        if self.commit_mode == "manual":
            roles = self._roles
            assert roles is not None
            if roles.pending is not None:
                self._skipped += 1  # staged, never committed, superseded
            roles.stage(staged)
            self._send(Staged(self.worker_idx, staged.version, staged.slot))  # older slots go back
            self._changed.notify()
        else:
            self._commit(staged)
        if self._transient:
            self._release_transient()

    def _refusal(self, msg: Receive, seg: Segment | None) -> str | None:
        """Why this worker cannot apply *msg* (it then keeps its weights), or None."""
        if self._layout is None or self._layout_error is not None or self._roles is None:
            return self._layout_error or "no layout received"
        if seg is None:
            return f"slot {msg.slot} was never mapped"
        if seg.nbytes < self._layout.nbytes:
            return f"slot {msg.slot} holds {seg.nbytes} bytes, the layout needs {self._layout.nbytes}"
        return None

    def _commit(self, staged: Weights) -> bool:
        """Make *staged* what the model runs, and acknowledge it; False if it could not be
        (then the sender gets the reason)."""
        assert self._roles is not None
        roles = self._roles
        t0 = time.perf_counter()
        targets = self._targets
        # Versions recorded at the last commit stay valid while untouched: ``.data =`` keeps
        # each parameter's own version counter as it was.
        recorded = roles.live.slot is not None and self._check_untouched()
        try:
            if self._inference:
                with torch.inference_mode():
                    self._write(staged)
            else:
                self._write(staged)
        except Exception as exc:
            return self._commit_failed(staged, exc)
        if self.commit_kind == "swap":
            roles.committed(staged, consumed=None)
        else:
            roles.committed(Weights(staged.version, roles.live.tensors, None), consumed=staged)
        if debug_enabled():
            roles.check({k: t.data for k, t in targets.items()})
        holds = roles.live.slot
        if holds is not None and not (recorded and self.commit_kind == "swap"):
            # Parameters now view a shared slot: remember their version counters to notice
            # in-place writes (they would reach every worker reading that slot).
            self._slot_versions = list(map(_version_of, targets.values()))
        self._commit_s = time.perf_counter() - t0
        self._stage_s = staged.stage_s
        self._updates += 1
        self._ack(Ack(self.worker_idx, staged.version, True, None, holds, staged.stage_s, self._commit_s))
        self._changed.notify()
        self._run_callbacks(staged.version)
        return True

    def _write(self, staged: Weights) -> None:
        """Point the model's tensors at *staged* (swap) or copy *staged* into them; raise
        :class:`_WriteFailed` naming the key where it failed."""
        targets = self._targets
        tensors = staged.tensors
        if self.commit_kind == "swap":
            if self._bucket is not None and staged.slot is not None:
                # the whole model in one storage swap, or views of a fresh storage to arrange it
                bucket_views = self._bucket.commit(self._segments[staged.slot])
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
                live = self._roles.live.tensors  # type: ignore[union-attr]
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

    def _commit_failed(self, staged: Weights, exc: Exception) -> bool:
        """A commit raised (what ``_on_setup`` checks makes this unexpected): refuse the version.

        A swap is undone; a copy that already wrote some tensors cannot be: say so.
        """
        assert self._roles is not None
        self._roles.committed(self._roles.live, consumed=staged)  # the staged set is freed
        cause = exc.__cause__ if isinstance(exc, _WriteFailed) and exc.__cause__ is not None else exc
        where = f" at {exc.key!r}" if isinstance(exc, _WriteFailed) else ""
        error = f"commit={self.commit_kind!r} failed{where} ({type(cause).__name__}: {cause}); "
        if isinstance(exc, _WriteFailed) and exc.torn:
            error += f"the tensors before it already hold version {staged.version}, the others version {self._version}"
        else:
            error += f"the model keeps version {self._version}"
        logger.error("worker %d: %s", self.worker_idx, error, exc_info=cause)
        self._rejected += 1
        self._ack(Ack(self.worker_idx, staged.version, False, error, self._roles.live.slot))
        return False

    def _check_untouched(self) -> bool:
        """True if nothing wrote into the weights since the last commit; else say so (and False)."""
        if list(map(_version_of, self._targets.values())) == self._slot_versions:
            return True  # the common case, in C
        written = [k for (k, t), v in zip(self._targets.items(), self._slot_versions) if t._version != v]
        if written:
            logger.error(
                "worker %d wrote in place into weights that view a shared slot (%s): other workers on "
                "the same slot see those writes; keep the model read-only (eval mode) or use commit='copy'",
                self.worker_idx,
                ", ".join(written[:8]),
            )
        return False

    def _run_callbacks(self, version: int) -> None:
        """Call ``update_policy_weights_`` and ``on_update``; an exception is logged and counted,
        never allowed to end the receiver."""
        has_cascade = self.context is not None and hasattr(self.context, "update_policy_weights_")
        if self.on_update is None and not has_cascade:
            return
        weights = as_user_weights({k: t.data for k, t in self._targets.items()}, self.strategy, self._layout)
        try:
            if has_cascade:
                self.context.update_policy_weights_(weights)
            if self.on_update is not None:
                result = self.on_update(weights, version)
                if inspect.isawaitable(result):
                    task = asyncio.ensure_future(result)
                    self._callback_tasks.add(task)
                    task.add_done_callback(self._callback_done)
        except Exception as exc:
            self._callback_failed(exc)

    def _callback_done(self, task: asyncio.Task[Any]) -> None:
        self._callback_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._callback_failed(task.exception())  # type: ignore[arg-type]

    def _callback_failed(self, exc: BaseException) -> None:
        self._callback_errors += 1
        self._last_callback_error = f"{type(exc).__name__}: {exc}"
        logger.error("worker %d: on_update callback raised (the receiver goes on)", self.worker_idx, exc_info=exc)

    def _release_transient(self) -> None:
        live = self._roles.views_slot() if self._roles is not None else set()
        for sid in [s for s in self._transient if s not in live]:
            self._transient.discard(sid)
            self._slot_views.pop(sid, None)
            seg = self._segments.pop(sid, None)
            if seg is not None:
                if self._stager is not None:
                    self._stager.unpin(seg.buf)  # page-locked memory is unregistered before it is unmapped
                seg.close()

    def _ack(self, ack: Ack) -> None:
        self._responded = max(self._responded, ack.version)
        if not ack.ok:
            self.last_error = ack.error
            logger.warning("worker %d rejected version %d: %s", self.worker_idx, ack.version, ack.error)
            self._changed.notify()
        self._send(ack)

    def _send(self, msg: Ack | Staged | Bye) -> None:
        try:
            self._queue.put_bytes_nowait(encode(msg))
        except (BrokenChannelError, ClosedError, WouldBlock):
            pass  # the read side notices the sender's death

    def _release(self, reason: str) -> None:
        """The receiver ends: detach from shared slots, say goodbye, close (once)."""
        if self._released:
            return
        self._released = True
        if self._roles is not None:
            roles = self._roles
            with torch.no_grad():
                if roles.detach(lambda ts: {k: t.clone() for k, t in ts.items()}):
                    for key, t in self._targets.items():
                        t.data = roles.live.tensors[key]
        if not self._no_bye:
            self._send(Bye(self.worker_idx, self._version, reason))
        self._queue.close()
        if self._stager is not None:
            self._stager.close()  # unregisters page-locked slots: before they are unmapped
            self._stager = None
        for seg in self._segments.values():
            seg.close()  # a pending set still viewing a slot was copied above
        self._segments.clear()
        self._slot_views.clear()


def _copy_problems(targets: dict[str, torch.Tensor]) -> list[str]:
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


def _check_segments(msg: MapSlots, fds: list[int]) -> None:
    """Raise :class:`ProtocolError` (closing *fds*) unless each segment holds the bytes announced.

    Mapping more than a memfd holds would kill the worker with SIGBUS at the first touch.
    """
    for sid, nbytes, fd in zip(msg.slot_ids, msg.nbytes, fds):
        size = os.fstat(fd).st_size
        if size < nbytes:
            for d in fds:
                os.close(d)
            raise ProtocolError(f"MapSlots: field 'nbytes': slot {sid} announces {nbytes} bytes, its segment holds {size}")
