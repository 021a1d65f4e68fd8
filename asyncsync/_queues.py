"""Async wrappers around multiprocessing pipes and queues.

Waiting is readiness of the underlying file descriptor in the event loop
(:func:`anyio.wait_readable`), never a thread parked in a blocking ``get()``: such a
thread cannot be cancelled and would swallow the next message. A cancelled or
timed-out :meth:`AsyncQueue.get` therefore loses nothing.

Example::

    import multiprocessing as mp
    a, b = mp.get_context("spawn").Pipe()
    qa, qb = AsyncQueue(a), AsyncQueue(b)
    await qa.put("ping")
    assert await qb.get(timeout=1) == "ping"
"""

from __future__ import annotations

import array
import queue as _queue
import select
import socket
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue as _MPQueue
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from ._errors import BrokenChannelError, ClosedError, WouldBlock

__all__ = ["AsyncQueue"]

T = TypeVar("T")


class AsyncQueue(Generic[T]):
    """``await put`` / ``await get`` over a multiprocessing ``Connection`` or ``Queue``.

    One task may read at a time (one reader per file descriptor). Messages should be
    small: weights travel through shared memory, not through the pipe.
    """

    def __init__(self, endpoint: Connection | _MPQueue[Any]) -> None:
        self._endpoint = endpoint
        self._conn: Connection | None
        if isinstance(endpoint, Connection):
            self._conn = endpoint
            self._fd = endpoint.fileno()
            # A poll object on the one descriptor: a cheaper readiness probe than Connection.poll.
            self._poller = select.poll()
            self._poller.register(self._fd, select.POLLIN)
        elif isinstance(endpoint, _MPQueue):
            self._conn = None
            self._fd = endpoint._reader.fileno()  # type: ignore[attr-defined]
        else:
            raise TypeError(f"expected a multiprocessing Connection or Queue, got {type(endpoint).__name__}")
        self._closed = False

    @property
    def endpoint(self) -> Connection | _MPQueue[Any]:
        """The wrapped connection or queue."""
        return self._endpoint

    def fileno(self) -> int:
        """The file descriptor that becomes readable when a message may be waiting."""
        return self._fd

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the queue was closed")

    def get_nowait(self) -> T:
        """Return the next message, or raise :class:`WouldBlock` if none is waiting."""
        self._check_open()
        if self._conn is None:
            try:
                return self._endpoint.get_nowait()  # type: ignore[union-attr,no-any-return]
            except _queue.Empty:
                raise WouldBlock from None
            except (EOFError, OSError) as exc:
                raise BrokenChannelError("the queue's writer is gone") from exc
        try:
            if not self._poller.poll(0):
                raise WouldBlock
            return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, ConnectionError) as exc:
            raise BrokenChannelError("the other end of the pipe is closed") from exc
        except OSError as exc:
            if self._closed:
                raise ClosedError("the queue was closed") from exc
            raise BrokenChannelError(f"the pipe broke: {exc}") from exc

    async def get(self, timeout: float | None = None) -> T:
        """Wait for the next message; raise :class:`TimeoutError` after *timeout* seconds.

        Cancel-safe: a cancelled or timed-out ``get`` consumes nothing.
        """
        try:
            return self.get_nowait()
        except WouldBlock:
            pass
        if timeout is None:  # the hot path of every reader: no cancel scope to set up
            return await self._wait_and_get()
        with anyio.fail_after(timeout):
            return await self._wait_and_get()

    async def _wait_and_get(self) -> T:
        while True:
            await anyio.wait_readable(self._fd)
            try:
                return self.get_nowait()
            except WouldBlock:
                pass

    def put_nowait(self, item: T) -> None:
        """Send *item* at once (small control messages never wait on a pipe buffer)."""
        self._check_open()
        try:
            if self._conn is None:
                self._endpoint.put_nowait(item)  # type: ignore[union-attr]
            else:
                self._conn.send(item)
        except (BrokenPipeError, ConnectionError, EOFError) as exc:
            raise BrokenChannelError("the other end of the pipe is closed") from exc
        except ValueError as exc:  # multiprocessing raises ValueError on a closed queue
            raise ClosedError(str(exc)) from exc

    async def put(self, item: T) -> None:
        """Send *item*; a checkpoint first, so a cancelled ``put`` sends nothing."""
        await anyio.lowlevel.checkpoint()
        self.put_nowait(item)

    def send_fds(self, fds: list[int]) -> None:
        """Pass file descriptors to the peer (Unix socket pipes only, SCM_RIGHTS)."""
        self._check_open()
        if not fds:
            return
        sock = socket.socket(fileno=self._fd, family=socket.AF_UNIX, type=socket.SOCK_STREAM)
        try:
            sock.sendmsg([bytes([len(fds) % 256])], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError as exc:
            raise BrokenChannelError(f"cannot pass file descriptors: {exc}") from exc
        finally:
            sock.detach()

    def recv_fds(self, count: int) -> list[int]:
        """Receive *count* file descriptors sent with :meth:`send_fds` (blocks briefly)."""
        self._check_open()
        if count == 0:
            return []
        sock = socket.socket(fileno=self._fd, family=socket.AF_UNIX, type=socket.SOCK_STREAM)
        try:
            fds = array.array("i")
            msg, ancdata, _flags, _addr = sock.recvmsg(1, socket.CMSG_SPACE(count * fds.itemsize))
            if not msg and not ancdata:
                raise BrokenChannelError("the other end closed while passing file descriptors")
            for level, type_, data in ancdata:
                if level == socket.SOL_SOCKET and type_ == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
            if len(fds) != count:
                raise BrokenChannelError(f"expected {count} file descriptors, got {len(fds)}")
            return list(fds)
        finally:
            sock.detach()

    def close(self) -> None:
        """Close the endpoint now (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._conn is None:
            q = self._endpoint
            q.close()
            q.join_thread()  # type: ignore[union-attr]
        else:
            self._conn.close()

    async def aclose(self) -> None:
        """Close the endpoint (idempotent); a task waiting on it gets :class:`ClosedError`."""
        if not self._closed:
            try:
                anyio.notify_closing(self._fd)
            except Exception:  # no readiness waiter registered: nothing to wake
                pass
        self.close()
        await anyio.lowlevel.checkpoint()
