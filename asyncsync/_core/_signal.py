"""A change signal: every waiter wakes at each ``notify()`` and re-checks its condition."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Signal"]


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Signal:
    """Edge-triggered wake-ups for "wait until this state holds" loops.

    ``notify()`` wakes everyone currently waiting without tracking what they wait for;
    state lives with the owner, never in the signal, so a cancelled waiter loses nothing.
    Timeouts are a timer on the loop, not a cancel scope: this sits on every send's path.
    """

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for fut in waiters:
                _wake(fut)

    async def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``ready()`` is true; False once *timeout* seconds passed first.

        ``ready`` may raise to end the wait with an error.
        """
        if ready():  # the common case on hot paths: no future, no timer
            return True
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if deadline is not None and loop.time() >= deadline:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            timer = None if deadline is None else loop.call_at(deadline, _wake, fut)
            try:
                await fut
            finally:
                if timer is not None:
                    timer.cancel()
                if not fut.done() or fut.cancelled() or timer is not None:
                    try:  # timed out or cancelled: keep no dead future in the list
                        self._waiters.remove(fut)
                    except ValueError:
                        pass
            if ready():
                return True
