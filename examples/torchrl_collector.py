"""Train CartPole with a torchrl collector whose weights move through asyncsync.

``MultiSyncCollector`` runs two worker processes, each with torchrl's ``GymEnv``; the
trainer learns with REINFORCE and, after every batch, ``collector.update_policy_weights_()``
pushes the new weights through ``AsyncSyncScheme`` (returns once both workers run them).

Run: ``python examples/torchrl_collector.py``. It needs torchrl and gymnasium:
``pip install torch==2.13.0 torchrl==0.14.1 tensordict==0.14.3 gymnasium``. torchrl 0.14.1
requires ``tensordict<0.15``: where a newer tensordict is installed, this replaces it with
0.14.3 (asyncsync works with both; use a virtual environment of its own to keep the newer one).
"""

from __future__ import annotations

import logging
import time

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv
from torchrl.modules import OneHotCategorical, ProbabilisticActor

from asyncsync.torchrl import AsyncSyncScheme

GAMMA = 0.99


def make_env() -> GymEnv:
    return GymEnv("CartPole-v1")


def make_policy() -> ProbabilisticActor:
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(module, in_keys=["logits"], out_keys=["action"], distribution_class=OneHotCategorical)


def returns_to_go(reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """Discounted returns along the last (time) dimension, reset at episode ends."""
    out = torch.zeros_like(reward)
    running = torch.zeros_like(reward[..., 0])
    for t in range(reward.shape[-1] - 1, -1, -1):
        running = reward[..., t] + GAMMA * running * (~done[..., t]).float()
        out[..., t] = running
    return out


def main() -> None:
    print("imports done; starting a torchrl MultiSyncCollector with 2 workers...", flush=True)
    torch.manual_seed(0)
    policy = make_policy()
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    scheme = AsyncSyncScheme(timeout=120)
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy,
        frames_per_batch=400,
        total_frames=8_000,
        weight_sync_schemes={"policy": scheme},
    )
    t0 = time.perf_counter()
    try:
        for i, batch in enumerate(collector):
            reward = batch["next", "reward"].squeeze(-1)
            done = batch["next", "done"].squeeze(-1)
            episodes = int(done.sum())
            length = reward.numel() / max(episodes, 1)
            ret = returns_to_go(reward, done)
            ret = (ret - ret.mean()) / (ret.std() + 1e-6)
            logits = policy.module[0](batch.select("observation"))["logits"]
            logp = (torch.log_softmax(logits, -1) * batch["action"].float()).sum(-1)
            loss = -(logp * ret).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            collector.update_policy_weights_()  # AsyncSyncScheme.send(): both workers run it on return
            print(f"batch {i:2d}: mean episode length {length:6.1f}, workers at version {scheme.version}")
        stats = scheme.statistics()
        print(f"{time.perf_counter() - t0:.1f} s; applied versions {[w.applied_version for w in stats.workers]}")
    finally:
        collector.shutdown()
        scheme.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # asyncsync's progress lines
    main()
