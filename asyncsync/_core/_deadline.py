"""Per-call deadlines, and racing work against a stop condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from .._errors import SyncTimeoutError

__all__ = ["Deadline", "locked_within", "unless"]

T = TypeVar("T")


class Deadline:
    """One bound for a whole call that waits several times (``None``: unbounded).

    Example::

        deadline = Deadline(5.0)
        await first_step(timeout=deadline.remaining())
        await second_step(timeout=deadline.remaining())   # what the first left
    """

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None without a bound."""
        return None if self.at is None else max(self.at - time.monotonic(), 0.0)


async def locked_within(lock: asyncio.Lock, deadline: Deadline, what: str) -> None:
    """Acquire *lock* before *deadline*, else raise :class:`SyncTimeoutError` about *what*."""
    if not lock.locked():
        await lock.acquire()
        return
    try:
        await asyncio.wait_for(lock.acquire(), deadline.remaining())
    except asyncio.TimeoutError:
        raise SyncTimeoutError(what, {}, deadline.timeout) from None


async def unless(work: Coroutine[Any, Any, T], stop: Coroutine[Any, Any, Any]) -> T | None:
    """*work*'s result, or None if *stop* finished first (then *work* is cancelled)."""
    work_task = asyncio.ensure_future(work)
    stop_task = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({work_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_task.cancel()
        if not work_task.done():
            work_task.cancel()
        await asyncio.wait({work_task, stop_task})
    if work_task.cancelled():
        return None
    return work_task.result()
