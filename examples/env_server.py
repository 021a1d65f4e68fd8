"""An async environment server that keeps serving actions while the trainer pushes weights.

The worker steps several environments concurrently on one event loop and answers each
with an action from its policy. The trainer pushes a new version every ~100 ms. New
weights are staged off the loop and committed in one step between two awaits, so action
latency stays flat across updates and each action is stamped with exactly one version.

Run: python examples/env_server.py [--params 25000000] [--commit swap|copy] [--updates 10]

``--commit copy`` copies into the parameters on the loop (stable addresses): compare its
p99 with the default ``swap``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers


class Policy(nn.Module):
    def __init__(self, n_params: int) -> None:
        super().__init__()
        hidden = 64
        self.inp = nn.Linear(8, hidden)
        self.out = nn.Linear(hidden, 2)
        # a large table stands in for the bulk of a real policy's weights
        self.table = nn.Parameter(torch.zeros(max(n_params - 8 * hidden - hidden * 2, 1)))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(obs))) + self.table[:2]


class ToyEnv:
    """A stand-in environment: a step takes a little simulated time."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    STEP_S = 0.002

    async def step(self, action: torch.Tensor) -> torch.Tensor:
        await asyncio.sleep(self.STEP_S)
        return torch.randn(1, 8, generator=self.gen)


async def env_server(worker_idx: int, scheme: MultiProcessWeightSyncScheme, n_params: int, n_envs: int) -> dict[int, list[float]]:
    torch.set_num_threads(1)
    policy = Policy(n_params)
    scheme.init_on_receiver(worker_idx=worker_idx, model=policy)
    latencies: dict[int, list[float]] = {}

    requests: asyncio.Queue[tuple[torch.Tensor, asyncio.Future[tuple[torch.Tensor, int]]]] = asyncio.Queue()

    async def serve_policy() -> None:
        """Answers action requests; a stalled loop would show up as request latency."""
        while True:
            obs, reply = await requests.get()
            with torch.no_grad():
                reply.set_result((policy(obs), scheme.version))  # one forward, one version

    async def run_env(seed: int, stopped: asyncio.Future[None]) -> None:
        env = ToyEnv(seed)
        obs = torch.zeros(1, 8)
        loop = asyncio.get_running_loop()
        ready = time.perf_counter()  # when the observation was ready
        while not stopped.done():
            reply: asyncio.Future[tuple[torch.Tensor, int]] = loop.create_future()
            requests.put_nowait((obs, reply))
            action, version = await reply
            # latency the env sees: from its observation being ready to getting an action,
            # including any time the loop was blocked and could not wake it up
            latencies.setdefault(version, []).append((time.perf_counter() - ready) * 1e3)
            started = time.perf_counter()
            obs = await env.step(action)
            ready = started + ToyEnv.STEP_S

    async with scheme:
        stopped = asyncio.ensure_future(scheme.wait_stopped())
        server = asyncio.ensure_future(serve_policy())
        envs = [asyncio.ensure_future(run_env(i, stopped)) for i in range(n_envs)]
        await stopped
        await asyncio.gather(*envs)
        server.cancel()
    return latencies


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--params", type=int, default=25_000_000, help="float32 parameters of the policy (25M: 100 MB)")
    parser.add_argument("--envs", type=int, default=8, help="environments the server steps concurrently, each an asyncio task")
    parser.add_argument("--updates", type=int, default=10, help="weight versions the trainer pushes, one every ~100 ms")
    parser.add_argument(
        "--commit",
        choices=["swap", "copy"],
        default="swap",
        help="how the server applies new weights: swap (point the parameters at shared memory) or copy (into the parameters, on its loop)",
    )
    args = parser.parse_args()
    print(f"imports done; starting the env server ({args.params:,} parameters, {args.envs} envs)...", flush=True)
    torch.set_num_threads(1)
    policy = Policy(args.params)
    scheme = MultiProcessWeightSyncScheme(commit=args.commit, sync=False, timeout=60)
    scheme.init_on_sender(model=policy, num_workers=1)
    async with spawn_workers(env_server, 1, args=(scheme, args.params, args.envs), scheme=scheme) as server:
        async with scheme:
            print("the server runs version 0; pushing updates while it steps its envs", flush=True)
            for _ in range(args.updates):
                await asyncio.sleep(0.1)  # "training"
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(0.01)
                version = await scheme.send()  # sync=False: returns once handed over
                print(f"sent version {version}; the server runs {scheme.sender.applied_versions()[0]}", flush=True)
            await scheme.wait_async()
            await asyncio.sleep(0.1)
        latencies = (await server.join())[0]
    mb = sum(p.numel() for p in policy.parameters()) * 4 / 1e6
    print(f"policy {mb:.0f} MB, {args.envs} envs, commit={args.commit}")
    print(f"{'version':>7} {'actions':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for version in sorted(latencies):
        xs = latencies[version]
        print(f"{version:>7} {len(xs):>8} {statistics.median(xs):>8.3f} {_pct(xs, 0.99):>8.3f} {max(xs):>8.3f}")
    every = [x for xs in latencies.values() for x in xs]
    print(f"{'all':>7} {len(every):>8} {statistics.median(every):>8.3f} {_pct(every, 0.99):>8.3f} {max(every):>8.3f}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # asyncsync's progress lines
    asyncio.run(main())
