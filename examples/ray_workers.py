"""The quickstart's worker function in Ray actors: Ray places them, asyncsync moves the weights.

    pip install torch==2.13.0 -e '.[ray]'
    python examples/ray_workers.py                 # a local Ray instance
    python examples/ray_workers.py --address auto  # the Ray cluster this node belongs to

Each actor runs the quickstart's ``rollout_worker`` (the function ``spawn_workers`` runs
there), unchanged, in its event loop; its scheme attaches to the trainer by address, so
every update goes through shared memory on this node. Ray's object store carries no weights.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import quickstart  # examples/quickstart.py, next to this file
import ray
import torch

from asyncsync import MultiProcessWeightSyncScheme
from asyncsync.ray import start_workers

# The actors cannot import this folder's modules: the quickstart's functions travel by value.
ray.cloudpickle.register_pickle_by_value(quickstart)
make_policy, rollout_worker = quickstart.make_policy, quickstart.rollout_worker


async def main(num_workers: int, steps: int) -> None:
    policy = make_policy()
    optim = torch.optim.Adam(policy.parameters(), lr=1e-3)
    scheme = MultiProcessWeightSyncScheme(timeout=120)
    scheme.init_on_sender(model=policy, num_workers=num_workers)
    async with start_workers(rollout_worker, scheme, num_workers=num_workers, actor_options={"num_cpus": 1}) as group:
        print(f"actors started: pids {group.pids}")
        async with scheme:  # waits for every actor to attach and apply version 0
            for step in range(steps):
                loss = policy(torch.randn(64, 8)).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                t0 = time.perf_counter()
                version = await scheme.send()
                print(f"step {step}: version {version} applied by every actor in {(time.perf_counter() - t0) * 1e3:.2f} ms")
    print(f"results: {group.results}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help="a Ray cluster to join (default: start a local instance)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.address is None:
        ray.init(num_cpus=max(2, args.workers), include_dashboard=False)
    else:
        ray.init(address=args.address)
    try:
        asyncio.run(main(args.workers, args.steps))
    finally:
        ray.shutdown()
