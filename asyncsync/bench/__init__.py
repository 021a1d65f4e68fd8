"""Benchmarks: asyncsync's transports against torchrl's weight-sync schemes.

Command line: ``python -m asyncsync.bench --help``. From Python::

    from asyncsync.bench import run_benchmark

    rows = run_benchmark(params=["10k", "1M/256"], workers=[1, 2], repeats=15)

Each row is a dict (``kind`` = ``"latency"``, ``"memory"`` or ``"loop_lag"``); see
``docs/benchmarks.md`` for the fields. Must be called from synchronous code (it runs
its own event loops) and, since workers are spawned, under
``if __name__ == "__main__":`` in a script.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DEFAULT_PARAMS", "DEFAULT_REPEATS", "DEFAULT_WORKERS", "available_transports", "run_benchmark"]

DEFAULT_PARAMS: tuple[str, ...] = ("10k", "1M/256", "25M")
DEFAULT_WORKERS: tuple[int, ...] = (1, 2)
DEFAULT_REPEATS = 15


def available_transports() -> list[str]:
    """``["shm", "queue"]``, plus ``"torchrl-mp"`` and ``"torchrl-shared"`` when torchrl imports."""
    from asyncsync.bench._run import available_transports as _available

    return _available()


def run_benchmark(
    transports: Sequence[str] | None = None,
    params: Sequence[str] = DEFAULT_PARAMS,
    workers: Sequence[int] = DEFAULT_WORKERS,
    repeats: int = DEFAULT_REPEATS,
    *,
    loop_lag: bool = False,
    memory: bool | None = None,
    echo: bool = True,
    floors: bool = True,
    flat: bool = False,
    progress: bool | Callable[[str], None] = False,
) -> list[dict[str, Any]]:
    """Run the benchmark and return its rows.

    Args:
        transports: any of ``shm``, ``queue``, ``torchrl-mp``, ``torchrl-shared``
            (default: all available).
        params: model specs ``N`` or ``N/T`` (N params in T tensors), e.g. ``"1M/256"``.
        workers: worker counts to measure.
        repeats: timed sends per row (after 2 warm-up sends).
        loop_lag: add ``loop_lag`` rows (worker loop stalls while the largest model lands,
            commit ``swap`` = "staged" vs ``copy`` = "inline").
        memory: add ``memory`` rows (20 back-to-back sends of the largest model); None:
            only when the largest model has at least 25M params.
        echo: before each latency row, time a bare round trip of one small message to
            the row's workers (fresh processes, same channel): ``echo_ms``,
            ``echo_ratio``. False: both None.
        floors: before each latency row, also time a raw blocking socketpair round trip
            and a spin on a shared-memory version word to the row's workers (fresh
            processes, no event loop): ``socket_rtt_ms``, ``spin_rtt_ms`` and their
            ``*_ratio``. False: all None.
        flat: also measure every asyncsync row with the trainer's model flattened
            (:func:`asyncsync.flatten_parameters`); those rows have ``flat: True``.
        progress: True prints one line per row to stderr; or a callable taking the line.
    """
    from asyncsync.bench._run import _print, run_rows

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("run_benchmark() runs its own event loops; call it from synchronous code")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not params or not workers:
        raise ValueError("params and workers must not be empty")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in workers):
        raise ValueError(f"workers must be positive ints, got {list(workers)}")
    chosen = list(transports) if transports is not None else available_transports()
    if not chosen:
        raise ValueError("no transport to measure")
    say: Callable[[str], None] | None = _print if progress is True else (progress or None)
    return run_rows(chosen, list(params), list(workers), repeats, loop_lag=loop_lag, memory=memory, echo=echo, floors=floors, flat=flat, progress=say)
