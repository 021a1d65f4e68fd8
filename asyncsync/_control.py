"""The multi-host control plane: the binary protocol over an authenticated asyncio TCP stream.

One connection per remote host, trainer (server) <-> relay (client). Frames are exactly
those of :mod:`._protocol` (``!2sBBI`` header, then the payload); a reader takes the
8-byte header, checks magic, version, type and a size limit *before* reading the payload,
then decodes. Nothing a peer sends is unpickled. Before authentication the limit is the
size of the handshake frames, so a stranger cannot make us allocate anything.

Authentication is an HMAC-SHA256 challenge in both directions over a shared token (the
``token`` argument or ``ASYNCSYNC_TOKEN``): the trainer sends a random nonce, the relay
answers with its MAC and a nonce of its own, the trainer answers that. The token never
travels. The connection is the liveness signal: EOF, or no frame (heartbeats included)
for ``3 x heartbeat`` seconds, means the peer is gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import struct

from ._errors import BrokenChannelError, ProtocolError, format_seconds
from ._protocol import HEADER_BYTES, NONCE_BYTES, Beat, Message, decode, encode, payload_length

__all__ = ["HANDSHAKE_LIMIT", "ControlStream", "mac", "new_nonce", "resolve_token"]

logger = logging.getLogger("asyncsync")

# The largest payload before authentication: an Auth frame (host, workers, pid, 2 x 32 bytes).
HANDSHAKE_LIMIT = 12 + 2 * NONCE_BYTES
# After authentication: a Setup frame of a very large layout.
FRAME_LIMIT = 256 << 20


def resolve_token(token: str | bytes | None) -> bytes | None:
    """The shared secret: *token*, else ``ASYNCSYNC_TOKEN``, else None."""
    if token is None:
        token = os.environ.get("ASYNCSYNC_TOKEN") or None
    if token is None:
        return None
    raw = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not raw:
        raise ValueError("the token is empty")
    return raw


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def auth_mac(token: bytes, challenge: bytes, host: int, num_workers: int) -> bytes:
    return mac(token, b"relay", challenge, struct.pack("!II", host, num_workers))


def welcome_mac(token: bytes, nonce: bytes) -> bytes:
    return mac(token, b"trainer", nonce)


class ControlStream:
    """Protocol frames over one TCP connection; ``peer`` names the other end in errors."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self.limit = HANDSHAKE_LIMIT

    async def recv(self, timeout: float | None = None) -> Message:
        """The next message. Raises :class:`ProtocolError` (naming the peer) for a malformed
        frame, :class:`BrokenChannelError` for EOF, a reset, or *timeout* seconds of silence."""
        try:
            header, payload = await asyncio.wait_for(self._read(), timeout)
        except asyncio.IncompleteReadError as exc:
            what = "closed the connection" if not exc.partial else f"closed the connection inside a frame ({len(exc.partial)} bytes read)"
            raise BrokenChannelError(f"{self.peer} {what}") from None
        except (TimeoutError, asyncio.TimeoutError):
            raise BrokenChannelError(f"{self.peer} sent nothing for {format_seconds(timeout)} (no heartbeat)") from None
        except ProtocolError as exc:
            raise ProtocolError(f"{self.peer}: {exc}") from None
        except OSError as exc:
            raise BrokenChannelError(f"{self.peer}: {exc}") from None
        try:
            return decode(header + payload)
        except ProtocolError as exc:
            raise ProtocolError(f"{self.peer}: {exc}") from None

    async def _read(self) -> tuple[bytes, bytes]:
        header = await self.reader.readexactly(HEADER_BYTES)
        n = payload_length(header, self.limit)
        return header, (await self.reader.readexactly(n) if n else b"")

    def send(self, msg: Message) -> None:
        """Queue *msg* for writing (never blocks); a closed stream raises :class:`BrokenChannelError`."""
        if self.writer.is_closing():
            raise BrokenChannelError(f"the connection to {self.peer} is closed")
        self.writer.write(encode(msg))

    async def heartbeat(self, every: float) -> None:
        """Send a ``Beat`` every *every* seconds until the connection closes (the peer's liveness signal)."""
        try:
            while True:
                await asyncio.sleep(every)
                self.send(Beat())
        except BrokenChannelError:
            pass

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except OSError as exc:
            raise BrokenChannelError(f"{self.peer}: {exc}") from None

    def close(self) -> None:
        self.writer.close()

    async def aclose(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)
        except (OSError, TimeoutError, asyncio.TimeoutError):
            pass
