"""This process's memory, read from ``/proc`` (stdlib; psutil as a fallback).

Current and peak RSS (``VmHWM``, which :func:`reset_peak_rss` resets), the resident
part of asyncsync's ``memfd`` mappings, and what ``/dev/shm`` holds. Used on both sides
of the benchmark: the trainer around its timed sends, each worker in its report.
"""

from __future__ import annotations

import contextlib
import os
import shutil

__all__ = ["dev_shm_mb", "memfd_mb", "peak_rss_mb", "reset_peak_rss", "rss_mb"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    """Current RSS of this process in MiB (Linux /proc; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        import psutil

        return float(psutil.Process().memory_info().rss) / 2**20


def reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) on Linux; a no-op elsewhere."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")


def peak_rss_mb() -> float:
    """Peak RSS (VmHWM) of this process in MiB; the current RSS where unsupported."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    return rss_mb()


def memfd_mb() -> float | None:
    """Resident MiB of this process's asyncsync memfd mappings (from /proc/self/smaps)."""
    try:
        total_kb = 0
        inside = False
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping header line
                    inside = "/memfd:asyncsync" in line
                elif inside and head == "Rss:":
                    total_kb += int(line.split()[1])
        return total_kb / 1024.0
    except (OSError, ValueError, IndexError):
        return None


def dev_shm_mb() -> float | None:
    """Bytes used in /dev/shm, in MiB (None where there is no /dev/shm)."""
    try:
        return shutil.disk_usage("/dev/shm").used / 2**20
    except OSError:
        return None
