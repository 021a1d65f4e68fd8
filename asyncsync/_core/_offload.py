"""The one way blocking work (a large snapshot copy) leaves the event loop.

The rule, for every caller: work handed to the thread cannot be stopped. If the caller is
cancelled (or gives up) while it runs, the caller gets the exception at once, and
whatever the work writes stays reserved until it is done: ``keep()`` is called at once,
``release()`` on the loop when the work ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["THREAD_COPY_BYTES", "Offload"]

T = TypeVar("T")

# Copies larger than this run in the copy thread, so the trainer's loop keeps going.
THREAD_COPY_BYTES = 4 << 20


class Offload:
    """One worker thread, started on first use, one job at a time.

    Example::

        copier = Offload("asyncsync-copy")
        await copier.run(copy_tensors, dst, src, keep=mark_busy, release=mark_free)
        copier.close()
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._running: Future[Any] | None = None

    @property
    def busy(self) -> bool:
        """A job is running (one whose caller may have given up on it)."""
        return self._running is not None and not self._running.done()

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        inline: bool = False,
        keep: Callable[[], None],
        release: Callable[[], None],
    ) -> T:
        """``fn(*args)`` in the thread (or here, with *inline*); see the module's rule.

        A job its caller gave up on is waited for (shielded) before the next one starts:
        at most one runs off the books.
        """
        if inline:
            return fn(*args)
        if self._running is not None and not self._running.done():
            await asyncio.shield(asyncio.wrap_future(self._running))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        job = self._executor.submit(fn, *args)
        self._running = job
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        except BaseException:
            if not job.done():
                keep()
                loop = asyncio.get_running_loop()

                def done(_f: object) -> None:
                    if not loop.is_closed():
                        loop.call_soon_threadsafe(release)

                job.add_done_callback(done)
            raise

    def close(self) -> None:
        """Wait for the job still running, if any, and end the thread. Idempotent."""
        if self._executor is not None:
            executor, self._executor = self._executor, None
            executor.shutdown(wait=True)
