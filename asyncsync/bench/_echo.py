"""The echo floor: a bare round trip of one small message to N workers.

Same channel and same kind of processes as the scheme's: N workers started with
:func:`asyncsync.spawn_workers` (spawn), one ``multiprocessing`` spawn-context
``Pipe(duplex=True)`` (a socketpair) per worker, the public :class:`asyncsync.AsyncQueue`
on both ends, every end passed to every worker which keeps its own and closes the others
(as the scheme's pickled endpoints are), ``torch.set_num_threads(1)`` in the workers. And
the same kind of hot path as the scheme's: raw frames (no pickle), written with
``put_bytes_nowait`` and read from a reader callback on the loop (``loop.add_reader`` on
the queue's ``fileno()``, then ``get_bytes_nowait``: the descriptor stays registered with
the selector; no task wakes up per message on the worker). One echo: the trainer writes
one 40-byte frame (about a ``Receive``) to every worker and awaits a future that the
reader callbacks resolve once every reply is back; each worker writes every frame back
from its reader callback. ``ECHO_WARMUP`` echoes, then ``repeats`` timed ones.

Each queue has at most one frame in flight each way (a reply only answers a frame, the
next frame waits for every reply), so a reader callback takes one frame per call: one
read per message, as the scheme's own listener does, and no frame is left read ahead
where the descriptor would not show it.

A send of weights cannot take less than this unless it sends no message: it is the
message and wake-up cost that dominates small models, as the one-copy floor is the data
cost that dominates large ones.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import signal
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import anyio
import torch

from asyncsync import AsyncQueue, WouldBlock, spawn_workers

__all__ = ["ECHO_PAYLOAD", "ECHO_WARMUP", "echo_worker", "measure_echo", "measure_echo_async"]

ECHO_WARMUP = 5
ECHO_PAYLOAD = bytes(32)
#: Limit of the whole measurement (spawn excluded), and of joining the workers.
ECHO_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 60.0


def _read_one(q: AsyncQueue[Any], on_frame: Callable[[bytes], None], on_end: Callable[[Exception], None]) -> None:
    """A reader callback: hand the one frame that arrived to *on_frame*. The end of the
    stream, a closed queue or what *on_frame* raised stops reading and goes to *on_end*."""
    try:
        on_frame(q.get_bytes_nowait())
    except WouldBlock:
        pass  # a spurious wake-up: nothing complete yet
    except Exception as exc:
        asyncio.get_running_loop().remove_reader(q.fileno())
        on_end(exc)


async def echo_worker(worker_idx: int, ends: list[Connection]) -> int:
    """Send back every frame until an empty one (or the trainer's end closes); return how many."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl-C is the trainer's business
    torch.set_num_threads(1)
    for i, other in enumerate(ends):
        if i != worker_idx:
            other.close()  # the other workers' ends (as the scheme's receiver does)
    q: AsyncQueue[Any] = AsyncQueue(ends[worker_idx])
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    echoed = 0

    def on_frame(data: bytes) -> None:
        nonlocal echoed
        if not data:
            if not done.done():
                done.set_result(None)
            return
        q.put_bytes_nowait(data)
        echoed += 1

    def on_end(exc: Exception) -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(q.fileno(), _read_one, q, on_frame, on_end)
    try:
        await done
    finally:
        loop.remove_reader(q.fileno())
        await q.aclose()
    return echoed


async def measure_echo_async(workers: int, repeats: int, *, warmup: int = ECHO_WARMUP) -> dict[str, float]:
    """Spawn *workers* echo workers, time *repeats* echoes to all of them, stop them.

    Returns ``echo_ms`` (median), ``echo_p90_ms`` and ``echo_min_ms``.
    No process is left behind, also on errors and cancellation.
    """
    if workers < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need workers >= 1, repeats >= 1, warmup >= 0; got {workers}, {repeats}, {warmup}")
    ctx = mp.get_context("spawn")
    pairs = [ctx.Pipe(duplex=True) for _ in range(workers)]
    theirs = [b for _, b in pairs]
    queues: list[AsyncQueue[Any]] = [AsyncQueue(a) for a, _ in pairs]
    times: list[float] = []
    loop = asyncio.get_running_loop()
    replies: list[bytes] = []
    round_done: asyncio.Future[None] = loop.create_future()
    listening: list[int] = []

    def on_frame(data: bytes) -> None:
        replies.append(data)
        if len(replies) == workers and not round_done.done():
            round_done.set_result(None)

    def on_end(exc: Exception) -> None:
        if not round_done.done():
            round_done.set_exception(exc)

    try:
        async with spawn_workers(echo_worker, workers, args=(theirs,), join_timeout=JOIN_TIMEOUT_S) as group:
            for b in theirs:
                b.close()  # each worker holds its own copy now: EOF will mean it is gone
            for q in queues:
                loop.add_reader(q.fileno(), _read_one, q, on_frame, on_end)
                listening.append(q.fileno())
            with anyio.fail_after(ECHO_TIMEOUT_S):
                for step in range(warmup + repeats):
                    msg = step.to_bytes(8, "big") + ECHO_PAYLOAD
                    replies.clear()
                    round_done = loop.create_future()
                    t0 = time.perf_counter_ns()
                    for q in queues:
                        q.put_bytes_nowait(msg)
                    await round_done
                    t1 = time.perf_counter_ns()
                    if any(r != msg for r in replies):
                        raise RuntimeError(f"echo {step}: expected {msg!r} back, got {replies!r}")
                    if step >= warmup:
                        times.append((t1 - t0) / 1e6)
                while listening:
                    loop.remove_reader(listening.pop())
                for q in queues:
                    q.put_bytes_nowait(b"")
                for q in queues:
                    await q.flush()
            echoed = await group.join(timeout=JOIN_TIMEOUT_S)
        if any(n != warmup + repeats for n in echoed.values()):
            raise RuntimeError(f"echo workers echoed {echoed}, expected {warmup + repeats} each")
    finally:
        while listening:
            loop.remove_reader(listening.pop())
        for b in theirs:
            b.close()
        for q in queues:
            q.close()
    ordered = sorted(times)
    return {
        "echo_ms": statistics.median(times),
        "echo_p90_ms": ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)],  # nearest rank
        "echo_min_ms": ordered[0],
    }


def measure_echo(workers: int, repeats: int, *, warmup: int = ECHO_WARMUP) -> dict[str, float]:
    """:func:`measure_echo_async` in its own event loop (call from synchronous code)."""
    return asyncio.run(measure_echo_async(workers, repeats, warmup=warmup))
