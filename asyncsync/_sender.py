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
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Literal

import anyio
import torch

from ._errors import (
    BrokenChannelError,
    CapacityError,
    ClosedError,
    ProtocolError,
    SyncTimeoutError,
    WeightsError,
    WorkerDiedError,
    WorkerError,
    WorkerLeftError,
    WouldBlock,
)
from ._layout import Layout
from ._ownership import Ref, SlotLedger
from ._protocol import Ack, Bye, Hello, MapSlots, Message, Receive, Setup, Staged, Stop, decode, encode
from ._queues import AsyncQueue
from ._signal import Signal
from ._slots import Slot, SlotPool
from ._flat import SpanCopier
from ._staging import copy_tensors
from ._stats import SenderStatistics, WorkerStatistics
from ._strategy import KnownSource, to_flat, validate

__all__ = ["Sender"]

logger = logging.getLogger("asyncsync")

OnWorkerError = Literal["raise", "skip"]
Timeout = float | None

# Copies larger than this run in the sender's copy thread so the trainer's loop keeps going.
_THREAD_COPY_BYTES = 4 << 20


class _Link:
    """One connection (generation) to one worker: its channel and what it answered."""

    def __init__(self, generation: int, conn: Connection, child_conn: Connection) -> None:
        self.generation = generation
        self.child_conn: Connection | None = child_conn
        self.queue: AsyncQueue[Any] = AsyncQueue(conn)
        self.pid: int | None = None
        self.applied = -1
        self.responded = -1
        self.rejected = -1  # newest version this connection rejected
        self.last_error: str | None = None
        self.mapped: set[int] = set()
        self.delivered_sends = 0  # w.sends at the last delivery on this connection
        self.stage_s = 0.0
        self.commit_s = 0.0
        self.bye: Bye | None = None
        self.lost = False
        self.tasks: list[asyncio.Task[None]] = []


class _Worker:
    """Sender-side state of one worker id, across its connections."""

    def __init__(self, idx: int, device: str | None) -> None:
        self.idx = idx
        self.device = device
        self.state = "waiting"  # waiting | connected | dead | left | stopped
        self.link: _Link | None = None
        self.generation = 0
        self.sends = 0  # versions published to this worker id
        self.exitcode: int | None = None
        self.process: Any = None
        self.sentinel: int | None = None
        self.death: WorkerDiedError | None = None
        self.death_generation = 0
        self.pid: int | None = None


class StillWriting(Exception):
    """Raised by a ``publish_filled`` fill that gives up while its writer still runs;
    ``done`` resolves once the buffer is no longer written."""

    def __init__(self, message: str, done: asyncio.Future[None]) -> None:
        super().__init__(message)
        self.done = done


class ModelRef:
    """A model looked up at every send (``context`` + ``model_id``), as torchrl does."""

    def __init__(self, resolve: Callable[[], Any]) -> None:
        self.resolve = resolve


class Sender:
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
        self._source_layout = source_layout
        self._layout = wire_layout
        self._spans = SpanCopier(wire_layout)  # one copy per span of a flattened source
        self._sources = sources  # worker id -> what send(weights=None) reads for it
        self._pool = pool
        self._ledger = SlotLedger(manual=manual)
        self.sync = sync
        self.timeout = timeout
        self.on_worker_error = on_worker_error
        self.check_finite = check_finite
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
        self._state = "new"
        self._version = -1
        self._sends = 0
        self._bytes = 0
        self._last_copy_s = 0.0
        self._changed = Signal()
        self._executor: ThreadPoolExecutor | None = None
        self._copy_future: Future[None] | None = None
        self._send_lock: asyncio.Lock | None = None
        self._known: dict[int, KnownSource] = {}  # id(source) -> its last validated tensors
        # Called with each worker's answers and losses (a relay forwards them to its trainer).
        self.on_ack: Callable[[int, Ack], None] | None = None
        self.on_lost: Callable[[int, WorkerDiedError], None] | None = None

    # ----------------------------------------------------------------- channels

    def _new_link(self, w: _Worker) -> _Link:
        ours, theirs = self._ctx.Pipe(duplex=True)
        w.generation += 1
        w.link = _Link(w.generation, ours, theirs)
        return w.link

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
        w = self._worker(worker_idx)
        generation = w.generation

        def joined() -> bool:
            if self._state != "running":
                raise ClosedError("the sender is closed")
            if w.state in ("dead", "left") and w.death is not None and w.death_generation >= generation:
                raise w.death  # the connection we wait for is already gone
            link = w.link
            return w.state == "connected" and link is not None and link.responded >= self._sent(w)

        if not await self._changed.wait_until(joined, timeout):
            raise SyncTimeoutError(
                f"waiting for worker {worker_idx} to join", {worker_idx: self._applied(w)}, timeout, never_connected=self._never_connected([worker_idx])
            )
        link = w.link
        assert link is not None
        if link.applied < self._sent(w):
            raise WorkerError(worker_idx, link.rejected, link.last_error or "rejected")

    def _never_connected(self, ids: Iterable[int]) -> dict[int, int | None]:
        """Of *ids*, the workers whose receiver never said hello, with the pid of the process
        watched for them (alive: its death would have been noticed), or None."""
        out: dict[int, int | None] = {}
        for i in ids:
            w = self._workers[i]
            if w.state == "waiting" and (w.link is None or w.link.pid is None):
                out[i] = getattr(w.process, "pid", None)
        return out

    async def wait_dead(self, worker_idx: int, timeout: float | None = None) -> None:
        """Wait until the sender has noticed that *worker_idx* is gone."""
        w = self._worker(worker_idx)
        gone = ("dead", "left", "stopped")
        if not await self._changed.wait_until(lambda: w.state in gone or self._state != "running", timeout):
            raise SyncTimeoutError(f"waiting for worker {worker_idx} to be declared dead", {worker_idx: self._applied(w)}, timeout)

    # ----------------------------------------------------------------- public API

    @property
    def worker_ids(self) -> list[int]:
        return list(self._workers)

    @property
    def version(self) -> int:
        return self._version

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def ledger(self) -> SlotLedger:
        """Who holds which slot (for debugging and tests)."""
        return self._ledger

    def applied_versions(self) -> dict[int, int]:
        return {i: self._applied(w) for i, w in self._workers.items()}

    @staticmethod
    def _applied(w: _Worker) -> int:
        return w.link.applied if w.link is not None else -1

    def sent_version(self, worker_idx: int) -> int:
        """The newest version sent to *worker_idx* (-1: none)."""
        return self._sent(self._worker(worker_idx))

    def _sent(self, w: _Worker) -> int:
        """The newest version sent to *w* (-1: none)."""
        latest = self._ledger.latest.get(w.idx)
        return -1 if latest is None else latest.version

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

    async def publish_filled(
        self,
        fill: Callable[[torch.Tensor], Awaitable[None]],
        version: int,
        worker_ids: int | Iterable[int] | None = None,
        *,
        base_version: int | None = None,
    ) -> None:
        """Publish *version* whose bytes ``await fill(buffer)`` writes straight into a slot.

        For a relay: *buffer* is the slot itself (a uint8 tensor of the wire layout), so
        weights received from the network land in shared memory without another copy.
        *version* must be newer than what each target was sent (one version may be
        published in several slots, to different workers, as a partial update does; an
        older one than the newest may go to a worker that lacks it). With *base_version* (a partial update), the
        slot first gets a copy of the targets' newest version, which must be
        *base_version* in one slot for all of them, and *fill* writes only what changed.
        If *fill* raises, the slot is released and nothing is published.
        """
        self._check_running()
        targets = self._targets(worker_ids)
        self._check_newer(version, targets)  # fail early...
        assert self._send_lock is not None
        async with self._send_lock:
            self._check_running()
            self._check_newer(version, targets)  # ...and for sure, under the lock
            base = None if base_version is None else self._base_slot(targets, base_version)
            slot = await self._acquire_slot(None)
            try:
                if base is not None:
                    await self._write(slot, {}, base)
                await fill(self._pool.views_buffer(slot))
            except BaseException as exc:
                if slot.copying:
                    raise  # the copy thread still writes it: it is released when that is done
                writer = exc.done if isinstance(exc, StillWriting) else getattr(exc, "still_writing", None)
                if writer is None:
                    self._unreserve([slot])
                    raise
                # Abandoned (or cancelled) while something (a network receive) still writes
                # the slot: it stays reserved, off the books, and mapped until that is done.
                slot.copying = True
                slot.writer = writer
                writer.add_done_callback(lambda _f: self._written_late(slot))
                raise
            if version > self._version:
                self._sends += 1
                self._version = version
            if base is None:  # (else _write counted the copy of the base)
                self._bytes += self._layout.nbytes
            self._publish([(slot, targets)], version)

    def _base_slot(self, targets: list[int], base_version: int) -> int:
        """The one slot holding every target's newest version, *base_version*."""
        refs = {i: self._ledger.latest.get(i) for i in targets}
        slots = {r.slot for r in refs.values() if r is not None and r.version == base_version}
        if len(slots) != 1 or any(r is None or r.version != base_version for r in refs.values()):
            have = {i: (r.version if r is not None else None) for i, r in refs.items()}
            raise WeightsError(f"cannot complete a partial update from version {base_version}: the targets' newest versions are {have}")
        slot = slots.pop()
        assert slot is not None
        return slot

    def _check_newer(self, version: int, targets: list[int]) -> None:
        # Per worker only: a relay may publish an older version to a worker that lacks it
        # (a transfer repeated after the group re-formed) after a newer one went to others.
        stale = {i: self._sent(self._workers[i]) for i in targets if self._sent(self._workers[i]) >= version}
        if stale:
            raise ValueError(f"version {version} is not newer than what workers {stale} were sent")

    def _publish(self, written: list[tuple[Slot, list[int]]], version: int) -> None:
        """Make each written slot its members' newest *version* and send it to those with nothing in flight."""
        for slot, members in written:
            self._ledger.publish(slot.id, version, members)
            for i in members:
                self._workers[i].sends += 1
        for _, members in written:
            for i in members:
                self._pump(self._workers[i])
        self._release_unused()
        self._changed.notify()

    def _unreserve(self, slots: list[Slot]) -> None:
        """Give back slots reserved by a send that publishes nothing."""
        for slot in slots:
            self._ledger.unreserve(slot.id)
        self._release_unused()
        self._changed.notify()

    def _written_late(self, slot: Slot) -> None:
        """The writer a failed send left behind (copy thread, network receive) is done: free its slot."""
        slot.copying = False
        self._ledger.unreserve(slot.id)
        if self._state != "closed":
            self._release_unused()
        self._changed.notify()

    async def connect(self, timeout: Timeout | object = ..., weights: Any = None) -> int:
        """Start watching the workers, send the initial weights, wait for every ack.

        If the wait times out, calling ``connect()`` again waits for the same initial version.
        """
        self.start()
        deadline = _deadline(self._limit(timeout))
        if self._version < 0:
            await self.send_async(weights, timeout=_remaining(deadline))
        await self.wait_async(version=0, timeout=_remaining(deadline), what="connect")
        return 0

    async def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        partial: bool = False,
        timeout: Timeout | object = ...,
    ) -> int:
        """Publish *weights*; with ``sync`` wait until every targeted worker applied them.

        *timeout* bounds the whole call: waiting for a free slot and for the acks.
        """
        targets = self._targets(worker_ids)
        deadline = _deadline(self._limit(timeout))
        version = await self.send_async(weights, targets, partial=partial, timeout=_remaining(deadline))
        if self.sync:
            await self.wait_async(version=version, worker_ids=targets, timeout=_remaining(deadline), what=f"send of version {version}")
        return version

    async def send_async(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        partial: bool = False,
        timeout: Timeout | object = ...,
    ) -> int:
        """Copy *weights* into shared memory and publish them; return the new version.

        Returns once the snapshot is taken and each targeted worker will get it (now, or
        when it answers its current update); acks are collected in the background (see
        :meth:`wait_async`). With *partial*, *weights* may hold a subset of the keys; the
        others keep the values each target last received. *timeout* bounds the wait for a
        free slot (only possible with a ``max_slots`` cap).
        """
        self._check_running()
        targets = self._targets(worker_ids)
        if self.on_worker_error == "raise":
            for i in targets:
                w = self._workers[i]
                if w.state in ("dead", "left") and w.death is not None:
                    raise w.death
        groups = self._group(weights, targets, partial)
        deadline = _deadline(self._limit(timeout))
        assert self._send_lock is not None
        async with self._send_lock:
            self._check_running()
            plan = self._split_partial(groups)
            written: list[tuple[Slot, list[int]]] = []
            try:
                for flat, members, base in plan:
                    slot = await self._acquire_slot(deadline)
                    written.append((slot, members))
                    await self._write(slot, flat, base)
            except BaseException:
                self._unreserve([slot for slot, _ in written if not slot.copying])
                raise
            self._version += 1
            version = self._version
            self._sends += 1
            self._publish(written, version)
        return version

    async def wait_async(
        self,
        version: int | None = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        quorum: int | None = None,
        timeout: Timeout | object = ...,
        what: str | None = None,
    ) -> None:
        """Wait until the targeted workers applied *version* (default: all sent so far).

        Only workers that were sent *version* (or a newer one) are waited for. With
        *quorum*, return once that many of them have. Raises :class:`WorkerError` if a
        worker rejected the weights, :class:`WorkerDiedError` if one died or left (unless
        ``on_worker_error="skip"``), :class:`SyncTimeoutError` after *timeout* seconds,
        :class:`ValueError` for a version not sent yet.
        """
        if self._state == "closed":
            raise ClosedError("the sender is closed")
        if version is not None and version > self._version:
            raise ValueError(f"version {version} was not sent yet (the newest is {self._version})")
        targets = self._targets(worker_ids)
        sent = {i: self._sent(self._workers[i]) for i in targets}
        wanted = {i: (sent[i] if version is None else version) for i in targets}
        wanted = {i: v for i, v in wanted.items() if v >= 0 and sent[i] >= v}
        need = len(wanted) if quorum is None else quorum
        if need > len(wanted):
            raise ValueError(f"quorum={quorum} but only {len(wanted)} targeted workers were sent version {version}")
        limit = self._limit(timeout)
        what = what or ("wait_async" if version is None else f"wait for version {version}")

        def settled() -> bool:
            if self._settled(wanted, need, quorum is not None):
                return True
            if self._state == "closed":
                raise ClosedError("the sender was closed while waiting")
            return False

        if not await self._changed.wait_until(settled, limit):
            pending = {i: self._applied(self._workers[i]) for i, v in wanted.items() if self._applied(self._workers[i]) < v}
            raise SyncTimeoutError(what, pending, limit, never_connected=self._never_connected(pending))

    def _settled(self, wanted: dict[int, int], need: int, quorum: bool) -> bool:
        """True once *need* workers applied their wanted version; raise if that cannot happen."""
        done = 0
        open_ = 0
        failure: BaseException | None = None
        for i, v in wanted.items():
            w = self._workers[i]
            link = w.link
            applied = link.applied if link is not None and w.state == "connected" else -1
            if applied >= v:
                done += 1
            elif w.state == "connected" and link is not None and link.responded >= v:
                failure = failure or WorkerError(i, link.rejected, link.last_error or "rejected")
            elif w.state in ("dead", "left"):
                if self.on_worker_error == "skip" and not quorum:
                    done += 1  # skipped: the living workers are what counts
                else:
                    assert w.death is not None
                    failure = failure or w.death
            elif w.state == "stopped":
                failure = failure or ClosedError(f"worker {i} stopped before applying version {v}")
            else:
                open_ += 1
        if done >= need:
            return True
        if failure is not None and (not quorum or done + open_ < need):
            raise failure
        return False

    def statistics(self) -> SenderStatistics:
        """A snapshot of versions, lags, errors, slots and timings."""
        workers = []
        for i, w in self._workers.items():
            link = w.link
            applied = self._applied(w)
            sent = self._sent(w)
            held = self._ledger.links.get(i)
            workers.append(
                WorkerStatistics(
                    worker_idx=i,
                    state=w.state,
                    pid=w.pid,
                    exitcode=w.exitcode,
                    sent_version=sent,
                    applied_version=applied,
                    lag=max(self._version - applied, 0) if sent >= 0 else 0,
                    last_error=link.last_error if link is not None else None,
                    stage_ms=link.stage_s * 1e3 if link is not None else 0.0,
                    commit_ms=link.commit_s * 1e3 if link is not None else 0.0,
                    generation=w.generation,
                    in_flight_version=held.in_flight.version if held is not None and held.in_flight is not None else None,
                    reason=w.death.reason if w.death is not None else None,
                )
            )
        return SenderStatistics(
            version=self._version,
            sends=self._sends,
            bytes_copied=self._bytes,
            slots=len(self._pool.slots),
            slot_bytes=self._layout.nbytes,
            last_copy_ms=self._last_copy_s * 1e3,
            workers=tuple(workers),
        )

    async def aclose(self, timeout: float = 10.0, *, stop: bool = True) -> None:
        """Stop every receiver, wait (bounded) for them to end, release everything. Idempotent.

        Every waiter (``send``, ``send_async``, ``wait_async``) wakes with :class:`ClosedError`.
        ``stop=False`` closes the channels without ``Stop``: the receivers end with
        :class:`SenderDiedError` (a relay whose trainer died passes that on).
        """
        if self._state == "closed":
            return
        was_running = self._state == "running" and stop
        self._state = "closing"
        self._changed.notify()
        with anyio.CancelScope(shield=True):
            if was_running:
                for w in self._workers.values():
                    if w.state == "connected" and w.link is not None:
                        try:
                            w.link.queue.put_bytes_nowait(encode(Stop()))
                        except Exception:
                            pass
                await self._changed.wait_until(lambda: all(w.state != "connected" for w in self._workers.values()), timeout)
            self._state = "closed"
            self._changed.notify()
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
                    if w.link.child_conn is not None:
                        w.link.child_conn.close()
                        w.link.child_conn = None
                self._drop_sentinel(w)
            if self._executor is not None:
                ex, self._executor = self._executor, None
                ex.shutdown(wait=True)  # at most one copy still running
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

    def _limit(self, timeout: Timeout | object) -> Timeout:
        return self.timeout if timeout is ... else timeout  # type: ignore[return-value]

    def _check_running(self) -> None:
        if self._state == "new":
            raise RuntimeError("call `await scheme.connect()` before sending")
        if self._state != "running":
            raise ClosedError("the sender is closed")

    def _worker(self, idx: int) -> _Worker:
        try:
            return self._workers[idx]
        except KeyError:
            raise ValueError(f"unknown worker id {idx!r}; workers are {sorted(self._workers)}") from None

    def _targets(self, worker_ids: int | Iterable[int] | None) -> list[int]:
        if worker_ids is None:
            return list(self._workers)
        if isinstance(worker_ids, bool):
            raise TypeError("worker_ids must be an int, a list of ints or None")
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool):
                raise TypeError(f"worker id {i!r} is not an int")
            self._worker(i)
        if not ids:
            raise ValueError("worker_ids is empty")
        return list(dict.fromkeys(ids))

    def _group(self, weights: Any, targets: list[int], partial: bool) -> list[tuple[Mapping[str, torch.Tensor], list[int]]]:
        """Which validated weights go to which targets: one group per distinct source."""
        if weights is not None:
            return [(self._validated(to_flat(weights, self._source_layout), partial), targets)]
        groups: dict[int, tuple[Mapping[str, torch.Tensor], list[int]]] = {}
        for i in targets:  # workers sharing one source share one slot
            source = self._sources[i]
            if isinstance(source, ModelRef):
                source = source.resolve()
            if id(source) not in groups:
                groups[id(source)] = (self._read_source(source), [])
            groups[id(source)][1].append(i)
        return list(groups.values())

    def _read_source(self, source: Any) -> Mapping[str, torch.Tensor]:
        """A configured source's weights: validated once, then only checked cheaply."""
        known = self._known.get(id(source))
        flat = known.current() if known is not None and known.obj is source else None
        if flat is None:
            flat = self._validated(to_flat(source, self._source_layout), partial=False)
            known = KnownSource.of(source, flat)
            if known is not None:
                self._known[id(source)] = known
        elif self.check_finite:
            validate(flat, self._source_layout, check_finite=True, wire_layout=self._layout)
        return flat

    def _validated(self, flat: dict[str, torch.Tensor], partial: bool) -> dict[str, torch.Tensor]:
        if not flat:
            raise WeightsError("the weights hold no tensors")
        validate(flat, self._source_layout, partial=partial, check_finite=self.check_finite, wire_layout=self._layout)
        return flat

    def _split_partial(
        self, groups: list[tuple[Mapping[str, torch.Tensor], list[int]]]
    ) -> list[tuple[Mapping[str, torch.Tensor], list[int], int | None]]:
        """A partial update is completed from the slot holding each target's newest version."""
        out: list[tuple[Mapping[str, torch.Tensor], list[int], int | None]] = []
        for flat, members in groups:
            if len(flat) == len(self._source_layout.specs):
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

    async def _acquire_slot(self, deadline: float | None) -> Slot:
        slot = self._pool.acquire()
        if slot is not None:  # the common case: no closure, no wait
            return slot
        got: list[Slot] = []

        def free_slot() -> bool:
            if self._state != "running":
                raise ClosedError("the sender was closed while waiting for a free slot")
            slot = self._pool.acquire()
            if slot is not None:
                got.append(slot)
                return True
            if not self._can_free_a_slot():
                raise CapacityError(
                    f"no free shared-memory slot among max_slots={self._pool.max_slots} and no answer pending "
                    "that would free one; held: "
                    + "; ".join(f"slot {s}: {', '.join(self._ledger.owners(s))}" for s in sorted(self._pool.slots))
                )
            return False

        timeout = _remaining(deadline)
        if not await self._changed.wait_until(free_slot, timeout):
            pending = {i: self._applied(w) for i, w in self._workers.items() if (lk := self._ledger.links.get(i)) and lk.in_flight}
            raise SyncTimeoutError("waiting for a free shared-memory slot", pending, timeout)
        return got[0]

    def _can_free_a_slot(self) -> bool:
        """Whether an outstanding answer or a finishing copy can still free a slot."""
        if self._copy_future is not None and not self._copy_future.done():
            return True
        return any(link.in_flight is not None or link.staged is not None for link in self._ledger.links.values())

    def _release_unused(self) -> None:
        self._pool.release_unused()

    async def _write(self, slot: Slot, flat: Mapping[str, torch.Tensor], base: int | None) -> None:
        keys = self._layout.keys
        dst = list(map(self._pool.views(slot).__getitem__, keys))
        if base is None:
            src = list(map(flat.__getitem__, keys))
            fused = self._spans.pairs(self._pool.views_buffer(slot), src)
            if fused is not None:
                dst, src = fused
        else:
            base_views = self._pool.views(self._pool.get(base))
            src = [flat[k] if k in flat else base_views[k] for k in keys]
        t0 = time.perf_counter()
        if self._layout.nbytes < _THREAD_COPY_BYTES:
            copy_tensors(dst, src)
        else:
            if self._copy_future is not None and not self._copy_future.done():
                # A cancelled send's copy still runs: at most one slot is written off the books.
                await asyncio.shield(asyncio.wrap_future(self._copy_future))
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="asyncsync-copy")
            cfut = self._executor.submit(copy_tensors, dst, src)
            self._copy_future = cfut
            try:
                await asyncio.shield(asyncio.wrap_future(cfut))
            except BaseException:
                # The copy thread cannot be stopped: the slot stays reserved until it is done.
                slot.copying = True
                loop = asyncio.get_running_loop()

                def _done(_f: object) -> None:
                    if not loop.is_closed():
                        loop.call_soon_threadsafe(self._written_late, slot)

                cfut.add_done_callback(_done)
                raise
        self._last_copy_s = time.perf_counter() - t0
        self._bytes += self._layout.nbytes

    def _pump(self, w: _Worker) -> None:
        """Send the worker its newest version if nothing is in flight (latest wins)."""
        if w.state != "connected" or w.link is None:
            return
        ref = self._ledger.next_delivery(w.idx)
        if ref is not None:
            skipped = max(w.sends - w.link.delivered_sends - 1, 0)
            w.link.delivered_sends = w.sends
            self._deliver(w.link, ref, skipped)

    def _deliver(self, link: _Link, ref: Ref, skipped: int) -> None:
        assert ref.slot is not None
        slot = self._pool.get(ref.slot)
        try:
            if slot.transient or slot.id not in link.mapped:
                link.queue.put_bytes_nowait(encode(MapSlots((slot.id,), (slot.nbytes,), slot.transient)))
                link.queue.send_fds([slot.fd])
                if not slot.transient:
                    link.mapped.add(slot.id)
            link.queue.put_bytes_nowait(encode(Receive(ref.version, slot.id, skipped)))
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
        link.pid = w.pid = msg.pid
        w.state = "connected"
        w.death = None
        w.exitcode = None
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
        if self.on_ack is not None:
            try:
                self.on_ack(w.idx, ack)
            except Exception:  # the hook's failure is not the worker's: it stays connected
                logger.exception("worker %d: the on_ack hook failed", w.idx)
        link.responded = max(link.responded, ack.version)
        if ack.ok:
            link.applied = max(link.applied, ack.version)
            link.last_error = None
            link.stage_s, link.commit_s = ack.stage_s, ack.commit_s
        else:
            link.rejected = max(link.rejected, ack.version)
            link.last_error = ack.error
        self._after_answer(w)

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
            w.state = "stopped"
        elif broken is not None:
            w.state = "dead"
            w.death = WorkerDiedError(
                w.idx, None, link.pid, reason=f"it sent a malformed message ({type(broken).__name__}: {broken}); its channel was closed"
            )
            w.death.__cause__ = broken
            w.process = None  # its process may run on: it is no longer this worker
            self._drop_sentinel(w)
        elif link.bye is not None:
            w.state = "left"
            w.death = WorkerLeftError(w.idx, link.bye.reason, link.bye.version, link.pid)
            w.process = None  # its process may run on: it is no longer this worker
            self._drop_sentinel(w)
        else:
            process = w.process
            if process is not None:
                # The pipe may close a moment before the process is reaped: wait for the exit code.
                with anyio.move_on_after(1.0):
                    while getattr(process, "exitcode", None) is None:
                        await anyio.sleep(0.005)
                w.exitcode = getattr(process, "exitcode", None)
            if link is not w.link:
                return
            w.state = "dead"
            w.death = WorkerDiedError(w.idx, w.exitcode, link.pid)
            w.process = None
            self._drop_sentinel(w)
        if self.on_lost is not None and w.death is not None and w.state in ("dead", "left"):
            try:
                self.on_lost(w.idx, w.death)
            except Exception:
                logger.exception("worker %d: the on_lost hook failed", w.idx)
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
        if self._state == "running":
            # A replacement for this index can attach through a new channel.
            w.death_generation = link.generation
            new = self._new_link(w)
            self._ledger.connect(w.idx)
            self._start_tasks(w, new, asyncio.get_running_loop())
        self._release_unused()
        self._changed.notify()


def _deadline(timeout: Timeout) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> Timeout:
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.0)

