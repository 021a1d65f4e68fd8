"""The sender: per-worker state, ``send`` / ``send_async`` / ``wait_async``, acks, liveness.

Every send copies the weights once into a shared-memory slot (a :class:`~._slots.SlotPool`
decides which) and publishes ``Receive(version, slot)`` to each targeted worker. A reader
task per worker turns the worker's acks into state; waiters only look at that state, so a
cancelled wait never loses an ack.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Literal

import anyio
import torch

from ._errors import (
    BrokenChannelError,
    ClosedError,
    SyncTimeoutError,
    WeightsError,
    WorkerDiedError,
    WorkerError,
)
from ._layout import Layout
from ._protocol import Ack, Hello, MapSlots, Receive, Setup, Staged, Stop
from ._queues import AsyncQueue
from ._signal import Signal
from ._slots import Slot, SlotPool
from ._staging import copy_tensors
from ._stats import SenderStatistics, WorkerStatistics
from ._strategy import to_flat, validate

__all__ = ["Sender"]

OnWorkerError = Literal["raise", "skip"]

# Copies larger than this run in the sender's copy thread so the trainer's loop keeps going.
_THREAD_COPY_BYTES = 4 << 20


class _Worker:
    """Sender-side state of one worker."""

    def __init__(self, idx: int, device: str | None) -> None:
        self.idx = idx
        self.device = device
        self.state = "waiting"
        self.conn: Connection | None = None
        self.child_conn: Connection | None = None
        self.queue: AsyncQueue[Any] | None = None
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.process: Any = None
        self.sentinel: int | None = None
        self.sent = -1
        self.applied = -1
        self.responded = -1
        self.last_error: str | None = None
        self.pending: dict[int, int] = {}  # version -> slot id, sent and not yet acked
        self.latest_slot: int | None = None
        self.live_slot: int | None = None
        self.mapped: set[int] = set()
        self.stage_s = 0.0
        self.commit_s = 0.0
        self.tasks: list[asyncio.Task[None]] = []
        self.death: WorkerDiedError | None = None

    def slots_in_use(self) -> Iterable[int | None]:
        yield self.latest_slot
        yield self.live_slot
        yield from self.pending.values()




class Sender:
    """Pushes weights to a fixed set of workers; created by ``init_on_sender``."""

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
        ctx: mp.context.BaseContext,
    ) -> None:
        self._source_layout = source_layout
        self._layout = wire_layout
        self._sources = sources  # worker id -> what send(weights=None) reads for it
        self._pool = pool
        self.sync = sync
        self.timeout = timeout
        self.on_worker_error = on_worker_error
        self.check_finite = check_finite
        self._ctx = ctx
        self._workers: dict[int, _Worker] = {}
        for idx in worker_ids:
            w = _Worker(idx, devices.get(idx))
            self._new_channel(w)
            self._workers[idx] = w
        self._state = "new"
        self._version = -1
        self._sends = 0
        self._bytes = 0
        self._last_copy_s = 0.0
        self._changed = Signal()
        self._executor: ThreadPoolExecutor | None = None
        self._send_lock: asyncio.Lock | None = None

    # ----------------------------------------------------------------- channels

    def _new_channel(self, w: _Worker) -> None:
        ours, theirs = self._ctx.Pipe(duplex=True)
        w.conn, w.child_conn = ours, theirs
        w.queue = AsyncQueue(ours)
        w.mapped = set()

    def child_endpoints(self) -> dict[int, Connection]:
        """The worker ends that are still ours to hand out (pickled with the scheme)."""
        return {i: w.child_conn for i, w in self._workers.items() if w.child_conn is not None}

    def watch_process(self, worker_idx: int, process: Any) -> None:
        """Watch *process* (``multiprocessing.Process``-like) as worker *worker_idx*."""
        w = self._worker(worker_idx)
        self._drop_sentinel(w)
        w.process = process
        # A private duplicate: one reader per descriptor, and others may wait on the original.
        w.sentinel = os.dup(process.sentinel)
        if self._state == "running":
            assert w.queue is not None
            w.tasks.append(asyncio.get_running_loop().create_task(self._watch_sentinel(w, w.queue)))

    @staticmethod
    def _drop_sentinel(w: _Worker) -> None:
        if w.sentinel is not None:
            os.close(w.sentinel)
            w.sentinel = None

    async def wait_joined(self, worker_idx: int, timeout: float | None = None) -> None:
        """Wait until *worker_idx* is connected and has answered the latest version sent to it."""
        w = self._worker(worker_idx)

        def joined() -> bool:
            if self._state != "running":
                raise ClosedError("the sender is closed")
            return w.state == "connected" and w.responded >= w.sent

        if not await self._changed.wait_until(joined, timeout):
            raise SyncTimeoutError(f"waiting for worker {worker_idx} to join", {worker_idx: w.applied}, timeout)
        if w.applied < w.sent:
            raise WorkerError(worker_idx, w.sent, w.last_error or "rejected")

    async def wait_dead(self, worker_idx: int, timeout: float | None = None) -> None:
        """Wait until the sender has noticed that *worker_idx* is gone."""
        w = self._worker(worker_idx)
        if not await self._changed.wait_until(lambda: w.state in ("dead", "stopped") or self._state != "running", timeout):
            raise SyncTimeoutError(f"waiting for worker {worker_idx} to be declared dead", {worker_idx: w.applied}, timeout)

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

    def applied_versions(self) -> dict[int, int]:
        return {i: w.applied for i, w in self._workers.items()}

    async def connect(self, timeout: float | None | object = ..., weights: Any = None) -> int:
        """Start watching the workers, send the initial weights, wait for every ack."""
        if self._state != "new":
            raise ClosedError("the sender is closed") if self._state == "closed" else RuntimeError("connect() was already called")
        self._pool.open()
        self._state = "running"
        self._send_lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        for w in self._workers.values():
            self._start_tasks(w, loop)
        version = await self.send_async(weights)
        await self.wait_async(version=version, timeout=timeout, what="connect")
        return version

    async def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        partial: bool = False,
        timeout: float | None | object = ...,
    ) -> int:
        """Publish *weights*; with ``sync`` wait until every targeted worker applied them."""
        targets = self._targets(worker_ids)
        version = await self.send_async(weights, targets, partial=partial)
        if self.sync:
            await self.wait_async(version=version, worker_ids=targets, timeout=timeout, what=f"send of version {version}")
        return version

    async def send_async(
        self, weights: Any = None, worker_ids: int | Iterable[int] | None = None, *, partial: bool = False
    ) -> int:
        """Copy *weights* into shared memory and publish them; return the new version.

        Returns once the snapshot is taken and the instruction is handed to every
        targeted worker; acks are collected in the background (see :meth:`wait_async`).
        With *partial*, *weights* may hold a subset of the keys; the others keep the
        values each target last received.
        """
        self._check_running()
        targets = self._targets(worker_ids)
        if self.on_worker_error == "raise":
            for i in targets:
                w = self._workers[i]
                if w.state == "dead" and w.death is not None:
                    raise w.death
        groups = self._group(weights, targets)
        for flat, _ in groups:
            validate(flat, self._source_layout, partial=partial, check_finite=self.check_finite)
            if not flat:
                raise WeightsError("the weights hold no tensors")
        assert self._send_lock is not None
        async with self._send_lock:
            self._check_running()
            written: list[tuple[Slot, list[int]]] = []
            try:
                for flat, members, base in self._split_partial(groups):
                    slot = await self._acquire_slot()
                    written.append((slot, members))
                    await self._write(slot, flat, base)
            except BaseException:
                for slot, _ in written:
                    if not slot.writing_elsewhere:
                        slot.writing = False
                self._release_unused()
                raise
            self._version += 1
            version = self._version
            self._sends += 1
            for slot, members in written:
                slot.writing = False
                slot.version = version
                for i in members:
                    self._publish(self._workers[i], version, slot)
            self._release_unused()
            self._changed.notify()
        return version

    async def wait_async(
        self,
        version: int | None = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        quorum: int | None = None,
        timeout: float | None | object = ...,
        what: str | None = None,
    ) -> None:
        """Wait until the targeted workers applied *version* (default: all sent so far).

        With *quorum*, return once that many of them have. Raises :class:`WorkerError`
        if a worker rejected the weights, :class:`WorkerDiedError` if one died (unless
        ``on_worker_error="skip"``), :class:`SyncTimeoutError` after *timeout* seconds.
        """
        if self._state == "closed":
            raise ClosedError("the sender is closed")
        targets = self._targets(worker_ids)
        wanted = {i: (self._workers[i].sent if version is None else version) for i in targets}
        wanted = {i: v for i, v in wanted.items() if v >= 0 and self._workers[i].sent >= v}
        need = len(wanted) if quorum is None else quorum
        if need > len(wanted):
            raise ValueError(f"quorum={quorum} but only {len(wanted)} targeted workers were sent version {version}")
        limit = self.timeout if timeout is ... else timeout
        what = what or ("wait_async" if version is None else f"wait for version {version}")

        def settled() -> bool:
            if self._settled(wanted, need, quorum is not None):
                return True
            if self._state == "closed":
                raise ClosedError("the sender was closed while waiting")
            return False

        if not await self._changed.wait_until(settled, limit):  # type: ignore[arg-type]
            pending = {i: self._workers[i].applied for i, v in wanted.items() if self._workers[i].applied < v}
            raise SyncTimeoutError(what, pending, limit)  # type: ignore[arg-type]

    def _settled(self, wanted: dict[int, int], need: int, quorum: bool) -> bool:
        """True once *need* workers applied their wanted version; raise if that cannot happen."""
        done = 0
        open_ = 0
        failure: BaseException | None = None
        for i, v in wanted.items():
            w = self._workers[i]
            if w.applied >= v:
                done += 1
            elif w.responded >= v:
                failure = failure or WorkerError(i, v, w.last_error or "rejected")
            elif w.state == "dead":
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
        """A snapshot of versions, lags, errors and timings."""
        workers = tuple(
            WorkerStatistics(
                worker_idx=i,
                state=w.state,
                pid=w.pid,
                exitcode=w.exitcode,
                sent_version=w.sent,
                applied_version=w.applied,
                lag=max(self._version - w.applied, 0) if w.sent >= 0 else 0,
                last_error=w.last_error,
                stage_ms=w.stage_s * 1e3,
                commit_ms=w.commit_s * 1e3,
            )
            for i, w in self._workers.items()
        )
        return SenderStatistics(
            version=self._version,
            sends=self._sends,
            bytes_copied=self._bytes,
            slots=len(self._pool.slots),
            slot_bytes=self._layout.nbytes,
            last_copy_ms=self._last_copy_s * 1e3,
            workers=workers,
        )

    async def aclose(self, timeout: float = 10.0) -> None:
        """Stop every receiver, wait (bounded) for them to end, release everything. Idempotent."""
        if self._state == "closed":
            return
        was_running = self._state == "running"
        self._state = "closing"
        with anyio.CancelScope(shield=True):
            if was_running:
                for w in self._workers.values():
                    if w.state == "connected" and w.queue is not None:
                        try:
                            w.queue.put_nowait(Stop())
                        except Exception:
                            pass
                await self._changed.wait_until(lambda: all(w.state != "connected" for w in self._workers.values()), timeout)
            self._state = "closed"
            self._changed.notify()
            tasks = [t for w in self._workers.values() for t in w.tasks]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for w in self._workers.values():
                w.tasks = []  # finished tasks keep tracebacks that point back at us
            for w in self._workers.values():
                if w.queue is not None:
                    await w.queue.aclose()
                if w.child_conn is not None:
                    w.child_conn.close()
                    w.child_conn = None
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

    def _group(self, weights: Any, targets: list[int]) -> list[tuple[Mapping[str, torch.Tensor], list[int]]]:
        """Which weights go to which targets: one group per distinct source."""
        if weights is not None:
            return [(to_flat(weights), targets)]
        groups: dict[int, tuple[Mapping[str, torch.Tensor], list[int]]] = {}
        for i in targets:  # workers sharing one source share one slot
            source = self._sources[i]
            if id(source) not in groups:
                groups[id(source)] = (to_flat(source), [])
            groups[id(source)][1].append(i)
        return list(groups.values())

    def _split_partial(
        self, groups: list[tuple[Mapping[str, torch.Tensor], list[int]]]
    ) -> list[tuple[Mapping[str, torch.Tensor], list[int], Slot | None]]:
        """A partial update is completed from the slot each target last received."""
        out: list[tuple[Mapping[str, torch.Tensor], list[int], Slot | None]] = []
        for flat, members in groups:
            if len(flat) == len(self._source_layout.specs):
                out.append((flat, members, None))
                continue
            by_base: dict[int | None, list[int]] = {}
            for i in members:
                by_base.setdefault(self._workers[i].latest_slot, []).append(i)
            if None in by_base:
                raise WeightsError(f"a partial update needs full weights first; worker(s) {by_base[None]} have none")
            for base, ids in by_base.items():
                out.append((flat, ids, self._pool.get(base)))  # type: ignore[arg-type]
        return out

    async def _acquire_slot(self) -> Slot:
        got: list[Slot] = []

        def free_slot() -> bool:
            in_use = self._slots_in_use()
            slot = self._pool.acquire(in_use, can_wait=self._release_pending(in_use))
            if slot is not None:
                slot.writing = True
                got.append(slot)
            return slot is not None

        if not await self._changed.wait_until(free_slot, self.timeout):
            pending = {i: w.applied for i, w in self._workers.items() if w.pending}
            raise SyncTimeoutError("waiting for a free shared-memory slot", pending, self.timeout)
        return got[0]

    def _slots_in_use(self) -> set[int]:
        """Slots some worker runs on, was sent, or would get on (re)joining."""
        return {s for w in self._workers.values() for s in w.slots_in_use() if s is not None}

    def _release_pending(self, in_use: set[int]) -> bool:
        """Whether some slot in use will be freed once outstanding acks arrive."""
        pinned = {w.latest_slot for w in self._workers.values()}
        return any(s not in pinned for s in in_use) or any(s.writing for s in self._pool.slots)

    def _release_unused(self) -> None:
        self._pool.release_unused(self._slots_in_use())

    async def _write(self, slot: Slot, flat: Mapping[str, torch.Tensor], base: Slot | None = None) -> None:
        views = self._pool.views(slot)
        keys = self._layout.keys
        dst = [views[k] for k in keys]
        base_views = self._pool.views(base) if base is not None else {}
        src = [flat[k] if k in flat else base_views[k] for k in keys]
        t0 = time.perf_counter()
        if self._layout.nbytes < _THREAD_COPY_BYTES:
            copy_tensors(dst, src)
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="asyncsync-copy")
            fut = asyncio.get_running_loop().run_in_executor(self._executor, copy_tensors, dst, src)
            try:
                await asyncio.shield(fut)
            except BaseException:
                # The copy thread cannot be stopped: keep the slot reserved until it is done.
                slot.writing_elsewhere = True

                def _done(_f: object) -> None:
                    slot.writing_elsewhere = False
                    slot.writing = False
                    self._release_unused()
                    self._changed.notify()

                fut.add_done_callback(_done)
                raise
        self._last_copy_s = time.perf_counter() - t0
        self._bytes += self._layout.nbytes

    def _publish(self, w: _Worker, version: int, slot: Slot) -> None:
        w.sent = version
        w.latest_slot = slot.id
        if w.state != "connected":
            return  # delivered on hello (late join or rejoin)
        w.pending[version] = slot.id
        self._deliver(w, version, slot)

    def _deliver(self, w: _Worker, version: int, slot: Slot) -> None:
        assert w.queue is not None
        try:
            if slot.id not in w.mapped:
                w.queue.put_nowait(MapSlots((slot.id,), (slot.nbytes,), slot.transient))
                w.queue.send_fds([slot.fd])
                w.mapped.add(slot.id)
            w.queue.put_nowait(Receive(version, slot.id))
        except (BrokenChannelError, ClosedError):
            pass  # the reader task notices the death and reports it

    def _start_tasks(self, w: _Worker, loop: asyncio.AbstractEventLoop) -> None:
        assert w.queue is not None
        w.tasks = [loop.create_task(self._read_loop(w, w.queue))]
        if w.sentinel is not None:
            w.tasks.append(loop.create_task(self._watch_sentinel(w, w.queue)))

    async def _read_loop(self, w: _Worker, queue: AsyncQueue[Any]) -> None:
        try:
            while True:
                msg = await queue.get()
                if isinstance(msg, Ack):
                    self._on_ack(w, msg)
                elif isinstance(msg, Staged):
                    self._on_staged(w, msg)
                elif isinstance(msg, Hello):
                    self._on_hello(w, msg)
        except BrokenChannelError:
            await self._on_lost(w, queue)
        except ClosedError:
            pass

    async def _watch_sentinel(self, w: _Worker, queue: AsyncQueue[Any]) -> None:
        sentinel = w.sentinel
        if sentinel is None:
            return
        try:
            await anyio.wait_readable(sentinel)
        except (OSError, anyio.ClosedResourceError):
            return
        await self._on_lost(w, queue)

    def _on_hello(self, w: _Worker, msg: Hello) -> None:
        assert w.queue is not None
        w.pid = msg.pid
        w.state = "connected"
        w.death = None
        w.exitcode = None
        if w.child_conn is not None:
            w.child_conn.close()  # the worker holds its own copy now: EOF will mean it is gone
            w.child_conn = None
        try:
            w.queue.put_nowait(Setup(self._layout, w.device, os.getpid()))
        except (BrokenChannelError, ClosedError):
            return
        if w.sent >= 0 and w.latest_slot is not None:
            w.pending = {w.sent: w.latest_slot}
            self._deliver(w, w.sent, self._pool.get(w.latest_slot))
        self._changed.notify()

    def _on_ack(self, w: _Worker, ack: Ack) -> None:
        v = ack.version
        for old in [u for u in w.pending if u <= v]:
            del w.pending[old]
        w.responded = max(w.responded, v)
        if ack.ok:
            w.applied = max(w.applied, v)
            w.live_slot = ack.holds
            w.last_error = None
            w.stage_s, w.commit_s = ack.stage_s, ack.commit_s
        else:
            w.last_error = ack.error
        self._release_unused()
        self._changed.notify()

    def _on_staged(self, w: _Worker, msg: Staged) -> None:
        for old in [u for u in w.pending if u < msg.version or (u == msg.version and msg.holds is None)]:
            del w.pending[old]
        self._release_unused()
        self._changed.notify()

    async def _on_lost(self, w: _Worker, queue: AsyncQueue[Any]) -> None:
        if queue is not w.queue or w.state in ("dead", "stopped"):
            return  # an older channel, or already handled
        if self._state in ("closing", "closed") and w.state == "connected":
            w.state = "stopped"
            self._changed.notify()
            return
        process = w.process
        if process is not None:
            # The pipe may close a moment before the process is reaped: wait for the exit code.
            with anyio.move_on_after(1.0):
                while getattr(process, "exitcode", None) is None:
                    await anyio.sleep(0.005)
            w.exitcode = getattr(process, "exitcode", None)
        if queue is not w.queue or w.state in ("dead", "stopped"):
            return
        w.state = "dead"
        w.death = WorkerDiedError(w.idx, w.exitcode, w.pid)
        w.pending.clear()
        w.live_slot = None
        w.process = None
        self._drop_sentinel(w)
        current = asyncio.current_task()
        for t in w.tasks:
            if t is not current:
                t.cancel()
        queue.close()
        if self._state == "running":
            # A replacement for this index can attach through the new channel.
            self._new_channel(w)
            self._start_tasks(w, asyncio.get_running_loop())
        self._release_unused()
        self._changed.notify()
