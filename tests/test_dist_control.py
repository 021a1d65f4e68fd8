"""The control stream's writes: a frame goes out at once from the caller when nothing is
queued, what the socket does not take goes to the stream's thread, frames stay whole and
in order either way, and the thread's heartbeats keep going while the loop is blocked."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import AsyncIterator

import pytest

from asyncsync import BrokenChannelError
from asyncsync._dist._control import ControlStream
from asyncsync._wire._codec import decode
from asyncsync._wire._control import HEADER_BYTES, Ack, Beat, FromRelay, decode_from_relay

pytestmark = pytest.mark.timeout(60)


async def _pair() -> tuple[ControlStream[FromRelay], socket.socket]:
    """A stream on this loop, and the other end as a plain blocking socket."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    peer, _ = await asyncio.to_thread(listener.accept)
    listener.close()
    peer.settimeout(30.0)
    return ControlStream(reader, writer, "test peer", decode_from_relay), peer


@pytest.fixture
async def pair() -> AsyncIterator[tuple[ControlStream[FromRelay], socket.socket]]:
    stream, peer = await _pair()
    try:
        yield stream, peer
    finally:
        await stream.aclose()
        peer.close()


def _read_frame(sock: socket.socket) -> object:
    header = _read_exactly(sock, HEADER_BYTES)
    (n,) = struct.unpack("!I", header[4:8])
    return decode(header + _read_exactly(sock, n))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += got
    return bytes(buf)


async def test_frames_stay_whole_and_in_order_when_the_socket_is_full(pair: tuple[ControlStream[FromRelay], socket.socket]) -> None:
    stream, peer = pair
    # Far more than the socket buffers hold while the peer reads nothing: the first frames
    # go out at once, the rest wait for the stream's thread, behind what is still queued.
    big = "x" * 60_000
    sent = [Ack(i % 7, i, i % 2 == 0, big if i % 3 == 0 else None, None, 0.0, 0.0) for i in range(300)]
    for msg in sent:
        stream.send(msg)
    got = await asyncio.to_thread(lambda: [_read_frame(peer) for _ in sent])
    assert got == sent
    await asyncio.wait_for(stream.drain(), 30.0)  # everything written


async def test_drain_returns_once_every_frame_is_written(pair: tuple[ControlStream[FromRelay], socket.socket]) -> None:
    stream, peer = pair
    stream.send(Ack(0, 1, True, None, None, 0.0, 0.0))
    await asyncio.wait_for(stream.drain(), 30.0)
    assert await asyncio.to_thread(_read_frame, peer) == Ack(0, 1, True, None, None, 0.0, 0.0)


async def test_heartbeats_go_out_while_the_loop_is_blocked(pair: tuple[ControlStream[FromRelay], socket.socket]) -> None:
    stream, peer = pair
    stream.send(Ack(0, 1, True, None, None, 0.0, 0.0))
    beat_seen = threading.Event()

    def watch() -> None:
        while True:
            if isinstance(_read_frame(peer), Beat):
                beat_seen.set()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stream.start_heartbeat(0.05)
    # Block this loop (a long synchronous step) until the peer got a heartbeat: only the
    # stream's own thread can have sent it.
    assert beat_seen.wait(30.0), "no heartbeat reached the peer while the loop was blocked"
    watcher.join(30.0)


async def test_frames_and_heartbeats_interleave_whole(pair: tuple[ControlStream[FromRelay], socket.socket]) -> None:
    stream, peer = pair
    stream.start_heartbeat(0.001)
    assert await asyncio.to_thread(_read_frame, peer) == Beat()
    sent = [Ack(1, v, True, "e" * 5000, None, 0.0, 0.0) for v in range(200)]
    for msg in sent:
        stream.send(msg)

    def acks() -> list[object]:
        out: list[object] = []
        while len(out) < len(sent):
            frame = _read_frame(peer)  # (a frame cut by a beat would not decode)
            if not isinstance(frame, Beat):
                out.append(frame)
        return out

    assert await asyncio.to_thread(acks) == sent


async def test_send_after_close_raises(pair: tuple[ControlStream[FromRelay], socket.socket]) -> None:
    stream, _ = pair
    stream.close()
    with pytest.raises(BrokenChannelError, match="test peer"):
        stream.send(Beat())
