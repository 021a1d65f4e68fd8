"""The sender: ``send`` / ``send_async`` / ``wait_async`` and the workers' lifecycle.

Every send copies the weights once into a free shared-memory slot (the
:class:`~._publisher.Publisher`) and makes it the newest version of each targeted worker.
A worker has at most one ``Receive`` outstanding; when it answers, it is handed its newest
version (latest wins), so a slow worker holds at most its live slot and one in flight and
never slows a send. Slot ownership is kept by a :class:`~._ownership.SlotLedger`. Each
worker's channel and answers are the :class:`~._links.LinkTable`'s: its reader callbacks
turn them into state as they arrive (no task per message); waiters only look at that
state, so a cancelled wait never loses an ack.
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
from typing import Any

import anyio
import torch

from .._core._front import SenderCore
from .._core._layout import Layout
from .._core._ownership import SlotLedger
from .._errors import ClosedError, WeightsError
from .._io._slots import Slot, SlotPool
from .._options import DEFAULT, OnWorkerError, UseDefault
from .._stats import SenderStatistics
from .._wire._local import Setup, Stop, encode
from ._links import LinkTable, SenderObserver, _Worker
from ._publisher import Publisher, Reservation

__all__ = ["Sender", "SenderObserver"]

logger = logging.getLogger("asyncsync")


class Sender(LinkTable, SenderCore[int, _Worker]):
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
        first = next(iter(sources.values()), None)
        # The usual case, one source for every worker: a send resolves and checks it once.
        self._one_source = first if all(s is first for s in sources.values()) else None
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

    def in_owner_process(self) -> bool:
        """False in a child that inherited this sender by fork."""
        return os.getpid() == self._pid

    def child_endpoints(self) -> dict[int, Connection]:
        """The worker ends that are still ours to hand out (pickled with the scheme)."""
        return {i: w.link.child_conn for i, w in self._workers.items() if w.link is not None and w.link.child_conn is not None}

    def watch_process(self, worker_idx: int, process: Any) -> None:
        """Watch *process* (``multiprocessing.Process``-like) as worker *worker_idx*.

        *process* is a started ``multiprocessing.Process``, or an object like one: an int
        ``sentinel`` readable once it exits, its ``pid`` and ``exitcode``. Anything else
        (a ``subprocess.Popen``) is a TypeError saying so, and nothing changes.
        """
        w = self._worker(worker_idx)
        try:
            sentinel = process.sentinel
        except AttributeError:
            sentinel = None
        if not isinstance(sentinel, int) or isinstance(sentinel, bool):
            kind = f"{type(process).__module__}.{type(process).__qualname__}"
            hint = ""
            if type(process).__module__ == "subprocess":
                hint = (
                    ": a program started with subprocess has no sentinel; let it attach by address "
                    "(scheme.listen() here, MultiProcessWeightSyncScheme.attach() in it), and its closed socket says when it is gone"
                )
            raise TypeError(
                f"watch_process(worker {worker_idx}): expected a multiprocessing.Process (or one like it, with an int sentinel, "
                f"a pid and an exitcode), got {kind}{hint}"
            )
        self._drop_sentinel(w)
        w.process = process
        # A private duplicate: one reader per descriptor, and others may wait on the original.
        w.sentinel = os.dup(sentinel)
        if self._state == "running" and w.link is not None:
            w.link.tasks.append(asyncio.get_running_loop().create_task(self._watch_sentinel(w, w.link)))

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

    def _silence_hint(self, wids: Sequence[int]) -> str:
        polled = [i for i in wids if (link := self._workers[i].link) is not None and link.mailbox is not None]
        if not polled:
            return ""
        who = f"worker {polled[0]} is" if len(polled) == 1 else f"workers {', '.join(map(str, polled))} are"
        return f"{who} polled (poll=True): a polled worker applies a version only when its loop calls receiver.poll_nowait()"

    # ----------------------------------------------------------------- public API

    @property
    def ledger(self) -> SlotLedger:
        """Who holds which slot (for debugging and tests)."""
        return self._ledger

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
        workers, pump = self._workers, self._pump
        for slot, members in written:
            self._ledger.publish(slot.id, version, members)
            self._acks.sent_to(members, version)
            for i in members:
                workers[i].sends += 1
        for _, members in written:
            for i in members:
                pump(workers[i])
        if not self._pool.reuse:
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
        A target that is gone (died, left) keeps no other target from the version: with
        ``sync``, the wait raises its :class:`WorkerDiedError` (or :class:`WorkerLeftError`)
        once every other target answered, its ``applied_by`` naming those that applied it.
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
        A target that is gone is sent the version too (a replacement gets it first): the
        call does not raise for it; :meth:`wait_async` does.
        """
        targets = self._targets(worker_ids)
        self._check_running()
        groups = self._group(weights, targets, partial)
        async with self._sending(timeout) as deadline:
            self._check_running()
            plan = self._split_partial(groups)
            written: list[tuple[Slot, list[int]]] = []
            try:
                for flat, members, base in plan:
                    slot = await self._slots.acquire(deadline)
                    written.append((slot, members))
                    await self._slots.write(slot, flat, base, self._reader.known(flat))
            except BaseException:
                self._slots.unreserve([slot for slot, _ in written if not slot.copying])
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
        timeout: float | None | UseDefault = DEFAULT,
        what: str | None = None,
    ) -> None:
        """Wait until the targeted workers applied *version* (default: all sent so far).

        Only workers that were sent *version* (or a newer one) are waited for. With
        *quorum*, return once that many of them have. Raises :class:`WorkerError` if a
        worker rejected the weights (at once), :class:`WorkerDiedError` if one died or left
        (unless ``on_worker_error="skip"``) once every other target answered (or at the
        timeout), with ``applied_by`` naming the targets that applied the version,
        :class:`SyncTimeoutError` after *timeout* seconds, :class:`ValueError` for a
        version not sent yet.
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
        if isinstance(worker_ids, bool):
            raise TypeError("worker_ids must be an int, a list of ints or None")
        return self._parse_targets(worker_ids, _is_index, "an int")

    def _group(self, weights: Any, targets: list[int], partial: bool) -> list[tuple[Mapping[str, torch.Tensor], list[int]]]:
        """Which validated weights go to which targets: one group per distinct source."""
        if weights is not None:
            return [(self._reader.weights(weights, partial, self.check_finite), targets)]
        if self._one_source is not None:
            return [(self._reader.source(self._reader.resolve(self._one_source), self.check_finite), targets)]
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


def _is_index(i: object) -> bool:
    return isinstance(i, int) and not isinstance(i, bool)
