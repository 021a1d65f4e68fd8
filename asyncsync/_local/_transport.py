"""The single-host transport: shared-memory slots, and a channel per worker process.

Every send copies the weights once into a free slot (the :class:`~._publisher.Publisher`)
and makes it the newest version of each targeted worker. A worker has at most one
version outstanding; when it answers, it is handed its newest version (latest wins), so a
slow worker holds at most its live slot and one in flight and never slows a send. Slot
ownership is kept by a :class:`~.._core._ownership.SlotLedger`; each worker's channel and
answers are the :class:`~._links.LinkTable`'s.

Beside what a :class:`~.._core._sender.Sender` needs, it offers what the parts above the
sender use: a relay lands network bytes straight into a slot (:meth:`reserve`) and hears
every answer (:meth:`observe`); a listener hands it the sockets of workers that attach by
address (:meth:`attach_refusal`, :meth:`adopt_link`); a pickled scheme carries the
workers' channel ends (:meth:`child_endpoints`).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from .._core._deadline import Deadline
from .._core._delivery import Delivery
from .._core._ownership import SlotLedger
from .._core._transport import Group, Silence
from .._errors import ClosedError, WeightsError
from .._io._slots import Slot, SlotPool
from .._stats import SenderStatistics
from .._wire._local import Setup, Stop, encode
from ._links import LinkTable, SenderObserver, _Worker
from ._publisher import Publisher, Reservation

__all__ = ["LocalTransport", "SenderObserver"]


class LocalTransport:
    """Slots and worker channels on this host (see the module docstring)."""

    def __init__(
        self,
        delivery: Delivery[int, _Worker],
        *,
        pool: SlotPool,
        manual: bool,
        ctx: mp.context.BaseContext,
    ) -> None:
        self._delivery = delivery
        self._life = delivery.life
        self._workers: dict[int, _Worker] = delivery.records
        self._pool = pool
        self._ledger = SlotLedger(manual=manual)
        self._pid = os.getpid()
        layout = delivery.layout
        # Encoded once (a layout that cannot travel fails here, at init): one frame per device.
        by_device = {dev: encode(Setup(layout, dev, self._pid)) for dev in {w.device for w in self._workers.values()}}
        self._setup_frames = {i: by_device[w.device] for i, w in self._workers.items()}
        self._links = LinkTable(
            self._workers,
            delivery=delivery,
            pool=pool,
            ledger=self._ledger,
            ctx=ctx,
            setup_frames=self._setup_frames,
        )
        self._slots = Publisher(pool, self._ledger, layout, records=self._workers, copier=delivery.copier, changed=delivery.changed, life=delivery.life)

    @staticmethod
    def records(worker_ids: Sequence[int], devices: Mapping[int, str | None]) -> dict[int, _Worker]:
        """The per-worker records a :class:`Delivery` of this transport is built with."""
        return {i: _Worker(i, devices.get(i)) for i in worker_ids}

    @property
    def worker_ids(self) -> list[int]:
        return list(self._workers)

    @property
    def closed(self) -> bool:
        """The sender is closing or closed."""
        return self._life.phase in ("closing", "closed")

    @property
    def ledger(self) -> SlotLedger:
        """Who holds which slot (for debugging and tests)."""
        return self._ledger

    # ----------------------------------------------------------------- the Transport protocol

    async def open(self) -> None:
        self._open()

    def start(self) -> None:
        """Start the delivery, open the slots and watch the workers, without sending
        anything yet (a relay's first landing needs the slots before any send)."""
        if self._delivery.start():
            self._open()

    def _open(self) -> None:
        self._pool.open(self._ledger)
        loop = asyncio.get_running_loop()
        for w in self._workers.values():
            assert w.link is not None
            self._ledger.connect(w.idx)
            self._links.start_tasks(w, w.link, loop)

    async def publish(self, groups: Sequence[Group[int]], version: int, deadline: Deadline) -> None:
        plan = self._split_partial(groups)
        written: list[tuple[Slot, list[int]]] = []
        try:
            for flat, members, base in plan:
                slot = await self._slots.acquire(deadline)
                written.append((slot, members))
                await self._slots.write(slot, flat, base, self._delivery.reader.known(flat))
        except BaseException:
            self._slots.unreserve([slot for slot, _ in written if not slot.copying])
            raise
        self._publish(written, version)

    def silence(self, wids: Sequence[int]) -> Silence:
        never: dict[int, int | None] = {}
        polled = []
        for i in wids:
            w = self._workers[i]
            if w.state == "waiting" and (w.link is None or w.link.pid is None):
                never[i] = getattr(w.process, "pid", None)  # (alive: its death would have been noticed)
            if w.link is not None and w.link.mailbox is not None:
                polled.append(i)
        hint = ""
        if polled:
            who = f"worker {polled[0]} is" if len(polled) == 1 else f"workers {', '.join(map(str, polled))} are"
            hint = f"{who} polled (poll=True): a polled worker applies a version only when its loop calls receiver.poll_nowait()"
        return Silence(never, hint)  # type: ignore[arg-type]

    def statistics(self) -> SenderStatistics:
        d = self._delivery
        return SenderStatistics(
            version=d.version,
            sends=d.sends,
            bytes_copied=self._slots.bytes,
            slots=len(self._pool.slots),
            slot_bytes=d.layout.nbytes,
            last_copy_ms=self._slots.last_copy_s * 1e3,
            workers=d.acks.rows(d.version, self._in_flight),
        )

    async def aclose(self, timeout: float, *, stop: bool = True) -> None:
        """Close: every waiter wakes with :class:`ClosedError`; with *stop*, every receiver
        gets ``Stop`` and is waited for (up to *timeout*); without, the channels just close
        and the receivers end with :class:`SenderDiedError` (a relay whose trainer died
        passes that on). Idempotent."""
        d = self._delivery
        if d.life.phase == "closed":
            return
        if d.closing() and stop:
            stop_frame = encode(Stop())
            for w in self._connected():
                try:
                    w.link.queue.put_bytes_nowait(stop_frame)  # type: ignore[union-attr]
                except Exception:  # best effort: its loss is noticed by its reader
                    pass
            await d.changed.wait_until(lambda: not self._connected(), timeout)
        d.closed()
        links = [w.link for w in self._workers.values() if w.link is not None]
        for link in links:
            link.queue.unlisten()  # nothing is dispatched once closed
        tasks = [t for link in links for t in link.tasks]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for link in links:
            link.tasks = []  # finished tasks keep tracebacks that point back at us
            await link.queue.aclose()
            link.close_mailbox()
            if link.child_conn is not None:
                link.child_conn.close()
                link.child_conn = None
        for w in self._workers.values():
            self._links.drop_sentinel(w)
        await d.copier.aclose()  # at most one copy still running
        self._pool.close()

    # ----------------------------------------------------------------- for the scheme

    def in_owner_process(self) -> bool:
        """False in a child that inherited this transport by fork."""
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
        w = self._delivery.record(worker_idx)
        sentinel = getattr(process, "sentinel", None)
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
        self._links.drop_sentinel(w)
        w.process = process
        # A private duplicate: one reader per descriptor, and others may wait on the original.
        w.sentinel = os.dup(sentinel)
        if self._life.phase == "running" and w.link is not None:
            w.link.tasks.append(asyncio.get_running_loop().create_task(self._links.watch_sentinel(w, w.link)))

    # ----------------------------------------------------------------- for a listener

    def attach_refusal(self, idx: int) -> str | None:
        """Why a process attaching by address cannot be worker *idx* now (None: it can)."""
        return self._links.attach_refusal(idx)

    def adopt_link(self, idx: int, conn: Connection) -> None:
        """Make *conn* (an authenticated socket) worker *idx*'s next link, replacing the unused
        one; with elastic membership, a new worker id joins this way."""
        if idx not in self._workers:
            self.add_worker(idx)
        self._links.adopt_link(idx, conn)

    # ----------------------------------------------------------------- membership

    def add_worker(self, idx: int, device: str | None = None) -> None:
        """Elastic membership: worker *idx* (a new id) joins; it gets the members' newest
        version when it connects, then every send to all (see :meth:`Sender.connect`)."""
        d = self._delivery
        if not d.elastic:
            raise ValueError(f"worker {idx} is not one of the trainer's workers {sorted(self._workers)}; pass elastic=True to init_on_sender to accept new ones")
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise ValueError(f"worker ids are non-negative ints, got {idx!r}")
        if d.closed_or_closing():
            raise ClosedError(f"worker {idx} cannot join: the sender is closed")
        w = _Worker(idx, device)
        if device not in {x.device for x in self._workers.values()}:
            self._setup_frames[idx] = encode(Setup(d.layout, device, self._pid))
        else:
            self._setup_frames[idx] = next(self._setup_frames[i] for i, x in self._workers.items() if x.device == device)
        d.acks.add(idx, w)
        self._links.new_link(w)
        if self._life.phase == "running":
            assert w.link is not None
            self._ledger.connect(idx)
            self._links.start_tasks(w, w.link, asyncio.get_running_loop())

    def retire(self, idx: int) -> None:
        """Worker *idx*, gone or never connected, stops being a member."""
        self._delivery.acks.retire(idx)
        self._ledger.forget(idx)
        self._links.release_unused()

    # ----------------------------------------------------------------- for a relay

    def observe(self, observer: SenderObserver | None) -> None:
        """Tell *observer* every worker's answers and losses from now on (None: stop).

        One observer at a time (a relay): registering a second one raises ``RuntimeError``.
        """
        current = self._links.observer
        if observer is not None and current is not None and observer is not current:
            raise RuntimeError("this sender already has an observer")
        self._links.observer = observer

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

            async with transport.reserve(version, [0, 1]) as landing:
                await receive_into(landing.buffer)
                landing.publish()
        """
        self._delivery.check_running()
        targets = self._delivery.targets(worker_ids)
        self._check_newer(version, targets)  # fail early, and again once the send lock is held
        return Reservation(
            self._slots,
            self._delivery.lock,
            version=version,
            targets=targets,
            base_version=base_version,
            timeout=timeout,
            check=functools.partial(self._check_landing, version, targets),
            publish=functools.partial(self._publish_landing, version, targets),
        )

    # ----------------------------------------------------------------- internals

    def _connected(self) -> list[_Worker]:
        return [w for w in self._workers.values() if w.state == "connected" and w.link is not None]

    def _check_landing(self, version: int, targets: list[int]) -> None:
        self._delivery.check_running()
        self._check_newer(version, targets)

    def _publish_landing(self, version: int, targets: list[int], slot: Slot, based: bool) -> None:
        if not based:  # (else the copy of the base was counted)
            self._slots.bytes += self._delivery.layout.nbytes
        self._publish([(slot, targets)], version)

    def _check_newer(self, version: int, targets: list[int]) -> None:
        # Per worker only: a relay may publish an older version to a worker that lacks it
        # (a transfer repeated after the group re-formed) after a newer one went to others.
        stale = {i: self._workers[i].sent for i in targets if self._workers[i].sent >= version}
        if stale:
            raise ValueError(f"version {version} is not newer than what workers {stale} were sent")

    def _publish(self, written: list[tuple[Slot, list[int]]], version: int) -> None:
        """Make each written slot its members' newest *version* and send it to those with nothing in flight."""
        workers, pump, d = self._workers, self._links.pump, self._delivery
        for slot, members in written:
            self._ledger.publish(slot.id, version, members)
            d.published(version, members)
            for i in members:
                workers[i].sends += 1
        if d.elastic and set(d.members()) <= {i for _, members in written for i in members}:
            self._ledger.hold_newest(version, written[0][0].id)  # (every slot of a version holds all of it)
        for _, members in written:
            for i in members:
                pump(workers[i])
        if not self._pool.reuse:
            self._links.release_unused()
        d.changed.notify()

    def _in_flight(self, w: _Worker) -> dict[str, Any]:
        held = self._ledger.links.get(w.idx)
        return {"in_flight_version": held.in_flight.version if held is not None and held.in_flight is not None else None}

    def _split_partial(self, groups: Sequence[Group[int]]) -> list[tuple[Mapping[str, torch.Tensor], list[int], int | None]]:
        """A partial update is completed from the slot holding each target's newest version."""
        out: list[tuple[Mapping[str, torch.Tensor], list[int], int | None]] = []
        for flat, members in groups:
            if self._delivery.reader.is_whole(flat):  # type: ignore[arg-type]
                out.append((flat, members, None))
                continue
            by_base: dict[int | None, list[int]] = {}
            for i in members:
                latest = self._ledger.latest.get(i)
                by_base.setdefault(latest.slot if latest is not None else None, []).append(i)
            newest = self._ledger.newest
            if not members and newest is not None:  # no member yet (elastic): for those that join
                by_base[newest.slot] = []
            if None in by_base or not by_base:
                raise WeightsError(f"a partial update needs full weights first; worker(s) {by_base.get(None, [])} have none")
            for base, ids in by_base.items():
                out.append((flat, ids, base))
        return out

