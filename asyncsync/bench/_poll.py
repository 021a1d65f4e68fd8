"""The ``shm-poll`` transport: ``shm`` with polled receivers, and its publish-to-commit time.

Each worker spins on :meth:`Receiver.poll_nowait` (yielding to its loop every
:data:`POLLS_PER_YIELD` polls, as a worker between env steps would) and stamps each
version right after the poll that committed it. The trainer stamps each version right
before the sender writes it into a worker's mailbox. ``time.perf_counter`` is
CLOCK_MONOTONIC on Linux, shared by all processes, so the difference is the
publish-to-commit time: the worker noticing the version, its commit, and its ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from asyncsync.bench._workload import make_model

__all__ = ["POLL_TRANSPORTS", "POLLS_PER_YIELD", "poll_worker", "publish_to_commit", "recording_publishes"]

#: "shm" with every worker polling (``init_on_receiver(..., poll=True)``).
POLL_TRANSPORTS: tuple[str, ...] = ("shm-poll",)
POLLS_PER_YIELD = 256


async def poll_worker(worker_idx: int, scheme: Any, n_params: int, n_tensors: int, probe: bool = False, tick: bool = False) -> dict[str, Any]:
    """Poll until stopped; report what :func:`asyncsync.bench._run.bench_worker` reports,
    plus ``polled``: ``(version, perf_counter before the poll that committed it, when the
    commit was complete (its ack about to be sent), after that poll)``."""
    from asyncsync.bench._run import worker_report

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl-C is the trainer's business
    torch.set_num_threads(1)
    model = make_model(n_params, n_tensors, seed=1000 + worker_idx)
    scheme.init_on_receiver(worker_idx=worker_idx, model=model, poll=True)
    polled: list[tuple[int, float, float, float]] = []
    poll = scheme.poll_nowait
    clock = time.perf_counter
    committed_at: dict[int, float] = {}
    async with scheme:
        receiver = scheme.receiver
        ack = receiver._ack

        def stamped_ack(msg: Any) -> None:  # the commit is complete: its ack goes out now
            committed_at.setdefault(msg.version, clock())
            ack(msg)

        receiver._ack = stamped_ack  # type: ignore[method-assign]
        while not receiver.stopped:
            for _ in range(POLLS_PER_YIELD):
                t0 = clock()
                version = poll()
                if version is not None:
                    polled.append((version, t0, committed_at.get(version, math.nan), clock()))
            await asyncio.sleep(0)
        await scheme.wait_stopped()
    return {**worker_report(scheme, model, memfd_mb=None, commits=[], ticks=[]), "polled": polled}


@contextlib.contextmanager
def recording_publishes() -> Iterator[dict[int, float]]:
    """In this (the trainer's) process: ``{version: perf_counter}`` of each version's first
    publication, stamped just before the mailbox's even sequence store makes it visible."""
    from asyncsync._local import _poll

    published: dict[int, float] = {}
    clock = time.perf_counter

    def stamp(version: int) -> None:
        if version not in published:
            published[version] = clock()

    _poll.on_publish = stamp
    try:
        yield published
    finally:
        _poll.on_publish = None


def publish_to_commit(published: dict[int, float], workers: list[dict[str, Any]], versions: list[int]) -> dict[str, float]:
    """Over the timed *versions*, medians in µs: ``publish_to_commit_us`` (and its p90),
    from the mailbox write until the commit is complete; ``publish_to_poll_us``, until the
    poll that committed it began (how soon the worker ran and looked); ``commit_poll_us``,
    that whole poll (reading, committing, the ack, and any preemption the ack's wake-up of
    the trainer causes)."""
    timed = set(versions)
    rows = [(v, a, c, b) for w in workers for v, a, c, b in w.get("polled", ()) if v in timed and v in published]
    if not rows:
        return {k: math.nan for k in ("publish_to_commit_us", "publish_to_commit_p90_us", "publish_to_poll_us", "commit_poll_us")}
    total = sorted((c - published[v]) * 1e6 for v, _a, c, _b in rows)
    return {
        "publish_to_commit_us": statistics.median(total),
        "publish_to_commit_p90_us": total[min(len(total) - 1, int(0.9 * len(total)))],
        "publish_to_poll_us": statistics.median((a - published[v]) * 1e6 for v, a, _c, _b in rows),
        "commit_poll_us": statistics.median((b - a) * 1e6 for _v, a, _c, b in rows),
    }
