"""The sender: per-worker links, ``send`` / ``send_async`` / ``wait_async``, acks, liveness.

Every send copies the weights once into a free shared-memory slot and makes it the newest
version of each targeted worker. A worker has at most one ``Receive`` outstanding; when it
answers, it is handed its newest version (latest wins), so a slow worker holds at most its
live slot and one in flight and never slows a send. Slot ownership is kept by a
:class:`~._ownership.SlotLedger`. The loop's reader callback of each connection turns the
worker's answers into state as they arrive (no task per message); waiters only look at
that state, so a cancelled wait never loses an ack.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

import anyio
import torch

from .._core._acks import WorkerRecord
from .._core._deadline import Deadline
from .._core._front import SenderCore, Targets
from .._core._layout import Layout
from .._core._ownership import Ref, SlotLedger
from .._errors import (
    BrokenChannelError,
    ClosedError,
    ProtocolError,
    WeightsError,
    WorkerDiedError,
    WorkerLeftError,
    WouldBlock,
)
from .._io._queues import AsyncQueue
from .._io._slots import Slot, SlotPool
from .._options import DEFAULT, OnWorkerError, UseDefault
from .._stats import SenderStatistics
from .._wire._protocol import Ack, Bye, Hello, Mailbox, MapSlots, Message, Poll, Receive, Setup, Staged, Stop, decode, encode
from ._poll import MAILBOX_BYTES
from ._poll import Mailbox as _Mailbox
from ._publisher import Publisher, Reservation

__all__ = ["Sender"]

logger = logging.getLogger("asyncsync")


class _Link:
    """One connection (generation) to one worker: its channel, mapped slots and tasks (its
    answers are kept by the :class:`AckTracker`)."""

    def __init__(self, generation: int, conn: Connection, child_conn: Connection | None) -> None:
        self.generation = generation
        self.child_conn: Connection | None = child_conn
        self.queue: AsyncQueue[Any] = AsyncQueue(conn)
        self.pid: int | None = None
        self.mapped: set[int] = set()
        self.delivered_sends = 0  # w.sends at the last delivery on this connection
        self.bye: Bye | None = None
        self.lost = False
        self.tasks: list[asyncio.Task[None]] = []
        self.mailbox: _Mailbox | None = None  # a polled worker's: versions go there, not as Receive

    def close_mailbox(self) -> None:
        if self.mailbox is not None:
            self.mailbox.close()
            self.mailbox = None


class _Worker(WorkerRecord):
    """One worker id across its connections: its delivery state (kept by the
    :class:`AckTracker`) and its link, process and sentinel."""

    def __init__(self, idx: int, device: str | None) -> None:
        super().__init__(idx)
        self.idx = idx
        self.device = device
        self.link: _Link | None = None
        self.links = 0  # channels made for this worker id (the next one's generation)
        self.sends = 0  # versions published to this worker id
        self.process: Any = None
        self.sentinel: int | None = None


class SenderObserver(Protocol):
    """What a sender tells the one observer registered with :meth:`Sender.observe` (a relay,
    which forwards it to its trainer).

    An explicit, typed observer rather than callbacks assigned as attributes (two of them
    to keep in step, silently overwritten) or an event stream (a consumer task, a buffer
    that grows while it lags, one wake-up per ack on the ack path): each method is called
    synchronously where the sender learns the event (the reader callback that decoded an
    ack, the task that noticed a loss), before any waiter sees it, in the order the
    workers said it. It must not block; an exception is logged and changes nothing else.
    """

    def worker_answered(self, worker_idx: int, ack: Ack) -> None:
        """Worker *worker_idx* applied (``ack.ok``) or rejected ``ack.version``."""

    def worker_lost(self, worker_idx: int, death: WorkerDiedError) -> None:
        """Worker *worker_idx* died or left (a :class:`WorkerLeftError`)."""


class Sender(SenderCore[int, "_Worker"]):
    """Pushes weights to a fixed set of workers; created by ``init_on_sender``.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=2)
        sender = scheme.sender                 # the trainer side
        workers = [loopback_worker(scheme, i) for i in range(2)]
        for i, worker in enumerate(workers):
            worker.init_on_receiver(worker_idx=i, model=make_policy())
        await asyncio.gather(sender.connect(), *(w.connect() for w in workers))
        version = await sender.send_async()
        await sender.wait_async(version, quorum=1)  # the first worker to apply it
        await sender.wait_async(version)       # every worker
        print(sender.applied_versions())       # {0: 1, 1: 1}
        await sender.aclose()
        for worker in workers:
            await worker.aclose()
    """

    def __init__(
        self,
        *,
        worker_ids: Sequence[int],
        source_layout: Layout,
        wire_layout: Layout,
        sources: Mapping[int, Any],
        devices: Mapping[int, str | None],
        pool: SlotPool,
        sync: bool,
        timeout: float | None,
        on_worker_error: OnWorkerError,
        check_finite: bool,
        manual: bool,
        ctx: mp.context.BaseContext,
    ) -> None:
        self._sources = sources  # worker id -> what send(weights=None) reads for it
        self._pool = pool
        self._ledger = SlotLedger(manual=manual)
        self._ctx = ctx
        self._pid = os.getpid()
        # Encoded once (a layout that cannot travel fails here, at init): one frame per device.
        by_device = {dev: encode(Setup(wire_layout, dev, self._pid)) for dev in {devices.get(i) for i in worker_ids}}
        self._setup_frames = {i: by_device[devices.get(i)] for i in worker_ids}
        self._workers: dict[int, _Worker] = {}
        for idx in worker_ids:
            w = _Worker(idx, devices.get(idx))
            self._new_link(w)
            self._workers[idx] = w
        super().__init__(
            self._workers, source_layout=source_layout, wire_layout=wire_layout, sync=sync, timeout=timeout, on_worker_error=on_worker_error, check_finite=check_finite
        )
        self._slots = Publisher(pool, self._ledger, wire_layout, records=self._workers, copier=self._copier, changed=self._changed, phase=lambda: self._state)
        self._observer: SenderObserver | None = None

    # ----------------------------------------------------------------- channels

    def _new_link(self, w: _Worker) -> _Link:
        ours, theirs = self._ctx.Pipe(duplex=True)
        w.links += 1
        w.link = _Link(w.links, ours, theirs)
        return w.link

    def attach_refusal(self, idx: int) -> str | None:
        """Why a process attaching by address cannot be worker *idx* now (None: it can)."""
        if idx not in self._workers:
            return f"worker {idx} is not one of the trainer's workers {sorted(self._workers)}"
        if self._state in ("closing", "closed"):
            return "the trainer is closing"
        w = self._workers[idx]
        link = w.link
        if link is not None and not link.lost and (link.pid is not None or link.child_conn is None):
            pid = f" (pid {link.pid})" if link.pid is not None else ""
            return f"worker {idx} is already connected{pid}; only one process can be worker {idx} at a time"
        process = w.process
        if link is not None and not link.lost and process is not None and getattr(process, "exitcode", None) is None:
            # a child started with this worker's channel end that has not said hello yet
            return f"worker {idx} is a process the trainer started (pid {process.pid}) and that is still starting"
        return None

    def adopt_link(self, idx: int, conn: Connection) -> None:
        """Make *conn* (an authenticated socket) worker *idx*'s next link, replacing the unused one."""
        w = self._workers[idx]
        old = w.link
        if old is not None:
            old.queue._unlisten()
            for t in old.tasks:
                t.cancel()
            old.queue.close()
            if old.child_conn is not None:
                old.child_conn.close()
        w.links += 1
        w.link = _Link(w.links, conn, None)
        if self._state == "running":
            self._start_tasks(w, w.link, asyncio.get_running_loop())

    def in_owner_process(self) -> bool:
        """False in a child that inherited this sender by fork."""
        return os.getpid() == self._pid

    def child_endpoints(self) -> dict[int, Connection]:
        """The worker ends that are still ours to hand out (pickled with the scheme)."""
        return {i: w.link.child_conn for i, w in self._workers.items() if w.link is not None and w.link.child_conn is not None}

    def watch_process(self, worker_idx: int, process: Any) -> None:
        """Watch *process* (``multiprocessing.Process``-like) as worker *worker_idx*."""
        w = self._worker(worker_idx)
        self._drop_sentinel(w)
        w.process = process
        # A private duplicate: one reader per descriptor, and others may wait on the original.
        w.sentinel = os.dup(process.sentinel)
        if self._state == "running" and w.link is not None:
            w.link.tasks.append(asyncio.get_running_loop().create_task(self._watch_sentinel(w, w.link)))

    @staticmethod
    def _drop_sentinel(w: _Worker) -> None:
        if w.sentinel is not None:
            os.close(w.sentinel)
            w.sentinel = None

    async def wait_joined(self, worker_idx: int, timeout: float | None = None) -> None:
        """Wait until *worker_idx* is connected and answered the latest version sent to it.

        Raises :class:`WorkerError` if the new connection rejected that version.
        """
        self._worker(worker_idx)
        await self._acks.wait_joined([worker_idx], timeout, f"waiting for worker {worker_idx} to join")

    def _never_connected(self, wids: Sequence[int]) -> dict[int, int | None]:
        """Of *wids*, the workers whose receiver never said hello, with the pid of the process
        watched for them (alive: its death would have been noticed), or None."""
        out: dict[int, int | None] = {}
        for i in wids:
            w = self._workers[i]
            if w.state == "waiting" and (w.link is None or w.link.pid is None):
                out[i] = getattr(w.process, "pid", None)
        return out

    async def wait_dead(self, worker_idx: int, timeout: float | None = None) -> None:
        """Wait until the sender has noticed that *worker_idx* is gone."""
        self._worker(worker_idx)
        await self._acks.wait_gone([worker_idx], timeout, f"waiting for worker {worker_idx} to be declared dead")

    # ----------------------------------------------------------------- public API

    @property
    def ledger(self) -> SlotLedger:
        """Who holds which slot (for debugging and tests)."""
        return self._ledger

    def sent_version(self, worker_idx: int) -> int:
        """The newest version sent to *worker_idx* (-1: none)."""
        return self._worker(worker_idx).sent

    def start(self) -> None:
        """Open the slots and start watching the workers, without sending anything yet."""
        if self._state not in ("new", "running"):
            raise ClosedError("the sender is closed")
        if self._state == "new":
            self._pool.open(self._ledger)
            self._state = "running"
            self._send_lock = asyncio.Lock()
            loop = asyncio.get_running_loop()
            for w in self._workers.values():
                assert w.link is not None
                self._ledger.connect(w.idx)
                self._start_tasks(w, w.link, loop)

    async def _open(self) -> None:
        self.start()

    def observe(self, observer: SenderObserver | None) -> None:
        """Tell *observer* every worker's answers and losses from now on (None: stop).

        One observer at a time (a relay): registering a second one raises ``RuntimeError``.
        """
        if observer is not None and self._observer is not None and observer is not self._observer:
            raise RuntimeError("this sender already has an observer")
        self._observer = observer

    def reserve(
        self,
        version: int,
        worker_ids: int | Iterable[int] | None = None,
        *,
        base_version: int | None = None,
        timeout: float | None = None,
    ) -> Reservation:
        """A slot to write *version* into in place, for *worker_ids*; use it as ``async with``.

        For a relay: the reservation's ``buffer`` is the slot itself (a uint8 tensor of the
        wire layout), so weights received from the network land in shared memory without
        another copy; ``publish()`` makes them the targets' newest version. *version* must
        be newer than what each target was sent (one version may be published in several
        slots, to different workers, as a partial update does; an older one than the newest
        may go to a worker that lacks it). With *base_version* (a partial update), the slot
        first gets a copy of the targets' newest version, which must be *base_version* in
        one slot for all of them (else :class:`WeightsError`), and the holder writes only
        what changed. *timeout* bounds the wait for the send lock and for a free slot.
        Leaving the block without ``publish()`` (an exception, a cancellation) gives the
        slot back; see :class:`~._publisher.Reservation` for a writer that cannot be stopped.

        Example::

            async with sender.reserve(version, [0, 1]) as landing:
                await receive_into(landing.buffer)
                landing.publish()
        """
        self._check_running()
        targets = self._targets(worker_ids)
        self._check_newer(version, targets)  # fail early, and again once the send lock is held
        assert self._send_lock is not None
        return Reservation(
            self._slots,
            self._send_lock,
            version=version,
            targets=targets,
            base_version=base_version,
            timeout=timeout,
            check=functools.partial(self._check_landing, version, targets),
            publish=functools.partial(self._publish_landing, version, targets),
        )

    def _check_landing(self, version: int, targets: list[int]) -> None:
        self._check_running()
        self._check_newer(version, targets)

    def _publish_landing(self, version: int, targets: list[int], slot: Slot, based: bool) -> None:
        if version > self._version:
            self._sends += 1
            self._version = version
        if not based:  # (else the copy of the base was counted)
            self._slots.bytes += self._layout.nbytes
        self._publish([(slot, targets)], version)

    def _check_newer(self, version: int, targets: list[int]) -> None:
        # Per worker only: a relay may publish an older version to a worker that lacks it
        # (a transfer repeated after the group re-formed) after a newer one went to others.
        stale = {i: self._workers[i].sent for i in targets if self._workers[i].sent >= version}
        if stale:
            raise ValueError(f"version {version} is not newer than what workers {stale} were sent")

    def _publish(self, written: list[tuple[Slot, list[int]]], version: int) -> None:
        """Make each written slot its members' newest *version* and send it to those with nothing in flight."""
        for slot, members in written:
            self._ledger.publish(slot.id, version, members)
            for i in members:
                self._workers[i].sends += 1
                self._acks.sent(i, version)
        for _, members in written:
            for i in members:
                self._pump(self._workers[i])
        self._release_unused()
        self._changed.notify()

    async def connect(self, timeout: float | None | UseDefault = DEFAULT, weights: Any = None) -> int:
        """Start watching the workers, send the initial weights, wait for every ack.

        If the wait times out, calling ``connect()`` again waits for the same initial version.
        """
        return await self._connect(timeout, weights)

    async def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        partial: bool = False,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> int:
        """Publish *weights*; with ``sync`` wait until every targeted worker applied them.

        *timeout* bounds the whole call: waiting for a free slot and for the acks.
        """
        return await self._send(weights, worker_ids, partial, timeout)

    async def send_async(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        partial: bool = False,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> int:
        """Copy *weights* into shared memory and publish them; return the new version.

        Returns once the snapshot is taken and each targeted worker will get it (now, or
        when it answers its current update); acks are collected in the background (see
        :meth:`wait_async`). With *partial*, *weights* may hold a subset of the keys; the
        others keep the values each target last received. *timeout* bounds the wait for
        another send's snapshot and for a free slot (only possible with a ``max_slots`` cap).
        """
        targets = self._targets(worker_ids)
        self._before_send(targets)
        groups = self._group(weights, targets, partial)
        deadline = self._deadline(timeout)
        await self._send_turn(deadline)
        try:
            self._check_running()
            plan = self._split_partial(groups)
            written: list[tuple[Slot, list[int]]] = []
            try:
                for flat, members, base in plan:
                    slot = await self._slots.acquire(deadline)
                    written.append((slot, members))
                    await self._slots.write(slot, flat, base)
            except BaseException:
                self._slots.unreserve([slot for slot, _ in written if not slot.copying])
                raise
            self._version += 1
            version = self._version
            self._sends += 1
            self._publish(written, version)
        finally:
            self._send_lock.release()  # type: ignore[union-attr]
        return version

    async def wait_async(
        self,
        version: int | None = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        quorum: int | None = None,
        timeout: float | None | UseDefault = DEFAULT,
        what: str | None = None,
    ) -> None:
        """Wait until the targeted workers applied *version* (default: all sent so far).

        Only workers that were sent *version* (or a newer one) are waited for. With
        *quorum*, return once that many of them have. Raises :class:`WorkerError` if a
        worker rejected the weights, :class:`WorkerDiedError` if one died or left (unless
        ``on_worker_error="skip"``), :class:`SyncTimeoutError` after *timeout* seconds,
        :class:`ValueError` for a version not sent yet.
        """
        await self._wait(version, worker_ids, quorum, timeout, what)

    def statistics(self) -> SenderStatistics:
        """A snapshot of versions, lags, errors, slots and timings."""
        workers = self._acks.rows(self._version, self._in_flight)
        return SenderStatistics(
            version=self._version,
            sends=self._sends,
            bytes_copied=self._slots.bytes,
            slots=len(self._pool.slots),
            slot_bytes=self._layout.nbytes,
            last_copy_ms=self._slots.last_copy_s * 1e3,
            workers=workers,
        )

    def _in_flight(self, w: _Worker) -> dict[str, Any]:
        held = self._ledger.links.get(w.idx)
        return {"in_flight_version": held.in_flight.version if held is not None and held.in_flight is not None else None}

    async def aclose(self, timeout: float = 10.0, *, stop: bool = True) -> None:
        """Stop every receiver, wait (bounded) for them to end, release everything. Idempotent.

        Every waiter (``send``, ``send_async``, ``wait_async``) wakes with :class:`ClosedError`.
        ``stop=False`` closes the channels without ``Stop``: the receivers end with
        :class:`SenderDiedError` (a relay whose trainer died passes that on).
        """
        if self._state == "closed":
            return
        with anyio.CancelScope(shield=True):
            await self._stop_peers(
                timeout,
                stop,
                lambda: [w.link for w in self._workers.values() if w.state == "connected" and w.link is not None],
                lambda link: link.queue.put_bytes_nowait(encode(Stop())),
            )
            for w in self._workers.values():
                if w.link is not None:
                    w.link.queue._unlisten()  # nothing is dispatched once closed
            tasks = [t for w in self._workers.values() if w.link is not None for t in w.link.tasks]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for w in self._workers.values():
                if w.link is not None:
                    w.link.tasks = []  # finished tasks keep tracebacks that point back at us
                    await w.link.queue.aclose()
                    w.link.close_mailbox()
                    if w.link.child_conn is not None:
                        w.link.child_conn.close()
                        w.link.child_conn = None
                self._drop_sentinel(w)
            await self._copier.aclose()  # at most one copy still running
            self._pool.close()

    def __del__(self) -> None:
        # No shutdown from __del__ (it hung interpreters at exit in torchrl): just say so.
        if getattr(self, "_state", "closed") in ("running", "closing"):
            warnings.warn(
                "asyncsync sender was not closed: call `await scheme.aclose()` or use `async with scheme`",
                ResourceWarning,
                stacklevel=1,
            )

    # ----------------------------------------------------------------- internals

    def _worker(self, idx: int) -> _Worker:
        return self._record(idx)

    def _targets(self, worker_ids: int | Iterable[int] | None) -> list[int]:
        if worker_ids.__class__ is Targets:
            return worker_ids  # type: ignore[return-value]
        if isinstance(worker_ids, bool):
            raise TypeError("worker_ids must be an int, a list of ints or None")
        return self._parse_targets(worker_ids, _is_index, "an int")

    def _group(self, weights: Any, targets: list[int], partial: bool) -> list[tuple[Mapping[str, torch.Tensor], list[int]]]:
        """Which validated weights go to which targets: one group per distinct source."""
        if weights is not None:
            return [(self._reader.weights(weights, partial, self.check_finite), targets)]
        groups: dict[int, tuple[Mapping[str, torch.Tensor], list[int]]] = {}
        for i in targets:  # workers sharing one source share one slot
            source = self._reader.resolve(self._sources[i])
            if id(source) not in groups:
                groups[id(source)] = (self._reader.source(source, self.check_finite), [])
            groups[id(source)][1].append(i)
        return list(groups.values())

    def _split_partial(
        self, groups: list[tuple[Mapping[str, torch.Tensor], list[int]]]
    ) -> list[tuple[Mapping[str, torch.Tensor], list[int], int | None]]:
        """A partial update is completed from the slot holding each target's newest version."""
        out: list[tuple[Mapping[str, torch.Tensor], list[int], int | None]] = []
        for flat, members in groups:
            if self._reader.is_whole(flat):  # type: ignore[arg-type]
                out.append((flat, members, None))
                continue
            by_base: dict[int | None, list[int]] = {}
            for i in members:
                latest = self._ledger.latest.get(i)
                by_base.setdefault(latest.slot if latest is not None else None, []).append(i)
            if None in by_base:
                raise WeightsError(f"a partial update needs full weights first; worker(s) {by_base[None]} have none")
            for base, ids in by_base.items():
                out.append((flat, ids, base))
        return out

    def _release_unused(self) -> None:
        self._pool.release_unused()

    def _pump(self, w: _Worker) -> None:
        """Send the worker its newest version if nothing is in flight (latest wins)."""
        link = w.link
        if w.state != "connected" or link is None or link.delivered_sends == w.sends:
            return  # (the last: nothing was published to it since its last delivery)
        ref = self._ledger.next_delivery(w.idx)
        if ref is not None:
            skipped = max(w.sends - link.delivered_sends - 1, 0)
            link.delivered_sends = w.sends
            self._deliver(link, ref, skipped)

    def _deliver(self, link: _Link, ref: Ref, skipped: int) -> None:
        assert ref.slot is not None
        slot = self._pool.slots[ref.slot]
        try:
            if slot.transient or slot.id not in link.mapped:
                self._map_slots(link, [slot])
            if link.mailbox is not None:
                # A polled worker reads it between its steps: no message, no wake-up there.
                # (The slot's bytes are complete: the send's copy finished before publishing.)
                link.mailbox.publish(ref.version, slot.id, skipped)
            else:
                link.queue.put_bytes_nowait(_receive_frame(ref.version, slot.id, skipped))
        except (BrokenChannelError, ClosedError, WouldBlock):
            pass  # the channel's end is noticed by its reader callback, which reports it

    def _map_slots(self, link: _Link, slots: list[Slot]) -> None:
        """Have the worker map *slots* (their descriptors follow the message)."""
        for slot in slots:
            link.queue.put_bytes_nowait(encode(MapSlots((slot.id,), (slot.nbytes,), slot.transient)))
            link.queue.send_fds([slot.fd])
            if not slot.transient:
                link.mapped.add(slot.id)

    def _on_poll(self, link: _Link) -> None:
        """The worker polls: give it a mailbox, and the reusable slots mapped up front (so
        its polls rarely wait for its loop to map one)."""
        if link.mailbox is not None:
            raise ProtocolError("Poll: sent twice on one connection")
        try:
            self._map_slots(link, [s for s in self._pool.slots.values() if not s.transient and s.id not in link.mapped])
            mailbox = _Mailbox.create()
            try:
                link.queue.put_bytes_nowait(encode(Mailbox(MAILBOX_BYTES)))
                link.queue.send_fds([mailbox.fd])
            except BaseException:
                mailbox.close()
                raise
            mailbox.segment.close_fd()  # the worker holds its own copy now
            link.mailbox = mailbox
        except (BrokenChannelError, ClosedError, WouldBlock):
            pass  # the channel's end is noticed by its reader callback, which reports it

    def _start_tasks(self, w: _Worker, link: _Link, loop: asyncio.AbstractEventLoop) -> None:
        # Answers are handled in the loop's reader callback: no task wakes up per message.
        link.queue._listen(functools.partial(self._on_frame, w, link), functools.partial(self._on_channel_end, w, link))
        if w.sentinel is not None:
            link.tasks.append(loop.create_task(self._watch_sentinel(w, link)))

    def _on_frame(self, w: _Worker, link: _Link, data: bytes) -> bool:
        if link is not w.link:
            return False
        self._dispatch(w, link, decode(data))
        return True

    def _on_channel_end(self, w: _Worker, link: _Link, exc: Exception) -> None:
        if isinstance(exc, ClosedError):
            return  # closed here (aclose, or the loss is being handled already)
        if not isinstance(exc, (ProtocolError, BrokenChannelError)):
            logger.error("worker %d: handling its message failed; its channel is cut", w.idx, exc_info=exc)
            failed = ProtocolError(f"handling its message failed: {exc!r}")
            failed.__cause__ = exc
            broken: ProtocolError | None = failed
        else:
            broken = exc if isinstance(exc, ProtocolError) else None
        link.tasks.append(asyncio.get_running_loop().create_task(self._on_lost(w, link, broken=broken)))

    def _dispatch(self, w: _Worker, link: _Link, msg: Message) -> None:
        if isinstance(msg, Ack):
            self._on_ack(w, link, msg)
        elif isinstance(msg, Staged):
            self._ledger.on_staged(w.idx, msg.version, msg.holds)
            self._after_answer(w)
        elif isinstance(msg, Hello):
            self._on_hello(w, link, msg)
        elif isinstance(msg, Bye):
            link.bye = msg
        elif isinstance(msg, Poll):
            self._on_poll(link)
        else:
            raise ProtocolError(f"{type(msg).__name__}: a worker never sends this message")

    def _drain(self, w: _Worker, link: _Link) -> None:
        """Read what the worker said before it went (its last acks, its ``Bye``)."""
        try:
            while True:
                self._dispatch(w, link, decode(link.queue.get_bytes_nowait()))
        except (WouldBlock, BrokenChannelError, ClosedError):
            pass  # a malformed last word (ProtocolError) is ignored: the worker is gone anyway

    async def _watch_sentinel(self, w: _Worker, link: _Link) -> None:
        sentinel = w.sentinel
        if sentinel is None:
            return
        try:
            await anyio.wait_readable(sentinel)
        except (OSError, anyio.ClosedResourceError):
            return
        await self._on_lost(w, link)

    def _on_hello(self, w: _Worker, link: _Link, msg: Hello) -> None:
        link.pid = msg.pid
        self._acks.connected(w.idx, msg.pid, link.generation)
        if link.child_conn is not None:
            link.child_conn.close()  # the worker holds its own copy now: EOF will mean it is gone
            link.child_conn = None
        try:
            link.queue.put_bytes_nowait(self._setup_frames[w.idx])
        except (BrokenChannelError, ClosedError):
            return
        self._pump(w)
        self._changed.notify()

    def _on_ack(self, w: _Worker, link: _Link, ack: Ack) -> None:
        self._ledger.on_ack(w.idx, ack.version, ack.ok, ack.holds)
        if self._observer is not None:
            try:
                self._observer.worker_answered(w.idx, ack)
            except Exception:  # the observer's failure is not the worker's: it stays connected
                logger.exception("worker %d: the sender's observer failed on its answer", w.idx)
        self._acks.ack(w.idx, ack.version, ack.ok, ack.error, ack.stage_s, ack.commit_s)  # (it notifies)
        self._pump(w)
        if not self._pool.reuse:
            self._release_unused()

    def _after_answer(self, w: _Worker) -> None:
        self._pump(w)
        self._release_unused()
        self._changed.notify()

    async def _on_lost(self, w: _Worker, link: _Link, broken: ProtocolError | None = None) -> None:
        """The channel ended: the worker died or left, or (*broken*) sent a malformed message."""
        if link is not w.link or link.lost:
            return  # an older channel, or already handled
        link.lost = True
        link.queue._unlisten()
        if broken is None:
            self._drain(w, link)
        if self._state in ("closing", "closed") and w.state == "connected":
            self._acks.stopped(w.idx)
        elif broken is not None:
            death = WorkerDiedError(
                w.idx, None, link.pid, reason=f"it sent a malformed message ({type(broken).__name__}: {broken}); its channel was closed"
            )
            death.__cause__ = broken
            self._acks.lost(w.idx, "dead", death)
            w.process = None  # its process may run on: it is no longer this worker
            self._drop_sentinel(w)
        elif link.bye is not None:
            self._acks.lost(w.idx, "left", WorkerLeftError(w.idx, link.bye.reason, link.bye.version, link.pid))
            w.process = None  # its process may run on: it is no longer this worker
            self._drop_sentinel(w)
        else:
            process = w.process
            exitcode = None
            if process is not None:
                # The pipe may close a moment before the process is reaped: wait for the exit code.
                with anyio.move_on_after(1.0):
                    while getattr(process, "exitcode", None) is None:
                        await anyio.sleep(0.005)
                exitcode = getattr(process, "exitcode", None)
            if link is not w.link:
                return
            self._acks.lost(w.idx, "dead", WorkerDiedError(w.idx, exitcode, link.pid), exitcode)
            w.process = None
            self._drop_sentinel(w)
        if self._observer is not None and w.death is not None and w.state in ("dead", "left"):
            try:
                self._observer.worker_lost(w.idx, w.death)
            except Exception:
                logger.exception("worker %d: the sender's observer failed on its loss", w.idx)
        if broken is not None:
            # Its process may still view the slots it held: they are never written again.
            self._ledger.retire(w.idx)
        else:
            # The worker holds no slot any more: it died, or detached its weights before leaving.
            self._ledger.disconnect(w.idx)
        current = asyncio.current_task()
        for t in link.tasks:
            if t is not current:
                t.cancel()
        link.queue.close()
        link.close_mailbox()
        if self._state == "running":
            # A replacement for this index can attach through a new channel.
            new = self._new_link(w)
            self._ledger.connect(w.idx)
            self._start_tasks(w, new, asyncio.get_running_loop())
        self._release_unused()
        self._changed.notify()


@functools.lru_cache(maxsize=16)
def _receive_frame(version: int, slot: int, skipped: int) -> bytes:
    """The ``Receive`` frame: encoded once per send, for every worker it goes to."""
    return encode(Receive(version, slot, skipped))


def _is_index(i: object) -> bool:
    return isinstance(i, int) and not isinstance(i, bool)
