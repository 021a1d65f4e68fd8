"""asyncsync side of the benchmark, the one-copy floor, and the row driver.

Every timed send is ``await scheme.send()`` with ``sync=True``: it lasts until every
worker acknowledged (applied) the new version. The trainer model is changed with
``perturb_`` before every send, outside the timed region, so each send ships fresh
weights. Every process runs ``torch.set_num_threads(1)``.

Worker processes are started with :func:`asyncsync.spawn_workers`; each row gets fresh
workers, and the scheme is always closed (``try/finally: await scheme.aclose()``) before
the workers are joined, so ctrl-C or an error leaves no process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from asyncsync.bench import _cpu
from asyncsync.bench._echo import measure_echo
from asyncsync.bench._floors import measure_floors
from asyncsync.bench._poll import (
    POLL_TRANSPORTS,
    PUBLISH_KEYS,
    cpu_plan,
    pinned,
    poll_worker,
    publish_to_commit,
    send_stamped,
)
from asyncsync.bench._procmem import dev_shm_mb, memfd_mb, peak_rss_mb, reset_peak_rss, rss_mb
from asyncsync.bench._worker import TICK_S, bench_worker, param_sums
from asyncsync.bench._workload import make_model, parse_params, perturb_

__all__ = [
    "ASYNCSYNC_TRANSPORTS",
    "WARMUP_SENDS",
    "available_transports",
    "measure_floor",
    "run_asyncsync",
    "run_rows",
]

ASYNCSYNC_TRANSPORTS: tuple[str, ...] = ("shm", "queue")
#: "shm" with the trainer and its workers on uvloop (when uvloop is installed).
UVLOOP_TRANSPORTS: tuple[str, ...] = ("shm-uvloop",)
TORCHRL_TRANSPORTS: tuple[str, ...] = ("torchrl-mp", "torchrl-shared")
WARMUP_SENDS = 2
MEMORY_SENDS = 20
#: At least this many timed sends in a loop-lag row (a max over few samples is noise).
LOOP_LAG_SENDS = 30
#: Timeout of the scheme's waits (connect, sends, acks) in the benchmark.
SCHEME_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 60.0

Progress = Callable[[str], None]


def available_transports() -> list[str]:
    """asyncsync's transports (on uvloop too, when installed), plus torchrl's schemes when torchrl can be imported."""
    from asyncsync.bench._torchrl import available

    return [*ASYNCSYNC_TRANSPORTS, *POLL_TRANSPORTS, *(UVLOOP_TRANSPORTS if _has_uvloop() else ()), *(TORCHRL_TRANSPORTS if available() else ())]


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def _run_loop(transport: str, coro: Any) -> Any:
    """``asyncio.run(coro)``, on uvloop for a ``*-uvloop`` transport (its workers follow)."""
    if transport in UVLOOP_TRANSPORTS:
        import uvloop

        if sys.version_info >= (3, 11):
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coro)
        loop = uvloop.new_event_loop()  # Python 3.10: no asyncio.Runner
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
    return asyncio.run(coro)


# --------------------------------------------------------------------------
# small measurement helpers
# --------------------------------------------------------------------------

def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty sequence."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[k]


def summarize(latencies_ms: Sequence[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(latencies_ms), "p90_ms": _percentile(latencies_ms, 0.9)}


# --------------------------------------------------------------------------
# the one-copy floor
# --------------------------------------------------------------------------


def measure_floor(n_params: int, n_tensors: int, repeats: int) -> dict[str, float]:
    """Median time of one fused copy of the model's tensors into a touched buffer.

    Same process, one thread; the destination is one contiguous buffer of the model's
    size, written once before timing. Fresh values before every copy (``perturb_``,
    untimed), as for the sends.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(n_params, n_tensors, seed=0)
        src = [p.detach() for p in model.parameters()]
        buf = torch.zeros(sum(t.numel() for t in src), dtype=src[0].dtype)
        dst = [v.view(t.shape) for v, t in zip(torch.split(buf, [t.numel() for t in src]), src)]
        nbytes = buf.numel() * buf.element_size()
        n = max(repeats, 15) if nbytes >= 16 << 20 else max(repeats, 100)
        times: list[float] = []
        for step in range(WARMUP_SENDS + n):
            perturb_(model, step)
            t0 = time.perf_counter_ns()
            torch._foreach_copy_(dst, src)
            t1 = time.perf_counter_ns()
            if step >= WARMUP_SENDS:
                times.append((t1 - t0) / 1e6)
        if not torch.equal(buf[: src[0].numel()].view(src[0].shape), src[0]):
            raise RuntimeError("floor copy did not copy")
        return {"floor_ms": statistics.median(times), "floor_p90_ms": _percentile(times, 0.9)}
    finally:
        torch.set_num_threads(prev)


# --------------------------------------------------------------------------
# trainer side
# --------------------------------------------------------------------------


async def run_asyncsync(
    transport: str,
    n_params: int,
    n_tensors: int,
    workers: int,
    repeats: int,
    *,
    commit: str = "swap",
    probe: bool = False,
    tick: bool = False,
    warmup: int = WARMUP_SENDS,
    flat: bool = False,
) -> dict[str, Any]:
    """Time *repeats* synchronous sends of fresh weights to *workers* fresh processes.

    *flat*: the trainer's model goes through :func:`asyncsync.flatten_parameters` first.

    Returns ``latencies_ms``, per-send ``t0``/``t1`` (perf_counter seconds) and
    ``versions``, the sender's peak RSS and memory before/after the timed sends,
    ``trainer_cpu_s`` (``time.process_time()`` summed over the timed sends),
    ``workers_cpu_s`` (all workers' CPU from the end of the warm-up to the end of the
    timed sends, see :mod:`asyncsync.bench._cpu`; None where it cannot be read), and
    ``workers``: each worker's report (see :func:`bench_worker`). The workers' final
    weights are checked against the trainer's.
    """
    from asyncsync import MultiProcessWeightSyncScheme, flatten_parameters, spawn_workers

    polled = transport in POLL_TRANSPORTS
    if transport in UVLOOP_TRANSPORTS or polled:
        transport = transport.removesuffix("-uvloop").removesuffix("-poll")
    if transport not in ASYNCSYNC_TRANSPORTS:
        raise ValueError(f"unknown asyncsync transport {transport!r}; expected one of {ASYNCSYNC_TRANSPORTS + UVLOOP_TRANSPORTS + POLL_TRANSPORTS}")
    model = make_model(n_params, n_tensors, seed=0)
    if flat:
        flatten_parameters(model)
    scheme = MultiProcessWeightSyncScheme(
        strategy="tensordict",
        sync=True,
        timeout=SCHEME_TIMEOUT_S,
        transport=transport,  # type: ignore[arg-type]
        commit=commit,  # type: ignore[arg-type]
    )
    scheme.init_on_sender(model=model, num_workers=workers)
    reset_peak_rss()
    out: dict[str, Any] = {"latencies_ms": [], "t0": [], "t1": [], "versions": []}
    trainer_cpu_s = 0.0
    published: dict[int, float] = {}  # shm-poll: version -> when send_async returned
    cpus = cpu_plan(workers) if polled else None  # shm-poll: a CPU each, where there are enough
    pinning = contextlib.ExitStack()
    pinning.enter_context(pinned(cpus))
    out["pinned_cpus"] = cpus
    async with spawn_workers(
        poll_worker if polled else bench_worker,
        workers,
        args=(scheme, n_params, n_tensors, probe, tick, *([cpus] if polled else [])),
        scheme=scheme,
        join_timeout=JOIN_TIMEOUT_S,
    ) as group:
        try:
            await scheme.connect()
            pids = [p.pid for p in group.processes.values()]
            cpu_before: list[_cpu.Sample | None] = []
            for step in range(warmup + repeats):
                if step == warmup and tick:  # steady state: every slot mapped by now
                    out["baseline"] = await _lag_baselines(model, repeats, 1000)
                perturb_(model, step)
                if step == warmup:
                    out["rss_before_mb"] = rss_mb()
                    out["dev_shm_before_mb"] = dev_shm_mb()
                    out["memfd_before_mb"] = memfd_mb()
                    reset_peak_rss()
                    # The workers wait between sends: their CPU from here to the end
                    # of the timed sends is theirs for the timed sends.
                    cpu_before = _cpu.sample(pids)
                c0 = time.process_time()
                t0 = time.perf_counter_ns()
                version = await (send_stamped(scheme, published) if polled else scheme.send())
                t1 = time.perf_counter_ns()
                c1 = time.process_time()
                if step >= warmup:
                    trainer_cpu_s += c1 - c0
                    out["latencies_ms"].append((t1 - t0) / 1e6)
                    out["t0"].append(t0 / 1e9)
                    out["t1"].append(t1 / 1e9)
                    out["versions"].append(version)
            out["workers_cpu_s"] = _cpu.elapsed_s(cpu_before, _cpu.sample(pids))
            out["trainer_cpu_s"] = trainer_cpu_s
            out["rss_after_mb"] = rss_mb()
            out["dev_shm_after_mb"] = dev_shm_mb()
            out["memfd_after_mb"] = memfd_mb()
            out["peak_rss_sender_mb"] = peak_rss_mb()
            stats = scheme.sender.statistics()
            out["slots"] = stats.slots
            out["slot_bytes"] = stats.slot_bytes
            out["last_copy_ms"] = stats.last_copy_ms
            out["worker_commit_ms"] = [w.commit_ms for w in stats.workers]
        finally:
            pinning.close()
            await scheme.aclose()
        results = await group.join(timeout=JOIN_TIMEOUT_S)
    expected = param_sums(model)
    stale = [i for i, r in results.items() if r["sums"] != expected]
    if stale:
        raise RuntimeError(f"asyncsync workers {stale} do not hold the trainer's last weights")
    out["workers"] = [results[i] for i in sorted(results)]
    if polled:
        out.update(publish_to_commit(published, out["workers"], out["versions"]))
    out["peak_rss_worker_mb"] = max(r["peak_rss_mb"] for r in out["workers"])
    return out


async def _lag_baselines(model: nn.Module, repeats: int, step0: int) -> dict[str, list[tuple[float, float]]]:
    """Windows for the loop-lag references, before the timed sends.

    ``idle``: the trainer sleeps. ``copy``: the trainer does its own part of a send
    without sending (``perturb_``, then one copy of the weights into a touched buffer,
    in a thread as the sender does): what the machine alone imposes on the worker.
    """
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    await asyncio.sleep(0.5)
    windows: dict[str, list[tuple[float, float]]] = {"idle": [(t0, time.perf_counter())], "copy": []}
    src = [p.detach() for p in model.parameters()]
    dst = [torch.zeros_like(t) for t in src]
    for k in range(repeats):
        perturb_(model, step0 + k)
        a = time.perf_counter()
        await loop.run_in_executor(None, torch._foreach_copy_, dst, src)
        windows["copy"].append((a, time.perf_counter()))
    del dst
    return windows


def _max_gap(ticks: Sequence[float], windows: Sequence[tuple[float, float]]) -> list[float]:
    """Lag (ms beyond TICK_S) of every ticker sleep that began inside one of *windows*.

    (A stall that began before a window, e.g. the previous send's, is not counted in it;
    the sleep in progress when a window opens is, within two ticks.)
    """
    lags: list[float] = []
    i = 0
    for a, b in zip(ticks, ticks[1:]):
        while i < len(windows) and windows[i][1] < a:
            i += 1
        if i < len(windows) and a >= windows[i][0] - 2 * TICK_S:
            lags.append(max(0.0, (b - a) - TICK_S) * 1e3)
    return lags


def _loop_lag(res: dict[str, Any]) -> dict[str, Any]:
    """Max ticker gap beyond TICK_S while sends are in flight, references, send-to-commit."""
    sends = list(zip(res["t0"], res["t1"]))
    lags = [lag for w in res["workers"] for lag in _max_gap(w["ticks"], sends)]
    lag_max = max(lags, default=0.0)
    base: dict[str, float] = {}
    for name, windows in res.get("baseline", {}).items():
        ref = [lag for w in res["workers"] for lag in _max_gap(w["ticks"], windows)]
        base[f"loop_lag_{name}_max_ms"] = max(ref, default=float("nan"))
    sent_at = dict(zip(res["versions"], res["t0"]))
    to_commit: list[float] = []
    for w in res["workers"]:
        for version, t, _rss in w["commits"]:
            if version in sent_at:
                to_commit.append((t - sent_at[version]) * 1e3)
    return {
        "loop_lag_max_ms": lag_max,
        "loop_lag_p99_ms": _percentile(lags, 0.99) if lags else float("nan"),
        **base,
        "ticks": len(lags),
        "send_to_commit_ms": statistics.median(to_commit) if to_commit else float("nan"),
        "send_to_commit_max_ms": max(to_commit) if to_commit else float("nan"),
    }


# --------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------


def _largest(specs: Sequence[str]) -> str:
    return max(specs, key=lambda s: parse_params(s))


def _mb(nbytes: float) -> float:
    return nbytes / 2**20


def run_rows(
    transports: Sequence[str],
    params: Sequence[str],
    workers: Sequence[int],
    repeats: int,
    *,
    loop_lag: bool = False,
    memory: bool | None = None,
    echo: bool = True,
    floors: bool = True,
    flat: bool = False,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Run every (params x workers x transport) row, then the memory and loop-lag rows.

    *echo*: measure the echo floor (:func:`asyncsync.bench._echo.measure_echo`) with the
    row's worker count right before each latency row, after its one-copy floor.
    *floors*: also the raw socket round trip and the shared-memory spin
    (:func:`asyncsync.bench._floors.measure_floors`), same worker count.
    *flat*: asyncsync rows are measured twice, the second time (``flat: True``) with
    the trainer's model flattened (:func:`asyncsync.flatten_parameters`).
    """
    say = progress or (lambda _line: None)
    for t in transports:
        if t not in (*ASYNCSYNC_TRANSPORTS, *UVLOOP_TRANSPORTS, *POLL_TRANSPORTS, *TORCHRL_TRANSPORTS):
            raise ValueError(f"unknown transport {t!r}; expected one of {(*ASYNCSYNC_TRANSPORTS, *UVLOOP_TRANSPORTS, *POLL_TRANSPORTS, *TORCHRL_TRANSPORTS)}")
        if t in UVLOOP_TRANSPORTS and not _has_uvloop():
            raise ValueError(f"transport {t!r} needs uvloop (pip install uvloop)")
    if any(t in TORCHRL_TRANSPORTS for t in transports):
        from asyncsync.bench._torchrl import available

        if not available():
            raise ValueError("torchrl transports were asked for but torchrl.weight_update cannot be imported")
    specs = {p: parse_params(p) for p in params}
    if memory is None:
        memory = specs[_largest(params)][0] >= 25_000_000
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    try:
        for spec in params:
            n_params, n_tensors = specs[spec]
            nbytes = n_params * 4
            for nw in workers:
                variants = [(t, False) for t in transports]
                if flat:
                    variants += [(t, True) for t in transports if t in ASYNCSYNC_TRANSPORTS]
                for transport, flat_row in variants:
                    t_start = time.perf_counter()
                    neighbours = _Neighbours()
                    # The floor right before each row: the same conditions (a busy
                    # neighbour, memory bandwidth) as the row it is compared with.
                    floor = measure_floor(n_params, n_tensors, repeats)
                    # The echo floor too: fresh processes, the row's worker count.
                    echo_ms = measure_echo(nw, repeats)["echo_ms"] if echo else None
                    machine = measure_floors(nw, repeats) if floors else {}
                    row = _latency_row(transport, spec, n_params, n_tensors, nw, repeats, flat=flat_row)
                    row["floor_ms"] = floor["floor_ms"]
                    row["floor_ratio"] = row["median_ms"] / floor["floor_ms"]
                    row["echo_ms"] = echo_ms
                    row["echo_ratio"] = row["median_ms"] / echo_ms if echo_ms else None
                    for name in ("socket_rtt", "spin_rtt"):
                        value = machine.get(f"{name}_ms")
                        row[f"{name}_ms"] = value
                        row[f"{name}_ratio"] = row["median_ms"] / value if value else None
                    row["gbps"] = nbytes / (row["median_ms"] / 1e3) / 1e9
                    rows.append(neighbours.stamp(row))
                    say(
                        f"{transport + (' flat' if flat_row else ''):>14} {spec:>8} x{nw}: median {row['median_ms']:9.3f} ms  "
                        f"p90 {row['p90_ms']:9.3f} ms  {row['floor_ratio']:7.2f}x floor {row['floor_ms']:.4f} ms  "
                        f"{_x(row['echo_ratio'])} echo {_ms(echo_ms)}  {_x(row['socket_rtt_ratio'])} socket "
                        f"{_ms(row['socket_rtt_ms'])}  {_x(row['spin_rtt_ratio'])} spin {_ms(row['spin_rtt_ms'])}  "
                        f"CPU/send {_ms(row['cpu_ms_per_send'])} trainer {_ms(row['trainer_cpu_ms_per_send'])} "
                        f"({_ms(row['trainer_cpu_ms_per_worker'])}/worker)  ({time.perf_counter() - t_start:.1f}s, "
                        f"others {row.get('other_cpu_pct', '?')}% CPU)"
                    )
                    if "publish_to_commit_us" in row:
                        say(
                            f"{transport:>14} {spec:>8} x{nw}: publish->commit median {row['publish_to_commit_us']:.1f} us, "
                            f"min {row['publish_to_commit_min_us']:.1f} p10 {row['publish_to_commit_p10_us']:.1f} "
                            f"p90 {row['publish_to_commit_p90_us']:.1f} p99 {row['publish_to_commit_p99_us']:.1f} us, "
                            f"{100 * row['publish_to_commit_within_20us']:.0f}% within 20 us (until the poll began "
                            f"{row['publish_to_poll_us']:.1f} us, the committing poll {row['commit_poll_us']:.1f} us; "
                            f"{'pinned to CPUs ' + str(row['pinned_cpus']) if row.get('pinned_cpus') else 'not pinned'}, "
                            f"load {row.get('poll_loadavg')})"
                        )
        _add_torchrl_ratios(rows)
        for line in _add_cpu_growth(rows):
            say(line)
        ours = [t for t in transports if t in ASYNCSYNC_TRANSPORTS]
        big = _largest(params)
        n_params, n_tensors = specs[big]
        if memory and ours:
            for transport in ours:
                neighbours = _Neighbours()
                row = _memory_row(transport, big, n_params, n_tensors, max(workers))
                rows.append(neighbours.stamp(row))
                say(
                    f"memory {transport:>7} {big:>8} x{max(workers)}: sender RSS {row['rss_sender_before_mb']:.0f} -> "
                    f"{row['rss_sender_after_mb']:.0f} MiB, /dev/shm {row['dev_shm_before_mb']} -> {row['dev_shm_after_mb']} MiB"
                )
        if loop_lag:
            for nw in workers:
                for mode, commit in (("staged", "swap"), ("inline", "copy")):
                    neighbours = _Neighbours()
                    row = _loop_lag_row(mode, commit, big, n_params, n_tensors, nw, max(repeats, LOOP_LAG_SENDS))
                    rows.append(neighbours.stamp(row))
                    say(
                        f"loop-lag {mode:>6} {big:>8} x{nw}: lag max {row['loop_lag_max_ms']:.2f} ms (idle {row.get('loop_lag_idle_max_ms', float('nan')):.2f}, "
                        f"copy only {row.get('loop_lag_copy_max_ms', float('nan')):.2f}), send->commit "
                        f"{row['send_to_commit_ms']:.1f} ms, median send {row['median_ms']:.1f} ms"
                    )
    finally:
        torch.set_num_threads(prev_threads)
        _collect()
    return rows


class _Neighbours:
    """How busy the machine was with *other* processes while one row ran.

    ``/proc/stat`` gives the CPU time of the whole machine (and the time the hypervisor
    stole); this process's and its reaped children's CPU time (the row's workers) is
    subtracted. The rest, as a share of ``wall x cores``, is ``other_cpu_pct``: a
    neighbour running tests shows up there, and such a row's numbers are suspect.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float, float] | None:
        try:
            with open("/proc/stat") as fh:
                fields = [int(x) for x in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        own = sum(getattr(os.times(), f) for f in ("user", "system", "children_user", "children_system"))
        return (time.monotonic(), (user + nice + system + irq + softirq) / hz, steal / hz, own)

    def stamp(self, row: dict[str, Any]) -> dict[str, Any]:
        end = self._sample()
        if self._start is not None and end is not None:
            wall = end[0] - self._start[0]
            capacity = wall * (os.cpu_count() or 1)
            others = (end[1] - self._start[1]) - (end[3] - self._start[3])
            row["other_cpu_pct"] = round(max(0.0, others) / capacity * 100, 1) if capacity > 0 else None
            row["steal_pct"] = round((end[2] - self._start[2]) / capacity * 100, 1) if capacity > 0 else None
        return row


def _collect() -> None:
    """Free the last row's model and buffers now: a closed sender sits in a reference
    cycle (its done reader tasks) until the cyclic collector runs."""
    gc.collect()


def _latency_row(
    transport: str, spec: str, n_params: int, n_tensors: int, workers: int, repeats: int, *, flat: bool = False
) -> dict[str, Any]:
    _collect()
    row: dict[str, Any] = {
        "kind": "latency",
        "transport": transport,
        "params": spec,
        "n_params": n_params,
        "n_tensors": n_tensors,
        "workers": workers,
        "flat": flat,
    }
    if transport in TORCHRL_TRANSPORTS:
        from asyncsync.bench._torchrl import run_torchrl

        res = run_torchrl(transport, n_params, n_tensors, workers, repeats)
        torch.set_num_threads(1)
    else:
        res = _run_loop(transport, run_asyncsync(transport, n_params, n_tensors, workers, repeats, flat=flat))
        row["sender_copy_ms"] = res["last_copy_ms"]
        row["worker_commit_ms"] = max(res["worker_commit_ms"])
        for key in PUBLISH_KEYS:
            if key in res:
                row[key] = res[key]
        if transport in POLL_TRANSPORTS:
            row["pinned_cpus"] = res["pinned_cpus"]
            row["poll_loadavg"] = [round(x, 2) for x in os.getloadavg()]
    row.update(summarize(res["latencies_ms"]))
    row["min_ms"] = min(res["latencies_ms"])
    row["repeats"] = n = len(res["latencies_ms"])
    trainer_cpu: float | None = res.get("trainer_cpu_s")
    workers_cpu: float | None = res.get("workers_cpu_s")
    row["trainer_cpu_ms_per_send"] = trainer_cpu / n * 1e3 if trainer_cpu is not None else None
    row["trainer_cpu_ms_per_worker"] = trainer_cpu / n / workers * 1e3 if trainer_cpu is not None else None
    row["cpu_ms_per_send"] = (
        (trainer_cpu + workers_cpu) / n * 1e3 if trainer_cpu is not None and workers_cpu is not None else None
    )
    row["peak_rss_sender_mb"] = res["peak_rss_sender_mb"]
    row["peak_rss_worker_mb"] = res["peak_rss_worker_mb"]
    row["vs_torchrl_mp"] = None
    row["vs_torchrl_shared"] = None
    return row


def _add_cpu_growth(rows: list[dict[str, Any]]) -> list[str]:
    """``trainer_cpu_vs_1w``: trainer CPU per send / that of the same row with 1 worker.

    Returns one line per (transport, params, flat) with 1 and more workers: how the
    trainer's CPU per send grows from 1 worker to the most workers measured.
    """
    one = {
        (r["transport"], r["params"], r.get("flat", False)): r["trainer_cpu_ms_per_send"]
        for r in rows
        if r["kind"] == "latency" and r["workers"] == 1 and r.get("trainer_cpu_ms_per_send")
    }
    most: dict[tuple[str, str, bool], dict[str, Any]] = {}
    for r in rows:
        if r["kind"] != "latency":
            continue
        key = (r["transport"], r["params"], r.get("flat", False))
        base, cpu = one.get(key), r.get("trainer_cpu_ms_per_send")
        r["trainer_cpu_vs_1w"] = cpu / base if base and cpu is not None else None
        if r["trainer_cpu_vs_1w"] is not None and r["workers"] > most.get(key, {"workers": 1})["workers"]:
            most[key] = r
    return [
        f"trainer CPU per send, {t}{' flat' if f else ''} {p}: {r['workers']} workers / 1 worker = "
        f"{r['trainer_cpu_vs_1w']:.2f}x ({one[(t, p, f)]:.4f} -> {r['trainer_cpu_ms_per_send']:.4f} ms)"
        for (t, p, f), r in most.items()
    ]


def _add_torchrl_ratios(rows: list[dict[str, Any]]) -> None:
    """vs_torchrl_* = torchrl's median / ours, same params and workers, same run."""
    medians = {(r["transport"], r["params"], r["workers"]): r["median_ms"] for r in rows if r["kind"] == "latency"}
    for r in rows:
        if r["kind"] != "latency" or r["transport"] not in (*ASYNCSYNC_TRANSPORTS, *UVLOOP_TRANSPORTS, *POLL_TRANSPORTS):
            continue
        for kind, key in (("torchrl-mp", "vs_torchrl_mp"), ("torchrl-shared", "vs_torchrl_shared")):
            theirs = medians.get((kind, r["params"], r["workers"]))
            r[key] = theirs / r["median_ms"] if theirs is not None else None


def _memory_row(transport: str, spec: str, n_params: int, n_tensors: int, workers: int) -> dict[str, Any]:
    _collect()
    res = asyncio.run(run_asyncsync(transport, n_params, n_tensors, workers, MEMORY_SENDS, probe=True))
    timed = set(res["versions"])
    w_rss = [[rss for v, _t, rss in w["commits"] if v in timed] for w in res["workers"]]
    row: dict[str, Any] = {
        "kind": "memory",
        "transport": transport,
        "params": spec,
        "n_params": n_params,
        "workers": workers,
        "sends": len(res["latencies_ms"]),
        "model_mb": _mb(n_params * 4),
        **summarize(res["latencies_ms"]),
        "peak_rss_sender_mb": res["peak_rss_sender_mb"],
        "peak_rss_worker_mb": res["peak_rss_worker_mb"],
        "rss_sender_before_mb": res["rss_before_mb"],
        "rss_sender_after_mb": res["rss_after_mb"],
        "sender_extra_mb": res["peak_rss_sender_mb"] - res["rss_before_mb"],
        "rss_worker_first_mb": max(r[0] for r in w_rss) if all(w_rss) else None,
        "rss_worker_last_mb": max(r[-1] for r in w_rss) if all(w_rss) else None,
        "dev_shm_before_mb": res["dev_shm_before_mb"],
        "dev_shm_after_mb": res["dev_shm_after_mb"],
        "memfd_sender_before_mb": res["memfd_before_mb"],
        "memfd_sender_after_mb": res["memfd_after_mb"],
        "memfd_worker_mb": max((w["memfd_mb"] or 0.0) for w in res["workers"]),
        "slots": res["slots"],
        "slots_mb": _mb(res["slots"] * res["slot_bytes"]),
    }
    return row


def _loop_lag_row(mode: str, commit: str, spec: str, n_params: int, n_tensors: int, workers: int, repeats: int) -> dict[str, Any]:
    _collect()
    res = asyncio.run(run_asyncsync("shm", n_params, n_tensors, workers, repeats, commit=commit, probe=True, tick=True))
    row: dict[str, Any] = {
        "kind": "loop_lag",
        "transport": "shm",
        "mode": mode,
        "commit": commit,
        "params": spec,
        "n_params": n_params,
        "workers": workers,
        **summarize(res["latencies_ms"]),
        **_loop_lag(res),
        "worker_commit_ms": max(res["worker_commit_ms"]),
        "sender_copy_ms": res["last_copy_ms"],
        "peak_rss_sender_mb": res["peak_rss_sender_mb"],
        "peak_rss_worker_mb": res["peak_rss_worker_mb"],
    }
    return row


def _x(ratio: float | None) -> str:
    return f"{ratio:7.2f}x" if ratio is not None else "      -x"


def _ms(value: float | None) -> str:
    return f"{value:.4f} ms" if value is not None else "- ms"


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
