"""The trainer's side of a scheme: ``send`` / ``send_async`` / ``wait_async``, over any transport.

One :class:`Sender` serves both schemes. It holds a :class:`~._delivery.Delivery` (versions,
lifecycle, acks) and a :class:`~._transport.Transport` (which moves the bytes), and calls
both; neither calls it back.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import AsyncIterator, Hashable, Iterable
from typing import Any, Generic, TypeVar

import anyio

from .._errors import SyncTimeoutError
from ._acks import MembershipEvent
from ._deadline import Deadline
from ._delivery import Delivery
from ._layout import Layout
from ._options import DEFAULT, Timeout
from ._transport import Transport

__all__ = ["Sender"]

logger = logging.getLogger("asyncsync")

W = TypeVar("W", bound=Hashable)
S = TypeVar("S")


class Sender(Generic[W, S]):
    """Pushes weights to a set of workers; made by a scheme's ``init_on_sender`` (``scheme.sender``).

    Worker ids are ints on one host and ``(host, local index)`` pairs across hosts.

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

    def __init__(self, delivery: Delivery[W, Any], transport: Transport[W, S]) -> None:
        self._delivery = delivery
        self._transport = transport

    @property
    def version(self) -> int:
        """The newest version sent (-1: none yet)."""
        return self._delivery.version

    @property
    def worker_ids(self) -> list[W]:
        return list(self._delivery.records)

    @property
    def layout(self) -> Layout:
        """The weights' layout on the wire."""
        return self._delivery.layout

    @property
    def members(self) -> list[W]:
        """The workers a send to all targets now: every worker, or with elastic membership
        those that joined and are not gone (dead, left) nor retired."""
        return self._delivery.members()

    def membership(self) -> AsyncIterator[MembershipEvent]:
        """The membership changes from this call on, as they happen: ``async for event in
        sender.membership()`` yields a :class:`MembershipEvent` (``"joined"``, ``"left"``,
        ``"dead"``, ``"retired"``) per change, and ends when the sender closes.

        Example::

            async for event in scheme.sender.membership():
                print(event.kind, event.worker_id)      # joined 3
        """
        return _Membership(self._delivery)

    def retire(self, worker_idx: W) -> None:
        """Elastic membership: *worker_idx*, gone or never connected, stops being a member
        (its statistics stay; it joins again by connecting again). A connected worker must
        leave first (close its receiver, or stop its process)."""
        self._delivery.record(worker_idx)
        self._transport.retire(worker_idx)

    def applied_versions(self) -> dict[W, int]:
        """Each worker's newest applied version (-1: none). A worker that is gone keeps
        the last version it applied; its state (``statistics()``) says it is gone."""
        return self._delivery.acks.applied_versions()

    def sent_version(self, worker_idx: W) -> int:
        """The newest version sent to *worker_idx* (-1: none)."""
        return self._delivery.record(worker_idx).sent

    def statistics(self) -> S:
        """A snapshot of versions, lags, errors and timings, per worker."""
        return self._transport.statistics()

    async def connect(self, timeout: Timeout = DEFAULT, weights: Any = None) -> int:
        """Start, send the initial weights (once), and wait for every worker's ack of version 0.

        If the wait times out, calling ``connect()`` again waits for the same initial version.
        """
        d = self._delivery
        deadline = d.deadline(timeout)  # a bad timeout is refused before anything opens
        t0 = time.monotonic()
        if d.start():
            await self._transport.open()
        if d.version < 0:
            await self.send_async(weights, timeout=deadline)
        await self._wait(0, None, None, deadline, "connect")
        n = len(d.records)
        logger.info("asyncsync: connected: %d/%d %s at version 0 in %.1f s", n, n, "worker" if n == 1 else "workers", time.monotonic() - t0)
        return 0


    async def send(self, weights: Any = None, worker_ids: W | Iterable[W] | None = None, *, partial: bool = False, timeout: Timeout = DEFAULT) -> int:
        """Publish *weights* (None: the configured source); with ``sync``, wait until every
        targeted worker applied them. *timeout* bounds the whole call. Returns the version.

        A target that is gone (died, left) keeps no other target from the version: the
        wait raises its :class:`WorkerGoneError` once every other target answered, its
        ``applied_by`` naming those that applied it.
        """
        d = self._delivery
        targets = d.targets(worker_ids)  # parsed once: the send and its wait pass it on
        deadline = d.deadline(timeout)
        version = await self.send_async(weights, targets, partial=partial, timeout=deadline)
        if d.sync:
            await self._wait(version, targets, None, deadline, f"send of version {version}")
        return version

    async def send_async(
        self, weights: Any = None, worker_ids: W | Iterable[W] | None = None, *, partial: bool = False, timeout: Timeout | Deadline = DEFAULT
    ) -> int:
        """Snapshot *weights* and publish them; return the new version.

        Returns once the snapshot is taken and each targeted worker will get it (now, or
        when it answers its current update: latest wins); acks are collected in the
        background (see :meth:`wait_async`). With *partial*, *weights* may hold a subset of
        the keys; the others keep the values each target last received. *timeout* bounds
        the wait for another send's snapshot and for room to write it. A target that is
        gone is sent the version too (a replacement gets it first): this call does not
        raise for it; :meth:`wait_async` does.
        """
        d = self._delivery
        targets = d.targets(worker_ids)
        d.check_running()
        groups = d.read(weights, targets, partial)
        async with d.sending(timeout) as deadline:
            d.check_running()
            version = d.version + 1
            await self._transport.publish(groups, version, deadline)
        return version

    async def wait_async(
        self, version: int | None = None, worker_ids: W | Iterable[W] | None = None, *, quorum: int | None = None, timeout: Timeout = DEFAULT
    ) -> None:
        """Wait until the targeted workers applied *version* (default: all sent so far).

        Only workers that were sent *version* (or a newer one) are waited for. With
        *quorum*, return once that many of them have. Raises :class:`WorkerError` if a
        worker rejected the weights (at once), :class:`WorkerGoneError` if one died or left
        (unless ``on_worker_error="skip"``) once every other target answered (or at the
        timeout), its ``applied_by`` naming the targets that applied the version,
        :class:`SyncTimeoutError` after *timeout* seconds, :class:`ValueError` for a
        version not sent yet.
        """
        await self._wait(version, worker_ids, quorum, timeout, None)

    async def wait_joined(self, worker_idx: W, timeout: Timeout = DEFAULT) -> None:
        """Wait until *worker_idx* is connected and answered the newest version sent to it.

        Raises :class:`WorkerError` if its new connection rejected that version. With
        elastic membership, *worker_idx* may be an id that has not joined yet.
        """
        d = self._delivery
        deadline = d.deadline(timeout)
        what = f"waiting for worker {worker_idx} to join"
        if d.elastic and worker_idx not in d.records and d.ids.is_id(worker_idx):  # (one that may join)
            if not await d.changed.wait_until(lambda: worker_idx in d.records, deadline.remaining()):
                raise self._explained(SyncTimeoutError(what, {worker_idx: -1}, deadline.timeout))
        d.record(worker_idx)
        try:
            await d.acks.wait_joined([worker_idx], deadline.remaining(), what)
        except SyncTimeoutError as exc:
            raise self._explained(SyncTimeoutError(what, exc.pending, deadline.timeout)) from None  # (the call's bound)

    async def wait_dead(self, worker_idx: W, timeout: Timeout = DEFAULT) -> None:
        """Wait until the sender has noticed that *worker_idx* is gone (dead, left or stopped)."""
        d = self._delivery
        d.record(worker_idx)
        await d.acks.wait_gone([worker_idx], d.limit(timeout), f"waiting for worker {worker_idx} to be declared gone")

    async def aclose(self, timeout: float = 10.0) -> None:
        """Stop every worker, wait (up to *timeout*) for them to end, release everything. Idempotent.

        Every waiter (``send``, ``send_async``, ``wait_async``) wakes with :class:`ClosedError`.
        """
        if self._delivery.life.phase == "closed":
            return
        with anyio.CancelScope(shield=True):
            await self._transport.aclose(timeout)

    async def _wait(self, version: int | None, worker_ids: Any, quorum: int | None, timeout: Timeout | Deadline, what: str | None) -> None:
        d = self._delivery
        try:
            await d.wait(version, d.targets(worker_ids), quorum, timeout, what)
        except SyncTimeoutError as exc:
            raise self._explained(exc) from None

    def _explained(self, exc: SyncTimeoutError) -> SyncTimeoutError:
        """*exc* with what the transport knows of why its workers are silent."""
        silence = self._transport.silence(list(exc.pending))
        if not silence.never_connected and not silence.hint:
            return exc
        return SyncTimeoutError(exc.what, exc.pending, exc.timeout, never_connected=silence.never_connected, hint=silence.hint)  # type: ignore[arg-type]

    def __del__(self) -> None:
        # No shutdown from __del__ (it hung interpreters at exit in torchrl): just say so.
        delivery = getattr(self, "_delivery", None)
        if delivery is not None and delivery.life.phase in ("running", "closing"):
            warnings.warn(
                "asyncsync sender was not closed: call `await scheme.aclose()` or use `async with scheme`",
                ResourceWarning,
                stacklevel=1,
            )


class _Membership:
    """An iterator over a delivery's membership events, from its creation on."""

    def __init__(self, delivery: Delivery[Any, Any]) -> None:
        self._delivery = delivery
        self._seen = delivery.acks.events.count
        self._ready: list[MembershipEvent] = []

    def __aiter__(self) -> _Membership:
        return self

    async def __anext__(self) -> MembershipEvent:
        d, log = self._delivery, self._delivery.acks.events
        while not self._ready:
            if log.count == self._seen and d.closed_or_closing():
                raise StopAsyncIteration
            await d.changed.wait_until(lambda: log.count > self._seen or d.closed_or_closing(), None)
            self._ready, self._seen = log.since(self._seen), log.count
        return self._ready.pop(0)
