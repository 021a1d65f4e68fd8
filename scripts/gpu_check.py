"""GPU check for the CUDA staging paths (needs one CUDA device; runs in under 3 minutes).

Checks, on cuda:0, for commit="swap" and commit="copy":
  * staging and commit are correct (every parameter equals what was sent, on the GPU);
  * the worker's event loop keeps ticking while a 100M-parameter update lands (max lag);
  * send-until-acked latency;
and measures host-to-device GB/s (pinned and pageable) against the device's own copy
bandwidth. Prints one JSON document; exits non-zero if a check fails.

Run: python scripts/gpu_check.py [--params 100000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers


def make_model(n_params: int) -> nn.Module:
    m = nn.Module()
    per = n_params // 4
    for i in range(4):
        m.register_parameter(f"p{i}", nn.Parameter(torch.zeros(per)))
    return m


async def gpu_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, n_params: int, device: str) -> dict[str, object]:
    torch.set_num_threads(1)
    model = make_model(n_params).to(device)
    ptrs0 = [p.data_ptr() for p in model.parameters()]
    scheme.init_on_receiver(worker_idx=worker_idx, model=model)
    lags: list[float] = []
    wrong: list[int] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            lags.append(max(0.0, (now - last - 0.001) * 1e3))
            last = now

    def check() -> None:  # after the run: checking on the loop while ticking would add lag
        expect = float(scheme.version)
        for p in model.parameters():
            if p.device != torch.device(device) or not bool((p == expect).all()):
                wrong.append(scheme.version)
                break

    async with scheme:
        tick = asyncio.ensure_future(ticker())
        await scheme.wait_stopped()
        stop.set()
        await tick
        check()
    stable = ptrs0 == [p.data_ptr() for p in model.parameters()]
    stats = scheme.statistics()
    return {
        "max_loop_lag_ms": max(lags) if lags else None,
        "p99_loop_lag_ms": sorted(lags)[int(0.99 * len(lags))] if lags else None,
        "wrong_versions": wrong,
        "addresses_stable": stable,
        "last_stage_ms": stats.last_stage_ms,  # type: ignore[union-attr]
        "last_commit_ms": stats.last_commit_ms,  # type: ignore[union-attr]
    }


async def run_mode(commit: str, n_params: int, sends: int, device: str) -> dict[str, object]:
    model = make_model(n_params)
    scheme = MultiProcessWeightSyncScheme(commit=commit, timeout=120)  # type: ignore[arg-type]
    scheme.init_on_sender(model=model, devices=[device])
    latencies = []
    async with spawn_workers(gpu_worker, 1, args=(scheme, n_params, device), scheme=scheme) as group:
        async with scheme:
            for k in range(1, sends + 1):
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(float(k))
                t0 = time.perf_counter()
                await scheme.send()
                latencies.append((time.perf_counter() - t0) * 1e3)
        result = (await group.join(timeout=120))[0]
    result["commit"] = commit
    result["send_median_ms"] = statistics.median(latencies)
    result["gbps"] = n_params * 4 / (statistics.median(latencies) / 1e3) / 1e9
    return result


def bandwidth(n_bytes: int) -> dict[str, float]:
    dev = torch.device("cuda:0")
    pinned = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n_bytes, dtype=torch.uint8)
    a = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    b = torch.empty(n_bytes, dtype=torch.uint8, device=dev)

    def timed(fn: object) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        start.record()
        for _ in range(5):
            fn()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        return n_bytes * 5 / (start.elapsed_time(end) / 1e3) / 1e9

    return {
        "h2d_pinned_gbps": timed(lambda: a.copy_(pinned, non_blocking=True)),
        "h2d_pageable_gbps": timed(lambda: a.copy_(pageable)),
        "d2d_gbps": timed(lambda: b.copy_(a)),
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--sends", type=int, default=5)
    parser.add_argument("--device", default="cuda:0", help="cpu runs the same checks as a dry run")
    args = parser.parse_args()
    if args.device == "cpu":
        modes = [await run_mode(mode, args.params, args.sends, "cpu") for mode in ("swap", "copy")]
        print(json.dumps({"device": "cpu", "modes": modes}, indent=2))
        return 1 if any(m["wrong_versions"] for m in modes) else 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    out: dict[str, object] = {"device": torch.cuda.get_device_name(0), "params": args.params, "torch": torch.__version__}
    out["bandwidth"] = bandwidth(args.params * 4)
    out["modes"] = [await run_mode(mode, args.params, args.sends, args.device) for mode in ("swap", "copy")]
    print(json.dumps(out, indent=2))
    failed = [m for m in out["modes"] if m["wrong_versions"]]  # type: ignore[union-attr]
    failed += [m for m in out["modes"] if m["commit"] == "copy" and not m["addresses_stable"]]  # type: ignore[union-attr]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
