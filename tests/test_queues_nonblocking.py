"""AsyncQueue over a Connection never blocks the loop: framing, read-ahead, write buffer, descriptors."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import multiprocessing as mp
import os
import random
import struct
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
from anyio import wait_all_tasks_blocked
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync import AsyncQueue, BrokenChannelError, ClosedError, WouldBlock
from asyncsync._io._framing import frame_header

from ._queue_targets import blob, digest, echo, exchange, fd_reader, slow_reader
from ._strategies import texts

CTX = mp.get_context("spawn")
MiB = 1 << 20


@contextlib.contextmanager
def child(target: Callable[..., None], *args: Any) -> Iterator[BaseProcess]:
    """Start *target* in a child process (the suite's start method: a forkserver's child has
    asyncsync imported already); close our copies of its Connections; never leave it running."""
    proc = mp.get_context(os.environ.get("ASYNCSYNC_START_METHOD", "spawn")).Process(target=target, args=args, daemon=True)
    proc.start()
    for arg in args:
        if isinstance(arg, Connection):
            arg.close()
    try:
        yield proc
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def frame(obj: object) -> bytes:
    payload = bytes(ForkingPickler.dumps(obj))
    return frame_header(len(payload)) + payload


def raw_pair(kind: str) -> tuple[Connection, AsyncQueue[Any]]:
    """A plain writing Connection and an AsyncQueue reading what it writes."""
    if kind == "socket":
        a, b = CTX.Pipe()
        return b, AsyncQueue(a)
    r, w = CTX.Pipe(duplex=False)
    return w, AsyncQueue(r)


async def until(cond: Callable[[], bool]) -> None:
    """Yield to the loop until *cond* holds (the test's timeout bounds it)."""
    while not cond():
        await asyncio.sleep(0)


# ------------------------------------------------------------------ framing and reads


def test_frame_header_matches_connection() -> None:
    assert frame_header(5) == struct.pack("!i", 5)
    assert frame_header(0x7FFFFFFF) == struct.pack("!i", 0x7FFFFFFF)
    assert frame_header(0x80000000) == struct.pack("!i", -1) + struct.pack("!Q", 0x80000000)


@pytest.mark.parametrize("kind", ["socket", "pipe"])
def test_partial_frame_would_block_until_complete(kind: str) -> None:
    w, q = raw_pair(kind)
    data = frame({"x": list(range(100))})
    os.write(w.fileno(), data[:2])  # not even a whole header
    with pytest.raises(WouldBlock):
        q.get_nowait()
    os.write(w.fileno(), data[2:30])
    with pytest.raises(WouldBlock):
        q.get_nowait()
    os.write(w.fileno(), data[30:])
    assert q.get_nowait() == {"x": list(range(100))}
    with pytest.raises(WouldBlock):
        q.get_nowait()
    w.close()
    q.close()


@pytest.mark.parametrize("kind", ["socket", "pipe"])
def test_eof_mid_frame_is_broken_after_complete_frames(kind: str) -> None:
    w, q = raw_pair(kind)
    os.write(w.fileno(), frame("one") + frame("two") + frame("three")[:7])
    w.close()
    assert q.get_nowait() == "one"
    assert q.get_nowait() == "two"
    with pytest.raises(BrokenChannelError, match="middle of a message"):
        q.get_nowait()
    with pytest.raises(BrokenChannelError):
        q.get_nowait()
    q.close()


def test_long_length_header_is_read() -> None:
    w, q = raw_pair("socket")
    payload = bytes(ForkingPickler.dumps("long form"))
    os.write(w.fileno(), struct.pack("!iQ", -1, len(payload)) + payload)
    assert q.get_nowait() == "long form"
    w.close()
    q.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(st.integers(), texts(max_size=50), st.binary(max_size=3000)), min_size=1, max_size=8),
    st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=40),
    st.sampled_from(["socket", "pipe"]),
)
def test_any_split_of_the_stream_yields_the_messages_in_order(objs: list[object], cuts: list[int], kind: str) -> None:
    w, q = raw_pair(kind)
    try:
        stream = b"".join(frame(o) for o in objs)
        got: list[object] = []
        pos = 0
        for cut in [*cuts, len(stream)]:
            chunk = stream[pos : pos + cut]
            pos += len(chunk)
            if chunk:
                os.write(w.fileno(), chunk)
            while True:
                try:
                    got.append(q.get_nowait())
                except WouldBlock:
                    break
            if pos == len(stream):
                break
        assert got == objs
    finally:
        w.close()
        q.close()


def test_write_error_breaks_the_queue_but_buffered_frames_are_read() -> None:
    a, b = CTX.Pipe()
    q: AsyncQueue[str] = AsyncQueue(a)
    b.send("x")
    b.send("y")
    b.close()
    with pytest.raises(BrokenChannelError):
        q.put_nowait("z")
    with pytest.raises(BrokenChannelError):
        q.put_nowait("z")
    assert q.get_nowait() == "x"
    assert q.get_nowait() == "y"
    with pytest.raises(BrokenChannelError):
        q.get_nowait()
    q.close()


def test_descriptors_need_a_socket_and_max_buffer_is_checked() -> None:
    r, w = CTX.Pipe(duplex=False)
    q: AsyncQueue[Any] = AsyncQueue(w)
    with pytest.raises(TypeError, match="duplex"):
        q.send_fds([0])
    with pytest.raises(ValueError, match="max_buffer"):
        AsyncQueue(r, max_buffer=-1)
    q.close()
    r.close()


async def test_descriptor_flags_are_left_alone() -> None:
    a, b = CTX.Pipe()
    before = fcntl.fcntl(a.fileno(), fcntl.F_GETFL)
    q: AsyncQueue[Any] = AsyncQueue(a, max_buffer=0)
    r: AsyncQueue[Any] = AsyncQueue(b)
    q.put_nowait(blob(1, 2 * MiB))
    with pytest.raises(WouldBlock):
        q.get_nowait()  # nothing came our way: a read that must not block
    assert await r.get(timeout=30) == blob(1, 2 * MiB)
    assert fcntl.fcntl(a.fileno(), fcntl.F_GETFL) == before
    assert not before & os.O_NONBLOCK
    await q.aclose()
    await r.aclose()


# ------------------------------------------------------------------ buffered writes


async def test_put_nowait_buffers_then_refuses_above_the_mark() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a, max_buffer=64 * 1024)
    r: AsyncQueue[Any] = AsyncQueue(b)
    w.put_nowait(blob(1, 8 * MiB))  # above the mark once buffered: the kernel holds far less
    assert w.write_buffer_size > w.max_buffer
    before = w.write_buffer_size
    with pytest.raises(WouldBlock):
        w.put_nowait("refused")
    assert w.write_buffer_size == before  # nothing buffered
    put = asyncio.ensure_future(w.put("waits"))
    assert await r.get(timeout=30) == blob(1, 8 * MiB)
    await asyncio.wait_for(put, 30)
    assert await r.get(timeout=30) == "waits"
    await w.aclose()
    await r.aclose()


async def test_put_accepts_a_message_larger_than_the_mark_into_an_empty_buffer() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a, max_buffer=0)
    r: AsyncQueue[Any] = AsyncQueue(b)
    await w.put(blob(1, 2 * MiB))
    second = asyncio.ensure_future(w.put(blob(2, 2 * MiB)))
    assert await r.get(timeout=30) == blob(1, 2 * MiB)
    assert await r.get(timeout=30) == blob(2, 2 * MiB)
    await asyncio.wait_for(second, 30)
    await w.aclose()
    await r.aclose()


async def test_puts_of_4mb_both_ways_in_one_loop_complete() -> None:
    a, b = CTX.Pipe()
    qa: AsyncQueue[bytes] = AsyncQueue(a)
    qb: AsyncQueue[bytes] = AsyncQueue(b)
    await asyncio.wait_for(asyncio.gather(qa.put(blob(1, 4 * MiB)), qb.put(blob(2, 4 * MiB))), 30)
    got_a, got_b = await asyncio.wait_for(asyncio.gather(qa.get(), qb.get()), 30)
    assert got_a == blob(2, 4 * MiB)
    assert got_b == blob(1, 4 * MiB)
    await qa.aclose()
    await qb.aclose()


async def test_cancelled_put_during_backpressure_buffers_nothing() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a, max_buffer=0)
    r: AsyncQueue[Any] = AsyncQueue(b)
    w.put_nowait(("first", blob(1, 4 * MiB)))
    assert w.write_buffer_size > 0
    before = w.write_buffer_size
    task = asyncio.ensure_future(w.put(("cancelled", blob(2, MiB))))
    await wait_all_tasks_blocked()
    assert not task.done()  # nobody reads: it waits for room
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert w.write_buffer_size <= before
    w_next = asyncio.ensure_future(w.put(("next", blob(3, MiB))))
    assert await r.get(timeout=30) == ("first", blob(1, 4 * MiB))
    await asyncio.wait_for(w_next, 30)
    assert await r.get(timeout=30) == ("next", blob(3, MiB))
    await w.aclose()
    with pytest.raises(BrokenChannelError):  # and nothing else was on the wire
        await r.get(timeout=30)
    await r.aclose()


async def test_cancel_storm_delivers_exactly_the_puts_that_returned() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a, max_buffer=128 * 1024)
    r: AsyncQueue[Any] = AsyncQueue(b)
    rng = random.Random(1234)
    received: list[tuple[int, str]] = []

    async def reader() -> None:
        while True:
            msg = await r.get()
            if msg is None:
                return
            received.append((msg[0], digest(msg[1])))
            for _ in range(rng.randrange(3)):  # read slower than we write
                await asyncio.sleep(0)

    reading = asyncio.ensure_future(reader())
    sent: list[tuple[int, str]] = []
    for i in range(150):
        data = blob(i, rng.choice([100, 50_000, 300_000]))
        task = asyncio.ensure_future(w.put((i, data)))
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            continue
        sent.append((i, digest(data)))
    await w.put(None)
    await asyncio.wait_for(reading, 30)
    assert received == sent
    assert 0 < len(sent) < 150  # both outcomes happened
    await w.aclose()
    await r.aclose()


async def test_broken_pipe_while_buffered_wakes_a_waiting_put() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a, max_buffer=0)
    w.put_nowait(blob(1, 4 * MiB))
    task = asyncio.ensure_future(w.put("waits"))
    await wait_all_tasks_blocked()
    assert not task.done()
    b.close()
    with pytest.raises(BrokenChannelError):
        await asyncio.wait_for(task, 30)
    with pytest.raises(BrokenChannelError):
        await w.flush()
    await w.aclose()


async def test_aclose_flushes_what_is_buffered() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a)
    r: AsyncQueue[Any] = AsyncQueue(b)
    reading = asyncio.ensure_future(r.get(timeout=30))
    w.put_nowait(blob(1, MiB))
    assert w.write_buffer_size > 0
    await w.aclose()
    assert await reading == blob(1, MiB)
    with pytest.raises(BrokenChannelError):
        await r.get(timeout=30)
    await r.aclose()


async def test_close_drops_unwritten_bytes_and_wakes_a_waiting_put() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a, max_buffer=0)
    r: AsyncQueue[Any] = AsyncQueue(b)
    w.put_nowait(blob(1, 4 * MiB))
    task = asyncio.ensure_future(w.put("waits"))
    await wait_all_tasks_blocked()
    assert not task.done()
    w.close()
    w.close()  # idempotent
    with pytest.raises(ClosedError):
        await task
    with pytest.raises(BrokenChannelError, match="middle of a message"):
        await r.get(timeout=30)
    await r.aclose()


async def test_aclose_wakes_a_waiting_get_with_closed_error() -> None:
    a, b = CTX.Pipe()
    r: AsyncQueue[Any] = AsyncQueue(b)
    task = asyncio.ensure_future(r.get())
    await wait_all_tasks_blocked()
    assert not task.done()
    await r.aclose()
    with pytest.raises(ClosedError):
        await task
    a.close()


# ------------------------------------------------------------------ descriptors


def _files(n: int) -> list[Any]:
    files = []
    for i in range(n):
        f = tempfile.TemporaryFile()
        f.write(f"file-{i}".encode())
        f.flush()
        files.append(f)
    return files


async def test_descriptors_stay_in_order_behind_a_buffered_message() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a)
    r: AsyncQueue[Any] = AsyncQueue(b)
    files = _files(3)
    w.put_nowait(("big", blob(1, 4 * MiB)))
    w.put_nowait(("fds", 2))
    w.send_fds([files[0].fileno(), files[1].fileno()])
    w.put_nowait(("msg", "between"))
    w.put_nowait(("fds", 1))
    w.send_fds([files[2].fileno()])
    for f in files:  # ours may go at once: the queue holds its own duplicates
        f.close()
    w.put_nowait(("msg", "after"))
    assert w.write_buffer_size > 0  # all of it waits behind the large message
    assert await r.get(timeout=30) == ("big", blob(1, 4 * MiB))
    assert await r.get(timeout=30) == ("fds", 2)
    fds = await r.receive_fds(2)
    assert [os.pread(fd, 64, 0) for fd in fds] == [b"file-0", b"file-1"]
    assert await r.get(timeout=30) == ("msg", "between")
    assert await r.get(timeout=30) == ("fds", 1)
    fds += r.receive_fds_nowait(1)  # written right behind their message: here already
    assert os.pread(fds[2], 64, 0) == b"file-2"
    assert await r.get(timeout=30) == ("msg", "after")
    for fd in fds:
        os.close(fd)
    await w.aclose()
    await r.aclose()


async def test_receive_fds_with_a_different_count_is_broken() -> None:
    a, b = CTX.Pipe()
    w: AsyncQueue[Any] = AsyncQueue(a)
    r: AsyncQueue[Any] = AsyncQueue(b)
    (f,) = _files(1)
    w.put_nowait("fds")
    w.send_fds([f.fileno()])
    f.close()
    assert await r.get(timeout=30) == "fds"
    with pytest.raises(BrokenChannelError, match="expected 2 file descriptors, got 1"):
        r.receive_fds_nowait(2)
    await w.aclose()
    await r.aclose()


# ------------------------------------------------------------------ with other processes


async def test_peer_that_does_not_read_leaves_the_loop_running() -> None:
    a, b = CTX.Pipe()
    ctrl_a, ctrl_b = CTX.Pipe()
    q: AsyncQueue[Any] = AsyncQueue(a, max_buffer=256 * 1024)
    ctrl: AsyncQueue[Any] = AsyncQueue(ctrl_a)
    messages = [(i, blob(i, 512 * 1024)) for i in range(12)]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def writer() -> None:
        for m in messages:
            await q.put(m)
        await q.put(None)
        await q.flush()

    with child(slow_reader, b, ctrl_b) as proc:
        ticking = asyncio.ensure_future(ticker())
        writing = asyncio.ensure_future(writer())
        try:
            await until(lambda: q.write_buffer_size > q.max_buffer)  # the writer now waits for room
            start = ticks
            await until(lambda: ticks >= start + 1000)
            assert not writing.done()
            await ctrl.put("go")  # only now does the peer start reading
            await asyncio.wait_for(writing, 30)
            released, got = await ctrl.get(timeout=30)
        finally:
            ticking.cancel()
            writing.cancel()
        assert released, "the peer was never told to read: the loop was blocked"
        assert got == [(i, digest(data)) for i, data in messages]
        proc.join(30)
        assert proc.exitcode == 0
    await q.aclose()
    await ctrl.aclose()


async def test_cancelled_puts_while_the_peer_does_not_read() -> None:
    a, b = CTX.Pipe()
    ctrl_a, ctrl_b = CTX.Pipe()
    q: AsyncQueue[Any] = AsyncQueue(a, max_buffer=64 * 1024)
    ctrl: AsyncQueue[Any] = AsyncQueue(ctrl_a)
    expected: list[tuple[int, str]] = []
    with child(slow_reader, b, ctrl_b) as proc:
        first = blob(0, 2 * MiB)
        q.put_nowait((0, first))
        expected.append((0, digest(first)))
        assert q.write_buffer_size > q.max_buffer
        for i in (1, 2, 3):  # each waits for room that never comes, then is cancelled
            task = asyncio.ensure_future(q.put((i, blob(i, MiB))))
            await wait_all_tasks_blocked()
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await ctrl.put("go")
        for i in (4, 5):
            await asyncio.wait_for(q.put((i, blob(i, MiB))), 30)
            expected.append((i, digest(blob(i, MiB))))
        await q.put(None)
        await asyncio.wait_for(q.flush(), 30)
        released, got = await ctrl.get(timeout=30)
        assert released
        assert got == expected
        proc.join(30)
        assert proc.exitcode == 0
    await q.aclose()
    await ctrl.aclose()


async def test_two_processes_put_4mb_to_each_other_then_get() -> None:
    a, b = CTX.Pipe()
    q: AsyncQueue[Any] = AsyncQueue(a)
    with child(exchange, b, 4 * MiB) as proc:
        await asyncio.wait_for(q.put(blob(1, 4 * MiB)), 30)
        assert await q.get(timeout=30) == blob(2, 4 * MiB)
        assert await q.get(timeout=30) == digest(blob(1, 4 * MiB))
        proc.join(30)
        assert proc.exitcode == 0
    await q.aclose()


@pytest.mark.parametrize("duplex", [True, False], ids=["socket", "pipes"])
async def test_plain_connection_peer_both_ways(duplex: bool) -> None:
    if duplex:
        ours, theirs = CTX.Pipe()
        out: AsyncQueue[Any] = AsyncQueue(ours)
        inp = out
        args: tuple[Connection, Connection] = (theirs, theirs)
    else:
        their_in, our_out = CTX.Pipe(duplex=False)
        our_in, their_out = CTX.Pipe(duplex=False)
        out, inp = AsyncQueue(our_out), AsyncQueue(our_in)
        args = (their_in, their_out)
    messages: list[Any] = ["small", {"k": list(range(10))}, b"", blob(1, 100 * 1024), blob(2, 3 * MiB), None]
    with child(echo, *args) as proc:
        for m in messages:
            await out.put(m)
        for m in messages:
            assert await inp.get(timeout=30) == m
        proc.join(30)
        assert proc.exitcode == 0
    await out.aclose()
    await inp.aclose()


def test_put_nowait_without_a_loop_writes_everything() -> None:
    ours, theirs = CTX.Pipe()
    q: AsyncQueue[Any] = AsyncQueue(ours)
    with child(echo, theirs, theirs) as proc:
        q.put_nowait(blob(1, 3 * MiB))  # no loop: blocks until the kernel took it all
        assert q.write_buffer_size == 0
        q.put_nowait(None)
        assert asyncio.run(q.get(timeout=30)) == blob(1, 3 * MiB)
        assert asyncio.run(q.get(timeout=30)) is None
        proc.join(30)
        assert proc.exitcode == 0
    q.close()


@pytest.mark.parametrize("mode", ["receive_fds_nowait", "receive_fds", "plain"])
async def test_descriptors_reach_another_process_in_order(mode: str) -> None:
    ours, theirs = CTX.Pipe()
    q: AsyncQueue[Any] = AsyncQueue(ours)
    files = _files(3)
    with child(fd_reader, theirs, mode) as proc:
        q.put_nowait(("big", blob(1, 4 * MiB)))
        q.put_nowait(("fds", 2))
        q.send_fds([files[0].fileno(), files[1].fileno()])
        q.put_nowait(("msg", "between"))
        q.put_nowait(("fds", 1))
        q.send_fds([files[2].fileno()])
        for f in files:
            f.close()
        q.put_nowait(("stop",))
        report = await q.get(timeout=30)
        assert report == [
            ("big", digest(blob(1, 4 * MiB))),
            ("fds", [b"file-0", b"file-1"]),
            ("msg", "between"),
            ("fds", [b"file-2"]),
        ]
        proc.join(30)
        assert proc.exitcode == 0
    await q.aclose()
