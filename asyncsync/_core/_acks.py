"""Per-worker delivery state, acks per connection, waits, and the statistics rows.

Both senders keep one :class:`WorkerRecord` per worker id (an int locally, ``(host,
local index)`` across hosts) and report into an :class:`AckTracker`: what was sent, each
answer, a loss (died, left, host lost), a new connection. Waits only look at that state,
so a cancelled wait never loses an ack, and every rule about what satisfies a wait lives
here once:

- only a ``connected`` worker's answers count, and only those of its current connection;
- a worker that is gone (``dead``, ``left``) fails a wait (``on_worker_error="raise"``)
  or is skipped (``"skip"``, not with a quorum); one ``stopped`` by ``aclose`` fails it;
- a rejection of the wanted version fails it with :class:`WorkerError`, at once;
- a worker that is gone fails it only once no other target is still to answer (or at
  the timeout): the living targets apply the version whenever the other one left, and
  the error (a copy of the worker's death) says which of them did (``applied_by``);
- with a quorum, a failure only ends the wait once the quorum can no longer be met.

A departed connection's last applied version, error and timings stay visible (in
``applied_versions()`` and the statistics, with the worker's state) until a new
connection of that worker id starts; they never satisfy a wait.

A wait for versions (``send``, ``wait_async``) is woken by the reports themselves, and only
when its outcome may have changed: an ack that completes it, or any other change (a
rejection, a loss, a connection, the sender closing). Acks that leave it short are counted,
not woken for, so a send to *n* workers wakes its waiter once, not *n* times. The other
waits wake on the sender's :class:`~.._signal.Signal`, notified at every report.
"""

from __future__ import annotations

import asyncio
import collections
import copy
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from .._errors import ClosedError, SyncTimeoutError, WorkerError, WorkerGoneError, format_seconds
from .._stats import WorkerStatistics
from ._options import DEFAULT, Phase, UseDefault, WorkerState, checked_timeout
from ._signal import Signal

__all__ = ["AckTracker", "Lifecycle", "MembershipEvent", "MembershipLog", "WorkerRecord"]

W = TypeVar("W", bound=Hashable)
R = TypeVar("R", bound="WorkerRecord")

GONE = ("dead", "left")


def _departure(wanted: Sequence[tuple[Any, WorkerRecord, int]], wid: Any, silent_after: float | None = None, expired: bool = False) -> WorkerGoneError:
    """The death of target *wid* as a wait for *wanted* (``(worker id, record, version)``)
    reports it: a copy (the record keeps its own, and each wait names its own targets)
    whose ``applied_by`` lists the targets that applied their version; its message says
    so, names the other targets that are gone, and (*expired*) those that did not answer
    within *silent_after* seconds."""
    death = next(rec.death for w, rec, _v in wanted if w == wid)
    assert death is not None
    versions = {v for _w, _rec, v in wanted}
    version = f"version {versions.pop()}" if len(versions) == 1 else "the newest version sent to them"
    applied = tuple(w for w, rec, v in wanted if rec.state == "connected" and rec.applied >= v)
    others = [w for w, rec, _v in wanted if rec.state in GONE and w != wid]
    silent = [w for w, rec, v in wanted if rec.state not in GONE and not (rec.state == "connected" and rec.applied >= v)]
    details = []
    if applied or silent:  # (nothing to say when every target is gone)
        details.append(f"{_named(applied)} applied {version}" if applied else f"no other target applied {version}")
    if others:
        details.append(f"{_named(others)} {'is' if len(others) == 1 else 'are'} gone too")
    if expired and silent:
        details.append(f"{_named(silent)} did not answer within {format_seconds(silent_after)}")
    err = copy.copy(death)
    err.applied_by = applied
    err.args = ("; ".join([str(death), *details]),)
    if death.__cause__ is not None:
        err.__cause__ = death.__cause__
    return err


def _named(wids: Sequence[Any]) -> str:
    return ("worker " if len(wids) == 1 else "workers ") + ", ".join(map(str, wids))


class WorkerRecord:
    """What the sender knows of one worker id, across its connections.

    A transport subclasses it to hang its own per-worker state on it (its link, its
    buffers); only :class:`AckTracker` writes these fields.
    """

    def __init__(self, wid: Any) -> None:
        self.wid = wid
        self.state: WorkerState = "waiting"
        self.generation = 1  # the connection whose answers these are (numbered by the transport)
        self.sent = -1  # newest version sent to this worker id
        # The current (or last departed) connection's answers:
        self.applied = -1
        self.responded = -1
        self.rejected = -1  # newest version it rejected
        self.last_error: str | None = None
        self.stage_s = 0.0
        self.commit_s = 0.0
        self.death: WorkerGoneError | None = None
        self.death_generation = 0  # the generation that death ended
        self.exitcode: int | None = None
        self.pid: int | None = None

    def _new_connection(self) -> None:
        self.applied = self.responded = self.rejected = -1
        self.last_error = None
        self.stage_s = self.commit_s = 0.0
        self.death = None
        self.exitcode = None


class _Watch:
    """One version wait's wake-up: the reports count the acks that complete its workers
    (*versions*: worker id -> version wanted) and wake it once *missing* have come, or at
    any other change."""

    __slots__ = ("versions", "missing", "hits", "fut", "expired")

    def __init__(self, versions: dict[Any, int]) -> None:
        self.versions = versions
        self.missing = 1
        self.hits = 0
        self.fut: asyncio.Future[None] | None = None
        self.expired = False

    def wake(self) -> None:
        fut = self.fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def expire(self) -> None:
        self.expired = True
        self.wake()


class MembershipEvent(NamedTuple):
    """A change of a sender's members: ``kind`` is ``"joined"`` (connected, or connected
    again), ``"left"``, ``"dead"`` (died, or its host was lost) or ``"retired"``;
    ``worker_id`` names the worker; ``reason`` says why it is gone (None otherwise).

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1, elastic=True)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        await asyncio.gather(scheme.connect(), worker.connect())
        events = scheme.sender.membership()
        await worker.aclose()                  # the worker leaves
        event = await anext(events)
        print(event.kind, event.worker_id)     # left 0
        await scheme.aclose()
    """

    kind: Literal["joined", "left", "dead", "retired"]
    worker_id: Any
    reason: str | None


class MembershipLog:
    """The recent membership events, numbered, for readers that go at their own pace."""

    SIZE = 4096  # events kept; a reader further behind skips the older ones

    def __init__(self) -> None:
        self._events: collections.deque[MembershipEvent] = collections.deque(maxlen=self.SIZE)
        self.count = 0  # events ever added

    def add(self, event: MembershipEvent) -> None:
        self._events.append(event)
        self.count += 1

    def since(self, seen: int) -> list[MembershipEvent]:
        """The events after the first *seen* (those still kept)."""
        new = self.count - seen
        return list(self._events)[-new:] if new > 0 else []


class Lifecycle:
    """A sender's phase, shared by the parts that refuse work once it closes."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase: Phase = "new"


class AckTracker(Generic[W, R]):
    """The delivery state of a sender's workers; see the module docstring.

    *life* is the sender's lifecycle; *changed* is notified at every change here and
    wakes every wait. A timeout names the workers that did not answer; what the transport
    knows of why is added by the sender.
    """

    def __init__(self, records: Mapping[W, R], *, changed: Signal, life: Lifecycle) -> None:
        self.records: dict[W, R] = dict(records)
        self._changed = changed
        self._life = life
        self._watches: list[_Watch] = []  # the version waits in progress
        self.events = MembershipLog()

    def notify(self) -> None:
        """Something a wait looks at changed (a report here, or the sender's phase): every
        wait re-checks."""
        for watch in self._watches:
            watch.wake()
        self._changed.notify()

    def __getitem__(self, wid: W) -> R:
        return self.records[wid]

    # ----------------------------------------------------------------- reports

    def sent(self, wid: W, version: int) -> None:
        """*version* is now *wid*'s newest (it goes out when nothing else is in flight)."""
        self.records[wid].sent = version

    def sent_to(self, wids: Iterable[W], version: int) -> None:
        """:meth:`sent` for each of *wids* (one call per send)."""
        records = self.records
        for wid in wids:
            records[wid].sent = version

    def expect(self, wid: W, generation: int) -> None:
        """A new connection (*generation*) for *wid* is on its way: nothing answered before counts."""
        rec = self.records[wid]
        rec._new_connection()
        rec.state = "waiting"
        rec.generation = generation
        self.notify()

    def connected(self, wid: W, pid: int | None = None, generation: int | None = None) -> None:
        """*wid*'s connection (*generation*, if the transport numbers them) is up; a worker
        that was gone is on a new connection."""
        rec = self.records[wid]
        if rec.state == "connected" and (generation is None or generation == rec.generation) and pid in (None, rec.pid):
            self._changed.notify()  # nothing a version wait looks at changed (a transport's "still here")
            return
        if rec.state in ("waiting", "retired", *GONE):
            if rec.state != "waiting":
                rec._new_connection()
            rec.state = "connected"
            self.events.add(MembershipEvent("joined", wid, None))
        if generation is not None:
            rec.generation = generation
        if pid is not None:
            rec.pid = pid
        self.notify()

    def ack(self, wid: W, version: int, ok: bool, error: str | None, stage_s: float, commit_s: float) -> None:
        """*wid*'s current connection applied (*ok*) or rejected *version*."""
        rec = self.records[wid]
        if version > rec.responded:
            rec.responded = version
        if ok:
            before = rec.applied
            if version > before:
                rec.applied = version
            rec.last_error = None
            rec.stage_s, rec.commit_s = stage_s, commit_s
            if rec.state == "connected":
                for watch in self._watches:  # count, and wake only the waits this completes
                    v = watch.versions.get(wid)
                    if v is not None and before < v <= version:
                        watch.hits += 1
                        if watch.hits >= watch.missing:
                            watch.wake()
            self._changed.notify()
        else:
            if version > rec.rejected:
                rec.rejected = version
            rec.last_error = error
            self.notify()

    def lost(self, wid: W, state: str, death: WorkerGoneError, exitcode: int | None = None) -> None:
        """*wid*'s connection ended: ``"dead"`` or ``"left"``, with the error that says so.
        Its last answers stay visible; they no longer count."""
        rec = self.records[wid]
        rec.state = state  # type: ignore[assignment]
        rec.death = death
        rec.death_generation = rec.generation
        if exitcode is not None:
            rec.exitcode = exitcode
        self.events.add(MembershipEvent(state, wid, death.reason or str(death)))  # type: ignore[arg-type]
        self.notify()

    def add(self, wid: W, record: R) -> None:
        """A worker id the sender did not have joins the records (elastic membership)."""
        if wid in self.records:
            raise ValueError(f"worker {wid!r} is already one of the sender's workers")
        self.records[wid] = record
        self.notify()

    def retire(self, wid: W) -> None:
        """*wid* stops being a member (it may join again later, on a new connection)."""
        rec = self.records[wid]
        if rec.state == "connected":
            raise ValueError(f"worker {wid!r} is connected: it must leave (close its receiver, or stop its process) before it is retired")
        rec.state = "retired"
        self.events.add(MembershipEvent("retired", wid, None))
        self.notify()

    def stopped(self, wid: W) -> None:
        """The sender closed while *wid* was connected."""
        rec = self.records[wid]
        if rec.state == "connected":
            rec.state = "stopped"
        self.notify()

    # ----------------------------------------------------------------- queries

    def applied_versions(self) -> dict[W, int]:
        """Each worker's newest applied version (a departed one's last; -1: none)."""
        return {wid: rec.applied for wid, rec in self.records.items()}

    @staticmethod
    def missing(wanted: Sequence[tuple[W, R, int]], need: int, quorum: bool, skip_gone: bool) -> int:
        """How many more of *wanted* (``(worker id, record, version)``) must apply their
        version before *need* have (0: settled); raise if that cannot happen. With
        *skip_gone* (``on_worker_error="skip"``), a worker that is gone counts as done,
        except for a *quorum*. Without a quorum, a rejection ends the wait at once, a
        worker that is gone once no other target is still to answer."""
        done = open_ = 0
        refused: BaseException | None = None  # the first rejection or stop
        gone: W | None = None  # the first target that is gone (not skipped)
        gone_first = False  # which of the two came first, in target order
        for wid, rec, v in wanted:
            if rec.state == "connected" and rec.applied >= v:
                done += 1
            elif rec.state in GONE:
                if skip_gone and not quorum:
                    done += 1  # skipped: the living workers are what counts
                elif gone is None:
                    gone = wid
                    gone_first = refused is None
            elif rec.state == "connected" and rec.responded >= v:
                refused = refused or WorkerError(wid, rec.rejected, rec.last_error or "rejected")  # type: ignore[arg-type]
            elif rec.state == "stopped":
                refused = refused or ClosedError(f"worker {wid} stopped before applying version {v}")
            else:
                open_ += 1
        if done >= need:
            return 0
        if quorum:
            if (refused is not None or gone is not None) and done + open_ < need:
                raise _departure(wanted, gone) if gone_first else refused  # type: ignore[misc]
        elif refused is not None:
            raise refused
        elif gone is not None:
            if not open_:
                raise _departure(wanted, gone)
            return open_  # the answers that settle it: the gone ones never come
        return need - done

    async def wait(
        self,
        targets: Sequence[W],
        version: int | None,
        *,
        newest: int,
        quorum: int | None,
        skip_gone: bool,
        timeout: float | None,
        what: str | None = None,
        reported_timeout: float | None | UseDefault = DEFAULT,
    ) -> None:
        """Wait until *targets* applied *version* (None: each its newest); see ``wait_async``.

        A timeout error names *reported_timeout* (default: *timeout*): the whole call's
        bound, when this wait is its last part.

        *newest* is the sender's newest version; *skip_gone* as for :meth:`missing`. Only
        targets that were sent *version* (or a newer one) are waited for.
        """
        life = self._life
        if life.phase == "closed":
            raise ClosedError("the sender is closed")
        if version is not None and version > newest:
            raise ValueError(f"version {version} was not sent yet (the newest is {newest})")
        records = self.records
        wanted: list[tuple[W, R, int]] = []
        for wid in targets:
            rec = records[wid]
            v = rec.sent if version is None else version
            if v >= 0 and rec.sent >= v:
                wanted.append((wid, rec, v))
        need = len(wanted) if quorum is None else quorum
        if need > len(wanted):
            raise ValueError(f"quorum={quorum} but only {len(wanted)} targeted worker{' was' if len(wanted) == 1 else 's were'} sent version {version}")
        has_quorum = quorum is not None
        left = self.missing(wanted, need, has_quorum, skip_gone)
        if not left:
            return  # the common case of a wait_async after the acks: no future, no timer
        loop = asyncio.get_running_loop()
        watch = _Watch({wid: v for wid, _rec, v in wanted})
        timer = None
        if timeout is not None:
            if timeout <= 0:
                watch.expired = True
            else:
                timer = loop.call_later(timeout, watch.expire)
        self._watches.append(watch)
        try:
            while True:
                if life.phase == "closed":
                    raise ClosedError("the sender was closed while waiting")
                if watch.expired:
                    break
                watch.missing, watch.hits = left, 0
                watch.fut = loop.create_future()
                await watch.fut
                left = self.missing(wanted, need, has_quorum, skip_gone)
                if not left:
                    return
        finally:
            self._watches.remove(watch)
            if timer is not None:
                timer.cancel()
        reported = timeout if isinstance(reported_timeout, UseDefault) else reported_timeout
        if not has_quorum and not skip_gone:
            gone = next((wid for wid, rec, _v in wanted if rec.state in GONE), None)
            if gone is not None:  # what the user must act on: the departure, naming the silent ones
                raise _departure(wanted, gone, silent_after=reported, expired=True)
        pending = {wid: rec.applied for wid, rec, v in wanted if not self._counts(wid, v)}
        what = what or ("wait_async" if version is None else f"wait for version {version}")
        raise SyncTimeoutError(what, pending, reported)  # type: ignore[arg-type]

    def _counts(self, wid: W, version: int) -> bool:
        rec = self.records[wid]
        return rec.state == "connected" and rec.applied >= version

    async def wait_joined(self, wids: Sequence[W], timeout: float | None, what: str) -> None:
        """Wait until each of *wids* is connected and answered the newest version sent to it.

        A worker that is gone is waited for on its next connection; raises its death if
        that one goes too, and :class:`WorkerError` if it rejected that version.
        """
        timeout = checked_timeout(timeout)
        awaited = {wid: self._awaited_generation(self.records[wid]) for wid in wids}

        def joined() -> bool:
            if self._life.phase != "running":
                raise ClosedError("the sender is closed")
            for wid in wids:
                rec = self.records[wid]
                if rec.state in GONE and rec.death is not None and rec.death_generation >= awaited[wid]:
                    raise rec.death  # the connection we wait for is already gone
            return all(self.records[wid].state == "connected" and self.records[wid].responded >= self.records[wid].sent for wid in wids)

        if not await self._changed.wait_until(joined, timeout):
            pending = {wid: self.records[wid].applied for wid in wids}
            raise SyncTimeoutError(what, pending, timeout)  # type: ignore[arg-type]
        for wid in wids:
            rec = self.records[wid]
            if rec.applied < rec.sent:
                raise WorkerError(wid, rec.rejected, rec.last_error or "rejected")  # type: ignore[arg-type]

    @staticmethod
    def _awaited_generation(rec: WorkerRecord) -> int:
        # A worker that is gone is waited for on the connection after the one that ended.
        return max(rec.generation, rec.death_generation + 1) if rec.state in GONE else rec.generation

    async def wait_gone(self, wids: Sequence[W], timeout: float | None, what: str) -> None:
        """Wait until each of *wids* is known to be gone (dead, left or stopped)."""
        timeout = checked_timeout(timeout)
        gone = (*GONE, "stopped")
        if not await self._changed.wait_until(lambda: all(self.records[w].state in gone for w in wids) or self._life.phase != "running", timeout):
            raise SyncTimeoutError(what, {wid: self.records[wid].applied for wid in wids}, timeout)  # type: ignore[misc]

    def rows(self, newest: int, extra: Callable[[R], Mapping[str, Any]]) -> tuple[WorkerStatistics, ...]:
        """The statistics row of every worker; *extra(record)* gives the transport's fields
        (``generation``, ``in_flight_version``, ``pid``) where it knows better."""
        out = []
        for wid, rec in self.records.items():
            fields: dict[str, Any] = dict(
                worker_idx=wid,
                state=rec.state,
                pid=rec.pid,
                exitcode=rec.exitcode,
                sent_version=rec.sent,
                applied_version=rec.applied,
                lag=max(newest - rec.applied, 0) if rec.sent >= 0 else 0,
                last_error=rec.last_error,
                stage_ms=rec.stage_s * 1e3,
                commit_ms=rec.commit_s * 1e3,
                generation=rec.generation,
                in_flight_version=None,
                reason=rec.death.reason if rec.death is not None else None,
            )
            fields.update(extra(rec))
            out.append(WorkerStatistics(**fields))
        return tuple(out)
