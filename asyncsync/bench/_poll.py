"""The ``shm-poll`` transport: ``shm`` with polled receivers, and its publish-to-commit time.

Each worker spins on :meth:`Receiver.poll_nowait` (yielding to its loop, then its CPU
with ``sched_yield``, every :data:`POLLS_PER_YIELD` polls, as a worker between env steps
would) and stamps each poll that returns a new version: before the poll began and after
it returned (the version committed and its ack written). The trainer stamps each version
right after ``await scheme.send_async()`` returns (the version is published inside it),
then waits for the acks with ``wait_async``. Both clocks are ``time.perf_counter``,
CLOCK_MONOTONIC on Linux, shared by all processes, so the difference is the
publish-to-commit time. Public API only: nothing inside the library is timed.

With ``ASYNCSYNC_BENCH_PIN=1`` in the environment, and a CPU for the trainer and one for
each worker (:func:`cpu_plan`), the trainer and the workers are pinned each to its own CPU
(``os.sched_setaffinity``), so that a spinning worker runs on a core of its own. Other
processes may still run there: on a machine busier than its cores, pinning makes things
worse (a pinned process cannot move to a CPU that frees up), hence off by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from asyncsync.bench._worker import worker_report
from asyncsync.bench._workload import make_model

__all__ = ["POLL_TRANSPORTS", "PUBLISH_KEYS", "POLLS_PER_YIELD", "cpu_plan", "pinned", "poll_worker", "publish_to_commit", "send_stamped"]

#: "shm" with every worker polling (``init_on_receiver(..., poll=True)``).
POLL_TRANSPORTS: tuple[str, ...] = ("shm-poll",)
POLLS_PER_YIELD = 256


async def poll_worker(
    worker_idx: int, scheme: Any, n_params: int, n_tensors: int, probe: bool = False, tick: bool = False, cpus: list[int] | None = None
) -> dict[str, Any]:
    """Poll until stopped; report what :func:`asyncsync.bench._worker.bench_worker` reports,
    plus ``polled``: ``(version, perf_counter before the poll that committed it, after
    that poll returned)``. With *cpus* (:func:`cpu_plan`), the worker runs on
    ``cpus[1 + worker_idx]`` only."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl-C is the trainer's business
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[1 + worker_idx]})
    torch.set_num_threads(1)
    model = make_model(n_params, n_tensors, seed=1000 + worker_idx)
    scheme.init_on_receiver(worker_idx=worker_idx, model=model, poll=True)
    polled: list[tuple[int, float, float]] = []
    poll = scheme.poll_nowait
    clock = time.perf_counter
    async with scheme:
        receiver = scheme.receiver
        while not receiver.stopped:
            for _ in range(POLLS_PER_YIELD):
                t0 = clock()
                version = poll()
                if version is not None:
                    polled.append((version, t0, clock()))
            await asyncio.sleep(0)
            # Let the trainer and the other spinners run now rather than at the end of
            # this time slice (a no-op when nothing else waits for this CPU).
            os.sched_yield()
        await scheme.wait_stopped()
    return {**worker_report(scheme, model, memfd_mb=None, commits=[], ticks=[]), "polled": polled}


async def send_stamped(scheme: Any, published: dict[int, float]) -> int:
    """Trainer: one synchronous send as ``send_async`` then ``wait_async``, with
    ``published[version]`` = ``perf_counter`` right after ``send_async`` returned."""
    version: int = await scheme.send_async()
    published[version] = time.perf_counter()
    await scheme.wait_async(version)
    return version


def cpu_plan(workers: int) -> list[int] | None:
    """With ``ASYNCSYNC_BENCH_PIN=1``: a CPU for the trainer (first) and one for each worker,
    if this process may use that many; else None."""
    if os.environ.get("ASYNCSYNC_BENCH_PIN") != "1":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[: workers + 1] if len(cpus) > workers else None


@contextlib.contextmanager
def pinned(cpus: list[int] | None) -> Iterator[None]:
    """This (the trainer's) process on ``cpus[0]`` only, until the block ends."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


#: The publish-to-commit figures of a ``shm-poll`` row (see :func:`publish_to_commit`).
PUBLISH_KEYS = (
    "publish_to_commit_us",
    "publish_to_commit_min_us",
    "publish_to_commit_p10_us",
    "publish_to_commit_p90_us",
    "publish_to_commit_p99_us",
    "publish_to_commit_within_20us",
    "publish_to_poll_us",
    "commit_poll_us",
)


def publish_to_commit(published: dict[int, float], workers: list[dict[str, Any]], versions: list[int]) -> dict[str, float]:
    """Over the timed *versions*, in µs: ``publish_to_commit_us``, the median from the
    return of the trainer's ``send_async`` (the version published) until the worker's
    ``poll_nowait()`` that committed it returned (commit and ack done), with its min,
    p10, p90 and p99 and ``publish_to_commit_within_20us`` (the share at most 20 µs);
    ``publish_to_poll_us``, the median until that poll began (how soon the worker ran and
    looked; negative when it began before ``send_async`` returned); ``commit_poll_us``,
    that whole poll's median (reading, committing, the ack, and any preemption the ack's
    wake-up of the trainer causes)."""
    timed = set(versions)
    rows = [(v, a, b) for w in workers for v, a, b in w.get("polled", ()) if v in timed and v in published]
    if not rows:
        return dict.fromkeys(PUBLISH_KEYS, math.nan)
    total = sorted((b - published[v]) * 1e6 for v, _a, b in rows)

    def pct(q: float) -> float:
        return float(total[min(len(total) - 1, int(q * len(total)))])

    return {
        "publish_to_commit_us": statistics.median(total),
        "publish_to_commit_min_us": total[0],
        "publish_to_commit_p10_us": pct(0.1),
        "publish_to_commit_p90_us": pct(0.9),
        "publish_to_commit_p99_us": pct(0.99),
        "publish_to_commit_within_20us": sum(t <= 20.0 for t in total) / len(total),
        "publish_to_poll_us": statistics.median((a - published[v]) * 1e6 for v, a, _b in rows),
        "commit_poll_us": statistics.median((b - a) * 1e6 for _v, a, b in rows),
    }
