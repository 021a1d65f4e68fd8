"""CPU time of other processes, read from outside (stdlib; psutil as a fallback).

``sample(pids)`` before and after a window, then ``elapsed_s(before, after)``: the CPU
seconds (user + system) those processes used in between. On Linux the source is
``/proc/<pid>/task/<tid>/schedstat`` (the scheduler's ``sum_exec_runtime``, in ns, per
thread): ``/proc/<pid>/stat``, ``getrusage`` of a child and psutil count in clock ticks
(10 ms), coarser than a whole row of small sends. A thread that exits inside the window
takes its share of the window with it (none of the benchmark's processes starts or ends
threads between warm-up and the end of the timed sends); a thread that starts inside it
counts in full. Elsewhere psutil's ``cpu_times()`` is used (tick resolution), or nothing.

The trainer measures itself with ``time.process_time()`` (all its threads, ns).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["elapsed_s", "sample"]

#: A per-process sample: thread id -> CPU ns (key -1: the whole process, from psutil).
Sample = dict[int, int]


def _schedstat(pid: int) -> Sample | None:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: Sample = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                out[int(tid)] = int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended between listdir and open
    return out or None


def _psutil(pid: int) -> Sample | None:
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
    except Exception:
        return None
    return {-1: round((t.user + t.system) * 1e9)}


def _one(pid: int) -> Sample | None:
    got = _schedstat(pid)
    if got is not None and any(got.values()):
        return got
    # schedstat reads 0 where the kernel keeps no scheduler statistics
    return _psutil(pid)


def sample(pids: Sequence[int | None]) -> list[Sample | None]:
    """One sample per pid (None for a pid that cannot be read)."""
    return [_one(pid) if pid is not None else None for pid in pids]


def elapsed_s(before: Sequence[Sample | None], after: Sequence[Sample | None]) -> float | None:
    """CPU seconds used by all the sampled processes between two samples; None if any is missing."""
    if len(before) != len(after) or not before:
        return None
    total = 0
    for b, a in zip(before, after):
        if b is None or a is None or (-1 in b) != (-1 in a):
            return None
        total += sum(ns - b.get(tid, 0) for tid, ns in a.items())
    return total / 1e9
