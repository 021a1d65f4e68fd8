"""An event loop in a daemon thread of its own, to which coroutines are submitted."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._errors import SyncTimeoutError

__all__ = ["LoopThread"]

T = TypeVar("T")

SHUTDOWN_TIMEOUT_S = 10.0  # for the tasks still running when the loop stops


class LoopThread:
    """An event loop running in a daemon thread; *owner* names it in errors.

    Example::

        loops = LoopThread("asyncsync-relay-1")
        value = loops.run(compute(), timeout=5.0)    # from a thread that is not the loop's
        value = await loops.call(compute())          # from another event loop
        loops.close()
    """

    def __init__(self, name: str, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None, owner: str = "asyncsync") -> None:
        self.loop = loop_factory() if loop_factory is not None else asyncio.new_event_loop()
        self.owner = owner
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self.ident = self._thread.ident

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.wait(pending, timeout=SHUTDOWN_TIMEOUT_S))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule *coro* on the loop; refused from the loop's own thread (it would deadlock)."""
        if threading.get_ident() == self.ident:
            coro.close()
            raise RuntimeError(f"{self.owner}'s blocking calls cannot run on its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """*coro*'s result, blocking this thread at most *timeout* seconds."""
        future = self.submit(coro)
        try:
            done, _ = concurrent.futures.wait([future], timeout)
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in the caller: do not leave it running
            raise
        if not done:
            future.cancel()
            raise SyncTimeoutError(f"an {self.owner} call", {}, timeout)
        return future.result()

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """*coro* on the thread's loop, awaited from another loop; cancelling the caller
        cancels it there."""
        return await asyncio.wrap_future(self.submit(coro))

    def close(self) -> None:
        """Stop the loop and join its thread (bounded)."""
        if self.alive:
            self.loop.call_soon_threadsafe(self.loop.stop)
            if threading.get_ident() != self.ident:
                self._thread.join(SHUTDOWN_TIMEOUT_S)
