"""Quickstart: a trainer pushes weights to two async workers after every training step.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))


async def rollout_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> dict[str, int]:
    """Acts with its local policy copy; new weights land between two awaits."""
    torch.set_num_threads(1)
    policy = make_policy()
    scheme.init_on_receiver(worker_idx=worker_idx, model=policy)
    steps = 0
    async with scheme:  # starts the receiver task, waits for the initial weights
        stopped = asyncio.ensure_future(scheme.wait_stopped())
        while not stopped.done():
            with torch.no_grad():
                policy(torch.randn(16, 8))  # one "env step": never sees two versions mixed
            steps += 1
            await asyncio.sleep(0.001)
        await stopped
    return {"version": scheme.version, "steps": steps}


async def main() -> None:
    # Each worker process imports torch too (seconds, on a fresh interpreter): the library
    # logs its progress ("starting 2 workers", "connected") through `logging`, at INFO.
    t0 = time.perf_counter()
    print("imports done; starting 2 workers (each imports torch again: a few seconds)...", flush=True)
    torch.manual_seed(0)
    policy = make_policy()
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    scheme = MultiProcessWeightSyncScheme(strategy="tensordict", sync=True, timeout=30)
    scheme.init_on_sender(model=policy, num_workers=2)

    async with spawn_workers(rollout_worker, 2, args=(scheme,), scheme=scheme) as workers:
        async with scheme:  # connect(): initial weights to both workers
            print(f"both workers run version {scheme.version}, {time.perf_counter() - t0:.1f} s after the start; training", flush=True)
            for step in range(1, 11):
                loss = policy(torch.randn(64, 8)).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                t0 = time.perf_counter()
                version = await scheme.send()  # returns once both workers applied it
                ms = (time.perf_counter() - t0) * 1e3
                applied = scheme.sender.applied_versions()
                print(f"step {step:2d}  loss {loss.item():.4f}  sent v{version}  in {ms:6.2f} ms  workers at {applied}")
            version = await scheme.send_async()  # fire and forget ...
            await scheme.wait_async()  # ... then wait for the acks
            print(f"async send v{version} applied by all: {scheme.sender.applied_versions()}")
        results = await workers.join()
    for idx, res in results.items():
        print(f"worker {idx}: finished at version {res['version']} after {res['steps']} steps")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # asyncsync's progress lines (its logger, INFO)
    asyncio.run(main())
