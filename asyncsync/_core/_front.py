"""What both senders do the same way above their transports: lifecycle, connect, send,
waits and the first half of ``aclose``.

A sender subclasses :class:`SenderCore`, builds its per-worker records, and provides
``_open()`` (start its transport), ``_targets()`` (parse ``worker_ids``) and
``send_async()``; its public methods are one-line calls into the ``_``-methods here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from .._errors import ClosedError
from .._options import DEFAULT, Timeout, UseDefault, checked_timeout
from ._acks import AckTracker, WorkerRecord
from ._deadline import Deadline, locked_within
from ._layout import Layout
from ._offload import Offload
from ._signal import Signal
from ._source import SourceReader

__all__ = ["SenderCore", "Targets"]

logger = logging.getLogger("asyncsync")

W = TypeVar("W", bound=Hashable)
R = TypeVar("R", bound=WorkerRecord)
P = TypeVar("P")


class Targets(list):  # type: ignore[type-arg]
    """``worker_ids`` already parsed (known, distinct, in order): a send passes it on to
    its wait without parsing it again."""

    __slots__ = ()


class _SendTurn:
    """``async with`` form of :meth:`SenderCore._send_turn` (cheaper than a generator-based one)."""

    __slots__ = ("core", "deadline")

    def __init__(self, core: SenderCore[Any, Any], deadline: Deadline) -> None:
        self.core = core
        self.deadline = deadline

    async def __aenter__(self) -> Deadline:
        await self.core._send_turn(self.deadline)
        return self.deadline

    async def __aexit__(self, *exc: object) -> None:
        lock = self.core._send_lock
        assert lock is not None
        lock.release()


class SenderCore(Generic[W, R]):
    """The transport-independent half of a sender (see the module docstring)."""

    _layout: Layout

    def __init__(
        self,
        records: Mapping[W, R],
        *,
        source_layout: Layout,
        wire_layout: Layout,
        sync: bool,
        timeout: float | None,
        on_worker_error: str,
        check_finite: bool,
    ) -> None:
        self._source_layout = source_layout
        self._layout = wire_layout
        self.sync = sync
        self.timeout = timeout
        self.on_worker_error = on_worker_error
        self.check_finite = check_finite
        self._reader = SourceReader(source_layout, wire_layout)
        self._state = "new"  # new | running | closing | closed
        self._version = -1
        self._sends = 0
        self._changed = Signal()
        self._acks: AckTracker[W, R] = AckTracker(
            records, changed=self._changed, phase=lambda: self._state, never_connected=self._never_connected, hint=self._silence_hint
        )
        self._copier = Offload("asyncsync-copy")
        self._send_lock: asyncio.Lock | None = None

    def _never_connected(self, wids: Sequence[W]) -> dict[W, int | None]:
        """Of *wids*, those whose receiver never said hello, with the pid of the process
        watched for each (or None); a transport that knows overrides it."""
        return {}

    def _silence_hint(self, wids: Sequence[W]) -> str:
        """What a timeout naming *wids* should add about why they may be silent (a
        transport that knows overrides it)."""
        return ""

    @property
    def worker_ids(self) -> list[W]:
        return list(self._acks.records)

    @property
    def version(self) -> int:
        return self._version

    @property
    def layout(self) -> Layout:
        return self._layout

    def applied_versions(self) -> dict[W, int]:
        """Each worker's newest applied version (-1: none). A worker that is gone keeps
        the last version it applied; its state (``statistics()``) says it is gone."""
        return self._acks.applied_versions()

    def sent_version(self, worker_idx: W) -> int:
        """The newest version sent to *worker_idx* (-1: none)."""
        return self._record(worker_idx).sent

    async def wait_dead(self, worker_idx: W, timeout: float | None = None) -> None:
        """Wait until the sender has noticed that *worker_idx* is gone (dead, left or stopped)."""
        self._record(worker_idx)
        await self._acks.wait_gone([worker_idx], timeout, f"waiting for worker {worker_idx} to be declared dead")

    # ----------------------------------------------------------------- for subclasses

    async def _open(self) -> None:
        raise NotImplementedError

    def _targets(self, worker_ids: Any) -> list[W]:
        raise NotImplementedError

    def _parse_targets(self, worker_ids: Any, one: Callable[[Any], bool], kind: str) -> list[W]:
        """``None`` (every worker), one id (*one(worker_ids)*) or an iterable of ids, each
        *kind* (``"an int"``) and known; distinct, in order. :class:`Targets` (parsed
        before) are returned as they are."""
        if worker_ids is None:
            return Targets(self._acks.records)
        if worker_ids.__class__ is Targets:
            return worker_ids  # type: ignore[no-any-return]
        ids = [worker_ids] if one(worker_ids) else list(worker_ids)
        for wid in ids:
            if not one(wid):
                raise TypeError(f"worker id {wid!r} is not {kind}")
            self._record(wid)
        if not ids:
            raise ValueError("worker_ids is empty")
        return Targets(dict.fromkeys(ids))

    def _record(self, wid: W) -> R:
        try:
            return self._acks.records[wid]
        except KeyError:
            raise ValueError(f"unknown worker id {wid!r}; workers are {sorted(self._acks.records)}") from None  # type: ignore[type-var]

    def send_async(self, weights: Any = None, worker_ids: Any = None, *, partial: bool = False, timeout: Timeout = DEFAULT) -> Awaitable[int]:
        raise NotImplementedError

    def _limit(self, timeout: Timeout | Deadline) -> float | None:
        """Seconds for *timeout* (the sender's own where it is :data:`DEFAULT`; what is
        left of a :class:`Deadline`)."""
        if timeout is DEFAULT or timeout is ...:  # type: ignore[comparison-overlap]
            return self.timeout
        if timeout.__class__ is Deadline:
            return timeout.remaining()  # type: ignore[union-attr]
        return checked_timeout(timeout)  # type: ignore[arg-type]

    def _deadline(self, timeout: Timeout | Deadline) -> Deadline:
        """*timeout* as a :class:`Deadline` (one given is passed on, so a whole call keeps one)."""
        if timeout.__class__ is Deadline:
            return timeout  # type: ignore[return-value]
        return Deadline(self._limit(timeout))

    def _check_running(self) -> None:
        if self._state == "new":
            raise RuntimeError("call `await scheme.connect()` before sending")
        if self._state != "running":
            raise ClosedError("the sender is closed")

    async def _connect(self, timeout: Timeout, weights: Any) -> int:
        """Start, send the initial weights (once), wait for every worker's ack of version 0."""
        deadline = self._deadline(timeout)  # a bad timeout is refused before anything opens
        await self._open()
        t0 = time.monotonic()
        if self._version < 0:
            await self.send_async(weights, timeout=deadline)
        await self._wait(0, None, None, deadline.remaining(), "connect", reported_timeout=deadline.timeout)
        n = len(self._acks.records)
        logger.info("asyncsync: connected: %d/%d worker%s at version 0 in %.1f s", n, n, "" if n == 1 else "s", time.monotonic() - t0)
        return 0

    async def _send(self, weights: Any, worker_ids: Any, partial: bool, timeout: Timeout) -> int:
        """``send_async`` and, with ``sync``, the wait for its acks, within one deadline."""
        targets = self._targets(worker_ids)  # parsed once: the send and its wait pass it on
        deadline = self._deadline(timeout)
        version = await self.send_async(weights, targets, partial=partial, timeout=deadline)  # type: ignore[arg-type]
        if self.sync:
            await self._wait(version, targets, None, deadline, f"send of version {version}", reported_timeout=deadline.timeout)
        return version

    async def _send_turn(self, deadline: Deadline) -> None:
        """One send at a time: take the send lock before *deadline* (release it in a
        ``finally``); on the hot path (nobody else sending) no wait, no timer."""
        lock = self._send_lock
        assert lock is not None
        if lock.locked():
            await locked_within(lock, deadline, "waiting for another send's snapshot")
        else:
            await lock.acquire()

    def _sending(self, timeout: Timeout | Deadline) -> _SendTurn:
        """``async with self._sending(timeout) as deadline``: :meth:`_send_turn` within
        *timeout*, released at the end; *deadline* is what is left for the rest of the send."""
        return _SendTurn(self, self._deadline(timeout))

    async def _wait(
        self,
        version: int | None,
        worker_ids: Any,
        quorum: int | None,
        timeout: Timeout | Deadline,
        what: str | None,
        reported_timeout: float | None | UseDefault = DEFAULT,
    ) -> None:
        targets = self._targets(worker_ids)
        await self._acks.wait(
            targets,
            version,
            newest=self._version,
            quorum=quorum,
            skip_gone=self.on_worker_error == "skip",
            timeout=self._limit(timeout),
            what=what,
            reported_timeout=reported_timeout,
        )

    async def _stop_peers(self, timeout: float, stop: bool, peers: Callable[[], list[P]], send_stop: Callable[[P], None]) -> None:
        """The first half of ``aclose`` (call it shielded): every waiter wakes; with *stop*
        (and running), ``send_stop(peer)`` to each connected peer (*peers()*), and wait up
        to *timeout* until none is left; then the sender is closed."""
        was_running = self._state == "running" and stop
        self._state = "closing"
        self._acks.notify()
        if was_running:
            for peer in peers():
                try:
                    send_stop(peer)
                except Exception:  # best effort: its loss is noticed by its reader
                    pass
            await self._changed.wait_until(lambda: not peers(), timeout)
        self._state = "closed"
        self._acks.notify()
