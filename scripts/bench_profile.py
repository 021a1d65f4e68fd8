"""Where a send's CPU goes: the scheme and its receivers in one process, under cProfile.

``python scripts/bench_profile.py --params 10k --workers 2 --sends 2000``

By default the receivers are :func:`asyncsync.loopback_worker` ends in the trainer's own event loop,
over the same sockets and shared memory as spawned workers: this measures the Python and
system-call work of both sides per send (what the 2-core machine has to share), without
the cost of waking another process. It prints CPU per send without and with the
profiler, then that CPU split by owner (sender, receiver, channel, event loop, the copy
in torch, other) from the profile's own time per function, and the top functions. The
owners are the library's own files, and the ownership invariant checks
(``ASYNCSYNC_DEBUG``) are switched off while it measures: a developer's tool, hence in
``scripts/`` rather than in :mod:`asyncsync.bench`, which uses the public API only.

With ``--spawned`` the receivers are the bench's worker processes instead, and only the
trainer is profiled: its own CPU per send, as the bench's ``trainer_cpu_ms_per_send``
measures it (compare ``--workers 1`` with ``--workers 8`` for the cost of each worker).

From Python, with ``scripts/`` on the path::

    from bench_profile import profile_sends
    report = profile_sends("1M/256", workers=2, sends=300)
    print(report["cpu_us_per_send"], report["shares"])
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import time
from typing import Any

import torch

__all__ = ["profile_sends"]

_OWNERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # _core/ minus _layout.py, which counts as "other"
    ("sender", ("asyncsync/_local/_sender.py", "asyncsync/_local/_links.py", "asyncsync/_local/_publisher.py",
                "asyncsync/_core/_acks.py", "asyncsync/_core/_deadline.py", "asyncsync/_core/_front.py",
                "asyncsync/_core/_offload.py", "asyncsync/_core/_source.py", "asyncsync/_core/_ownership.py", "asyncsync/_io/_slots.py",
                "asyncsync/_core/_weights.py", "asyncsync/_core/_signal.py", "asyncsync/_core/_flat.py")),
    ("receiver", ("asyncsync/_local/_receiver.py", "asyncsync/_local/_commit.py", "asyncsync/_local/_slotmap.py",
                  "asyncsync/_local/_bucket.py", "asyncsync/_local/_mailbox.py")),
    ("channel", ("asyncsync/_io/_queues.py", "asyncsync/_io/_pipe.py", "asyncsync/_io/_framing.py", "asyncsync/_wire/_codec.py", "sendmsg", "recvmsg_into")),
    ("event loop", ("asyncio/", "selectors.py", "method 'poll'", "select.epoll")),
    ("torch copy", ("_foreach_copy_", "asyncsync/_io/_staging.py")),
)


def _owner(func: tuple[str, int, str]) -> str:
    where = f"{func[0]} {func[2]}"
    for owner, needles in _OWNERS:
        if any(n in where for n in needles):
            return owner
    return "other"


async def _run(params: str, workers: int, sends: int, profile: bool, flat: bool = False) -> tuple[float, pstats.Stats | None]:
    from asyncsync import MultiProcessWeightSyncScheme, flatten_parameters, loopback_worker
    from asyncsync.bench._workload import make_model, parse_params

    n_params, n_tensors = parse_params(params)
    model = make_model(n_params, n_tensors)
    if flat:
        flatten_parameters(model)
    scheme = MultiProcessWeightSyncScheme(strategy="tensordict", sync=True)
    scheme.init_on_sender(model=model, num_workers=workers)
    ends = [loopback_worker(scheme, i) for i in range(workers)]
    for i, end in enumerate(ends):
        end.init_on_receiver(worker_idx=i, model=make_model(n_params, n_tensors, seed=1))
    connecting = [asyncio.ensure_future(end.connect()) for end in ends]
    try:
        await scheme.connect()
        await asyncio.gather(*connecting)
        for _ in range(min(200, sends)):
            await scheme.send()
        prof = cProfile.Profile() if profile else None
        t0 = time.process_time()
        if prof is not None:
            prof.enable()
        for _ in range(sends):
            await scheme.send()
        if prof is not None:
            prof.disable()
        cpu = (time.process_time() - t0) / sends
    finally:
        for end in ends:
            await end.aclose()
        await scheme.aclose()
    return cpu, (pstats.Stats(prof) if prof is not None else None)


async def _run_spawned(params: str, workers: int, sends: int, profile: bool, flat: bool = False) -> tuple[float, pstats.Stats | None]:
    """:func:`_run` with the bench's worker processes as receivers: the trainer alone is measured."""
    from asyncsync import MultiProcessWeightSyncScheme, flatten_parameters, spawn_workers
    from asyncsync.bench._worker import bench_worker
    from asyncsync.bench._workload import make_model, parse_params, perturb_

    n_params, n_tensors = parse_params(params)
    model = make_model(n_params, n_tensors)
    if flat:
        flatten_parameters(model)
    scheme = MultiProcessWeightSyncScheme(strategy="tensordict", sync=True, timeout=300.0)
    scheme.init_on_sender(model=model, num_workers=workers)
    async with spawn_workers(bench_worker, workers, args=(scheme, n_params, n_tensors), scheme=scheme, join_timeout=60.0) as group:
        try:
            await scheme.connect()
            for step in range(min(200, sends)):
                perturb_(model, step)
                await scheme.send()
            # CPU time, not wall time: the trainer's waits for acks are idle time, not cost.
            prof = cProfile.Profile(time.process_time) if profile else None
            cpu = 0.0
            for step in range(sends):
                perturb_(model, step)  # fresh values, outside the measured part, as in the bench
                t0 = time.process_time()
                if prof is not None:
                    prof.enable()
                await scheme.send()
                if prof is not None:
                    prof.disable()
                cpu += time.process_time() - t0
        finally:
            await scheme.aclose()
        await group.join(timeout=60.0)
    return cpu / sends, (pstats.Stats(prof) if prof is not None else None)


def profile_sends(
    params: str = "10k", workers: int = 2, sends: int = 2000, top: int = 15, flat: bool = False, spawned: bool = False
) -> dict[str, Any]:
    """Profile *sends* sends of a *params* model to *workers* in-process receivers.

    *flat*: the trainer's model goes through :func:`asyncsync.flatten_parameters` first.
    *spawned*: the receivers are worker processes, and only the trainer is measured.

    Returns ``cpu_us_per_send`` (no profiler), ``profiled_cpu_us_per_send``,
    ``shares`` (owner -> fraction of the profiled time) and ``top`` (printable lines).
    """
    if workers < 1 or sends < 1:
        raise ValueError(f"need workers >= 1 and sends >= 1, got {workers}, {sends}")
    from asyncsync._core._ownership import debug_enabled, set_debug

    debug = debug_enabled()
    set_debug(False)  # the invariant checks (ASYNCSYNC_DEBUG) would dominate the profile
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = _run_spawned if spawned else _run
        plain, _ = asyncio.run(run(params, workers, sends, profile=False, flat=flat))
        profiled, stats = asyncio.run(run(params, workers, sends, profile=True, flat=flat))
    finally:
        set_debug(debug)
        torch.set_num_threads(threads)
    assert stats is not None
    by_owner: dict[str, float] = {}
    total = 0.0
    for func, (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        by_owner[_owner(func)] = by_owner.get(_owner(func), 0.0) + tt
        total += tt
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    return {
        "params": params,
        "workers": workers,
        "sends": sends,
        "spawned": spawned,
        "cpu_us_per_send": plain * 1e6,
        "profiled_cpu_us_per_send": profiled * 1e6,
        "shares": {k: v / total for k, v in sorted(by_owner.items(), key=lambda kv: -kv[1])},
        "top": out.getvalue(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python scripts/bench_profile.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="10k", help="model spec N or N/T, as in the bench (default 10k)")
    parser.add_argument("--workers", type=int, default=2, help="in-process receivers (default 2)")
    parser.add_argument("--sends", type=int, default=2000, help="profiled sends (default 2000)")
    parser.add_argument("--top", type=int, default=15, help="functions listed (default 15)")
    parser.add_argument("--flat", action="store_true", help="flatten the trainer's model first (asyncsync.flatten_parameters)")
    parser.add_argument("--spawned", action="store_true", help="receivers in worker processes; profile the trainer alone")
    args = parser.parse_args(argv)
    r = profile_sends(args.params, args.workers, args.sends, args.top, flat=args.flat, spawned=args.spawned)
    where, who = ("worker process", "trainer") if args.spawned else ("in-process receiver", "sender + receivers")
    print(f"{r['params']} to {r['workers']} {where}{'' if r['workers'] == 1 else 's'}, {r['sends']} sends")
    print(f"CPU per send ({who}): {r['cpu_us_per_send']:.0f} us; under the profiler {r['profiled_cpu_us_per_send']:.0f} us")
    print("profiled time by owner: " + ", ".join(f"{k} {v:.0%}" for k, v in r["shares"].items()))
    print(r["top"])


if __name__ == "__main__":
    main()
