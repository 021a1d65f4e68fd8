"""A change signal: every waiter wakes at each ``notify()`` and re-checks its condition."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import anyio

__all__ = ["Signal"]


class Signal:
    """Edge-triggered wake-ups for "wait until this state holds" loops.

    A fresh :class:`asyncio.Event` per ``notify()`` wakes everyone currently waiting
    without tracking who waits; state lives with the owner, never in the signal, so a
    cancelled waiter loses nothing.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``ready()`` is true; False once *timeout* seconds passed first.

        ``ready`` may raise to end the wait with an error.
        """
        if ready():  # the common case on hot paths: no cancel scope to set up
            return True
        with anyio.move_on_after(math.inf if timeout is None else timeout):
            while not ready():
                await self._event.wait()
            return True
        return False
