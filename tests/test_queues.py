"""AsyncQueue: fd-readiness waits, cancel-safety, timeouts, closed/broken ends."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle

import pytest
from anyio import wait_all_tasks_blocked

from asyncsync import AsyncQueue, BrokenChannelError, ClosedError, WouldBlock

CTX = mp.get_context("spawn")


class Exploding:
    """Raises when unpickled."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_explode, ())


def _explode() -> None:
    raise AssertionError("unpickled")


def pair(kind: str) -> tuple[AsyncQueue[object], AsyncQueue[object]]:
    if kind == "pipe":
        a, b = CTX.Pipe()
        return AsyncQueue(a), AsyncQueue(b)
    q = CTX.Queue()
    return AsyncQueue(q), AsyncQueue(q)


@pytest.fixture(params=["pipe", "queue"])
def queues(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    w, r = pair(request.param)
    yield w, r
    w.close()
    r.close()


async def test_put_get_roundtrip(queues) -> None:  # type: ignore[no-untyped-def]
    w, r = queues
    await w.put({"a": 1})
    w.put_nowait("two")
    assert await r.get(timeout=5) == {"a": 1}
    assert await r.get(timeout=5) == "two"


async def test_get_nowait_raises_would_block(queues) -> None:  # type: ignore[no-untyped-def]
    _, r = queues
    with pytest.raises(WouldBlock):
        r.get_nowait()


async def test_timed_out_get_loses_nothing(queues) -> None:  # type: ignore[no-untyped-def]
    w, r = queues
    with pytest.raises(TimeoutError):
        await r.get(timeout=0.05)
    await w.put("after-timeout")
    assert await r.get(timeout=5) == "after-timeout"


async def test_cancelled_get_loses_nothing(queues) -> None:  # type: ignore[no-untyped-def]
    w, r = queues
    task = asyncio.ensure_future(r.get())
    await wait_all_tasks_blocked()  # the get is now parked on the descriptor
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await w.put("m1")
    await w.put("m2")
    assert await r.get(timeout=5) == "m1"
    assert await r.get(timeout=5) == "m2"


async def test_get_wakes_when_message_arrives() -> None:
    w, r = pair("pipe")
    task = asyncio.ensure_future(r.get(timeout=5))
    await wait_all_tasks_blocked()  # parked: the message wakes it
    await w.put("hello")
    assert await task == "hello"
    w.close()
    r.close()


async def test_peer_closed_is_broken() -> None:
    w, r = pair("pipe")
    w.close()
    with pytest.raises(BrokenChannelError):
        await r.get(timeout=5)
    r.close()


async def test_closed_queue_refuses() -> None:
    w, r = pair("pipe")
    await r.aclose()
    await r.aclose()  # idempotent
    with pytest.raises(ClosedError):
        r.get_nowait()
    with pytest.raises(ClosedError):
        await r.put("x")
    w.close()


async def test_cancelled_put_sends_nothing() -> None:
    w, r = pair("pipe")
    task = asyncio.ensure_future(w.put("never"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(WouldBlock):
        r.get_nowait()
    w.close()
    r.close()


def test_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match="Connection or Queue"):
        AsyncQueue(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------ raw bytes (no pickle)


async def test_bytes_round_trip_in_order_with_pickled_messages() -> None:
    w, r = pair("pipe")
    w.put_bytes_nowait(b"\x00raw")
    w.put_bytes_nowait(bytearray(b""))
    w.put_bytes_nowait(memoryview(b"view"))
    await w.put("pickled")
    assert await r.get_bytes(timeout=5) == b"\x00raw"
    assert r.get_bytes_nowait() == b""
    assert await r.get_bytes() == b"view"
    assert await r.get(timeout=5) == "pickled"
    with pytest.raises(WouldBlock):
        r.get_bytes_nowait()
    w.close()
    r.close()


async def test_bytes_are_never_unpickled_and_interoperate_with_a_plain_connection() -> None:
    a, b = CTX.Pipe()
    q: AsyncQueue[object] = AsyncQueue(a)
    evil = pickle.dumps(Exploding())  # unpickling it would raise
    b.send_bytes(evil)
    assert await q.get_bytes(timeout=5) == evil
    q.put_bytes_nowait(b"back")
    await q.flush()
    assert b.recv_bytes() == b"back"
    q.close()
    b.close()


async def test_cancelled_or_timed_out_get_bytes_loses_nothing() -> None:
    w, r = pair("pipe")
    with pytest.raises(TimeoutError):
        await r.get_bytes(timeout=0.05)
    task = asyncio.ensure_future(r.get_bytes())
    await wait_all_tasks_blocked()  # parked on the descriptor
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    w.put_bytes_nowait(b"kept")
    assert await r.get_bytes(timeout=5) == b"kept"
    w.close()
    with pytest.raises(BrokenChannelError):
        await r.get_bytes(timeout=5)
    r.close()


async def test_put_bytes_nowait_refuses_above_the_mark() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[object] = AsyncQueue(a, max_buffer=0)
    w.put_bytes_nowait(bytes(8 << 20))  # the kernel takes far less: the rest stays buffered
    assert w.write_buffer_size > 0
    with pytest.raises(WouldBlock):
        w.put_bytes_nowait(b"refused")
    w.close()
    b.close()


async def test_raw_bytes_need_a_connection() -> None:
    w, r = pair("queue")
    with pytest.raises(TypeError, match="only over a Connection"):
        w.put_bytes_nowait(b"x")
    with pytest.raises(TypeError, match="only over a Connection"):
        r.get_bytes_nowait()
    w.close()
    r.close()


async def test_a_framed_frame_keeps_its_place_behind_buffered_bytes_and_the_rules() -> None:
    from asyncsync._io._framing import HEADER

    def framed(payload: bytes) -> bytes:
        return HEADER.pack(len(payload)) + payload

    a, b = CTX.Pipe()
    w: AsyncQueue[object] = AsyncQueue(a, max_buffer=0)
    r: AsyncQueue[object] = AsyncQueue(b)
    w.put_frame_nowait(framed(b"first"))  # nothing buffered: straight to the kernel
    assert w.write_buffer_size == 0
    big = bytes(8 << 20)
    w.put_bytes_nowait(big)  # the kernel takes far less: the rest stays buffered
    assert w.write_buffer_size > 0
    with pytest.raises(WouldBlock):  # above the mark, as put_bytes_nowait
        w.put_frame_nowait(framed(b"refused"))
    assert await r.get_bytes(timeout=5) == b"first"
    assert await r.get_bytes(timeout=30) == big
    await w.flush()
    w.put_frame_nowait(framed(b"after"))
    assert await r.get_bytes(timeout=5) == b"after"
    r.close()
    with pytest.raises(BrokenChannelError):
        for _ in range(1000):  # the kernel reports the peer gone on a write
            w.put_frame_nowait(framed(b"x"))
    w.close()
    with pytest.raises(ClosedError):
        w.put_frame_nowait(framed(b"closed"))
    q, _ = pair("queue")
    with pytest.raises(TypeError, match="only over a Connection"):
        q.put_frame_nowait(framed(b"x"))
    q.close()
