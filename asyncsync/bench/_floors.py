"""The machine's floors for a small send: a raw socket round trip and a shared-memory spin.

Beside the echo floor (asyncsync's own message machinery), two floors that use no event
loop at all, between the same processes: *workers* peers, each a bare interpreter
(no torch, no asyncsync, no event loop) given its end of a socketpair and a memfd.

* ``socket_rtt``: the trainer writes one 40-byte message to every peer on its blocking
  socketpair, then reads every reply (a ``poll`` with a timeout, then ``recv``); each peer reads and writes it back with blocking
  ``os.read`` / ``os.write``. What one message and one wake-up per worker cost.
* ``spin_rtt``: the trainer writes a new version into an int64 word of a shared-memory
  block (a memfd mapped by all); each peer spins on it and answers by writing the version into its
  own word, on which the trainer spins. No system call, no wake-up: what publishing by a
  version word costs. Spinners yield the CPU (``sched_yield``, immediate when nothing
  else wants it) every few hundred reads: on a loaded machine, or with more spinners
  than cores, a pure spin burns whole scheduler ticks (milliseconds) instead.

Both report the median of *repeats* rounds after ``FLOOR_WARMUP``.
"""

from __future__ import annotations

import math
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time

__all__ = ["FLOOR_WARMUP", "measure_floors"]

FLOOR_WARMUP = 20
#: At least this many rounds per floor (they are microseconds each).
MIN_ROUNDS = 200
MSG = 40
STOP = b"\xff" * MSG
#: Bound of every wait (a peer that stops answering), and of joining the peers.
WAIT_S = 60.0
_YIELD_EVERY = 256
_CLOCK_EVERY = 4096


# The peer: a bare interpreter (``python -I -c``: no torch, no asyncsync; it starts in
# milliseconds), handed its socket and the memfd of the words by descriptor.
_PEER = r"""
import mmap, os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
idx, fd, mem, n, yields = (int(a) for a in sys.argv[1:6])
MSG, STOP, WAIT_S = %d, b"\xff" * %d, %r
while True:
    msg = b""
    while len(msg) < MSG:
        chunk = os.read(fd, MSG - len(msg))
        if not chunk:
            break
        msg += chunk
    if len(msg) < MSG or msg == STOP:
        break
    os.write(fd, msg)
words = memoryview(mmap.mmap(mem, 8 * n)).cast("q")
last = 0
spins = 0
deadline = time.monotonic() + WAIT_S
while True:
    v = words[0]
    if v == last:
        spins += 1
        if yields and spins %% %d == 0:
            os.sched_yield()
        if spins %% %d == 0 and time.monotonic() > deadline:
            sys.exit("no new version for %%s s" %% WAIT_S)
        continue
    if v < 0:
        break
    words[1 + idx] = v
    last = v
    deadline = time.monotonic() + WAIT_S
"""


def _spin_until(words: memoryview, index: int, differs_from: int, deadline_s: float, yields: bool) -> int:
    """Spin until ``words[index] != differs_from``; return it (TimeoutError past the deadline)."""
    spins = 0
    while True:
        v = words[index]
        if v != differs_from:
            return int(v)
        spins += 1
        if yields and spins % _YIELD_EVERY == 0:
            os.sched_yield()
        if spins % _CLOCK_EVERY == 0 and time.monotonic() > deadline_s:
            raise TimeoutError(f"word {index} stayed {differs_from} for {WAIT_S} s")


def _median_p90(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(times), ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def measure_floors(workers: int, repeats: int, *, warmup: int = FLOOR_WARMUP) -> dict[str, float]:
    """Spawn *workers* peers, time the socket and the spin round trips to all, stop them.

    Returns ``socket_rtt_ms``, ``socket_rtt_p90_ms``, ``spin_rtt_ms``, ``spin_rtt_p90_ms``
    (medians and p90s over ``max(repeats, MIN_ROUNDS)`` rounds). No process is left behind.
    """
    if workers < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need workers >= 1, repeats >= 1, warmup >= 0; got {workers}, {repeats}, {warmup}")
    rounds = max(repeats, MIN_ROUNDS)
    yields = True
    code = _PEER % (MSG, MSG, WAIT_S, _YIELD_EVERY, _CLOCK_EVERY)
    mem = os.memfd_create("asyncsync-bench-floor", os.MFD_CLOEXEC)
    peers: list[subprocess.Popen[bytes]] = []
    socks: list[socket.socket] = []
    region: mmap.mmap | None = None
    words: memoryview | None = None
    out: dict[str, float] = {}
    try:
        os.ftruncate(mem, 8 * (1 + workers))
        region = mmap.mmap(mem, 8 * (1 + workers))
        words = memoryview(region).cast("q")
        for i in range(workers):
            ours, theirs = socket.socketpair()
            socks.append(ours)
            with theirs:
                argv = [sys.executable, "-I", "-c", code, str(i), str(theirs.fileno()), str(mem), str(1 + workers), str(int(yields))]
                peers.append(subprocess.Popen(argv, pass_fds=(theirs.fileno(), mem), stdin=subprocess.DEVNULL))
        for s in socks:
            s.settimeout(WAIT_S)
        times: list[float] = []
        for step in range(warmup + rounds):
            msg = step.to_bytes(8, "big") * (MSG // 8)
            t0 = time.perf_counter_ns()
            for s in socks:
                s.sendall(msg)
            for i, s in enumerate(socks):
                got = b""
                while len(got) < MSG:
                    chunk = s.recv(MSG - len(got))
                    if not chunk:
                        raise RuntimeError(f"floor peer {i} closed its socket (exit code {peers[i].poll()})")
                    got += chunk
                if got != msg:
                    raise RuntimeError(f"floor peer {i} answered {got!r} to {msg!r}")
            t1 = time.perf_counter_ns()
            if step >= warmup:
                times.append((t1 - t0) / 1e6)
        out["socket_rtt_ms"], out["socket_rtt_p90_ms"] = _median_p90(times)
        for s in socks:
            s.sendall(STOP)
        times = []
        for step in range(warmup + rounds):
            version = step + 1
            t0 = time.perf_counter_ns()
            words[0] = version
            for i in range(workers):
                deadline = time.monotonic() + WAIT_S
                while _spin_until(words, 1 + i, version - 1, deadline, yields) != version:
                    pass
            t1 = time.perf_counter_ns()
            if step >= warmup:
                times.append((t1 - t0) / 1e6)
        out["spin_rtt_ms"], out["spin_rtt_p90_ms"] = _median_p90(times)
        words[0] = -1
        for i, p in enumerate(peers):
            if p.wait(WAIT_S) != 0:
                raise RuntimeError(f"floor peer {i} exited with {p.returncode}")
    finally:
        if words is not None:
            words[0] = -1  # a peer spinning stops; one reading its socket sees EOF below
            words.release()
        for s in socks:
            s.close()
        for p in peers:
            try:
                p.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(WAIT_S)
        if region is not None:
            region.close()
        os.close(mem)
    return out
