"""Elastic membership: the group grows from 1 to 4 workers and shrinks back to 1 while the
trainer keeps sending; each line shows every member's version.

Run: python examples/elastic.py
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))


async def rollout_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, leave_at: int | None = None) -> int:
    """Acts with its policy copy until the trainer stops it, or (a preemptible worker)
    until its policy reaches version *leave_at*: then it leaves."""
    torch.set_num_threads(1)
    policy = make_policy()
    scheme.init_on_receiver(worker_idx=worker_idx, model=policy)
    async with scheme:  # joins: the first version it runs is the trainer's newest
        stopped = asyncio.ensure_future(scheme.wait_stopped())
        while not stopped.done() and (leave_at is None or scheme.version < leave_at):
            with torch.no_grad():
                policy(torch.randn(16, 8))
            await asyncio.sleep(0.005)
        stopped.cancel()
    return scheme.version


def line(scheme: MultiProcessWeightSyncScheme, step: int) -> str:
    versions = scheme.sender.applied_versions()
    members = scheme.sender.members
    shown = ", ".join(f"{i}: v{versions[i]}" for i in members)
    return f"step {step:2d}  version {scheme.version:2d}  {len(members)} member{'' if len(members) == 1 else 's'}  [{shown}]"


async def main() -> None:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    policy = make_policy()
    optim = torch.optim.SGD(policy.parameters(), lr=1e-2)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=policy, num_workers=1, elastic=True)
    print("starting worker 0 (it imports torch: a few seconds)...", flush=True)

    async def train_step() -> None:
        loss = policy(torch.randn(32, 8)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()

    async def announce() -> None:
        async for event in scheme.sender.membership():
            print(f"  worker {event.worker_id} {event.kind}", flush=True)

    async with contextlib.AsyncExitStack() as stack:
        groups = {0: await stack.enter_async_context(spawn_workers(rollout_worker, worker_ids=[0], args=(scheme,), scheme=scheme))}
        await stack.enter_async_context(scheme)  # connect(): version 0 to worker 0
        watcher = asyncio.ensure_future(announce())
        step = 0
        leave_at = {1: 19, 2: 17, 3: 15}  # the group shrinks back in reverse order
        for idx in (1, 2, 3):  # grow: one worker more every few steps, while the trainer sends
            scheme.add_worker(idx)
            groups[idx] = await stack.enter_async_context(
                spawn_workers(rollout_worker, worker_ids=[idx], args=(scheme, leave_at[idx]), scheme=scheme)
            )
            await scheme.sender.wait_joined(idx)  # (sends meanwhile go to the members before it)
            for _ in range(3):
                step += 1
                await train_step()
                await scheme.send()  # every member at the time of the send
                print(line(scheme, step), flush=True)
        while len(scheme.sender.members) > 1:  # shrink: the preemptible workers leave one by one
            step += 1
            await train_step()
            await scheme.send()  # reaches the members that are left, no error for those gone
            print(line(scheme, step), flush=True)
            await asyncio.sleep(0.05)  # (a training step's worth of time: they leave meanwhile)
        print(line(scheme, step), flush=True)  # back to one member
        watcher.cancel()
    left = {i: g.results[i] for i, g in groups.items() if i}
    print(f"worker 0 ended at version {groups[0].results[0]}, the others left at {left}; {time.perf_counter() - t0:.1f} s in all")


if __name__ == "__main__":
    asyncio.run(main())
