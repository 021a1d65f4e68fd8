"""A worker that steps its environments in a tight loop and polls for new weights between steps.

The worker's receiver is made with ``poll=True``: the trainer announces each version in
shared memory, and ``receiver.poll_nowait()`` between two steps commits it if it is new.
A poll with nothing new is one memory load (no system call, no event-loop wake-up), so
it can run at every step of a kHz loop. Every ``--yield-every`` steps the worker awaits
once, so its event loop can map new shared-memory slots and notice ``stop``.

Run: python examples/polled_env_server.py [--updates 50] [--envs 16] [--yield-every 100]

It prints the steps per second, how many versions each poll committed, and what an empty
poll costs, measured in the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))


class ToyEnv:
    """A stand-in environment whose step is a little synchronous work."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.obs = torch.zeros(8)

    def step(self, action: torch.Tensor) -> torch.Tensor:
        self.obs = 0.9 * self.obs + 0.1 * torch.randn(8, generator=self.gen) + action.sum() * 1e-3
        return self.obs


async def env_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, n_envs: int, yield_every: int) -> dict[str, float]:
    torch.set_num_threads(1)
    policy = make_policy()
    scheme.init_on_receiver(worker_idx=worker_idx, model=policy, poll=True)
    envs = [ToyEnv(seed) for seed in range(n_envs)]
    steps = 0
    committed: list[int] = []
    async with scheme:  # returns once version 0 runs; from here on, versions change at polls only
        receiver = scheme.receiver
        # What a poll costs when nothing is new (almost every poll of a fast loop).
        n = 100_000
        p0 = time.perf_counter()
        for _ in range(n):
            version = receiver.poll_nowait()
            if version is not None:
                committed.append(version)
        empty_us = (time.perf_counter() - p0) / n * 1e6
        obs = torch.stack([env.obs for env in envs])
        t0 = time.perf_counter()
        while not receiver.stopped:
            version = receiver.poll_nowait()  # between two steps: never blocks
            if version is not None:
                committed.append(version)
            with torch.no_grad():
                actions = policy(obs)  # one forward, one version
            obs = torch.stack([env.step(a) for env, a in zip(envs, actions)])
            steps += 1
            if steps % yield_every == 0:
                await asyncio.sleep(0)  # the loop maps new slots, notices stop and the trainer's death
        elapsed = time.perf_counter() - t0
        await scheme.wait_stopped()
    return {"steps_per_s": steps / elapsed, "polls_that_committed": len(committed), "last": float(scheme.version), "empty_poll_us": empty_us}


async def main(updates: int, n_envs: int, yield_every: int) -> None:
    print("imports done; starting 1 worker process (it imports torch too: a few seconds)...", flush=True)
    trainer = make_policy()
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-3)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with spawn_workers(env_worker, 1, args=(scheme, n_envs, yield_every), scheme=scheme) as workers:
        async with scheme:
            print(f"the worker runs version 0; publishing {updates} versions", flush=True)
            for _ in range(updates):
                loss = trainer(torch.randn(32, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                version = await scheme.send_async()  # the worker picks it up at its next poll
                await asyncio.sleep(0.01)
                if version % 10 == 0:
                    print(f"published v{version}; the worker runs v{scheme.sender.applied_versions()[0]}", flush=True)
            await scheme.wait_async(version)  # the worker polled the last one in
        results = await workers.join()
    r = results[0]
    print(f"sent {version} versions; the worker committed {r['polls_that_committed']} of them at its polls (latest wins), ends at version {r['last']:.0f}")
    print(f"{r['steps_per_s']:.0f} steps/s of {n_envs} envs; an empty poll costs {r['empty_poll_us']:.2f} us")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=50)
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--yield-every", type=int, default=100)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # asyncsync's start-up progress
    asyncio.run(main(a.updates, a.envs, a.yield_every))
