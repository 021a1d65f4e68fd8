"""FramedPipe: a framed, non-blocking ``Connection`` end, with descriptor passing.

Nothing here ever blocks the loop: reads take what the kernel holds and keep a partial
frame until the rest arrives (:mod:`._framing`, so the peer may be a plain
``Connection``); writes go to a bounded buffer that the loop flushes when the descriptor
becomes writable. Over a Unix socket (a duplex ``Pipe``) descriptors travel in order with
the frames (SCM_RIGHTS). :meth:`FramedPipe.listen` hands frames to a callback straight
from the loop's reader callback: the scheme's own channels read that way.
:class:`~._queues.AsyncQueue` is the public face over it.

Example::

    import multiprocessing as mp
    a, b = mp.get_context("spawn").Pipe()
    pa, pb = FramedPipe(a), FramedPipe(b)
    pa.put_bytes_nowait(b"ping")
    pb.listen(lambda frame: print(frame) or False, lambda exc: None)  # b'ping'
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import select
import socket
import stat
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import anyio
import anyio.lowlevel

from .._errors import BrokenChannelError, ClosedError, WouldBlock
from ._framing import EMPTY, HEADER, dumps, frame_header, header_bytes, parse_frame

__all__ = ["DEFAULT_MAX_BUFFER", "FDS_NEED_SOCKET", "FdEnd", "FramedPipe"]

DEFAULT_MAX_BUFFER = 16 * 1024 * 1024
"""Default high-water mark of the write buffer, in bytes."""

_READ_CHUNK = 256 * 1024  # bytes asked of the kernel per read
_SMALL_FRAME = 16 * 1024  # header and payload up to this size go out as one buffer
_IOV_MAX = 64  # buffers gathered into one sendmsg
_SCM_MAX_FD = 253  # Linux: most descriptors one SCM_RIGHTS message carries
_ANC_SPACE = socket.CMSG_SPACE(_SCM_MAX_FD * array.array("i").itemsize)
_RECV_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
_CLOSE_FLUSH_TIMEOUT = 1.0  # how long aclose tries to flush what is buffered
FDS_NEED_SOCKET = "file descriptors pass only over a duplex Pipe (a Unix socket)"


class _BorrowedSocket(socket.socket):
    """A socket object over a descriptor it does not own: it never closes it, not even when collected."""

    __slots__ = ()

    def __del__(self) -> None:
        self.detach()


class _FdBatch:
    """Descriptors waiting in the write buffer: one marker byte with SCM_RIGHTS."""

    __slots__ = ("fds",)

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


_Pending = memoryview | bytes | _FdBatch


# uvloop (libuv) makes a descriptor non-blocking when it starts polling it; the flag lives
# on a file description other processes may share, so it is put back (reads and writes
# here pass MSG_DONTWAIT and never rely on it). asyncio's own loops leave flags alone.
def _flags_to_keep(loop: asyncio.AbstractEventLoop, fd: int) -> int | None:
    if isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop):
        return None
    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        return None


def _restore_flags(fd: int, flags: int | None) -> None:
    if flags is None:
        return
    try:
        if fcntl.fcntl(fd, fcntl.F_GETFL) != flags:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except OSError:
        pass  # closed meanwhile


async def wait_readable_fd(fd: int) -> None:
    """``anyio.wait_readable``, leaving *fd*'s flags as they were once it returns."""
    flags = _flags_to_keep(asyncio.get_running_loop(), fd)
    try:
        await anyio.wait_readable(fd)
    finally:
        _restore_flags(fd, flags)


class FdEnd:
    """What every end of an :class:`~._queues.AsyncQueue` has: a descriptor that turns
    readable when more arrives, and a closed state."""

    _fd: int
    _closed: bool

    def fileno(self) -> int:
        return self._fd

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("the queue was closed")

    async def wait_readable(self) -> None:
        """Until the descriptor is readable (more bytes, or the end); :class:`ClosedError` if closed meanwhile."""
        try:
            await wait_readable_fd(self._fd)
        except anyio.ClosedResourceError:
            raise ClosedError("the queue was closed") from None


class FramedPipe(FdEnd):
    """One end of a ``Connection`` (a pipe or a Unix socket), framed and non-blocking.

    One reader at a time (one reader per file descriptor): a task calling
    :meth:`try_get` / :meth:`wait_readable`, or a :meth:`listen` callback. Not
    thread-safe: use it from one event loop. Once wrapped, do not use the connection's
    own ``send``/``recv``.
    """

    def __init__(self, conn: Connection, *, max_buffer: int = DEFAULT_MAX_BUFFER) -> None:
        if max_buffer < 0:
            raise ValueError(f"max_buffer must be >= 0, got {max_buffer}")
        self._conn = conn
        self.max_buffer = max_buffer
        self._fd = conn.fileno()
        self._writable = conn.writable  # fixed for a connection's life (read once: a Python property)
        self._sock: socket.socket | None = None
        self._poller: Any = None  # select.poll on the descriptor, POLLIN (readable pipes)
        self._wpoller: Any = None  # select.poll on the descriptor, POLLOUT (writable pipes)
        if stat.S_ISSOCK(os.fstat(self._fd).st_mode):
            self._sock = self._borrow_socket(self._fd)
        else:
            self._poller = select.poll()
            self._poller.register(self._fd, select.POLLIN)
            self._wpoller = select.poll()
            self._wpoller.register(self._fd, select.POLLOUT)
        self._closed = False  # refuses calls (set by close and at the start of aclose)
        self._released = False  # the descriptor is closed
        # Reading: bytes read ahead, descriptor batches received, end of stream.
        self._rbuf = bytearray()
        self._scratch: memoryview | None = None
        self._fd_batches: deque[list[int]] = deque()
        self._eof = False
        self._read_error: OSError | None = None
        # Writing: frames and descriptor batches not yet written, in order.
        self._wq: deque[_Pending] = deque()
        self._wbytes = 0
        self._writer_loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._broken: OSError | None = None
        # Listening: frames handed to a callback straight from the loop's reader callback.
        self._listener: tuple[Callable[[bytes], bool], Callable[[Exception], None]] | None = None
        self._listen_loop: asyncio.AbstractEventLoop | None = None

    @staticmethod
    def _borrow_socket(fd: int) -> socket.socket:
        """A socket object on *fd* (family and type read from it) that leaves its flags as they were."""
        if socket.getdefaulttimeout() is None:
            return _BorrowedSocket(fileno=fd)
        # The constructor would apply the global timeout, that is O_NONBLOCK on a file
        # description other processes share: keep the socket object in blocking mode
        # (one attempt per call; MSG_DONTWAIT says when not to wait) and restore the flags.
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        sock = _BorrowedSocket(fileno=fd)
        sock.settimeout(None)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return sock

    @property
    def write_buffer_size(self) -> int:
        """Bytes accepted by ``put``/``send_fds`` but not yet written to the pipe."""
        return self._wbytes

    # ------------------------------------------------------------------ reading

    def try_get(self, raw: bool) -> Any:
        """The next frame, unpickled (its bytes if *raw*), or :data:`~._framing.EMPTY`; never blocks.

        Raises :class:`BrokenChannelError` once the other end is gone and every complete
        frame that arrived before has been returned.
        """
        self.check_open()
        msg = parse_frame(self._rbuf, raw)
        if msg is not EMPTY:
            return msg
        while self._fill():
            msg = parse_frame(self._rbuf, raw)
            if msg is not EMPTY:
                return msg
        if self._eof or self._broken is not None:
            self._raise_broken()
        return EMPTY

    def _fill(self) -> int:
        """Read what the kernel holds now (one read); return the byte count, 0 if none or at the end."""
        if self._eof:
            return 0
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_READ_CHUNK))
        scratch = self._scratch
        if self._sock is None and not self._conn.readable:
            raise OSError("connection is write-only")
        try:
            if self._sock is not None:
                n, ancdata, flags, _addr = self._sock.recvmsg_into((scratch,), _ANC_SPACE, _RECV_FLAGS)
                if ancdata:
                    self._take_ancillary(ancdata, flags)
            else:
                if not self._poller.poll(0):
                    return 0
                n = os.readv(self._fd, (scratch,))
        except BlockingIOError:
            return 0
        except OSError as exc:
            if self._closed:
                raise ClosedError("the queue was closed") from exc
            self._eof = True
            self._read_error = exc
            return 0
        if n == 0:
            self._eof = True
            return 0
        self._rbuf += scratch[:n]
        return n

    def _take_ancillary(self, ancdata: list[tuple[int, int, bytes]], flags: int) -> None:
        fds = array.array("i")
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
        batch = list(fds)
        if flags & socket.MSG_CTRUNC:
            batch.append(-1)  # descriptors were dropped: receiving this batch is refused
        self._fd_batches.append(batch)

    def _raise_broken(self) -> None:
        if self._read_error is not None:
            raise BrokenChannelError(f"the pipe broke: {self._read_error}") from self._read_error
        if self._eof:
            if self._rbuf:
                raise BrokenChannelError("the other end of the pipe closed in the middle of a message")
            raise BrokenChannelError("the other end of the pipe is closed")
        raise BrokenChannelError(f"the pipe broke: {self._broken}") from self._broken

    # ------------------------------------------------------------------ listening

    def listen(self, on_frame: Callable[[bytes], bool], on_end: Callable[[Exception], None]) -> None:
        """Hand each raw frame to *on_frame* from the running loop's reader callback.

        The fast path of the scheme's own channels: no task wakes up and the descriptor
        stays registered with the selector between messages (``AsyncQueue.get`` registers it
        for each wait). *on_frame* returns False to stop listening after that frame; the frames
        behind it stay buffered for ``get_bytes``/``receive_fds`` or a later ``listen``.
        *on_end* gets the exception that ended listening: :class:`BrokenChannelError` at
        the end of the stream, :class:`ClosedError` when the queue is closed, or what
        *on_frame* raised. Frames already buffered are handed over before this returns.
        Only one reader at a time: do not ``get`` while listening.
        """
        self.check_open()
        loop = asyncio.get_running_loop()
        self._listener = (on_frame, on_end)
        self._hand_over(fill=False)
        if self._listener is not None:
            flags = _flags_to_keep(loop, self._fd)
            loop.add_reader(self._fd, self._hand_over, True)
            _restore_flags(self._fd, flags)
            self._listen_loop = loop

    def unlisten(self) -> None:
        """Stop listening (idempotent); buffered frames stay for the next reader."""
        self._listener = None
        loop, self._listen_loop = self._listen_loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)

    def _hand_over(self, fill: bool) -> None:
        listener = self._listener
        if listener is None:
            return
        on_frame, on_end = listener
        try:
            if fill:
                self._fill()  # one read: the level-triggered selector calls again while bytes wait
            buf = self._rbuf
            while self._listener is listener:
                data = parse_frame(buf, True) if buf else EMPTY
                if data is EMPTY:
                    if self._eof or self._read_error is not None:
                        self._raise_broken()
                    return
                if not on_frame(data):
                    if self._listener is listener:  # unless on_frame listened anew
                        self.unlisten()
                    return
        except Exception as exc:
            if self._listener is listener:
                self.unlisten()
                on_end(exc)

    # -------------------------------------------------------------- descriptors

    def _require_socket(self) -> socket.socket:
        if self._sock is None or self._sock.family != socket.AF_UNIX:
            raise TypeError(FDS_NEED_SOCKET)
        return self._sock

    def send_fds(self, fds: list[int]) -> None:
        """Duplicates of *fds* to the peer, in order with the frames, past the
        high-water mark (see :meth:`AsyncQueue.send_fds <._queues.AsyncQueue.send_fds>`)."""
        self.check_open()
        self._require_socket()
        if not fds:
            return
        if len(fds) > _SCM_MAX_FD:
            raise ValueError(f"at most {_SCM_MAX_FD} descriptors at a time, got {len(fds)}")
        if self._broken is not None:
            self._raise_broken()
        batch = _FdBatch([])
        try:
            for fd in fds:
                batch.fds.append(os.dup(fd))
        except BaseException:
            batch.close()
            raise
        self._wq.append(batch)
        self._wbytes += 1
        self._start_flush()

    def receive_fds_nowait(self, count: int) -> list[int]:
        """*count* descriptors from :meth:`send_fds`, right after the frame announcing them,
        if they are here; else :class:`WouldBlock`."""
        self.check_open()
        if count == 0:
            return []
        self._require_socket()
        while not self._fd_batches:
            if self._fill():
                continue
            if self._eof:
                self._raise_broken()
            raise WouldBlock(f"the {count} announced file descriptors have not arrived yet")
        return self._take_fds(count)

    async def receive_fds(self, count: int) -> list[int]:
        """:meth:`receive_fds_nowait`, waiting in the event loop (from the reading task); cancel-safe."""
        await anyio.lowlevel.checkpoint()
        self.check_open()
        if count == 0:
            return []
        self._require_socket()
        while not self._fd_batches:
            if self._fill():
                continue
            if self._eof:
                self._raise_broken()
            await self.wait_readable()
            self.check_open()
        return self._take_fds(count)

    def _take_fds(self, count: int) -> list[int]:
        batch = self._fd_batches.popleft()
        marker = self._rbuf[0] if self._rbuf else None
        del self._rbuf[:1]
        if len(batch) != count or marker != count % 256:
            received = [fd for fd in batch if fd >= 0]
            _FdBatch(received).close()
            self._eof = True  # the stream is out of step: nothing after this can be trusted
            raise BrokenChannelError(f"expected {count} file descriptors, got {len(received)}")
        return batch

    # ------------------------------------------------------------------ writing

    def put_nowait(self, item: Any) -> None:
        """Send *item* pickled, without waiting (see :meth:`put_bytes_nowait`)."""
        self.check_open()
        self._check_writable()
        self._append_frame(dumps(item))

    def put_bytes_nowait(self, data: bytes | bytearray | memoryview) -> None:
        """Send *data* as one frame, without waiting; the bytes are copied when accepted.

        What the kernel does not take at once stays buffered and the running event loop
        writes it when the pipe has room (with no running loop, this blocks until it is
        written). Raises :class:`WouldBlock`, buffering nothing, while more than
        ``max_buffer`` bytes wait, and :class:`BrokenChannelError` once a write failed.
        """
        self.check_open()
        self._check_writable()
        self._append_frame(data if type(data) is bytes else bytes(data))

    def put_frame_nowait(self, frame: bytes) -> None:
        """:meth:`put_bytes_nowait` of a small payload framed already (``HEADER.pack(len(payload)) +
        payload``, at most 16 KiB): the hot path of a send, one system call when nothing
        waits to be written. The same rules as :meth:`put_bytes_nowait`."""
        if self._wq or self._sock is None or self._closed or self._broken is not None:
            self.put_bytes_nowait(frame[HEADER.size :])  # the general path: it raises what it must
            return
        self._write_small(frame)

    def _check_writable(self) -> None:
        """Raise unless a frame can be buffered now (broken, read-only, above the mark)."""
        if self._broken is not None:
            self._raise_broken()
        if not self._writable:
            raise OSError("connection is read-only")
        if self._wbytes > self.max_buffer:
            raise WouldBlock

    def _append_frame(self, payload: bytes | memoryview) -> None:
        size = len(payload)
        if size <= _SMALL_FRAME:
            self._write_small(HEADER.pack(size) + payload)
            return
        self._wq.append(frame_header(size))
        self._wq.append(payload)
        self._wbytes += size + header_bytes(size)
        self._start_flush()

    def _write_small(self, frame: bytes | memoryview) -> None:
        """A small frame (its header included): to the kernel at once when nothing is queued
        (every control message), what it does not take buffered behind the rest."""
        if not self._wq and self._sock is not None:
            try:
                sent = self._sock.send(frame, _SEND_FLAGS)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._set_broken(exc)
                self._raise_broken()
            if sent == len(frame):
                return
            frame = memoryview(frame)[sent:]
        self._wq.append(frame)
        self._wbytes += len(frame)
        self._start_flush()

    async def put(self, item: Any) -> None:
        """Send *item*, first waiting (in the loop) while more than ``max_buffer`` bytes are
        unwritten; a cancelled ``put`` buffered either the whole frame or nothing."""
        while True:
            try:
                self.put_nowait(item)
                return
            except WouldBlock:
                await self._wait_written(self.max_buffer)

    async def flush(self) -> None:
        """Until everything accepted is written; :class:`BrokenChannelError` if the pipe
        broke first, :class:`ClosedError` if it was closed first."""
        self.check_open()
        await self._wait_written(0)
        if self._broken is not None:
            self._raise_broken()
        self.check_open()

    def _start_flush(self) -> None:
        """Write now what the kernel takes; leave the rest to the loop (or block if none runs)."""
        if self._writer_loop is not None:
            if not self._writer_loop.is_closed():
                return  # waiting for writability already; the callback writes in order
            self._writer_loop = None  # left by a loop that ended: write from here
        try:
            self._flush()
        except OSError as exc:
            self._set_broken(exc)
            self._raise_broken()
        if not self._wq:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._flush_blocking()
            return
        self._add_writer(loop)

    def _flush(self) -> None:
        """Write buffered entries while the kernel takes them; raise OSError when the pipe broke."""
        q = self._wq
        if self._sock is None:
            fd = self._fd
            poll = self._wpoller.poll
            while q and poll(0):
                head = q[0]
                assert not isinstance(head, _FdBatch)
                try:
                    # At most PIPE_BUF bytes: a POLLOUT pipe takes that many without blocking.
                    n = os.write(fd, head[: select.PIPE_BUF])
                except BlockingIOError:
                    return
                self._consume(n)
            return
        sock = self._sock
        while q:
            head = q[0]
            if isinstance(head, _FdBatch):
                fds = array.array("i", head.fds)
                try:
                    sock.sendmsg((bytes((len(fds) % 256,)),), ((socket.SOL_SOCKET, socket.SCM_RIGHTS, fds),), _SEND_FLAGS)
                except BlockingIOError:
                    return
                q.popleft()
                self._wbytes -= 1
                head.close()
                continue
            bufs: list[memoryview | bytes] = []
            total = 0
            for entry in q:
                if isinstance(entry, _FdBatch) or len(bufs) == _IOV_MAX:
                    break
                bufs.append(entry)
                total += len(entry)
            try:
                n = sock.sendmsg(bufs, (), _SEND_FLAGS)
            except BlockingIOError:
                return
            self._consume(n)
            if n < total:
                return  # the kernel is full: the next try would only fail

    def _consume(self, n: int) -> None:
        self._wbytes -= n
        q = self._wq
        while n:
            head = q[0]
            assert not isinstance(head, _FdBatch)
            size = len(head)
            if size <= n:
                q.popleft()
                n -= size
            else:
                q[0] = memoryview(head)[n:]
                n = 0

    def _flush_blocking(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        while self._wq:
            poller.poll()
            try:
                self._flush()
            except OSError as exc:
                self._set_broken(exc)
                self._raise_broken()

    def _add_writer(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._writer_loop is loop:
            return
        self._remove_writer()
        flags = _flags_to_keep(loop, self._fd)
        loop.add_writer(self._fd, self._on_writable)
        _restore_flags(self._fd, flags)
        self._writer_loop = loop

    def _remove_writer(self) -> None:
        loop, self._writer_loop = self._writer_loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_writer(self._fd)

    def _on_writable(self) -> None:
        try:
            self._flush()
        except OSError as exc:
            self._set_broken(exc)
            return
        if not self._wq:
            self._remove_writer()
        self._wake()

    def _set_broken(self, exc: OSError) -> None:
        if self._broken is None:
            self._broken = exc
        self._drop_pending()

    def _drop_pending(self) -> None:
        self._remove_writer()
        for entry in self._wq:
            if isinstance(entry, _FdBatch):
                entry.close()
        self._wq.clear()
        self._wbytes = 0
        self._wake()

    def _wake(self) -> None:
        """Resolve the waiters whose condition now holds (all of them once broken or closed)."""
        if not self._waiters:
            return
        done = self._broken is not None or self._released
        for threshold, fut in self._waiters:
            if (done or self._wbytes <= threshold) and not fut.done():
                fut.set_result(None)

    async def _wait_written(self, threshold: int) -> None:
        """Wait until at most *threshold* bytes are unwritten (or the queue broke or was closed)."""
        while self._wbytes > threshold and self._broken is None and not self._released:
            loop = asyncio.get_running_loop()
            self._add_writer(loop)  # a no-op unless the bytes were left by another loop
            entry = (threshold, loop.create_future())
            self._waiters.append(entry)
            try:
                await entry[1]
            finally:
                self._waiters.remove(entry)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Close the descriptor now (idempotent); unwritten bytes are dropped."""
        if self._released:
            return
        self._closed = True
        self._released = True
        self._end_listener()
        try:
            anyio.notify_closing(self._fd)  # a task waiting for readability gets ClosedError
        except Exception:  # no event loop, or no waiter registered: nothing to wake
            pass
        self._drop_pending()
        while self._fd_batches:
            _FdBatch([fd for fd in self._fd_batches.popleft() if fd >= 0]).close()
        if self._sock is not None:
            self._sock.detach()
        self._conn.close()

    def _end_listener(self) -> None:
        listener = self._listener
        if listener is not None:
            self.unlisten()
            listener[1](ClosedError("the queue was closed"))

    async def aclose(self) -> None:
        """Close (idempotent), first trying for at most a second to write what is buffered;
        a task waiting on it gets :class:`ClosedError`."""
        if not self._closed:
            self._closed = True
            self._end_listener()
            try:
                anyio.notify_closing(self._fd)
            except Exception:  # no readiness waiter registered: nothing to wake
                pass
        if self._wq and not self._released and self._broken is None:
            with anyio.move_on_after(_CLOSE_FLUSH_TIMEOUT, shield=True):
                await self._wait_written(0)
        self.close()
        await anyio.lowlevel.checkpoint()
