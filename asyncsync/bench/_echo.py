"""The echo floor: a bare round trip of one small message to N workers.

Same channel and same kind of processes as the scheme's: N workers started with
:func:`asyncsync.spawn_workers` (spawn), one ``multiprocessing`` spawn-context
``Pipe(duplex=True)`` (a socketpair) per worker, the framed pipe under
:class:`asyncsync.AsyncQueue` on both ends, every end passed to every worker which keeps
its own and closes the others (as the scheme's pickled endpoints are),
``torch.set_num_threads(1)`` in the workers. And the same machinery as the scheme's hot
path: raw frames (no pickle), written with ``put_bytes_nowait`` and handed over by the
pipe's reader callback (``listen``: the descriptor stays registered with the loop's
selector; no task wakes up per message on the worker). One echo: the trainer writes one
40-byte frame (about a ``Receive``) to every worker and awaits a future that the reader
callbacks resolve once every reply is back; each worker writes every frame back from its
reader callback. ``ECHO_WARMUP`` echoes, then ``repeats`` timed ones.

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
from multiprocessing.connection import Connection

import anyio
import torch

__all__ = ["ECHO_PAYLOAD", "ECHO_WARMUP", "echo_worker", "measure_echo", "measure_echo_async"]

ECHO_WARMUP = 5
ECHO_PAYLOAD = bytes(32)
#: Limit of the whole measurement (spawn excluded), and of joining the workers.
ECHO_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 60.0


async def echo_worker(worker_idx: int, ends: list[Connection]) -> int:
    """Send back every frame until an empty one (or the trainer's end closes); return how many."""
    from asyncsync._io._pipe import FramedPipe

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl-C is the trainer's business
    torch.set_num_threads(1)
    for i, other in enumerate(ends):
        if i != worker_idx:
            other.close()  # the other workers' ends (as the scheme's receiver does)
    q = FramedPipe(ends[worker_idx])
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    echoed = 0

    def on_frame(data: bytes) -> bool:
        nonlocal echoed
        if not data:
            done.set_result(None)
            return False
        q.put_bytes_nowait(data)
        echoed += 1
        return True

    def on_end(exc: Exception) -> None:
        if not done.done():
            done.set_result(None)

    try:
        q.listen(on_frame, on_end)
        await done
    finally:
        await q.aclose()
    return echoed


async def measure_echo_async(workers: int, repeats: int, *, warmup: int = ECHO_WARMUP) -> dict[str, float]:
    """Spawn *workers* echo workers, time *repeats* echoes to all of them, stop them.

    Returns ``echo_ms`` (median), ``echo_p90_ms`` and ``echo_min_ms``.
    No process is left behind, also on errors and cancellation.
    """
    from asyncsync import spawn_workers
    from asyncsync._io._pipe import FramedPipe

    if workers < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need workers >= 1, repeats >= 1, warmup >= 0; got {workers}, {repeats}, {warmup}")
    ctx = mp.get_context("spawn")
    pairs = [ctx.Pipe(duplex=True) for _ in range(workers)]
    theirs = [b for _, b in pairs]
    queues = [FramedPipe(a) for a, _ in pairs]
    times: list[float] = []
    loop = asyncio.get_running_loop()
    replies: list[bytes] = []
    round_done: asyncio.Future[None] = loop.create_future()

    def on_frame(data: bytes) -> bool:
        replies.append(data)
        if len(replies) == workers and not round_done.done():
            round_done.set_result(None)
        return True

    def on_end(exc: Exception) -> None:
        if not round_done.done():
            round_done.set_exception(exc)

    try:
        async with spawn_workers(echo_worker, workers, args=(theirs,), join_timeout=JOIN_TIMEOUT_S) as group:
            for b in theirs:
                b.close()  # each worker holds its own copy now: EOF will mean it is gone
            for q in queues:
                q.listen(on_frame, on_end)
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
                for q in queues:
                    q.unlisten()
                    q.put_bytes_nowait(b"")
                for q in queues:
                    await q.flush()
            echoed = await group.join(timeout=JOIN_TIMEOUT_S)
        if any(n != warmup + repeats for n in echoed.values()):
            raise RuntimeError(f"echo workers echoed {echoed}, expected {warmup + repeats} each")
    finally:
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
