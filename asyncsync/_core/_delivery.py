"""The delivery core: what every sender keeps the same way, whatever moves its bytes.

A :class:`Delivery` holds a sender's lifecycle, its version counter, its send lock, the
sources it reads, and the :class:`~._acks.AckTracker` of its workers. It is passive: the
:class:`~._sender.Sender` calls it, its transport reports into it, and it calls neither.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from .._errors import ClosedError
from ._acks import AckTracker, Lifecycle, WorkerRecord
from ._deadline import Deadline, locked_within
from ._layout import Layout
from ._offload import Offload
from ._options import DEFAULT, SchemeOptions, Timeout, checked_timeout
from ._signal import Signal
from ._source import SourceReader
from ._transport import Group

__all__ = ["Delivery", "WorkerIds"]

W = TypeVar("W", bound=Hashable)
R = TypeVar("R", bound=WorkerRecord)


class WorkerIds:
    """What a worker id looks like: *kind* names it in errors (``"an int"``), *is_id* tells one."""

    def __init__(self, kind: str, is_id: Callable[[object], bool]) -> None:
        self.kind = kind
        self.is_id = is_id


class Targets(list):  # type: ignore[type-arg]
    """``worker_ids`` already parsed (known, distinct, in order): a send passes it on to its
    wait without parsing it again."""

    __slots__ = ()


class _SendTurn:
    """``async with delivery.sending(timeout) as deadline``: one send at a time."""

    __slots__ = ("lock", "deadline")

    def __init__(self, lock: asyncio.Lock, deadline: Deadline) -> None:
        self.lock = lock
        self.deadline = deadline

    async def __aenter__(self) -> Deadline:
        if self.lock.locked():
            await locked_within(self.lock, self.deadline, "waiting for another send's snapshot")
        else:  # the hot path (nobody else sending): no wait, no timer
            await self.lock.acquire()
        return self.deadline

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()


class Delivery(Generic[W, R]):
    """Versions, lifecycle, send lock, sources and acks of one sender (see the module docstring).

    *records* has one :class:`WorkerRecord` per worker id; *sources* says what
    ``send(weights=None)`` reads for each (one object for all, usually); *source*, the one
    for every worker, those that join later too (*elastic*).
    """

    def __init__(
        self,
        records: Mapping[W, R],
        *,
        ids: WorkerIds,
        options: SchemeOptions,
        source_layout: Layout,
        wire_layout: Layout,
        sources: Mapping[W, Any],
        elastic: bool = False,
        source: Any = None,
    ) -> None:
        self.ids = ids
        self.elastic = elastic
        self.sync = options.sync
        self.timeout = options.timeout
        # With elastic membership a member may go at any time: one gone during a send drops
        # out of its wait, as with on_worker_error="skip" (the membership events say so).
        self.skip_gone = options.on_worker_error == "skip" or elastic
        self.check_finite = options.check_finite
        self.source_layout = source_layout
        self.layout = wire_layout
        self.life = Lifecycle()
        self.changed = Signal()
        self.acks: AckTracker[W, R] = AckTracker(records, changed=self.changed, life=self.life)
        self.copier = Offload("asyncsync-copy")
        self.reader = SourceReader(source_layout, wire_layout)
        self.version = -1
        self.sends = 0
        self._lock = asyncio.Lock()
        self._sources = dict(sources)
        first = next(iter(self._sources.values()), None)
        # The usual case, one source for every worker: a send resolves and checks it once.
        self._one_source = source if source is not None else first if all(s is first for s in self._sources.values()) else None

    @property
    def records(self) -> dict[W, R]:
        return self.acks.records

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> bool:
        """Make the delivery running; False if it already was (ClosedError once closed)."""
        if self.life.phase == "running":
            return False
        if self.life.phase != "new":
            raise ClosedError("the sender is closed")
        self.life.phase = "running"
        return True

    def check_running(self) -> None:
        if self.life.phase == "new":
            raise RuntimeError("call `await scheme.connect()` before sending")
        if self.life.phase != "running":
            raise ClosedError("the sender is closed")

    def closed_or_closing(self) -> bool:
        return self.life.phase in ("closing", "closed")

    def closing(self) -> bool:
        """Enter ``closing`` (every waiter wakes); False if it was not running."""
        was_running = self.life.phase == "running"
        if self.life.phase != "closed":
            self.life.phase = "closing"
        self.acks.notify()
        return was_running

    def closed(self) -> None:
        self.life.phase = "closed"
        self.acks.notify()

    # ----------------------------------------------------------------- sends

    def members(self) -> list[W]:
        """The workers a send to all targets: every worker; with elastic membership, those
        not gone (dead, left) nor retired."""
        if not self.elastic:
            return list(self.acks.records)
        return [wid for wid, rec in self.acks.records.items() if rec.state not in ("dead", "left", "retired")]

    def targets(self, worker_ids: Any) -> list[W]:
        """``None`` (the members), one id or an iterable of ids, each known; distinct, in
        order. :class:`Targets` (parsed before) are returned as they are."""
        if worker_ids is None:
            return Targets(self.members())
        if worker_ids.__class__ is Targets:
            return worker_ids  # type: ignore[no-any-return]
        is_id = self.ids.is_id
        if isinstance(worker_ids, bool):
            raise TypeError(f"worker_ids must be {self.ids.kind}, a list of them, or None")
        ids = [worker_ids] if is_id(worker_ids) else list(worker_ids)
        for wid in ids:
            if not is_id(wid):
                raise TypeError(f"worker id {wid!r} is not {self.ids.kind}")
            if self.record(wid).state == "retired":
                raise ValueError(f"worker {wid!r} was retired: it is a target again once it joins again")
        if not ids:
            raise ValueError("worker_ids is empty")
        return Targets(dict.fromkeys(ids))

    def record(self, wid: W) -> R:
        try:
            return self.acks.records[wid]
        except KeyError:
            raise ValueError(f"unknown worker id {wid!r}; workers are {sorted(self.acks.records)}") from None  # type: ignore[type-var]

    def limit(self, timeout: Timeout | Deadline) -> float | None:
        """Seconds for *timeout* (the scheme's where it is :data:`DEFAULT`; what is left of a :class:`Deadline`)."""
        if timeout is DEFAULT:
            return self.timeout
        if timeout.__class__ is Deadline:
            return timeout.remaining()  # type: ignore[union-attr]
        return checked_timeout(timeout)  # type: ignore[arg-type]

    def deadline(self, timeout: Timeout | Deadline) -> Deadline:
        """*timeout* as a :class:`Deadline` (one given is passed on: a whole call keeps one)."""
        if timeout.__class__ is Deadline:
            return timeout  # type: ignore[return-value]
        return Deadline(self.limit(timeout))

    def sending(self, timeout: Timeout | Deadline) -> _SendTurn:
        """``async with delivery.sending(timeout) as deadline``: the send lock, taken
        within *timeout*; *deadline* is what is left for the rest of the send."""
        return _SendTurn(self._lock, self.deadline(timeout))

    @property
    def lock(self) -> asyncio.Lock:
        """The send lock (a relay's landing takes it too)."""
        return self._lock

    def read(self, weights: Any, targets: Sequence[W], partial: bool) -> list[Group[W]]:
        """Which validated weights go to which targets: one group per distinct source."""
        reader, check = self.reader, self.check_finite
        if weights is not None:
            return [(reader.weights(weights, partial, check), list(targets))]
        if self._one_source is not None:
            return [(reader.source(reader.resolve(self._one_source), check), list(targets))]
        groups: dict[int, Group[W]] = {}
        for wid in targets:  # workers sharing one source share one write
            source = reader.resolve(self._sources[wid])
            if id(source) not in groups:
                groups[id(source)] = (reader.source(source, check), [])
            groups[id(source)][1].append(wid)
        return list(groups.values())

    def published(self, version: int, targets: Iterable[W]) -> None:
        """*version* is now the newest of *targets* (a send, or a relay's landing)."""
        if version > self.version:
            self.version = version
            self.sends += 1
        self.acks.sent_to(targets, version)

    # ----------------------------------------------------------------- waits

    async def wait(self, version: int | None, targets: Sequence[W], quorum: int | None, timeout: Timeout | Deadline, what: str | None) -> None:
        """Wait until *targets* applied *version* (None: each its newest); see ``wait_async``.
        A :class:`Deadline` is reported as the whole call's bound."""
        reported = timeout.timeout if timeout.__class__ is Deadline else DEFAULT  # type: ignore[union-attr]
        await self.acks.wait(
            targets,
            version,
            newest=self.version,
            quorum=quorum,
            skip_gone=self.skip_gone,
            timeout=self.limit(timeout),
            what=what,
            reported_timeout=reported,
        )
