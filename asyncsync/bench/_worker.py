"""The benchmark's worker side: the event-driven worker and the report every worker sends back.

Module level, so that spawn pickles :func:`bench_worker` by name. The polled worker
(:mod:`asyncsync.bench._poll`) reports the same :func:`worker_report`.
"""

from __future__ import annotations

import array
import asyncio
import os
import signal
import time
from typing import Any

import torch
from torch import nn

from asyncsync.bench._procmem import memfd_mb, peak_rss_mb, rss_mb
from asyncsync.bench._workload import make_model

__all__ = ["TICK_S", "bench_worker", "param_sums", "worker_report"]

#: The worker's ticker period (``tick=True``): its gaps beyond this are the loop's lag.
TICK_S = 0.001


def param_sums(model: nn.Module) -> list[float]:
    """Per-parameter float64 sums (to check that workers hold the trainer's weights)."""
    with torch.no_grad():
        return [float(p.detach().double().sum()) for p in model.parameters()]


def worker_report(scheme: Any, model: Any, *, memfd_mb: float | None, commits: list[Any], ticks: list[Any]) -> dict[str, Any]:
    """What a bench worker sends back once its receiver stopped."""
    stats = scheme.statistics()
    return {
        "pid": os.getpid(),
        "version": scheme.version,
        "sums": param_sums(model),
        "peak_rss_mb": peak_rss_mb(),
        "rss_mb": rss_mb(),
        "memfd_mb": memfd_mb,
        "commits": commits,
        "ticks": ticks,
        "last_commit_ms": stats.last_commit_ms,
        "last_stage_ms": stats.last_stage_ms,
    }


async def _ticker(ticks: array.array[float], stop: asyncio.Event) -> None:
    """Sleep TICK_S in a loop, stamping each wake-up: gaps show how long the loop stalled."""
    ticks.append(time.perf_counter())
    while not stop.is_set():
        await asyncio.sleep(TICK_S)
        ticks.append(time.perf_counter())


async def bench_worker(
    worker_idx: int,
    scheme: Any,
    n_params: int,
    n_tensors: int,
    probe: bool = False,
    tick: bool = False,
) -> dict[str, Any]:
    """Receive until stopped; report weights' sums, peak RSS and (optionally) probes.

    *probe*: record ``(version, commit time, RSS MiB)`` at every commit (an
    ``on_update`` callback). *tick*: run a 1 ms ticker on the loop and return its
    wake-up times, from which the trainer computes the loop lag during its sends.
    ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, shared by all processes.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl-C is the trainer's business
    torch.set_num_threads(1)
    model = make_model(n_params, n_tensors, seed=1000 + worker_idx)
    commits: list[tuple[int, float, float]] = []

    def on_update(_weights: Any, version: int) -> None:
        commits.append((version, time.perf_counter(), rss_mb()))

    scheme.init_on_receiver(worker_idx=worker_idx, model=model, on_update=on_update if probe else None)
    ticks: array.array[float] = array.array("d")
    stop_tick = asyncio.Event()
    ticker = asyncio.ensure_future(_ticker(ticks, stop_tick)) if tick else None
    try:
        async with scheme:
            await scheme.wait_stopped()
    finally:
        stop_tick.set()
        if ticker is not None:
            await ticker
    return worker_report(scheme, model, memfd_mb=memfd_mb(), commits=commits, ticks=ticks.tolist())
