"""Multi-host quickstart: rank 0 trains, every other rank is a host running async workers.

The worker function is quickstart.py's ``rollout_worker``, unchanged: on each host the
scheme handed to the workers *is* a local ``MultiProcessWeightSyncScheme`` fed by that
host's relay. Only the scheme's constructor and how processes start differ.

One machine, three processes (a trainer and two "hosts" with two workers each)::

    torchrun --standalone --nproc-per-node=3 examples/multihost.py

Two machines (the trainer on node 0, one host on node 1)::

    export ASYNCSYNC_TOKEN=$(openssl rand -hex 32)        # the same secret on both nodes
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --master-addr=10.0.0.1 --master-port=29500 examples/multihost.py
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1 --master-addr=10.0.0.1 --master-port=29500 examples/multihost.py

Options: ``--workers-per-host N`` (default 2), ``--steps N`` (default 10),
``--rank-is-worker``: torchrl's layout, every rank but the trainer's *is* one worker
(``init_on_receiver`` on the multi-host scheme, the same ``rollout_worker`` run in the
rank's own process; no worker processes are spawned)::

    torchrun --standalone --nproc-per-node=3 examples/multihost.py --rank-is-worker
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned workers import quickstart too

from quickstart import make_policy, rollout_worker  # noqa: E402

from asyncsync import DistributedWeightSyncScheme, spawn_workers  # noqa: E402


async def train(scheme: DistributedWeightSyncScheme, workers_per_host: int, steps: int) -> None:
    torch.manual_seed(0)
    policy = make_policy()
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    scheme.init_on_sender(model=policy, workers_per_host=workers_per_host)
    async with scheme:  # waits for every host to join and every worker to run version 0
        print(f"[trainer] workers {scheme.sender.worker_ids} run version 0", flush=True)
        for step in range(1, steps + 1):
            loss = policy(torch.randn(64, 8)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            t0 = time.perf_counter()
            version = await scheme.send()  # one network transfer per host; returns once every worker applied it
            ms = (time.perf_counter() - t0) * 1e3
            print(f"[trainer] step {step:2d}  loss {loss.item():.4f}  v{version} on every worker in {ms:6.2f} ms", flush=True)
        stats = scheme.sender.statistics()
        print(f"[trainer] {stats.last_send_bytes} bytes left the trainer per send ({stats.buffer_bytes} per host)", flush=True)


async def host(scheme: DistributedWeightSyncScheme, workers_per_host: int) -> None:
    scheme.init_on_relay(model=make_policy(), num_workers=workers_per_host)
    async with spawn_workers(rollout_worker, workers_per_host, args=(scheme,), scheme=scheme.local) as workers:
        async with scheme:  # joins the trainer; returns once the first weights reached the workers
            await scheme.wait_stopped()  # until the trainer is done (SenderDiedError if it dies)
        results = await workers.join()
    for idx, res in results.items():
        print(f"[host {scheme.rank}] worker {idx}: finished at version {res['version']} after {res['steps']} steps", flush=True)


async def rank_worker(scheme: DistributedWeightSyncScheme) -> None:
    result = await rollout_worker(0, scheme)  # type: ignore[arg-type]  # the quickstart's worker, unchanged
    print(f"[host {scheme.rank}] worker 0: finished at version {result['version']} after {result['steps']} steps", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers-per-host", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rank-is-worker", action="store_true", help="every rank but the trainer's is one worker")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # asyncsync's progress lines
    scheme = DistributedWeightSyncScheme(strategy="tensordict", timeout=60)  # RANK, WORLD_SIZE, MASTER_* from torchrun
    who = "trainer" if scheme.rank == 0 else f"host {scheme.rank}"
    print(f"[{who}] imports done; connecting (rank {scheme.rank} of {scheme.world_size})...", flush=True)
    if scheme.rank == 0:
        asyncio.run(train(scheme, 1 if args.rank_is_worker else args.workers_per_host, args.steps))
    elif args.rank_is_worker:
        asyncio.run(rank_worker(scheme))
    else:
        asyncio.run(host(scheme, args.workers_per_host))


if __name__ == "__main__":
    main()
