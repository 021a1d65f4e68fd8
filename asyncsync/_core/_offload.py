"""The one way blocking work leaves the event loop, with one cancellation rule.

Every blocking call asyncsync makes (a large snapshot copy, a staging copy on a worker,
a store client connecting or waiting, a process group's rendezvous) runs through
:class:`Offload`, and every caller gets the same rule:

- **The caller is never held up.** Cancelled, it gets ``CancelledError`` at once; given
  a *timeout*, it gets :class:`~asyncsync.SyncTimeoutError` naming *what* it awaited.
  A failure of the work itself is raised to the caller as it is.
- **The work cannot be stopped:** it runs to its end on its thread.
- **What the work owns is released when the work ends, never by a caller who left.**
  When the caller leaves before the end, ``keep()`` is called at once, and ``release()``
  on the loop once the work has ended; a result nobody takes any more goes to
  ``discard(result)`` there first (a process group built too late is dropped).
- **The outcome is always consumed:** an exception raised after the caller left is
  logged at debug level, never reported as "exception was never retrieved".
- **The loop never waits for the thread:** not for a result, not to queue a job behind
  one whose caller left, not to end it (:meth:`Offload.aclose`). The synchronous
  :meth:`Offload.close`, for teardown outside a coroutine, joins the thread. If the loop
  is closed by the time the work ends, nobody is left to release for: only ``discard``
  is called, on the work's thread (a process group built after its loop ended is still
  dropped, not left to the garbage collector with its sockets open).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .._errors import SyncTimeoutError

__all__ = ["THREAD_COPY_BYTES", "Offload", "retrieve"]

logger = logging.getLogger("asyncsync")

T = TypeVar("T")

# Copies larger than this run in the copy thread, so the trainer's loop keeps going.
THREAD_COPY_BYTES = 4 << 20


class Offload:
    """Blocking work on a thread, awaited from the loop under the module's rule.

    By default one worker thread, started on first use, runs the jobs one at a time in
    order, and :meth:`close` ends it. ``daemon=True`` gives every job a daemon thread of
    its own that nothing ever joins: for calls that may block past any deadline (a store
    client connecting to a listener that never answers).

    Example::

        copier = Offload("asyncsync-copy")
        await copier.run(copy_tensors, dst, src, keep=mark_busy, release=mark_free)
        await copier.aclose()

        store = await Offload("asyncsync-store", daemon=True).run(
            open_store, timeout=5.0, what="connecting to the rendezvous store"
        )
    """

    def __init__(self, name: str, *, daemon: bool = False) -> None:
        self._name = name
        self._daemon = daemon
        self._executor: ThreadPoolExecutor | None = None
        self._running: Future[Any] | None = None

    @property
    def busy(self) -> bool:
        """A job is running on the single thread (one whose caller may have left)."""
        return self._running is not None and not self._running.done()

    def start(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Start ``fn(*args)`` now and return its future, for :meth:`wait` (once or more:
        a caller that timed out can wait again for the same attempt)."""
        job: Future[T]
        if self._daemon:
            job = Future()

            def run() -> None:
                if not job.set_running_or_notify_cancel():
                    return
                try:
                    result = fn(*args)
                except BaseException as exc:  # delivered to whoever waits
                    job.set_exception(exc)
                else:
                    job.set_result(result)

            threading.Thread(target=run, name=self._name, daemon=True).start()
            return job  # not kept: daemon jobs are independent, and a result must not outlive its callers
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        job = self._executor.submit(fn, *args)
        self._running = job
        return job

    async def wait(
        self,
        job: Future[T],
        *,
        timeout: float | None = None,
        what: str = "blocking work",
        keep: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
        discard: Callable[[T], None] | None = None,
    ) -> T:
        """*job*'s result, waited for at most *timeout* seconds; see the module's rule."""
        outcome = _on_loop(job, discard)
        outcome.add_done_callback(lambda _: self._forget(job))
        try:
            await asyncio.wait((outcome,), timeout=timeout)
        except BaseException:
            if not outcome.done():
                _leave(outcome, keep, release, discard)
            raise
        if not outcome.done():
            _leave(outcome, keep, release, discard)
            raise SyncTimeoutError(what, {}, timeout)
        return outcome.result()

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        inline: bool = False,
        timeout: float | None = None,
        what: str = "blocking work",
        keep: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
        discard: Callable[[T], None] | None = None,
    ) -> T:
        """``fn(*args)`` on the thread (or here, with *inline*: small work); see the module's rule.

        On the single thread, a job whose caller left is waited for (cancellably) before
        the next one starts: at most one runs unaccounted for.
        """
        if inline:
            return fn(*args)
        previous = self._running
        if previous is not None and not previous.done():
            left = _on_loop(previous)
            left.add_done_callback(retrieve)  # its own caller left: its outcome is nobody's
            await asyncio.wait((left,))
        return await self.wait(self.start(fn, *args), timeout=timeout, what=what, keep=keep, release=release, discard=discard)

    def _forget(self, job: Future[Any]) -> None:
        if self._running is job:
            self._running = None  # its result lives no longer than its callers want it

    async def aclose(self) -> None:
        """:meth:`close` without blocking the loop: the job still running is awaited here
        (cancelled meanwhile, the thread still ends after it, on its own)."""
        running = self._running
        try:
            if running is not None and not running.done():
                left = _on_loop(running)
                left.add_done_callback(retrieve)  # its caller handles (or left) its outcome
                await asyncio.wait((left,))
        finally:
            if self._executor is not None:
                executor, self._executor = self._executor, None
                executor.shutdown(wait=not self.busy)

    def close(self) -> None:
        """Wait for the job still running on the single thread, if any, and end the thread
        (a daemon job is left to end on its own). Idempotent; blocks: from a coroutine, use
        :meth:`aclose`."""
        if self._executor is not None:
            executor, self._executor = self._executor, None
            executor.shutdown(wait=True)


def _on_loop(job: Future[T], orphan: Callable[[T], None] | None = None) -> asyncio.Future[T]:
    """A future of the running loop that gets *job*'s outcome when it ends (if the loop
    is closed by then, *orphan* gets the result, on the work's thread)."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[T] = loop.create_future()

    def ended(f: Future[T]) -> None:  # on the work's thread (or here, if it is done)
        try:
            loop.call_soon_threadsafe(_copy_outcome, f, outcome)
        except RuntimeError:  # the loop is closed: nobody waits any more
            if orphan is not None and not f.cancelled() and f.exception() is None:
                try:
                    orphan(f.result())
                except Exception:
                    logger.debug("asyncsync: dropping the result of work whose loop ended", exc_info=True)

    job.add_done_callback(ended)
    return outcome


def _copy_outcome(job: Future[T], outcome: asyncio.Future[T]) -> None:
    if outcome.done():
        return
    if job.cancelled():
        outcome.cancel()
        return
    exc = job.exception()
    if exc is not None:
        outcome.set_exception(exc)
    else:
        outcome.set_result(job.result())


def _leave(
    outcome: asyncio.Future[T],
    keep: Callable[[], None] | None,
    release: Callable[[], None] | None,
    discard: Callable[[T], None] | None,
) -> None:
    """The caller leaves before the work ended: reserve now, release when it ends."""
    if keep is not None:
        keep()

    def ended(f: asyncio.Future[T]) -> None:
        try:
            if f.cancelled():
                pass
            elif f.exception() is not None:  # consumed: the caller that wanted it is gone
                logger.debug("asyncsync: blocking work ended after its caller left", exc_info=f.exception())
            elif discard is not None:
                discard(f.result())
        finally:
            if release is not None:
                release()

    outcome.add_done_callback(ended)


def retrieve(fut: asyncio.Future[Any]) -> None:
    """A done callback that marks *fut*'s exception as seen (a future left behind on
    purpose logs no "exception was never retrieved"); whoever needs it reads it later."""
    if not fut.cancelled():
        fut.exception()
