"""The receiver: a task in the worker's own event loop that stages and commits weights.

Per instruction: take the ``Receive`` (the sender keeps at most one outstanding and sends
the newest next), stage its weights on the worker's device off the loop
(:class:`~._stage.SlotStaging`), then commit in one step between two awaits (a pointer
swap or an in-place copy, :class:`~._commit.Committer`), then acknowledge. A forward pass
that does not await in the middle therefore never sees two versions mixed.
Which tensors are live, pending or being staged is kept by :class:`~._ownership.BufferRoles`:
a set is never two of these at once, so staging never writes what the model runs or what
waits for ``commit()``. When the receiver ends, for any reason, weights that view a shared
slot are copied into the worker's own memory first: later sends never change the model.
Before each commit the receiver checks that the model still holds the tensors it bound
(:class:`~._commit.ModelWatch`); if the worker replaced some, it binds the new ones first,
so that the version it acknowledges is the one the model runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import warnings
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch
from torch import nn

from .._core._layout import Layout
from .._core._options import DEFAULT, Commit, CommitMode, Strategy, UseDefault, check_poll, resolve_timeout
from .._core._ownership import BufferRoles, Weights
from .._core._signal import Signal
from .._errors import BrokenChannelError, ClosedError, ProtocolError, SenderDiedError, SyncTimeoutError, WouldBlock
from .._io._queues import AsyncQueue
from .._stats import ReceiverStatistics
from .._wire._local import (
    Ack,
    Bye,
    Hello,
    Mailbox,
    MapSlots,
    Poll,
    Receive,
    Setup,
    Staged,
    Stop,
    ToWorker,
    assert_never,
    decode_to_worker,
    encode,
)
from ._bucket import SlotBucket
from ._commit import Binding, Committer, ModelWatch, OnUpdate, bind_model, rebind_model
from ._faults import installed as _installed_faults
from ._mailbox import Mailbox as _Mailbox
from ._stage import SlotStaging

__all__ = ["OnUpdate", "Receiver"]

ReceiverState = Literal["new", "running", "closed"]

logger = logging.getLogger("asyncsync")



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
        poll: bool = False,
    ) -> None:
        check_poll(poll, commit_mode)
        self.worker_idx = worker_idx
        self._model = model
        self.commit_kind = commit
        self.commit_mode = commit_mode
        self.timeout = timeout
        self.polled = poll
        self._device_override = torch.device(device) if device is not None else None
        self._queue: AsyncQueue[Any] = AsyncQueue(conn)
        self._staging = SlotStaging(worker_idx)
        self._slots = self._staging.slots
        self._committer = Committer(worker_idx, commit, strategy, context, on_update)
        self._mailbox: _Mailbox | None = None  # poll=True: where the sender announces versions
        self._roles: BufferRoles | None = None
        self._binding: Binding | None = None  # the model's tensors that commits write
        self._watch: ModelWatch | None = None  # notices that the model no longer holds them
        self._updates = 0
        self._skipped = 0
        self._rejected = 0
        self._responded = -1
        self.last_error: str | None = None
        self._stage_s = 0.0
        self._changed = Signal()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._no_bye = False  # the sender stopped us or is gone, or a test kills us: say no Bye
        self._released = False
        self._close_reason = "the worker closed its receiver"  # the goodbye's reason, unless the task says otherwise
        self._state: ReceiverState = "new"
        self._connected = False  # a connect() returned (one that timed out or was cancelled may be retried)
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
    def model(self) -> nn.Module | None:
        """The module that receives the weights.

        The receiver follows the tensors the model holds when a version is committed: after
        ``model.load_state_dict(sd, assign=True)``, a replaced submodule, or another module
        assigned here, the next version is written into the model's current tensors. A
        version they cannot take (another shape, dtype or device than the tensors they
        replace, a key added or removed) is refused naming the key: the model keeps what
        it runs and the sender raises :class:`~asyncsync.WorkerError`.
        """
        return self._model

    @model.setter
    def model(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"worker {self.worker_idx}: the model must be an nn.Module, got {type(model).__name__}")
        if self._model is None:
            raise ValueError(f"worker {self.worker_idx}: this receiver was made without a model; it cannot be given one")
        self._model = model

    @property
    def on_update(self) -> OnUpdate | None:
        """Called as ``on_update(weights, version)`` after each commit (may be reassigned)."""
        return self._committer.on_update

    @on_update.setter
    def on_update(self, fn: OnUpdate | None) -> None:
        self._committer.on_update = fn

    @property
    def context(self) -> Any:
        return self._committer.context

    @property
    def strategy(self) -> Strategy:
        return self._committer.strategy

    @property
    def update_pending(self) -> bool:
        """True when a staged version waits for :meth:`commit` (``commit_mode="manual"``)."""
        return self._pending is not None

    @property
    def device(self) -> torch.device:
        return self._staging.device

    @property
    def _layout(self) -> Layout | None:
        return self._staging.layout

    async def connect(self, timeout: float | None | UseDefault = DEFAULT) -> int:
        """Start the receiver task; return once the initial weights are applied.

        After a connect that timed out or was cancelled, call it again: the receiver task
        started by the first call goes on, and the new call waits for the same initial weights.
        """
        limit = resolve_timeout(timeout, self.timeout)  # a bad one is refused before anything starts
        if self._state == "closed":
            raise ClosedError(f"worker {self.worker_idx}: the receiver is closed")
        if self._connected:
            raise RuntimeError(f"worker {self.worker_idx}: connect() was already called, and it returned")
        if self._state == "new":
            self._state = "running"
            self._queue.put_bytes_nowait(encode(Hello(self.worker_idx, os.getpid())))
            if self.polled:
                self._queue.put_bytes_nowait(encode(Poll(self.worker_idx)))
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"asyncsync-receiver-{self.worker_idx}")
        # Done once the first instruction is answered: applied, staged (manual mode), or
        # rejected (then the worker keeps its own weights and keeps running; the sender raises).
        # A polled receiver also waits for its mailbox: from then on, polls see every version.
        def ready() -> bool:
            answered = self._responded >= 0 or self._pending is not None
            return (answered and (not self.polled or self._mailbox is not None)) or self._ended()

        if not await self._changed.wait_until(ready, limit):
            raise SyncTimeoutError(f"worker {self.worker_idx} waiting for its initial weights", {self.worker_idx: self._version}, limit)
        self._connected = True
        return self._version

    async def wait_for_version(self, version: int, *, timeout: float | None | UseDefault = DEFAULT) -> int:
        """Wait until the model runs *version* or newer, or has it staged (manual mode);
        return the version the model runs. On a polled receiver (``poll=True``) only
        :meth:`poll_nowait` applies versions: something else must poll meanwhile (a
        timeout says so)."""
        limit = resolve_timeout(timeout, self.timeout)

        def reached() -> bool:
            pending = self._pending
            staged = pending is not None and pending.version >= version
            return self._version >= version or staged or self._ended()

        if not await self._changed.wait_until(reached, limit):
            hint = ""
            if self.polled:
                hint = (
                    f"Worker {self.worker_idx} is polled (init_on_receiver(..., poll=True)): its model takes a new version only "
                    "in poll_nowait(), which wait_for_version() does not call. Call scheme.poll_nowait() between the worker's "
                    "steps (and wait in another task), or poll until it returns the version (see docs/polling.md)"
                )
            raise SyncTimeoutError(
                f"worker {self.worker_idx} waiting for version {version}", {self.worker_idx: self._version}, limit, hint=hint
            )
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

    def poll_nowait(self) -> int | None:
        """Commit the newest version sent to this worker if it is new; return it, else None.

        For a receiver made with ``poll=True`` (``init_on_receiver(..., poll=True)``): the
        sender announces each version in shared memory, and this call reads it there, so
        when nothing is new it costs a single memory load (no system call, no event-loop
        wake-up). When something is, it commits it as the receiver task would (atomic;
        a version the worker cannot apply is refused, the model keeps its weights and the
        sender gets a :class:`WorkerError`), then acknowledges it in shared memory too (one
        system call, the write that wakes the sender). Call it between steps::

            while running:
                receiver.poll_nowait()          # maybe a new version; never blocks
                obs = env.step(policy(obs))

        The worker's event loop must still run now and then (any ``await``): it maps new
        shared-memory slots and notices ``stop`` and the sender's death. It returns None
        while a slot it needs is not mapped yet, and on a receiver that is not connected.
        """
        mailbox = self._mailbox
        if mailbox is None:
            if not self.polled:
                raise RuntimeError(f"worker {self.worker_idx}: poll_nowait() needs a receiver made with init_on_receiver(..., poll=True)")
            return None  # not connected yet, or ended
        news = mailbox.peek()
        if news is None:
            return None
        seq, version, slot, skipped = news
        if self._released:
            return None
        faults = self._faults
        if faults is not None and not faults.idle:  # a test's fault (asyncsync.testing)
            refusal = faults.refusal
            if faults.held or refusal is None:
                return None  # it stays in the mailbox: the first poll after the hold applies the newest
            mailbox.take(seq)
            self._reject(Receive(version, slot, skipped), refusal)
            return None
        if self._staging.waits_for(slot):
            return None  # its segment is not mapped yet (the receiver task does that next)
        mailbox.take(seq)
        msg = Receive(version, slot, skipped)
        if not self._receive_now(msg, 0):
            self._stage_now(msg)
        return version if self._version == version else None

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
            last_commit_ms=self._committer.commit_s * 1e3,
            callback_errors=self._committer.callback_errors,
            last_callback_error=self._committer.last_callback_error,
        )

    async def aclose(self, *, reason: str = "the worker closed its receiver") -> None:
        """End the receiver task and close the channel (idempotent); *reason* is what the
        goodbye tells the trainer (its :class:`WorkerLeftError` says it).

        The model keeps its weights: any that view a shared slot are first copied into
        this process's memory, so the sender's later sends never change them.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        self._close_reason = reason
        # In a task of its own: a close that is itself cancelled still goes on to end the
        # receiver task, cancel the worker's callbacks and free what they held.
        await asyncio.shield(asyncio.ensure_future(self._finish_close()))

    async def _finish_close(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # (its end releases, with the close's reason)
        self._release(self._close_reason)
        await self._staging.wait_closed()  # a staging copy cut short ends first, off the loop
        await self._committer.aclose()

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
        reason: str | None = None  # None: what _close says (the task was cancelled by it)
        try:
            while True:
                batch = [await self._next_slow_message()]
                # Drain what is already waiting, but stop at MapSlots (and Mailbox): its
                # descriptors follow on the socket and must be read before any message.
                while not isinstance(batch[-1], (MapSlots, Mailbox, Stop)):
                    try:
                        batch.append(decode_to_worker(self._queue.get_bytes_nowait()))
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
            self._release(reason if reason is not None else self._close_reason)
            self._changed.notify()

    async def _next_slow_message(self) -> ToWorker:
        """Listen on the channel until a message needs this task; return it.

        A ``Receive`` that commits straight from its slot is handled in the loop's reader
        callback (a callback runs between two awaits of every task, as a commit must).
        Anything that awaits (mapping slots, staging a copy, ``Stop``) comes back here.
        """
        waiter: asyncio.Future[ToWorker] = asyncio.get_running_loop().create_future()

        def on_frame(data: bytes) -> bool:
            msg = decode_to_worker(data)
            if type(msg) is Receive and (self._faults is None or self._faults.idle) and self._receive_now(msg, 0):
                return True
            waiter.set_result(msg)
            return False

        def on_end(exc: Exception) -> None:
            if not waiter.done():
                waiter.set_exception(exc)

        self._queue.listen(on_frame, on_end)
        try:
            return await waiter
        finally:
            self._queue.unlisten()

    async def _handle(self, batch: list[ToWorker]) -> bool:
        """Process messages in order; of several Receives only the newest is applied."""
        newest = max((i for i, m in enumerate(batch) if isinstance(m, Receive)), default=-1)
        skipped = sum(isinstance(m, Receive) for m in batch) - (newest >= 0)
        for i, msg in enumerate(batch):
            if isinstance(msg, Setup):
                self._on_setup(msg)
            elif isinstance(msg, MapSlots):
                await self._staging.map_slots(msg, await self._queue.receive_fds(len(msg.slot_ids)))
            elif isinstance(msg, Mailbox):
                fd, wake_fd = await self._queue.receive_fds(2)  # the mailbox, the sender's wake
                if not self.polled or self._mailbox is not None:
                    os.close(fd)
                    os.close(wake_fd)
                    raise ProtocolError("Mailbox: this receiver did not ask for one" if not self.polled else "Mailbox: sent twice")
                self._mailbox = _Mailbox.attach(fd, msg.nbytes, wake_fd)
                self._changed.notify()
            elif isinstance(msg, Receive) and i == newest:
                await self._on_receive(msg, skipped)
            elif isinstance(msg, Stop):
                return True
            elif not isinstance(msg, Receive):
                assert_never(msg)
        return False

    def _on_setup(self, msg: Setup) -> None:
        if self._model is None:
            self._staging.bind(msg.layout, "the worker has no model to apply weights to", self._version)
            return
        device = self._device_override or (torch.device(msg.device) if msg.device else None)
        bound = bind_model(self._model, msg.layout, device, self.commit_kind)
        roles = self._staging.bind(msg.layout, bound, self._version)
        if isinstance(bound, str):
            return
        self._use(bound, msg.layout)
        self._roles = roles

    def _use(self, bound: Binding, layout: Layout) -> None:
        """Commit into *bound*'s tensors from now on, and watch the model for their replacement."""
        usable = bound.reads_slot and self.commit_kind == "swap" and SlotBucket.usable(layout, bound.targets.values())
        bucket = SlotBucket(layout, list(bound.targets.values())) if usable else None
        self._committer.bind(bound.targets, bound.inference, bucket, self._slots.segments)
        self._binding = bound
        assert self._model is not None
        self._watch = ModelWatch(self._model, bound.targets)

    def _rebind(self) -> str | None:
        """The model no longer holds the tensors bound to it: bind those it holds now (before
        a commit, which then writes them); or say why they cannot take the weights."""
        roles, layout, binding, model = self._roles, self._layout, self._binding, self._model
        assert roles is not None and layout is not None and binding is not None and model is not None
        bound = rebind_model(model, layout, binding, self.commit_kind)
        if isinstance(bound, str):
            return bound  # (checked again at the next version: the worker may fix its model)
        live = roles.live
        if live.slot is not None:  # what the model dropped leaves the slot that later versions overwrite
            kept = set(map(id, bound.targets.values()))
            for t in self._committer.targets.values():
                if id(t) not in kept:
                    t.data = t.data.clone()
        # The model's tensors are the live set now; the set they replace stays with the
        # dropped tensors (never recycled for staging).
        roles.live = Weights(live.version, {k: t.data for k, t in bound.targets.items()}, live.slot)
        roles.keep_free = bound.recyclable
        self._staging.retarget(bound)
        self._use(bound, layout)
        return None

    async def _on_receive(self, msg: Receive, skipped: int) -> None:
        if self._faults is not None:  # a test's fault: hold the update, or refuse it
            refusal = await self._faults.before_apply(msg.version)
            if refusal is not None:
                self._reject(msg, refusal)
                return
        if not self._receive_now(msg, skipped):
            self._staged(msg, await self._staging.stage(msg), msg.skipped + skipped)

    def _stage_now(self, msg: Receive) -> None:
        """:meth:`_on_receive`'s staging without awaiting (a poll), then the commit."""
        self._staged(msg, self._staging.stage_now(msg), msg.skipped)

    def _staged(self, msg: Receive, staged: Weights | str, skipped: int) -> None:
        """Staging ended: apply what it staged, or refuse *msg* with why it could not."""
        if isinstance(staged, str):
            self._reject(msg, staged)
        else:
            self._apply(staged, skipped)

    def _receive_now(self, msg: Receive, skipped: int) -> bool:
        """Handle *msg* without awaiting if it can be (a refusal, or weights read straight
        from the slot); False if it needs staging first."""
        refusal = self._staging.refusal(msg)
        if refusal is not None:
            self._reject(msg, refusal)
            return True
        if not self._staging.reads_slot:
            return False
        self._apply(self._staging.from_slot(msg), msg.skipped + skipped)
        return True

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
        if self._slots.transient:
            self._release_transient()

    def _commit(self, staged: Weights) -> bool:
        """Make *staged* what the model runs, and acknowledge it; False if it could not be
        (then the sender gets the reason)."""
        assert self._roles is not None
        roles = self._roles
        committer = self._committer
        error = None
        if self._watch is not None and not self._watch.unchanged(self._model):
            error = self._rebind()
            if error is not None:
                roles.committed(roles.live, consumed=staged)  # the staged set is freed
        if error is None:
            error = committer.commit(roles, staged)
        if error is not None:
            self._rejected += 1
            self._ack(Ack(self.worker_idx, staged.version, False, error, roles.live.slot))
            return False
        self._stage_s = staged.stage_s
        self._updates += 1
        self._ack(Ack(self.worker_idx, staged.version, True, None, roles.live.slot, staged.stage_s, committer.commit_s))
        committer.check_writes()
        self._changed.notify()
        committer.run_callbacks(staged.version, self._layout)
        return True

    def _release_transient(self) -> None:
        self._staging.release_transient(self._roles.views_slot() if self._roles is not None else set())

    def _ack(self, ack: Ack) -> None:
        self._responded = max(self._responded, ack.version)
        if not ack.ok:
            self.last_error = ack.error
            logger.warning("worker %d rejected version %d: %s", self.worker_idx, ack.version, ack.error)
            self._changed.notify()
        elif self._mailbox is not None:  # polled: in the mailbox, then one write of the sender's wake
            self._mailbox.ack(ack.version, ack.holds, ack.stage_s, ack.commit_s)
            return
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
                    for key, t in self._committer.targets.items():
                        t.data = roles.live.tensors[key]
        if not self._no_bye:  # (a reason quoting the user's text may hold what UTF-8 cannot)
            self._send(Bye(self.worker_idx, self._version, reason.encode("utf-8", "backslashreplace").decode("utf-8")))
        self._queue.close()
        self._staging.close()  # a pending set still viewing a slot was copied above
        if self._mailbox is not None:
            self._mailbox.close()
            self._mailbox = None

