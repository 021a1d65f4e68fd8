"""Soak test: sends for minutes with random worker kills, restarts and cancellations.

Run: ``python -m asyncsync.soak --minutes 2`` (``--poll``: every other worker is a polled
one, committing between its steps). The last line reads
``sends=N faults=N detected=N max_detect_ms=X leaks=N``; the exit status is non-zero if a
fault went undetected, a worker ended on the wrong weights, or anything leaked.

``--stateful`` then runs the state machine for the same time: random interleavings of
sends (full, partial, subsets, bfloat16 transfers), manual commits, busy workers and
hosts, blocked trainer loops, leaves, crashes and rejoins, on the local transport
(loopback workers) and the multi-host transport (a trainer and two relays on gloo over
127.0.0.1), checking every guarantee after every step, and that asyncsync logged no
error (it needs the ``test`` extra installed). Its line reads
``stateful_steps=N stateful_hosts_steps=N``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import torch
from torch import nn

from ._errors import AsyncSyncError
from ._schemes._local import MultiProcessWeightSyncScheme
from ._workers import spawn_workers
from .testing import LeakError, no_leaks

__all__ = ["main", "soak"]


def _model(n_params: int) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    for i in range(8):
        m.register_parameter(f"p{i}", nn.Parameter(torch.zeros(n_params // 8)))
    return m


async def _soak_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, n_params: int, poll: bool = False) -> int:
    """Receive until stopped; with *poll*, odd workers commit only between their steps
    (``poll_nowait()``), checking after each commit that the model is whole."""
    poll = poll and worker_idx % 2 == 1
    torch.set_num_threads(1)
    model = _model(n_params)
    scheme.init_on_receiver(worker_idx=worker_idx, model=model, poll=poll)
    async with scheme:
        if poll:
            while not scheme.receiver.stopped:
                if scheme.poll_nowait() is not None:
                    _check_whole(worker_idx, model)
                await asyncio.sleep(0.0005)  # a step of the worker's own work
        await scheme.wait_stopped()
    return _check_whole(worker_idx, model)


def _check_whole(worker_idx: int, model: nn.Module) -> int:
    """The one value every weight holds; AssertionError if they hold several (mixed versions)."""
    values = torch.cat([p.detach() for p in model.parameters()])
    if float(values.min()) != float(values.max()):
        raise AssertionError(f"worker {worker_idx} runs mixed weights")
    return int(values[0])


async def soak(
    minutes: float = 2.0, workers: int = 2, n_params: int = 1_000_000, seed: int = 0, kill_every: float = 3.0, poll: bool = False
) -> dict[str, float]:
    """Run the soak; return its counters (see the module docstring). With *poll*, every
    other worker (1, 3, ...) is a polled one (``init_on_receiver(..., poll=True)``)."""
    counters = {"sends": 0, "faults": 0, "detected": 0, "max_detect_ms": 0.0, "cancelled": 0, "leaks": 0, "wrong": 0}
    try:
        with no_leaks(threads=True):  # what this process tree left: other programs' files are not counted
            await _soak(counters, minutes, workers, n_params, seed, kill_every, poll)
    except LeakError as exc:
        print(exc, file=sys.stderr)
        counters["leaks"] = len(exc.problems)
    return counters


async def _soak(counters: dict[str, float], minutes: float, workers: int, n_params: int, seed: int, kill_every: float, poll: bool) -> None:
    rng = random.Random(seed)
    model = _model(n_params)
    scheme = MultiProcessWeightSyncScheme(timeout=20, on_worker_error="skip")
    scheme.init_on_sender(model=model, num_workers=workers)
    value = 0.0
    group = spawn_workers(_soak_worker, workers, args=(scheme, n_params, poll), scheme=scheme)
    try:
        group.start()
        await scheme.connect()
        deadline = time.monotonic() + minutes * 60  # from the first weights on: start-up is not soaked
        next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
        while time.monotonic() < deadline or not counters["sends"]:
            value += 1.0
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(value)
            action = rng.random()
            if action < 0.2:  # a send cancelled at a random point
                task = asyncio.ensure_future(scheme.send())
                for _ in range(rng.randint(0, 8)):
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                    counters["sends"] += 1
                except asyncio.CancelledError:
                    counters["cancelled"] += 1
            elif action < 0.4:
                await scheme.send_async()
                await scheme.wait_async()
                counters["sends"] += 1
            else:
                await scheme.send()
                counters["sends"] += 1
            if time.monotonic() >= next_kill:
                victim = rng.randrange(workers)
                t0 = time.perf_counter()
                group.kill(victim)
                counters["faults"] += 1
                try:
                    await scheme.sender.wait_dead(victim, timeout=5.0)
                    counters["detected"] += 1
                    counters["max_detect_ms"] = max(counters["max_detect_ms"], (time.perf_counter() - t0) * 1e3)
                except AsyncSyncError as exc:
                    print(f"fault not detected: {exc}", file=sys.stderr)
                await group.restart(victim)
                next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
            if counters["sends"] % 200 == 0:
                print(f"... sends={counters['sends']} faults={counters['faults']}", file=sys.stderr)
        final = await scheme.send()
        applied = scheme.sender.applied_versions()
        counters["wrong"] = sum(v != final for v in applied.values())
        await scheme.aclose()
        results = await group.join(timeout=60)
        counters["wrong"] += sum(r != int(value) for r in results.values())
    finally:
        await scheme.aclose()
        await group.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncsync.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between worker kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--poll", action="store_true", help="every other worker polls (poll_nowait between its steps)")
    parser.add_argument("--stateful", action="store_true", help="also run the ownership state machine for --minutes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    c = asyncio.run(soak(args.minutes, args.workers, args.params, args.seed, args.kill_every, args.poll))
    print(f"cancelled={c['cancelled']} wrong_final_weights={c['wrong']}")
    print(f"sends={c['sends']} faults={c['faults']} detected={c['detected']} max_detect_ms={c['max_detect_ms']:.1f} leaks={c['leaks']}")
    ok = c["detected"] == c["faults"] and c["leaks"] == 0 and c["wrong"] == 0
    if args.stateful:
        steps, process_steps = stateful(args.minutes)  # local, multi-host
        print(f"stateful_steps={steps} stateful_hosts_steps={process_steps}")
    return 0 if ok else 1


def stateful(minutes: float) -> tuple[int, int]:
    """Run the state machine for about *minutes* on the local and the multi-host transport
    (in batches, each with its own leak check); returns the steps checked on each."""
    try:
        from hypothesis import HealthCheck, settings

        from ._stateful import run_machine
    except ImportError as exc:
        raise SystemExit(f"--stateful needs the test extra (hypothesis) ({exc})") from None
    quick = list(HealthCheck)
    deadline = time.monotonic() + minutes * 60
    steps = {"local": 0, "hosts": 0}
    while time.monotonic() < deadline:  # batches, each with its own leak check
        for transport, examples in (("local", 10), ("hosts", 4)):
            batch = settings(max_examples=examples, stateful_step_count=30, deadline=None, suppress_health_check=quick, database=None)
            steps[transport] += run_machine(batch, (transport,), strict_logs=True)
    return steps["local"], steps["hosts"]


if __name__ == "__main__":
    sys.exit(main())
