"""Count the system calls of empty polls: ``strace`` around a loop of ``poll_nowait()``.

Run: python scripts/poll_syscalls.py [--polls 1000000]

It runs itself under ``strace -f`` (when strace is installed): a sender and a polled
receiver in one process (``asyncsync.testing.loopback_worker``), version 0 applied, then
*polls* calls of ``receiver.poll_nowait()`` with nothing new, between two marker calls
(``os.stat`` of paths that do not exist). It prints how many system calls each thread made
between the markers, then does the same with one version sent before the polls, to show
the cost of a poll that commits: its ack goes into the mailbox's shared memory, then one
``write`` of the sender's wake (an eventfd); nothing goes through the socket. Without
strace it counts the calls made through the receiver's socket object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BEGIN, END = "/asyncsync-poll-begin", "/asyncsync-poll-end"


def _marker(path: str) -> None:
    try:
        os.stat(path)
    except FileNotFoundError:
        pass


async def _inner(polls: int, send_first: bool) -> int:
    """The traced program: returns how many polls committed something."""
    import torch
    from torch import nn

    from asyncsync import MultiProcessWeightSyncScheme
    from asyncsync.testing import loopback_worker

    def policy() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=policy(), num_workers=1)
    worker = loopback_worker(scheme, 0)
    worker.init_on_receiver(worker_idx=0, model=policy(), poll=True)
    await asyncio.gather(scheme.connect(), worker.connect())
    if send_first:
        await scheme.send_async()  # written into the mailbox: the first poll commits it
    receiver = worker.receiver
    committed = 0
    _marker(BEGIN)
    for _ in range(polls):  # a synchronous loop: nothing else runs on this thread meanwhile
        if receiver.poll_nowait() is not None:
            committed += 1
    _marker(END)
    await scheme.aclose()
    await worker.aclose()
    return committed


def _count(trace: str, main_pid: int) -> dict[str, int]:
    """System calls per thread between the markers of an ``strace -f -o`` trace."""
    inside = False
    counts: dict[str, int] = {}
    for line in trace.splitlines():
        m = re.match(r"(\d+)\s+(\w+)\(", line)
        if not m:
            continue
        pid, name = int(m.group(1)), m.group(2)
        if BEGIN in line:
            inside = True
            continue
        if END in line:
            break
        if inside:
            who = "main thread" if pid == main_pid else "other threads"
            counts[who] = counts.get(who, 0) + 1
            counts[f"{who}: {name}"] = counts.get(f"{who}: {name}", 0) + 1
    return counts


def _traced(polls: int, send_first: bool) -> tuple[dict[str, int], str]:
    strace = shutil.which("strace")
    assert strace is not None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace"
        args = [strace, "-f", "-qq", "-o", str(out), sys.executable, __file__, "--inner", str(polls)]
        if send_first:
            args.append("--send-first")
        proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the traced run failed:\n{proc.stderr}")
        trace = out.read_text()
        first = re.match(r"(\d+)\s", trace)
        assert first is not None
        return _count(trace, int(first.group(1))), proc.stdout.strip()


def _counted_socket(polls: int) -> int:
    """Without strace: calls made through the receiver's socket object during the polls."""

    async def run() -> int:
        import torch
        from torch import nn

        from asyncsync import MultiProcessWeightSyncScheme
        from asyncsync.testing import loopback_worker

        scheme = MultiProcessWeightSyncScheme(timeout=30)
        scheme.init_on_sender(model=nn.Linear(4, 2), num_workers=1)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=nn.Linear(4, 2), poll=True)
        await asyncio.gather(scheme.connect(), worker.connect())
        queue = worker.receiver._queue
        calls = [0]
        real = queue._sock

        class Counting:
            def __getattr__(self, name: str) -> Any:
                attr = getattr(real, name)
                if callable(attr):
                    calls[0] += 1
                return attr

        queue._sock = Counting()  # type: ignore[assignment]
        for _ in range(polls):
            worker.receiver.poll_nowait()
        queue._sock = real
        await scheme.aclose()
        await worker.aclose()
        del torch
        return calls[0]

    return asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--polls", type=int, default=1_000_000)
    p.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--send-first", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.inner is not None:
        print(asyncio.run(_inner(a.inner, a.send_first)))
        return
    if shutil.which("strace") is None:
        print(f"strace is not installed: counting calls through the receiver's socket instead: {_counted_socket(a.polls)} in {a.polls} empty polls")
        return
    for send_first, what in ((False, "empty polls"), (True, "polls, the first of which commits a version")):
        counts, committed = _traced(a.polls, send_first)
        main_calls = counts.get("main thread", 0)
        others = counts.get("other threads", 0)
        detail = ", ".join(f"{k.split(': ', 1)[1]} x{v}" for k, v in sorted(counts.items()) if k.startswith("main thread: "))
        print(f"{a.polls} {what} ({committed} committed): {main_calls} system calls on the polling thread{f' ({detail})' if detail else ''}, {others} on other threads")


if __name__ == "__main__":
    main()
