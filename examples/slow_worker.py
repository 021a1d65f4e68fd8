"""A slow worker slows nobody; a worker that leaves keeps its weights.

Worker 0 is fast. Worker 1 is an inference worker whose steps block its event loop for
50 ms (a synchronous forward of a big model, say). The trainer publishes with
``send_async`` as fast as it trains: worker 1 always has at most one update in flight and
gets the newest version when it answers, skipping the ones in between; neither the
trainer nor worker 0 ever waits for it, and memory stays within the stated bound.
Halfway, worker 1 leaves (``aclose()``) and goes on serving with its last weights: the
trainer's later sends never change them, and the trainer sees it as "left".

Run: python examples/slow_worker.py
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, ReceiverStatistics, spawn_workers


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 2))


async def worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, step_s: float, leave_after: int | None) -> dict[str, object]:
    torch.set_num_threads(1)
    policy = make_policy()
    scheme.init_on_receiver(worker_idx=worker_idx, model=policy)
    steps = 0
    async with scheme:
        stopped = asyncio.ensure_future(scheme.wait_stopped())
        while not stopped.done():
            time.sleep(step_s)  # a synchronous step: this loop is busy, the receiver waits its turn
            steps += 1
            await asyncio.sleep(0)
            if leave_after is not None and steps == leave_after:
                break  # leave: the end of `async with` closes the receiver, the model is kept
        left = not stopped.done()
        if left:
            stopped.cancel()
    if left:
        kept = scheme.version
        first = next(policy.parameters()).detach().clone()
        for _ in range(40):  # keep serving; nothing changes our weights any more
            time.sleep(step_s)
            await asyncio.sleep(0)
        assert torch.equal(first, next(policy.parameters())), "weights changed after leaving"
        return {"left_at_version": kept, "steps": steps, "stats": scheme.receiver.statistics()}
    return {"version": scheme.version, "steps": steps, "stats": scheme.receiver.statistics()}


async def main() -> None:
    print("imports done; starting 2 workers (a fast one and a slow one)...", flush=True)
    torch.manual_seed(0)
    policy = make_policy()
    optim = torch.optim.SGD(policy.parameters(), lr=1e-2)
    scheme = MultiProcessWeightSyncScheme(timeout=30, on_worker_error="skip")
    scheme.init_on_sender(model=policy, num_workers=2)
    args = {0: (0.0005, None), 1: (0.05, 20)}  # (seconds per step, leave after N steps)

    async with spawn_workers(_dispatch, 2, args=(scheme, args), scheme=scheme) as workers:
        async with scheme:
            t0 = time.perf_counter()
            for step in range(1, 201):
                loss = policy(torch.randn(32, 8)).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                await scheme.send_async()  # never waits for worker 1
                await asyncio.sleep(0.01)  # the rest of a training step's awaits
                if step % 50 == 0:
                    stats = scheme.sender.statistics()
                    lags = {w.worker_idx: (w.state, w.lag) for w in stats.workers}
                    print(f"step {step:3d}  v{stats.version}  slots={stats.slots}  (state, lag) per worker: {lags}")
            print(f"200 sends in {time.perf_counter() - t0:.2f} s")
            await scheme.wait_async()  # worker 0 applied the newest; worker 1 left (skipped)
            w1 = scheme.sender.statistics().worker(1)
            print(f"worker 1 is {w1.state!r}: {w1.reason}")
        results = await workers.join()
    for idx, res in results.items():
        stats = res.pop("stats")
        assert isinstance(stats, ReceiverStatistics)
        print(f"worker {idx}: {res}, skipped {stats.skipped} versions")


async def _dispatch(worker_idx: int, scheme: MultiProcessWeightSyncScheme, args: dict[int, tuple[float, int | None]]) -> dict[str, object]:
    return await worker(worker_idx, scheme, *args[worker_idx])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # asyncsync's progress lines
    asyncio.run(main())
