"""AsyncQueue: ``await put`` / ``await get`` over a multiprocessing pipe or queue.

Waiting is readiness of the underlying file descriptor in the event loop
(:func:`anyio.wait_readable`, or a reader callback that stays registered for the scheme's
own channels), never a thread parked in a blocking ``get()``: such a
thread cannot be cancelled and would swallow the next message. A cancelled or
timed-out :meth:`AsyncQueue.get` therefore loses nothing.

Over a ``Connection`` the work is done by :class:`~._pipe.FramedPipe` (non-blocking
reads and buffered writes, in ``Connection``'s own framing, so either end may be a
plain ``Connection``); over a ``multiprocessing.Queue`` by a small adapter with the same
calls. This module is the public face over both.

Example::

    import multiprocessing as mp
    a, b = mp.get_context("spawn").Pipe()
    qa, qb = AsyncQueue(a), AsyncQueue(b)
    await qa.put("ping")
    assert await qb.get(timeout=1) == "ping"
"""

from __future__ import annotations

import queue as _queue
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue as _MPQueue
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from .._errors import BrokenChannelError, ClosedError, WouldBlock
from ._framing import EMPTY
from ._pipe import DEFAULT_MAX_BUFFER, FDS_NEED_SOCKET, FdEnd, FramedPipe

__all__ = ["AsyncQueue"]

T = TypeVar("T")

_RAW_NEEDS_PIPE = "raw bytes travel only over a Connection (a multiprocessing Queue pickles)"


class AsyncQueue(Generic[T]):
    """``await put`` / ``await get`` over a multiprocessing ``Connection`` or ``Queue``.

    One task may read at a time (one reader per file descriptor). Messages should be
    small: weights travel through shared memory, not through the pipe.

    Over a ``Connection`` the queue buffers in both directions. :meth:`put_nowait`
    writes what the kernel takes at once and leaves the rest to the running event loop;
    it raises :class:`WouldBlock` while more than *max_buffer* bytes wait to be written
    (:meth:`put` waits instead). Received bytes are read ahead, so a message may be
    waiting although the descriptor is not readable: call :meth:`get_nowait` (or
    :meth:`get`) before waiting on :meth:`fileno` yourself. Once wrapped, do not use
    the connection's own ``send``/``recv``. Not thread-safe: use it from one event loop.
    Over a ``Queue`` the multiprocessing queue does its own buffering.

    Example::

        import multiprocessing as mp

        a, b = mp.get_context("spawn").Pipe()  # one end would go to another process
        trainer, worker = AsyncQueue(a, max_buffer=1 << 20), AsyncQueue(b)
        await trainer.put(("hello", 1))        # waits while 1 MiB is still unwritten
        print(await worker.get(timeout=5))     # ('hello', 1)
        worker.put_bytes_nowait(b"ack")        # raw bytes, never pickled
        print(await trainer.get_bytes(timeout=5))  # b'ack'
        await trainer.aclose()                 # flushes (bounded), then closes
        await worker.aclose()
    """

    def __init__(self, endpoint: Connection | _MPQueue[Any], *, max_buffer: int = DEFAULT_MAX_BUFFER) -> None:
        if max_buffer < 0:
            raise ValueError(f"max_buffer must be >= 0, got {max_buffer}")
        self._endpoint = endpoint
        self._end: FramedPipe | _QueueEnd
        if isinstance(endpoint, Connection):
            self._end = FramedPipe(endpoint, max_buffer=max_buffer)
        elif isinstance(endpoint, _MPQueue):
            self._end = _QueueEnd(endpoint, max_buffer)
        else:
            raise TypeError(f"expected a multiprocessing Connection or Queue, got {type(endpoint).__name__}")
        # (the end's own method: no call through this object on every send's hot path)
        self.put_frame_nowait: Callable[[bytes], None] = self._end.put_frame_nowait
        """:meth:`put_bytes_nowait` of a small payload that carries its frame header already
        (``HEADER.pack(len(payload)) + payload``, at most 16 KiB; made once, written to many
        queues): one system call when nothing waits to be written. Same rules otherwise."""

    @property
    def endpoint(self) -> Connection | _MPQueue[Any]:
        """The wrapped connection or queue."""
        return self._endpoint

    @property
    def max_buffer(self) -> int:
        """High-water mark of the write buffer: ``put_nowait`` refuses while more bytes wait."""
        return self._end.max_buffer

    @property
    def write_buffer_size(self) -> int:
        """Bytes accepted by ``put``/``send_fds`` but not yet written to the pipe."""
        return self._end.write_buffer_size

    def fileno(self) -> int:
        """The descriptor that becomes readable when more bytes arrive.

        A hint only: messages already read ahead wait in the queue without making it
        readable, so try :meth:`get_nowait` first.
        """
        return self._end.fileno()

    # ------------------------------------------------------------------ reading

    def get_nowait(self) -> T:
        """Return the next message, or raise :class:`WouldBlock` if none is complete yet.

        Raises :class:`BrokenChannelError` once the other end is gone and every complete
        message that arrived before has been returned.
        """
        msg = self._end.try_get(False)
        if msg is EMPTY:
            raise WouldBlock
        return msg  # type: ignore[no-any-return]

    async def get(self, timeout: float | None = None) -> T:
        """Wait for the next message; raise :class:`TimeoutError` after *timeout* seconds.

        Cancel-safe: a cancelled or timed-out ``get`` consumes nothing (a partly
        received message stays buffered for the next call).
        """
        return await self._get(False, timeout)  # type: ignore[no-any-return]

    def get_bytes_nowait(self) -> bytes:
        """Return the next frame's bytes as they came (no unpickling), or raise :class:`WouldBlock`.

        Same framing, buffering and end-of-stream behaviour as :meth:`get_nowait`; the peer
        writes with :meth:`put_bytes_nowait` (or ``Connection.send_bytes``). ``Connection``
        endpoints only (a ``Queue`` pickles everything).
        """
        msg = self._end.try_get(True)
        if msg is EMPTY:
            raise WouldBlock
        return msg  # type: ignore[no-any-return]

    async def get_bytes(self, timeout: float | None = None) -> bytes:
        """Wait for the next frame's bytes (no unpickling); cancel-safe, like :meth:`get`."""
        return await self._get(True, timeout)  # type: ignore[no-any-return]

    async def _get(self, raw: bool, timeout: float | None) -> Any:
        msg = self._end.try_get(raw)
        if msg is not EMPTY:
            return msg
        if timeout is None:  # the hot path of every reader: no cancel scope to set up
            return await self._wait_and_get(raw)
        with anyio.fail_after(timeout):
            return await self._wait_and_get(raw)

    async def _wait_and_get(self, raw: bool) -> Any:
        end = self._end
        while True:
            await end.wait_readable()
            msg = end.try_get(raw)
            if msg is not EMPTY:
                return msg

    def listen(self, on_frame: Callable[[bytes], bool], on_end: Callable[[Exception], None]) -> None:
        """Read raw frames as they arrive, in the event loop's reader callback (no task, no
        wake-up per message): ``on_frame(frame)`` for each (it returns False to stop
        listening and leave the rest buffered), ``on_end(exc)`` once the channel ends.
        Do not ``get`` while listening; the callbacks must not block.

        Example::

            import multiprocessing

            ours, theirs = multiprocessing.Pipe()
            queue, peer = AsyncQueue(ours), AsyncQueue(theirs)
            got = asyncio.get_running_loop().create_future()
            queue.listen(lambda frame: got.set_result(frame) is None, lambda exc: None)
            peer.put_bytes_nowait(b"hello")
            print(await got)                  # b'hello'
            queue.unlisten()
            await queue.aclose()
            await peer.aclose()
        """
        self._end.listen(on_frame, on_end)

    def unlisten(self) -> None:
        """Stop listening (idempotent); buffered frames stay for the next reader."""
        self._end.unlisten()

    # -------------------------------------------------------------- descriptors

    def send_fds(self, fds: list[int]) -> None:
        """Pass file descriptors to the peer (Unix socket pipes only, SCM_RIGHTS).

        They travel in order with the messages: send the message that announces them
        first, then call ``send_fds``; the peer calls :meth:`receive_fds` (or
        :meth:`receive_fds_nowait`) right after it got that message. The descriptors are
        duplicated, so the caller may close its own at once. Never raises
        :class:`WouldBlock`: the high-water mark does not apply here.
        """
        self._end.send_fds(fds)

    def receive_fds_nowait(self, count: int) -> list[int]:
        """The *count* descriptors sent with :meth:`send_fds` right after the message that
        announced them, if they arrived; else :class:`WouldBlock` (the sender writes them
        right behind the message, so they normally have)."""
        return self._end.receive_fds_nowait(count)

    async def receive_fds(self, count: int) -> list[int]:
        """The *count* descriptors sent with :meth:`send_fds`, waiting in the event loop; cancel-safe.

        Uses the reader's descriptor wait: call it from the task that reads.
        """
        return await self._end.receive_fds(count)

    # ------------------------------------------------------------------ writing

    def put_nowait(self, item: T) -> None:
        """Send *item* without waiting.

        Over a ``Connection`` the bytes the kernel does not take at once stay buffered
        and the running event loop writes them when the pipe has room (with no running
        loop, this blocks until they are written). Raises :class:`WouldBlock`, buffering
        nothing, while more than ``max_buffer`` bytes wait; a message of any size is
        accepted below the mark. Raises :class:`BrokenChannelError` once a write failed.
        """
        self._end.put_nowait(item)

    def put_bytes_nowait(self, data: bytes | bytearray | memoryview) -> None:
        """Send *data* as one frame, as it is (no pickling); :meth:`get_bytes` returns it.

        Same framing, buffering, ``max_buffer`` and :class:`WouldBlock` rules as
        :meth:`put_nowait`; the bytes are copied when they are accepted. ``Connection``
        endpoints only.
        """
        self._end.put_bytes_nowait(data)

    async def put(self, item: T) -> None:
        """Send *item*, first waiting (in the loop) while more than ``max_buffer`` bytes are unwritten.

        Cancel-safe: a cancelled ``put`` buffered either the whole message or nothing.
        """
        await anyio.lowlevel.checkpoint()
        await self._end.put(item)

    async def flush(self) -> None:
        """Wait until everything accepted by ``put``/``send_fds`` is written to the pipe.

        Raises :class:`BrokenChannelError` if the pipe broke first, :class:`ClosedError`
        if the queue was closed first.
        """
        await anyio.lowlevel.checkpoint()
        await self._end.flush()

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Close the endpoint now (idempotent); unwritten bytes are dropped."""
        self._end.close()

    async def aclose(self) -> None:
        """Close the endpoint (idempotent); a task waiting on it gets :class:`ClosedError`.

        First tries, for at most a second, to write what is still buffered.
        """
        await self._end.aclose()


class _QueueEnd(FdEnd):
    """A ``multiprocessing.Queue`` behind :class:`FramedPipe`'s calls: it pickles and
    buffers by itself, so raw frames, descriptors and listening are refused."""

    write_buffer_size = 0

    def __init__(self, q: _MPQueue[Any], max_buffer: int) -> None:
        self._q = q
        self.max_buffer = max_buffer
        self._fd = q._reader.fileno()  # type: ignore[attr-defined]
        self._closed = False
        self._released = False

    def try_get(self, raw: bool) -> Any:
        self.check_open()
        if raw:
            raise TypeError(_RAW_NEEDS_PIPE)
        try:
            return self._q.get_nowait()
        except _queue.Empty:
            return EMPTY
        except (EOFError, OSError) as exc:
            raise BrokenChannelError("the queue's writer is gone") from exc

    def listen(self, on_frame: Callable[[bytes], bool], on_end: Callable[[Exception], None]) -> None:
        raise TypeError("listening needs a Connection (a multiprocessing Queue pickles)")

    def unlisten(self) -> None:
        pass

    def send_fds(self, fds: list[int]) -> None:
        self.check_open()
        raise TypeError(FDS_NEED_SOCKET)

    def receive_fds_nowait(self, count: int) -> list[int]:
        self.check_open()
        if count == 0:
            return []
        raise TypeError(FDS_NEED_SOCKET)

    async def receive_fds(self, count: int) -> list[int]:
        await anyio.lowlevel.checkpoint()
        return self.receive_fds_nowait(count)

    def put_nowait(self, item: Any) -> None:
        self.check_open()
        try:
            self._q.put_nowait(item)
        except (BrokenPipeError, ConnectionError, EOFError) as exc:
            raise BrokenChannelError("the other end of the pipe is closed") from exc
        except ValueError as exc:  # multiprocessing raises ValueError on a closed queue
            raise ClosedError(str(exc)) from exc

    def put_bytes_nowait(self, data: bytes | bytearray | memoryview) -> None:
        self.check_open()
        raise TypeError(_RAW_NEEDS_PIPE)

    put_frame_nowait = put_bytes_nowait

    async def put(self, item: Any) -> None:
        self.put_nowait(item)

    async def flush(self) -> None:
        self.check_open()

    def close(self) -> None:
        if self._released:
            return
        self._closed = self._released = True
        try:
            anyio.notify_closing(self._fd)  # a task waiting in get gets ClosedError
        except Exception:  # no event loop, or no waiter registered: nothing to wake
            pass
        self._q.close()
        self._q.join_thread()

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()
