"""The local sender's link table: one channel (generation) per worker at a time, what
each worker says on it, and its loss.

The loop's reader callback of each connection turns the worker's answers (``Hello``,
``Ack``, ``Staged``, ``Bye``) into state as they arrive (no task per message): the
ownership ledger, the :class:`~.._core._acks.AckTracker`, and the sender's observer. A
worker has at most one ``Receive`` outstanding; when it answers, it is handed its newest
version (latest wins). A channel that ends (EOF, the process's sentinel, a malformed
message) makes the worker dead or left, frees what it held, and opens the next channel
for a replacement.

A polled worker (one that sent ``Poll``) gets a mailbox in shared memory instead: its
versions are written there, and it writes its acks of applied versions there too, then
the sender's one wake (an eventfd) for all polled workers: :class:`_PolledAcks` reads the
wake once and takes every polled worker's new ack in one pass (see ``_mailbox``). A send to
a polled worker whose version in the mailbox is unanswered takes its ack words itself,
then writes the newest version over that one (:meth:`LinkTable._replace`): latest wins
without the loop reading acks in between.

:class:`LinkTable` does this for the :class:`~._transport.LocalTransport` that owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

import anyio

from .._core._acks import WorkerRecord
from .._core._delivery import Delivery
from .._core._ownership import Ref, SlotLedger
from .._errors import (
    BrokenChannelError,
    ClosedError,
    ProtocolError,
    WorkerDiedError,
    WorkerGoneError,
    WorkerLeftError,
    WouldBlock,
)
from .._io._framing import HEADER
from .._io._queues import AsyncQueue
from .._io._slots import Slot, SlotPool
from .._wire._local import (
    Ack,
    Bye,
    FromWorker,
    Hello,
    Mailbox,
    MapSlots,
    Poll,
    Receive,
    Staged,
    assert_never,
    decode_from_worker,
    encode,
)
from ._mailbox import MAILBOX_BYTES, Wake
from ._mailbox import Mailbox as _Mailbox

__all__ = ["LinkTable", "SenderObserver"]

logger = logging.getLogger("asyncsync")


class _SecondHello(ProtocolError):
    """A second ``Hello`` on one worker's channel: two processes took the same channel end."""


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
        self.polled: _PolledAcks | None = None  # the wake that scans its mailbox's acks
        # A polled worker's connect() waits for its first version without polling: that one
        # always goes as a Receive, and only versions after its first answer use the mailbox.
        self.answered = False
        self.entry = (0, 0)  # the version in the mailbox: (its sequence, the base it was written with)
        self.maybe_seq = 0  # the sequence of the ledger's ``maybe`` version of this link

    def close_mailbox(self) -> None:
        if self.mailbox is not None:
            if self.polled is not None:
                self.polled.remove(self)
                self.polled = None
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


class _PolledAcks:
    """The sender's wake for its polled workers and the links it scans: one read of the
    eventfd, then every polled link's ack words (opened with the first polled link,
    closed with the last)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_ack: _OnAck, on_broken: Callable[[_Worker, _Link, Exception], None]) -> None:
        self.wake = Wake()
        self._loop = loop
        self._on_ack = on_ack  # the table's, as for an Ack message
        self._on_broken = on_broken  # handling an ack failed: as for a message, the channel is cut
        self.links: dict[_Link, _Worker] = {}
        assert self.wake.fd is not None
        loop.add_reader(self.wake.fd, self.scan)

    @property
    def closed(self) -> bool:
        return self.wake.fd is None

    def add(self, w: _Worker, link: _Link) -> None:
        self.links[link] = w
        link.polled = self

    def remove(self, link: _Link) -> None:
        self.links.pop(link, None)
        if not self.links and self.wake.fd is not None:
            self._loop.remove_reader(self.wake.fd)
            self.wake.close()

    def scan(self) -> None:
        """The wake rang: take every polled link's new ack (a link of a worker that is
        being lost is taken by its drain)."""
        self.wake.clear()
        for link, w in list(self.links.items()):
            if link is w.link and not link.lost:
                try:
                    take_ack(w, link, self._on_ack)
                except Exception as exc:  # (a bug): the other links are still scanned
                    link.close_mailbox()
                    self._on_broken(w, link, exc)


_OnAck = Callable[[_Worker, _Link, Ack], None]


def take_ack(w: _Worker, link: _Link, on_ack: _OnAck) -> None:
    """Hand *link*'s new ack in its mailbox, if any, to *on_ack* as an ``Ack`` message."""
    mailbox = link.mailbox
    got = mailbox.take_ack() if mailbox is not None else None
    if got is not None:
        version, holds, stage_s, commit_s = got
        on_ack(w, link, Ack(w.idx, version, True, None, holds, stage_s, commit_s))


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

    def worker_lost(self, worker_idx: int, death: WorkerGoneError) -> None:
        """Worker *worker_idx* died or left (a :class:`WorkerLeftError`)."""

class LinkTable:
    """Each worker's current channel and what it says on it (see the module docstring).

    It reports into the sender's :class:`~.._core._delivery.Delivery` (acks, states, the
    change signal) and the slot ledger, and tells its :attr:`observer`, if any.
    """

    def __init__(
        self,
        workers: dict[int, _Worker],
        *,
        delivery: Delivery[int, _Worker],
        pool: SlotPool,
        ledger: SlotLedger,
        ctx: mp.context.BaseContext,
        setup_frames: dict[int, bytes],
    ) -> None:
        self._workers = workers
        self._life = delivery.life
        self._elastic = delivery.elastic
        self._acks = delivery.acks
        self._changed = delivery.changed
        self._pool = pool
        self._ledger = ledger
        self._ctx = ctx
        self._setup_frames = setup_frames
        self.observer: SenderObserver | None = None
        self._polled: _PolledAcks | None = None  # made with the first polled link
        for w in workers.values():
            self.new_link(w)

    def new_link(self, w: _Worker) -> _Link:
        ours, theirs = self._ctx.Pipe(duplex=True)
        w.links += 1
        w.link = _Link(w.links, ours, theirs)
        return w.link

    def attach_refusal(self, idx: int) -> str | None:
        """Why a process attaching by address cannot be worker *idx* now (None: it can)."""
        if idx not in self._workers:
            if self._elastic:
                return None  # a new member
            return f"worker {idx} is not one of the trainer's workers {sorted(self._workers)}"
        if self._life.phase in ("closing", "closed"):
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
            old.close_mailbox()
            old.queue.unlisten()
            for t in old.tasks:
                t.cancel()
            old.queue.close()
            if old.child_conn is not None:
                old.child_conn.close()
        w.links += 1
        w.link = _Link(w.links, conn, None)
        if self._life.phase == "running":
            self.start_tasks(w, w.link, asyncio.get_running_loop())

    @staticmethod
    def drop_sentinel(w: _Worker) -> None:
        if w.sentinel is not None:
            _close_sentinel(w.sentinel)
            w.sentinel = None

    def release_unused(self) -> None:
        self._pool.release_unused()

    def pump(self, w: _Worker) -> None:
        """Send the worker its newest version if nothing is in flight (latest wins)."""
        link = w.link
        if w.state != "connected" or link is None or link.delivered_sends == w.sends:
            return  # (the last: nothing was published to it since its last delivery)
        ref = self._ledger.next_delivery(w.idx)
        if ref is not None:
            base = link.delivered_sends  # (< w.sends: checked above)
            link.delivered_sends = w.sends
            self._deliver(w, link, ref, base)
        elif link.mailbox is not None and link.answered:
            self._replace(w, link, link.mailbox)

    def _replace(self, w: _Worker, link: _Link, mailbox: _Mailbox) -> None:
        """Latest wins in a polled worker's mailbox: write its newest version over the one
        it has not answered, then read its claim and take its ack words (see ``_mailbox``): the
        replaced slot stays held (``maybe``) only if the worker may be taking it."""
        held = self._ledger.links.get(w.idx)
        if held is None or held.in_flight is None:
            return  # (nothing in flight: nothing newer to send either)
        replaced, base = link.entry  # (the base too: the worker answered nothing since)
        link.delivered_sends = w.sends
        self._deliver(w, link, self._ledger.latest[w.idx], base)
        claim = mailbox.claimed()
        if self._ledger.replace(w.idx, claim == replaced, claim == link.maybe_seq):
            link.maybe_seq = replaced
        # Then its answer written before that claim, if any: what it holds now (a slot let
        # go just above, if it runs from it, is held again as its live one).
        take_ack(w, link, self._on_ack)

    def _deliver(self, w: _Worker, link: _Link, ref: Ref, base: int) -> None:
        """Send *ref* to *link*; *base*: the count of versions sent to *w* up to the newest
        one the worker answered (the versions in between are skipped)."""
        assert ref.slot is not None
        slot = self._pool.slots[ref.slot]
        try:
            if slot.transient or slot.id not in link.mapped:
                self._map_slots(link, [slot])
            if link.mailbox is not None and link.answered:
                # A polled worker reads it between its steps: no message, no wake-up there.
                # (The slot's bytes are complete: the send's copy finished before publishing.)
                link.entry = (link.mailbox.publish(ref.version, slot.id, w.sends, base), base)
            else:
                link.queue.put_frame_nowait(_receive_frame(ref.version, slot.id, w.sends - base - 1))
        except (BrokenChannelError, ClosedError, WouldBlock):
            pass  # the channel's end is noticed by its reader callback, which reports it

    def _map_slots(self, link: _Link, slots: list[Slot]) -> None:
        """Have the worker map *slots* (their descriptors follow the message)."""
        for slot in slots:
            link.queue.put_bytes_nowait(encode(MapSlots((slot.id,), (slot.nbytes,), slot.transient)))
            link.queue.send_fds([slot.fd])
            if not slot.transient:
                link.mapped.add(slot.id)

    def _on_poll(self, w: _Worker, link: _Link) -> None:
        """The worker polls: give it a mailbox and the group's wake, and the reusable slots
        mapped up front (so its polls rarely wait for its loop to map one)."""
        if link.mailbox is not None:
            raise ProtocolError("Poll: sent twice on one connection")
        try:
            self._map_slots(link, [s for s in self._pool.slots.values() if not s.transient and s.id not in link.mapped])
            polled = self._polled
            if polled is None or polled.closed:
                polled = self._polled = _PolledAcks(asyncio.get_running_loop(), self._on_ack, self._on_channel_end)
            mailbox = _Mailbox.create()
            link.mailbox = mailbox
            self._ledger.poll(w.idx)
            polled.add(w, link)
            try:
                link.queue.put_bytes_nowait(encode(Mailbox(MAILBOX_BYTES)))
                link.queue.send_fds([mailbox.fd, polled.wake.fd])  # type: ignore[list-item]
            except BaseException:
                link.close_mailbox()
                raise
            mailbox.segment.close_fd()  # the worker holds its own copy now
        except (BrokenChannelError, ClosedError, WouldBlock):
            pass  # the channel's end is noticed by its reader callback, which reports it

    def start_tasks(self, w: _Worker, link: _Link, loop: asyncio.AbstractEventLoop) -> None:
        # Answers are handled in the loop's reader callback: no task wakes up per message.
        link.queue.listen(functools.partial(self._on_frame, w, link), functools.partial(self._on_channel_end, w, link))
        if w.sentinel is not None:
            link.tasks.append(loop.create_task(self.watch_sentinel(w, link)))

    def _on_frame(self, w: _Worker, link: _Link, data: bytes) -> bool:
        if link is not w.link:
            return False
        msg = decode_from_worker(data)
        if msg.__class__ is Ack:  # the one answer of every send: straight to its handler
            self._on_ack(w, link, msg)
        else:
            self._dispatch(w, link, msg)
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

    def _dispatch(self, w: _Worker, link: _Link, msg: FromWorker) -> None:
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
            self._on_poll(w, link)
        else:
            assert_never(msg)

    def _drain(self, w: _Worker, link: _Link) -> None:
        """Read what the worker said before it went (its last acks, its ``Bye``)."""
        take_ack(w, link, self._on_ack)  # written before anything it said after it
        try:
            while True:
                self._dispatch(w, link, decode_from_worker(link.queue.get_bytes_nowait()))
        except (WouldBlock, BrokenChannelError, ClosedError):
            pass  # a malformed last word (ProtocolError) is ignored: the worker is gone anyway

    async def watch_sentinel(self, w: _Worker, link: _Link) -> None:
        sentinel = w.sentinel
        if sentinel is None:
            return
        try:
            await anyio.wait_readable(sentinel)
        except (OSError, anyio.ClosedResourceError):
            return
        await self._on_lost(w, link)

    def _on_hello(self, w: _Worker, link: _Link, msg: Hello) -> None:
        if link.pid is not None:
            # One channel per worker index: a second hello on it is a second process that
            # took the same channel end (a worker function that ignores the worker_idx it was
            # given). The channel is cut: which of the two reads what is anyone's guess.
            second = f"a second process (pid {msg.pid})" if msg.pid != link.pid else "the same process again"
            raise _SecondHello(
                f"{second} connected as worker {w.idx} on the channel of worker {w.idx} (pid {link.pid}); only one "
                f"process can be worker {w.idx}: call init_on_receiver(worker_idx=...) with the index each worker process "
                f"was started with (spawn_workers passes it as the function's first argument)"
            )
        link.pid = msg.pid
        self._acks.connected(w.idx, msg.pid, link.generation)
        if link.child_conn is not None:
            link.child_conn.close()  # the worker holds its own copy now: EOF will mean it is gone
            link.child_conn = None
        try:
            link.queue.put_bytes_nowait(self._setup_frames[w.idx])
        except (BrokenChannelError, ClosedError):
            return
        self.catch_up(w)
        self.pump(w)
        self._changed.notify()

    def catch_up(self, w: _Worker) -> None:
        """A member that joins (or comes back) gets the members' newest version first."""
        ref = self._ledger.catch_up(w.idx)
        if ref is not None:
            w.sends += 1
            self._acks.sent(w.idx, ref.version)

    def _on_ack(self, w: _Worker, link: _Link, ack: Ack) -> None:
        link.answered = True
        self._ledger.on_ack(w.idx, ack.version, ack.ok, ack.holds)
        if self.observer is not None:
            try:
                self.observer.worker_answered(w.idx, ack)
            except Exception:  # the observer's failure is not the worker's: it stays connected
                logger.exception("worker %d: the sender's observer failed on its answer", w.idx)
        self._acks.ack(w.idx, ack.version, ack.ok, ack.error, ack.stage_s, ack.commit_s)  # (it notifies)
        if link.delivered_sends != w.sends:  # a newer version waits for this answer (what _pump checks first)
            self.pump(w)
        if not self._pool.reuse:
            self.release_unused()  # (no notify: the ack above woke the waiters)

    def _after_answer(self, w: _Worker) -> None:
        self.pump(w)
        self.release_unused()
        self._changed.notify()

    async def _on_lost(self, w: _Worker, link: _Link, broken: ProtocolError | None = None) -> None:
        """The channel ended: the worker died or left, or (*broken*) sent a malformed message."""
        if link is not w.link or link.lost:
            return  # an older channel, or already handled
        drop = False  # its process sentinel: closed once nothing waits on it
        link.lost = True
        link.queue.unlisten()
        if broken is None:
            self._drain(w, link)
        if self._life.phase in ("closing", "closed") and w.state == "connected":
            self._acks.stopped(w.idx)
        elif broken is not None:
            reason = str(broken) if isinstance(broken, _SecondHello) else f"it sent a malformed message ({type(broken).__name__}: {broken})"
            death = WorkerDiedError(w.idx, None, link.pid, reason=f"{reason}; its channel was closed")
            death.__cause__ = broken
            self._acks.lost(w.idx, "dead", death)
            w.process = None  # its process may run on: it is no longer this worker
            drop = True
        elif link.bye is not None:
            self._acks.lost(w.idx, "left", WorkerLeftError(w.idx, link.bye.reason, link.bye.version, link.pid))
            w.process = None  # its process may run on: it is no longer this worker
            drop = True
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
            drop = True
        if self.observer is not None and w.death is not None and w.state in ("dead", "left"):
            try:
                self.observer.worker_lost(w.idx, w.death)
            except Exception:
                logger.exception("worker %d: the sender's observer failed on its loss", w.idx)
        if broken is not None:
            # Its process may still view the slots it held: they are never written again.
            self._ledger.retire(w.idx)
        else:
            # The worker holds no slot any more: it died, or detached its weights before leaving.
            self._ledger.disconnect(w.idx)
        if self._elastic:
            self._ledger.forget(w.idx)  # no longer a member: it catches up if it comes back
        current = asyncio.current_task()
        others = [t for t in link.tasks if t is not current]
        for t in others:
            t.cancel()
        sentinel = w.sentinel if drop else None
        if drop:
            w.sentinel = None  # (not this process's any more: the next link does not watch it)
        link.queue.close()
        link.close_mailbox()
        if self._life.phase == "running":
            # A replacement for this index can attach through a new channel.
            new = self.new_link(w)
            self._ledger.connect(w.idx)
            self.start_tasks(w, new, asyncio.get_running_loop())
        self.release_unused()
        self._changed.notify()
        if sentinel is not None:
            if others:  # a watcher of the sentinel lets go of it before its descriptor closes
                await asyncio.gather(*others, return_exceptions=True)
            _close_sentinel(sentinel)


def _close_sentinel(fd: int) -> None:
    # A watcher may still wait on it: unregister it first, or the loop keeps the number, and
    # the next descriptor that gets it cannot be waited on.
    with contextlib.suppress(RuntimeError):
        asyncio.get_running_loop().remove_reader(fd)
    os.close(fd)


@functools.lru_cache(maxsize=16)
def _receive_frame(version: int, slot: int, skipped: int) -> bytes:
    """The ``Receive`` frame with its length header: made once per send, written as it is
    to every worker it goes to (``put_frame_nowait``)."""
    payload = encode(Receive(version, slot, skipped))
    return HEADER.pack(len(payload)) + payload
