"""The multi-host control plane: the binary protocol over an authenticated asyncio TCP stream.

One connection per remote host, trainer (server) <-> relay (client). Frames are exactly
those of :mod:`.._wire._control` (``!2sBBI`` header, then the payload); a reader takes the
8-byte header, checks magic, version, type and a size limit *before* reading the payload,
then decodes. Nothing a peer sends is unpickled. Before authentication the limit is the
size of the handshake frames, so a stranger cannot make us allocate anything.

Authentication is an HMAC-SHA256 challenge in both directions over a shared token (the
``token`` argument or ``ASYNCSYNC_TOKEN``): the trainer sends a random nonce, the relay
answers with its MAC and a nonce of its own, the trainer answers that. The token never
travels. The connection is the liveness signal: EOF, or no frame (heartbeats included)
for ``silence_timeout`` seconds, means the peer is gone. Heartbeats come from each
stream's writer thread, so a peer whose event loop is blocked still beats.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .._core._offload import retrieve
from .._errors import BrokenChannelError, ProtocolError, format_seconds
from .._wire._auth import HANDSHAKE_LIMIT, auth_mac, mac, new_nonce, resolve_token, welcome_mac
from .._wire._control import HEADER_BYTES, Beat, ControlMessage, encode, payload_length

__all__ = ["HANDSHAKE_LIMIT", "ControlStream", "auth_mac", "mac", "new_nonce", "resolve_token", "welcome_mac"]

logger = logging.getLogger("asyncsync")

# After authentication: a Setup frame of a very large layout.
FRAME_LIMIT = 256 << 20

Received = TypeVar("Received")


class ControlStream(Generic[Received]):
    """Protocol frames over one TCP connection; ``peer`` names the other end in errors, and
    ``decode`` reads what it sends (this end's plane direction: any other message is refused).

    ``send`` never blocks: when nothing is queued it writes the frame at once, with one
    non-blocking write from the caller's thread (the usual case: a control frame is a few
    dozen bytes), and whatever the socket does not take at once goes to a small daemon
    thread of the stream's own, which writes it in order. That thread also sends the
    heartbeats (:meth:`start_heartbeat`), so they keep going while the loop is blocked (a
    long synchronous training step), which is what the peer's silence detection watches.
    Reading stays on the loop. The thread ends when the stream is closed.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, peer: str, decode: Callable[[bytes], Received]
    ) -> None:
        self.reader = reader
        self._decode = decode
        self.writer = writer
        self.peer = peer
        self.limit = HANDSHAKE_LIMIT
        self._read_task: asyncio.Task[tuple[bytes, bytes]] | None = None
        self._cond = threading.Condition()
        self._out: list[bytes] = []
        self._queued = 0  # bytes handed to send() so far
        self._written = 0  # bytes written so far (by send() itself, or by the thread)
        self._writing = False  # the thread is writing (outside the lock): send() queues
        self._last_write = time.monotonic()  # when a frame last went out (for heartbeats)
        self._beat: float | None = None
        self._closing = False  # write what is queued, then end
        self._abort = False  # end now, dropping what is queued
        self._error: str | None = None
        self._drains: list[tuple[int, asyncio.Future[None]]] = []
        self._ended: asyncio.Future[None] | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._fd = -1
        if writer is not None:
            raw = writer.get_extra_info("socket")
            self._fd = raw.fileno()
            # Our own descriptor of the same socket (its non-blocking flag is shared).
            self._sock = socket.socket(fileno=os.dup(self._fd))
            self._loop = asyncio.get_running_loop()
            self._ended = self._loop.create_future()
            self._thread = threading.Thread(target=self._run, name=f"asyncsync-control-{peer}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ reading (on the loop)

    async def recv(self, timeout: float | None = None) -> Received:
        """The next message. Raises :class:`ProtocolError` (naming the peer) for a malformed
        frame, :class:`BrokenChannelError` for EOF, a reset, or *timeout* seconds of silence.

        Silence is judged on what arrived, not on the clock alone: if this loop was
        blocked past the deadline while the peer's frames kept coming, it is no silence."""
        if self._read_task is None:
            self._read_task = asyncio.ensure_future(self._read())
            self._read_task.add_done_callback(retrieve)
        task = self._read_task
        while True:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if done:
                break
            if not self._arrived():
                task.cancel()
                self._read_task = None
                raise BrokenChannelError(f"{self.peer} sent nothing for {format_seconds(timeout)} (no heartbeat)")
        self._read_task = None
        if task.cancelled():  # the stream was closed meanwhile
            raise BrokenChannelError(f"the connection to {self.peer} is closed")
        try:
            header, payload = task.result()
        except asyncio.IncompleteReadError as exc:
            what = "closed the connection" if not exc.partial else f"closed the connection inside a frame ({len(exc.partial)} bytes read)"
            raise BrokenChannelError(f"{self.peer} {what}") from None
        except ProtocolError as exc:
            raise ProtocolError(f"{self.peer}: {exc}") from None
        except OSError as exc:
            raise BrokenChannelError(f"{self.peer}: {exc}") from None
        try:
            return self._decode(header + payload)
        except ProtocolError as exc:
            raise ProtocolError(f"{self.peer}: {exc}") from None

    def _arrived(self) -> bool:
        """Bytes from the peer wait to be read (in the reader's buffer or the socket)."""
        if len(getattr(self.reader, "_buffer", b"")) > 0:
            return True
        if self._fd < 0:
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        try:
            return bool(poller.poll(0))
        except OSError:
            return False

    async def _read(self) -> tuple[bytes, bytes]:
        header = await self.reader.readexactly(HEADER_BYTES)
        n = payload_length(header, self.limit)
        return header, (await self.reader.readexactly(n) if n else b"")

    # ------------------------------------------------------------------ writing (at once, or by the thread)

    def send(self, msg: ControlMessage) -> None:
        """Write *msg*, or queue what the socket does not take at once (never blocks); a
        closed stream raises :class:`BrokenChannelError`."""
        data = encode(msg)
        with self._cond:
            if self._error is not None:
                raise BrokenChannelError(f"the connection to {self.peer} is broken: {self._error}")
            if self._closing or self._abort or self._thread is None:
                raise BrokenChannelError(f"the connection to {self.peer} is closed")
            self._queued += len(data)
            self._last_write = time.monotonic()
            if not self._out and not self._writing:
                # Nothing ahead of it: write now, sparing a wake-up of the thread (and, on a
                # busy machine, the wait for it to be scheduled) on every frame.
                try:
                    n = os.write(self._fd_of_thread(), data)
                except BlockingIOError:
                    n = 0
                except OSError:
                    n = 0  # the thread meets the same error, and ends the stream
                self._written += n
                if n == len(data):
                    return
                data = data[n:]
            self._out.append(data)
            self._cond.notify()

    def start_heartbeat(self, every: float) -> None:
        """From now on, a ``Beat`` whenever nothing was written for *every* seconds (the
        peer's liveness signal); sent by the stream's thread, whatever this loop does."""
        with self._cond:
            self._beat = every
            self._cond.notify()

    async def drain(self) -> None:
        """Until everything queued so far is written."""
        with self._cond:
            target = self._queued
            if self._written >= target:
                return
            if self._error is not None or self._abort or self._thread is None:
                raise BrokenChannelError(f"the connection to {self.peer} is closed")
            fut: asyncio.Future[None] = self._loop.create_future()
            self._drains.append((target, fut))
        await fut

    def _run(self) -> None:
        beat = encode(Beat())
        try:
            while True:
                with self._cond:
                    while not self._out and not self._closing and not self._abort:
                        if self._beat is None:
                            self._cond.wait()
                            continue
                        quiet = time.monotonic() - self._last_write
                        if quiet < self._beat:
                            self._cond.wait(self._beat - quiet)
                            continue
                        self._out.append(beat)  # nothing went out for a heartbeat period
                        self._queued += len(beat)
                        self._last_write = time.monotonic()
                    if self._abort or not self._out:
                        return
                    data, self._out = b"".join(self._out), []
                    self._writing = True
                self._write_all(data)
                with self._cond:
                    self._writing = False
                    self._written += len(data)
                    ready = [f for n, f in self._drains if n <= self._written]
                    self._drains = [(n, f) for n, f in self._drains if n > self._written]
                for f in ready:
                    self._to_loop(_settle, f, None)
        except OSError as exc:
            with self._cond:
                self._error = str(exc) or type(exc).__name__
        finally:
            with self._cond:
                drains, self._drains = self._drains, []
                error = self._error or "closed"
            for _, f in drains:
                self._to_loop(_settle, f, BrokenChannelError(f"the connection to {self.peer} is closed ({error})"))
            assert self._ended is not None
            self._to_loop(_settle, self._ended, None)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        poller = select.poll()
        poller.register(self._fd_of_thread(), select.POLLOUT)
        while view:
            if self._abort:
                return
            try:
                n = os.write(self._fd_of_thread(), view)
            except BlockingIOError:
                n = 0
            if n:
                view = view[n:]
            else:
                poller.poll(200)  # writable again, or time to look at _abort

    def _fd_of_thread(self) -> int:
        assert self._sock is not None
        return self._sock.fileno()

    def _to_loop(self, fn: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """End the connection now (what is still queued is dropped); the peer sees EOF."""
        with self._cond:
            self._abort = True
            self._cond.notify()
        self._shutdown()

    async def aclose(self) -> None:
        """Write what is queued (at most 2 s), then end the connection and the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._ended is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._ended), 2.0)
            except (TimeoutError, asyncio.TimeoutError):
                pass
        self.close()
        await self.wait_closed()

    async def wait_closed(self) -> None:
        """Until the thread ended and the socket is closed (after :meth:`close`)."""
        if self._ended is not None:
            await asyncio.shield(self._ended)
        if self._thread is not None:
            self._thread.join()  # it has ended: instant
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.writer is not None:
            try:
                await asyncio.wait_for(self.writer.wait_closed(), 2.0)
            except (OSError, TimeoutError, asyncio.TimeoutError):
                pass
        if self._read_task is not None:
            self._read_task.cancel()
            await asyncio.wait({self._read_task})
            self._read_task = None

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # FIN now, whoever else holds the socket
            except OSError:
                pass
        if self.writer is not None:
            self.writer.close()


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
