"""The multi-host data plane: a dedicated torch.distributed group for weight bytes.

A :class:`SyncGroup` is one generation of the weight-sync group: a gloo process group
built directly on a ``PrefixStore(f"gen{generation}/", store)``. It
is never the user's default group and never touches ``init_process_group``; a new
generation (after a host died or joined) is a new prefix, so groups can be re-formed as
often as needed. Buffers travel in chunks (``chunk_bytes``, default 64 MiB) issued
together, so the transfer is pipelined and uses no memory beyond the buffer itself.

Every operation runs with ``async_op=True``: the event loop awaits an asyncio future set
from the work's completion (``Work.get_future()`` + ``call_soon_threadsafe``), or, for
gloo's point-to-point work which has no future, from a waiting thread. No loop blocks.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]

from ._errors import BrokenChannelError

__all__ = ["DEFAULT_CHUNK_BYTES", "SyncGroup"]

logger = logging.getLogger("asyncsync")

DEFAULT_CHUNK_BYTES = 64 << 20


class SyncGroup:
    """One generation of the weight-sync process group (rank 0 is the trainer)."""

    def __init__(self, pg: Any, generation: int, rank: int, size: int, chunk_bytes: int, timeout: float) -> None:
        self.pg = pg
        self.generation = generation
        self.rank = rank
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self._waiter: ThreadPoolExecutor | None = None
        self._closed = False
        self._pending = 0  # operations the backend has not finished (a timed-out one included)

    @classmethod
    async def create(
        cls,
        store: Any,
        generation: int,
        rank: int,
        size: int,
        *,
        timeout: float,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        backend: str = "gloo",
        hostname: str | None = None,
    ) -> SyncGroup:
        """Rendezvous with the other *size - 1* members on the store (in a thread: it
        blocks until every member arrived, at most *timeout* seconds)."""
        # A connection of its own: a rendezvous left waiting for a dead member must not hold
        # up the next generation's behind it on a shared store client.
        base = store.clone() if hasattr(store, "clone") else store
        prefixed = PrefixStore(f"gen{generation}/", base)

        def build() -> Any:
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = datetime.timedelta(seconds=timeout)
                if hostname is not None:
                    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
                else:
                    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
                return dist.ProcessGroupGloo(prefixed, rank, size, opts)
            raise ValueError(f"backend must be 'gloo', got {backend!r}")

        loop = asyncio.get_running_loop()
        ex = ThreadPoolExecutor(1, thread_name_prefix="asyncsync-group")
        fut = loop.run_in_executor(ex, build)
        try:
            pg = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException:
            # The rendezvous cannot be interrupted: its thread ends by itself (store timeout).
            fut.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
            ex.shutdown(wait=False)
            raise
        ex.shutdown(wait=True)  # the thread is done: join it
        return cls(pg, generation, rank, size, chunk_bytes, timeout)

    def _chunks(self, buf: torch.Tensor) -> list[torch.Tensor]:
        flat = buf.view(-1)
        n = flat.numel()
        return [flat[i : i + self.chunk_bytes] for i in range(0, max(n, 1), self.chunk_bytes)] if n else []

    async def broadcast(self, buf: torch.Tensor, root: int = 0, release: Callable[[], None] | None = None) -> None:
        """Broadcast *buf* (a contiguous uint8 tensor) from *root* to every member.

        *release* is called (on the loop) once the backend no longer touches *buf*: at
        return, or later if this coroutine raised or was cancelled while it still ran.
        """
        works = []
        for chunk in self._chunks(buf):
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            works.append(self.pg.broadcast([chunk], opts))
        await self._wait(works, use_future=True, release=release)

    async def send(self, buf: torch.Tensor, dst: int, tag: int, release: Callable[[], None] | None = None) -> None:
        """Point-to-point: *buf* to member *dst*; chunk ``i`` carries tag ``tag + i``."""
        works = [self.pg.send([chunk], dst, tag + i) for i, chunk in enumerate(self._chunks(buf))]
        await self._wait(works, use_future=False, release=release)

    async def recv(self, buf: torch.Tensor, src: int, tag: int, release: Callable[[], None] | None = None) -> None:
        """Point-to-point: fill *buf* from member *src* (the tags of :meth:`send`)."""
        works = [self.pg.recv([chunk], src, tag + i) for i, chunk in enumerate(self._chunks(buf))]
        await self._wait(works, use_future=False, release=release)

    @staticmethod
    def max_tag_chunks(nbytes: int, chunk_bytes: int) -> int:
        return max(-(-nbytes // chunk_bytes), 1)

    async def _wait(self, works: list[Any], use_future: bool, release: Callable[[], None] | None = None) -> None:
        """Await every work from the loop; raise :class:`BrokenChannelError` if one failed.

        The buffer must stay untouched until :attr:`busy` is False again: a backend
        operation cannot be interrupted, even when this coroutine was cancelled.
        """
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[None]] = []
        left = [len(works)]

        def one_done() -> None:
            self._pending -= 1
            left[0] -= 1
            if left[0] == 0 and release is not None:
                release()
            if self._pending == 0 and self._closed:
                self._destroy(background=True)  # closed while busy: now it can go

        if not works and release is not None:
            release()
        for work in works:
            afut: asyncio.Future[None] = loop.create_future()
            futures.append(afut)
            self._pending += 1
            done = _bridge(loop, afut, one_done)
            if use_future:
                try:
                    work.get_future().add_done_callback(lambda f, done=done: done(_outcome(f.value)))
                    continue
                except RuntimeError:
                    pass  # this work has no future: wait for it in a thread
            if self._waiter is None:
                self._waiter = ThreadPoolExecutor(1, thread_name_prefix="asyncsync-gloo")
            self._waiter.submit(_wait_work, work, done)
            del work
        error: str | None = None
        gathered = asyncio.gather(*futures)
        gathered.add_done_callback(_retrieve)  # abandoned (cancelled) waits leave no "never retrieved" error
        try:
            await asyncio.wait_for(gathered, self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            error = f"a transfer took more than {self.timeout}s"
        except RuntimeError as exc:
            error = str(exc)
        finally:
            # No reference to a work may outlive this call (not even through a traceback):
            # a work keeps its group's connections open, and closing them is what releases
            # a peer still blocked in the group once it is dropped.
            works.clear()
            futures.clear()
        if error is not None:
            raise BrokenChannelError(f"weight-sync group generation {self.generation}: {error}")

    @property
    def busy(self) -> bool:
        """An operation is still running in the backend (its buffers must not be reused)."""
        return self._pending > 0

    def close(self, background: bool = False) -> None:
        """Drop the group; the waiting thread ends once the backend finished its work.

        A group with an operation still running in the backend is kept until that
        operation ends (at the latest at the group's timeout): its destructor would wait
        for it, holding the GIL, and freeze the whole process. An idle group is destroyed
        at once, which closes its connections; that can take a moment (up to a second was
        seen), so with *background* (a group replaced by a new generation) it happens in a
        short-lived thread, not on the loop.
        """
        self._closed = True
        busy = self.busy
        if self._waiter is not None:
            # Idle (the usual case): join its thread now. Else it ends with the backend's work.
            self._waiter.shutdown(wait=not busy)
            self._waiter = None
        if not busy:
            self._destroy(background)

    def _destroy(self, background: bool) -> None:
        pg, self.pg = self.pg, None
        if background and pg is not None:
            threading.Thread(target=_drop, args=([pg],), name="asyncsync-group-close", daemon=True).start()
        del pg


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _drop(holder: list[Any]) -> None:
    holder.clear()


def _wait_work(work: Any, done: Callable[[BaseException | None], None]) -> None:
    done(_outcome(work.wait))


def _outcome(get: Callable[[], Any]) -> BaseException | None:
    try:
        get()
    except BaseException as exc:  # the backend's error, delivered to the loop
        return exc
    return None


def _bridge(loop: asyncio.AbstractEventLoop, afut: asyncio.Future[None], done: Callable[[], None]) -> Callable[[BaseException | None], None]:
    def settle(exc: BaseException | None) -> None:
        done()
        if not afut.done():
            if exc is None:
                afut.set_result(None)
            else:
                afut.set_exception(RuntimeError(str(exc)))

    def from_any_thread(exc: BaseException | None) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, exc)

    return from_any_thread
