"""The same torchrl ``MultiSyncCollector`` run with torchrl's schemes and with asyncsync's.

For each scheme, one run: a ``MultiSyncCollector`` over CartPole (torchrl's ``GymEnv``)
with an MLP policy of ``--params`` parameters; per iteration the trainer changes the
weights in place, then times ``collector.update_policy_weights_()`` (until every worker
runs them: all the schemes here are synchronous) and the next batch (collection). Reports
frames/s of collection and the update latency (median, p90), and each against asyncsync's.

    python scripts/torchrl_collector_bench.py --params 1M --workers 2 --batches 30

Schemes: ``torchrl-default`` (what the collector picks when given none: torchrl's
``SharedMemWeightSyncScheme``), ``torchrl-mp`` (``MultiProcessWeightSyncScheme``),
``asyncsync`` (``asyncsync.torchrl.AsyncSyncScheme``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

SCHEMES = ("torchrl-default", "torchrl-mp", "asyncsync")


def make_env() -> Any:
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def make_policy(n_params: int) -> Any:
    from tensordict.nn import TensorDictModule

    # 4 -> h -> h -> 2 has about h*h + 7h parameters
    h = max(8, int((-7 + (49 + 4 * n_params) ** 0.5) / 2))
    net = nn.Sequential(nn.Linear(4, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 2))
    return TensorDictModule(_OneHotArgmax(net), in_keys=["observation"], out_keys=["action"])


class _OneHotArgmax(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        logits = self.net(observation)
        return torch.nn.functional.one_hot(logits.argmax(-1), 2).to(torch.int64)


def make_scheme(kind: str) -> Any:
    if kind == "torchrl-default":
        return None
    if kind == "torchrl-mp":
        from torchrl.weight_update import MultiProcessWeightSyncScheme

        return MultiProcessWeightSyncScheme(strategy="tensordict", sync=True)
    if kind == "asyncsync":
        from asyncsync.torchrl import AsyncSyncScheme

        return AsyncSyncScheme(timeout=300)
    raise ValueError(f"unknown scheme {kind!r}; expected one of {SCHEMES}")


def run(kind: str, n_params: int, workers: int, batches: int, frames_per_batch: int) -> dict[str, Any]:
    from torchrl.collectors import MultiSyncCollector

    torch.manual_seed(0)
    policy = make_policy(n_params)
    scheme = make_scheme(kind)
    t_build = time.perf_counter()
    collector = MultiSyncCollector(
        [make_env] * workers,
        policy,
        frames_per_batch=frames_per_batch,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme} if scheme is not None else None,
    )
    build_s = time.perf_counter() - t_build
    it = iter(collector)
    update_ms: list[float] = []
    collect_s = 0.0
    frames = 0
    try:
        next(it)  # warm-up batch
        for step in range(batches):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(1e-3 * (step + 1))
            t0 = time.perf_counter()
            collector.update_policy_weights_()
            t1 = time.perf_counter()
            batch = next(it)
            t2 = time.perf_counter()
            update_ms.append((t1 - t0) * 1e3)
            collect_s += t2 - t1
            frames += batch.numel()
    finally:
        collector.shutdown()
        if scheme is not None:
            scheme.shutdown()
    ordered = sorted(update_ms)
    return {
        "scheme": kind,
        "n_params": sum(p.numel() for p in policy.parameters()),
        "workers": workers,
        "batches": batches,
        "frames": frames,
        "frames_per_s": frames / collect_s,
        "update_median_ms": statistics.median(update_ms),
        "update_p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "build_s": build_s,
    }


def _params(text: str) -> int:
    scale = {"k": 10**3, "M": 10**6}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--params", type=_params, default=_params("1M"), help="policy size (e.g. 10k, 1M), default 1M")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=30, help="timed iterations per scheme (after one warm-up batch)")
    parser.add_argument("--frames-per-batch", type=int, default=200)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, default {','.join(SCHEMES)}")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {os.cpu_count()} cores, load average {load:.2f}, torch {torch.__version__}", file=sys.stderr)
    rows = []
    for kind in args.schemes.split(","):
        row = run(kind, args.params, args.workers, args.batches, args.frames_per_batch)
        rows.append(row)
        print(
            f"{kind:>16}: {row['frames_per_s']:8.0f} frames/s, update median {row['update_median_ms']:8.2f} ms "
            f"p90 {row['update_p90_ms']:8.2f} ms ({row['n_params']} params)",
            file=sys.stderr,
            flush=True,
        )
    ours = next((r for r in rows if r["scheme"] == "asyncsync"), None)
    print("| scheme | frames/s | update median (ms) | update p90 (ms) | frames/s vs asyncsync | update time vs asyncsync |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        fps = f"{r['frames_per_s'] / ours['frames_per_s']:.2f}x" if ours else "-"
        upd = f"{r['update_median_ms'] / ours['update_median_ms']:.2f}x" if ours else "-"
        print(f"| {r['scheme']} | {r['frames_per_s']:.0f} | {r['update_median_ms']:.2f} | {r['update_p90_ms']:.2f} | {fps} | {upd} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"load": load, "cores": os.cpu_count(), "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
