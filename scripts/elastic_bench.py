"""Elastic membership, measured in one run (public API only; one host, shared memory).

1. Join: the time from a new worker's ``connect()`` until it runs the trainer's newest
   version, against a plain ``send()`` to one connected worker, at 10k and 100M float32
   parameters (median of several joins and sends).
2. Sends during joins: ``send()`` latency to 2 connected members while other workers keep
   joining (each leaves once it runs the newest version, and the next one joins), against
   the same sends with no joins.

Run: python scripts/elastic_bench.py [--params 10k,100M] [--joins 5] [--sends 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers

SIZES = {"10k": 10_000, "1M": 1_000_000, "100M": 100_000_000}


def make_model(n: int) -> nn.Module:
    m = nn.Module()
    m.register_parameter("w", nn.Parameter(torch.zeros(n)))
    return m


async def joining_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, n: int) -> float:
    """Connects (the model then runs the newest version), reports how long that took, leaves."""
    torch.set_num_threads(1)
    scheme.init_on_receiver(worker_idx=worker_idx, model=make_model(n))
    t0 = time.perf_counter()
    async with scheme:
        took = time.perf_counter() - t0
    return took


async def member(worker_idx: int, scheme: MultiProcessWeightSyncScheme, n: int) -> int:
    torch.set_num_threads(1)
    scheme.init_on_receiver(worker_idx=worker_idx, model=make_model(n))
    async with scheme:
        await scheme.wait_stopped()
    return scheme.version


def ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1e3, "n": len(xs)}


async def join_vs_send(n: int, joins: int) -> dict[str, Any]:
    model = make_model(n)
    scheme = MultiProcessWeightSyncScheme(timeout=300)
    scheme.init_on_sender(model=model, num_workers=1, elastic=True)
    out: dict[str, Any] = {}
    async with spawn_workers(member, worker_ids=[0], args=(scheme, n), scheme=scheme, start_method="forkserver"):
        async with scheme:
            sends = []
            for _ in range(joins):
                with torch.no_grad():
                    model.w.add_(1)
                t0 = time.perf_counter()
                await scheme.send(worker_ids=[0])
                sends.append(time.perf_counter() - t0)
            out["send_to_one"] = ms(sends)
            took = []
            for k in range(joins):
                idx = 1 + k
                scheme.add_worker(idx)
                async with spawn_workers(joining_worker, worker_ids=[idx], args=(scheme, n), scheme=scheme, start_method="forkserver") as g:
                    await scheme.sender.wait_joined(idx)
                took.append(g.results[idx])
                await scheme.sender.wait_dead(idx)
                scheme.sender.retire(idx)
            out["join_until_newest"] = ms(took)
    out["ratio"] = out["join_until_newest"]["median_ms"] / out["send_to_one"]["median_ms"]
    return out


async def sends_during_joins(n: int, sends: int) -> dict[str, Any]:
    model = make_model(n)
    scheme = MultiProcessWeightSyncScheme(timeout=300)
    scheme.init_on_sender(model=model, num_workers=2, elastic=True)
    out: dict[str, Any] = {}
    async with spawn_workers(member, worker_ids=[0, 1], args=(scheme, n), scheme=scheme, start_method="forkserver"):
        async with scheme:

            async def timed() -> list[float]:
                xs = []
                for _ in range(sends):
                    with torch.no_grad():
                        model.w.add_(1)
                    t0 = time.perf_counter()
                    await scheme.send(worker_ids=[0, 1])
                    xs.append(time.perf_counter() - t0)
                return xs

            out["no_joins"] = ms(await timed())
            stop = asyncio.Event()
            joined = [0]

            async def churn() -> None:
                idx = 2
                while not stop.is_set():
                    scheme.add_worker(idx)
                    async with spawn_workers(joining_worker, worker_ids=[idx], args=(scheme, n), scheme=scheme, start_method="forkserver"):
                        await scheme.sender.wait_joined(idx)
                        joined[0] += 1
                    await scheme.sender.wait_dead(idx)
                    scheme.sender.retire(idx)
                    idx += 1

            churning = asyncio.ensure_future(churn())
            while joined[0] == 0:  # measure once the churn runs
                await asyncio.sleep(0.01)
            during = await timed()
            stop.set()
            await churning
            out["with_joins"] = ms(during)
            out["joins_during"] = joined[0]
    out["ratio"] = out["with_joins"]["median_ms"] / out["no_joins"]["median_ms"]
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="10k,100M")
    parser.add_argument("--joins", type=int, default=5)
    parser.add_argument("--sends", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {"torch": torch.__version__, "join": {}, "sends_during_joins": None}
    for name in args.params.split(","):
        report["join"][name] = await join_vs_send(SIZES[name], args.joins)
        print(name, "join:", json.dumps(report["join"][name]), flush=True)
    report["sends_during_joins"] = await sends_during_joins(SIZES["10k"], args.sends)
    print("10k sends during joins:", json.dumps(report["sends_during_joins"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
