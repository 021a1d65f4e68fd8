"""The multi-host data plane: a dedicated torch.distributed group for weight bytes.

A :class:`SyncGroup` is one generation of the weight-sync group: a gloo or NCCL process
group built directly on a ``PrefixStore(f"gen{generation}/", store)``. It
is never the user's default group and never touches ``init_process_group``; a new
generation (after a host died or joined) is a new prefix, so groups can be re-formed as
often as needed. Buffers travel in chunks (``chunk_bytes``, default 64 MiB) issued
together, so the transfer is pipelined and uses no memory beyond the buffer itself.

Every operation runs with ``async_op=True``: the event loop awaits an asyncio future set
from the work's completion (``Work.get_future()`` + ``call_soon_threadsafe``), or, for
gloo's point-to-point work which has no future, from a waiting thread. No loop blocks.

A group with a *device* (NCCL, whose wire is CUDA memory) issues and waits for its
operations in its own thread: NCCL sets up a communicator inside the first operation
between two ranks, which blocks, and its work futures complete when the kernel is queued,
not when it ran. A device buffer is sent or received as it is; a host buffer (a relay's
shared-memory slot) is received through two device chunks, the copy of one to the host
overlapping the receive of the next. A failed or timed-out NCCL operation raises in that
thread (blocking wait; the process is never torn down), and closing a busy group aborts
its communicator, which ends what it still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]

from .._core._offload import Offload, retrieve
from .._errors import BrokenChannelError, format_seconds

__all__ = ["DEFAULT_CHUNK_BYTES", "SyncGroup"]

logger = logging.getLogger("asyncsync")

DEFAULT_CHUNK_BYTES = 64 << 20

# Group rendezvous: each on a daemon thread of its own (see SyncGroup.create).
_BUILDS = Offload("asyncsync-group", daemon=True)

Buffer = torch.Tensor | list[torch.Tensor]  # one flat uint8 tensor, or its byte ranges


def _device_of(buf: Buffer) -> torch.device:
    return buf[0].device if isinstance(buf, list) else buf.device


class SyncGroup:
    """One generation of the weight-sync process group (rank 0 is the trainer)."""

    def __init__(
        self, pg: Any, generation: int, rank: int, size: int, chunk_bytes: int, timeout: float, device: torch.device | None = None
    ) -> None:
        self.pg = pg
        self.device = device  # the wire's device (NCCL); None: host memory (gloo)
        self.generation = generation
        self.rank = rank
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self._waiter: ThreadPoolExecutor | None = None
        self._closed = False
        self._pending = 0  # operations the backend has not finished (a timed-out one included)
        self._ring: list[torch.Tensor] = []  # device chunks a host buffer is received through
        self._stream: Any = None

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
        device: torch.device | None = None,
    ) -> SyncGroup:
        """Rendezvous with the other *size - 1* members on the store (in a thread: it
        blocks until every member arrived, at most *timeout* seconds). *device*: the CUDA
        device of the wire (required with NCCL)."""
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
                try:
                    return dist.ProcessGroupGloo(prefixed, rank, size, opts)
                except BaseException:
                    # This frame lives on in the exception, also after a caller who left
                    # (the work ends on its own thread): not its device's listening socket.
                    opts = None
                    raise
            if backend == "nccl":
                if device is None or device.type != "cuda":
                    raise ValueError(f"backend='nccl' needs a CUDA device, got {device}")
                return _nccl_group(prefixed, rank, size, timeout, device)
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")

        if backend == "nccl":
            _nccl_environment()  # here, on the loop, before the build thread starts
        # A daemon thread of its own: a rendezvous left waiting for a dead member cannot be
        # interrupted (it ends at the store's timeout), and must not hold up the interpreter's
        # exit meanwhile. A group built after its caller left is dropped, off the loop.
        try:
            pg = await _BUILDS.run(build, timeout=timeout, what=f"forming weight-sync group generation {generation}", discard=_drop_later)
        except BaseException as exc:
            # The exception lives on wherever it is kept (a log record keeps its arguments,
            # a caller may keep the error): its frames must not keep what a group that never
            # formed opened, the store connection and the gloo device (a listener, an epoll,
            # a pipe), open with it.
            traceback.clear_frames(exc.__traceback__)
            del base, prefixed, build
            raise
        return cls(pg, generation, rank, size, chunk_bytes, timeout, device)

    def _chunks(self, buf: Buffer) -> list[torch.Tensor]:
        """*buf* (one flat uint8 tensor, or several: the byte ranges of a partial update)
        in pieces of at most ``chunk_bytes``."""
        out: list[torch.Tensor] = []
        for piece in buf if isinstance(buf, list) else [buf]:
            flat = piece.view(-1)
            out += [flat[i : i + self.chunk_bytes] for i in range(0, flat.numel(), self.chunk_bytes)]
        return out

    async def broadcast(self, buf: Buffer, root: int = 0, release: Callable[[], None] | None = None) -> None:
        """Broadcast *buf* (a contiguous uint8 tensor) from *root* to every member.

        *release* is called (on the loop) once the backend no longer touches *buf*: at
        return, or later if this coroutine raised or was cancelled while it still ran.
        """
        def issue(chunk: torch.Tensor, i: int) -> Any:
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            return self.pg.broadcast([chunk], opts)

        if self.device is not None:
            await self._on_device(buf, issue, receive=self.rank != root, release=release)
            return
        works = [issue(chunk, i) for i, chunk in enumerate(self._chunks(buf))]
        await self._wait(works, use_future=True, release=release)

    async def send(self, buf: Buffer, dst: int, tag: int, release: Callable[[], None] | None = None) -> None:
        """Point-to-point: *buf* to member *dst*; chunk ``i`` carries tag ``tag + i``."""
        if self.device is not None:
            await self._on_device(buf, lambda chunk, i: self.pg.send([chunk], dst, tag + i), receive=False, release=release)
            return
        works = [self.pg.send([chunk], dst, tag + i) for i, chunk in enumerate(self._chunks(buf))]
        await self._wait(works, use_future=False, release=release)

    async def recv(self, buf: Buffer, src: int, tag: int, release: Callable[[], None] | None = None) -> None:
        """Point-to-point: fill *buf* from member *src* (the tags of :meth:`send`)."""
        if self.device is not None:
            await self._on_device(buf, lambda chunk, i: self.pg.recv([chunk], src, tag + i), receive=True, release=release)
            return
        works = [self.pg.recv([chunk], src, tag + i) for i, chunk in enumerate(self._chunks(buf))]
        await self._wait(works, use_future=False, release=release)

    async def _on_device(
        self, buf: Buffer, issue: Callable[[torch.Tensor, int], Any], receive: bool, release: Callable[[], None] | None
    ) -> None:
        """Run one operation of a device group in its thread; as :meth:`_wait` otherwise."""
        if self._closed:
            raise BrokenChannelError(f"weight-sync group generation {self.generation} is closed")
        loop = asyncio.get_running_loop()
        afut: asyncio.Future[None] = loop.create_future()
        afut.add_done_callback(retrieve)
        done = _bridge(loop, afut, self._finisher(1, release))
        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="asyncsync-nccl")
        self._waiter.submit(self._device_run, buf, issue, receive, done)
        self._raise(await self._outcome_of(afut))

    async def _outcome_of(self, fut: asyncio.Future[Any]) -> str | None:
        """Await the backend's *fut*, bounded by the group's timeout: what went wrong, if anything."""
        try:
            await asyncio.wait_for(fut, self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return f"a transfer took more than {format_seconds(self.timeout)}"
        except RuntimeError as exc:
            return str(exc)
        return None

    def _raise(self, error: str | None) -> None:
        if error is not None:
            raise BrokenChannelError(f"weight-sync group generation {self.generation}: {error}")

    def _finisher(self, operations: int, release: Callable[[], None] | None) -> Callable[[], None]:
        """Count *operations* as running in the backend; the callback (on the loop, once per
        operation) calls *release* after the last one, and destroys a group closed meanwhile."""
        self._pending += operations
        left = [operations]

        def one_done() -> None:
            self._pending -= 1
            left[0] -= 1
            if left[0] == 0 and release is not None:
                try:
                    release()
                except RuntimeError:  # (only once the loop is closed: what it released is gone with it)
                    logger.debug("asyncsync: releasing a buffer after its loop closed", exc_info=True)
            if self._pending == 0 and self._closed:
                self._destroy(background=True)  # closed while busy: now it can go

        return one_done

    def _device_run(
        self, buf: Buffer, issue: Callable[[torch.Tensor, int], Any], receive: bool, done: Callable[[BaseException | None], None]
    ) -> None:
        """In the group's thread: issue every chunk, then block until the device is done."""
        try:
            dev = self.device
            assert dev is not None
            cuda = dev.type == "cuda"  # (a CPU "device" runs the same steps: the tests' stand-in)
            with torch.cuda.device(dev) if cuda else contextlib.nullcontext():
                if cuda and self._stream is None:
                    self._stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
                stream = self._stream
                if stream is not None:
                    stream.wait_stream(torch.cuda.default_stream(dev))  # what was written into buf before
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    if _device_of(buf) == dev:
                        works = [issue(chunk, i) for i, chunk in enumerate(self._chunks(buf))]
                        for work in works:
                            work.wait()
                        del works
                        if stream is not None:
                            stream.synchronize()
                    elif receive:
                        self._receive_through_ring(buf, issue)
                    else:
                        raise ValueError(f"a {self.device} group sends from {self.device} memory, not from {_device_of(buf)}")
        except BaseException as exc:  # delivered to the loop
            if self._stream is not None:
                try:
                    # Queued device work may still read or write buf: the buffer is released
                    # (free for the next snapshot or slot) only once the device is done.
                    self._stream.synchronize()
                except Exception:  # noqa: S110 - the error that matters is exc
                    pass
            done(exc)
            return
        done(None)

    def _receive_through_ring(self, buf: Buffer, issue: Callable[[torch.Tensor, int], Any]) -> None:
        """Receive host *buf* chunk by chunk through two device chunks: chunk i+1 lands
        while chunk i is copied out (a copy to pageable memory returns once it is done, so
        a device chunk is free again when it is issued the next time)."""
        chunks = self._chunks(buf)
        if not chunks:
            return
        n = min(len(chunks), 2)
        size = chunks[0].numel()
        if len(self._ring) < n or self._ring[0].numel() < size:
            self._ring = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(n)]
        prev: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        for i, chunk in enumerate(chunks):
            landing = self._ring[i % n][: chunk.numel()]
            work = issue(landing, i)
            if prev is not None:
                _copy_out(*prev)
            prev = (work, landing, chunk)
        assert prev is not None
        _copy_out(*prev)

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
        one_done = self._finisher(len(works), release)
        if not works and release is not None:
            release()
        for work in works:
            afut: asyncio.Future[None] = loop.create_future()
            futures.append(afut)
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
        gathered = asyncio.gather(*futures)
        gathered.add_done_callback(retrieve)  # abandoned (cancelled) waits leave no "never retrieved" error
        try:
            error = await self._outcome_of(gathered)
        finally:
            # No reference to a work may outlive this call (not even through a traceback):
            # a work keeps its group's connections open, and closing them is what releases
            # a peer still blocked in the group once it is dropped.
            works.clear()
            futures.clear()
        self._raise(error)

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
        elif self.device is not None:
            # NCCL can end what it runs: abort the communicator (the waits in the group's
            # thread raise, and the group goes once they returned). In a thread of its
            # own: an abort waits for NCCL, which is slow exactly when a peer hangs.
            threading.Thread(target=_abort, args=(self.pg, self.generation), name="asyncsync-group-abort", daemon=True).start()

    def _destroy(self, background: bool) -> None:
        pg, self.pg = self.pg, None
        self._ring = []
        if pg is None:
            return
        if background or self.device is not None:  # an NCCL shutdown may wait for the device: never on the loop
            _drop_later(pg)
        else:
            _drop([pg])
        del pg


NCCL_ENVIRONMENT = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def _nccl_environment() -> None:
    """Waits that block (and raise on an error or a timeout) instead of a watchdog that
    tears the process down: read by each ProcessGroupNCCL's constructor. Set once for the
    process (changing the environment while other threads read it is not safe), unless
    the user set them; NCCL groups the user creates later see them too (documented)."""
    for key, value in NCCL_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def _nccl_group(store: Any, rank: int, size: int, timeout: float, device: torch.device) -> Any:
    """An NCCL group with its communicator set up now, not inside the first transfer."""
    nccl: Any = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise RuntimeError("this torch has no NCCL (a CPU-only build?)")
    opts = nccl.Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    opts.is_high_priority_stream = False
    pg = nccl(store, rank, size, opts)
    try:
        with torch.cuda.device(device):
            probe = torch.zeros(1, dtype=torch.uint8, device=device)
            pg.broadcast([probe], dist.BroadcastOptions()).wait()
    except BaseException:
        _abort(pg, -1)
        raise
    return pg


def _abort(pg: Any, generation: int) -> None:
    try:
        pg.abort()
    except Exception as exc:  # e.g. a backend without abort: it ends at its timeout
        logger.debug("asyncsync: aborting weight-sync group generation %d: %r", generation, exc)


def _copy_out(work: Any, landing: torch.Tensor, chunk: torch.Tensor) -> None:
    work.wait()  # the current stream waits for the receive
    chunk.copy_(landing)


# Held by the backend's threads that finish operations after their loop closed.
_OFF_LOOP = threading.Lock()


def _drop_later(pg: Any) -> None:
    """Drop *pg* off the loop (an NCCL shutdown may wait for the device)."""
    threading.Thread(target=_drop, args=([pg],), name="asyncsync-group-close", daemon=True).start()


def _drop(holder: list[Any]) -> None:
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None and isinstance(holder[0], nccl):
        try:
            holder[0].shutdown()  # NCCL warns when a group is dropped without it
        except Exception as exc:
            logger.debug("asyncsync: shutting down a weight-sync group: %r", exc)
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
            try:
                loop.call_soon_threadsafe(settle, exc)
                return
            except RuntimeError:
                pass  # closed meanwhile
        # The loop is gone (its program ended while the backend still ran this operation,
        # a receive from a peer that left, say): nobody awaits *afut*, but a group closed
        # meanwhile must still go once its last operation ended, or its connections stay
        # open for as long as the process lives.
        with _OFF_LOOP:
            done()

    return from_any_thread
