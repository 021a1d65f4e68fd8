"""Round trip of one weight update (send to ack), three or four ways, in one run:

- ``spawn``: the worker function started by ``spawn_workers``, ``await scheme.send()``;
- ``asyncsync.ray``: the same function in Ray actors (``asyncsync.ray.start_workers``);
- ``asyncsync.ray, other node`` (with ``--nodes``): the same actors on a second Ray node,
  behind its relay actor (a ``DistributedWeightSyncScheme`` with one host, gloo);
- ``ray-call``: a plain Ray actor, ``await actor.set_weights.remote(state_dict)`` (the
  weights travel through Ray's object store; the actor loads them into its model).

    python scripts/ray_bench.py                 # 2 workers, a 10k and a 4M-parameter model
    python scripts/ray_bench.py --workers 1 --repeats 50
    python scripts/ray_bench.py --nodes         # a two-node Ray cluster on this machine

Each way runs ``--rounds`` times in a rotating order (each time with fresh workers), and
the table gives the median and p90 in ms over all its sends, per size and way, and each
way's ratio to ``spawn``. Needs the ``ray`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import time
from typing import Any

import ray
import torch
from torch import nn

from asyncsync import DistributedWeightSyncScheme, MultiProcessWeightSyncScheme, spawn_workers
from asyncsync.ray import start_workers

SIZES = {"10k": (100, 100), "4M": (2000, 2000)}  # in_features, out_features of one Linear


def make_model(size: str) -> nn.Module:
    torch.manual_seed(0)
    n_in, n_out = SIZES[size]
    return nn.Linear(n_in, n_out)


async def worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, size: str) -> int:
    torch.set_num_threads(1)
    scheme.init_on_receiver(worker_idx=worker_idx, model=make_model(size))
    async with scheme:
        await scheme.wait_stopped()
    return scheme.version


class PlainActor:
    """What one writes with Ray alone: weights as an actor call's argument."""

    def __init__(self, size: str) -> None:
        torch.set_num_threads(1)
        self.model = make_model(size)
        self.version = 0

    async def set_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        self.model.load_state_dict(state_dict)
        self.version += 1
        return self.version


async def time_sends(scheme: MultiProcessWeightSyncScheme | DistributedWeightSyncScheme, model: nn.Module, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        with torch.no_grad():
            model.weight.add_(1e-3)
        t0 = time.perf_counter()
        await scheme.send()
        out.append(time.perf_counter() - t0)
    return out


async def bench_spawn(size: str, workers: int, repeats: int) -> list[float]:
    model = make_model(size)
    scheme = MultiProcessWeightSyncScheme(timeout=120)
    scheme.init_on_sender(model=model, num_workers=workers)
    async with spawn_workers(worker, workers, args=(scheme, size), scheme=scheme):
        async with scheme:
            await time_sends(scheme, model, 3)  # warm-up
            return await time_sends(scheme, model, repeats)


async def bench_asyncsync_ray(size: str, workers: int, repeats: int) -> list[float]:
    model = make_model(size)
    scheme = MultiProcessWeightSyncScheme(timeout=120)
    scheme.init_on_sender(model=model, num_workers=workers)
    async with start_workers(worker, scheme, size, num_workers=workers):
        async with scheme:
            await time_sends(scheme, model, 3)
            return await time_sends(scheme, model, repeats)


def other_node() -> str:
    here = ray.get_runtime_context().get_node_id()
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def bench_ray_other_node(size: str, workers: int, repeats: int) -> list[float]:
    model = make_model(size)
    scheme = DistributedWeightSyncScheme(timeout=120, master_addr=ray.util.get_node_ip_address(), master_port=free_port())
    scheme.init_on_sender(model=model, hosts={1: workers})
    async with start_workers(worker, scheme, size, nodes=[other_node()]):
        async with scheme:
            await time_sends(scheme, model, 3)
            return await time_sends(scheme, model, repeats)


async def bench_ray_call(size: str, workers: int, repeats: int) -> list[float]:
    model = make_model(size)
    cls = ray.remote(num_cpus=0)(PlainActor)
    actors = [cls.remote(size) for _ in range(workers)]
    try:

        async def once() -> float:
            with torch.no_grad():
                model.weight.add_(1e-3)
            t0 = time.perf_counter()
            state = model.state_dict()
            await asyncio.gather(*(a.set_weights.remote(state) for a in actors))
            return time.perf_counter() - t0

        for _ in range(3):
            await once()
        return [await once() for _ in range(repeats)]
    finally:
        for a in actors:
            ray.kill(a)


def summary(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[int(0.9 * (len(ordered) - 1))] * 1e3


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="each way runs this many times, in rotating order")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--nodes", action="store_true", help="a two-node Ray cluster on this machine: adds the other-node way")
    args = parser.parse_args()
    cpus = max(2, args.workers)
    cluster: Any = None
    if args.nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
        cluster.add_node(num_cpus=cpus)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    else:
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        rows = []
        ways: dict[str, Any] = {"spawn": bench_spawn, "asyncsync.ray": bench_asyncsync_ray}
        if args.nodes:
            ways["asyncsync.ray, other node"] = bench_ray_other_node
        ways["ray-call"] = bench_ray_call
        for size in args.sizes:
            results: dict[str, list[float]] = {way: [] for way in ways}
            order = list(ways)
            for _ in range(args.rounds):  # the order rotates: a busy spell does not hit one way only
                for way in order:
                    results[way] += await ways[way](size, args.workers, args.repeats)
                order = order[1:] + order[:1]
            base = summary(results["spawn"])[0]
            for way, samples in results.items():
                p50, p90 = summary(samples)
                rows.append(f"| {size} | {way} | {p50:.2f} | {p90:.2f} | {p50 / base:.2f}x |")
        print(f"{args.workers} worker{'' if args.workers == 1 else 's'}, {args.rounds} rounds of {args.repeats} sends per way, {os.cpu_count()} CPUs; round trip send -> ack")
        print("| model | way | p50 ms | p90 ms | p50 vs spawn |")
        print("| --- | --- | ---: | ---: | ---: |")
        print("\n".join(rows))
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
