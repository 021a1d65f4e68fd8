"""Testing your own training loop with asyncsync's pytest plugin (docs/testing.md).

The plugin is installed with asyncsync (entry point ``asyncsync``); with pytest-asyncio
(``asyncio_mode = "auto"``) these tests need nothing else.

Run: python -m pytest examples/test_my_loop.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, SyncTimeoutError, WorkerDiedError, WorkerError

# ------------------------------------------------------------------ the code under test


def make_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


async def train(scheme: MultiProcessWeightSyncScheme, policy: nn.Module, steps: int, *, send_timeout: float = 10.0) -> list[str]:
    """A training loop that pushes the weights after every step, and goes on when a worker
    is slow or refuses an update (a dead worker ends it)."""
    events = []
    for _ in range(steps):
        with torch.no_grad():
            policy.weight.add_(1.0)
        try:
            await scheme.send(timeout=send_timeout)
            events.append("sent")
        except SyncTimeoutError as exc:
            events.append(f"slow: {sorted(exc.pending)}")
        except WorkerError as exc:
            events.append(f"rejected by {exc.worker_idx}: {exc.message}")
    return events


async def rollout_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
    """A worker process (module level: spawn imports it by name)."""
    policy = make_policy()
    scheme.init_on_receiver(worker_idx=worker_idx, model=policy)
    async with scheme:
        await scheme.wait_stopped()
    return scheme.version


# ------------------------------------------------------------------ its tests


def sender(policy: nn.Module, num_workers: int = 2) -> MultiProcessWeightSyncScheme:
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=policy, num_workers=num_workers)
    return scheme


async def test_workers_follow_the_trainer(asyncsync_loopback) -> None:
    policy = make_policy()
    scheme = sender(policy)
    async with asyncsync_loopback(scheme, make_policy) as lb:  # workers in this event loop
        assert await train(scheme, policy, steps=3) == ["sent"] * 3
        for i, model in lb.models.items():
            assert lb.workers[i].version == 3
            assert torch.equal(model.weight, policy.weight)


async def test_a_slow_worker_is_reported_then_catches_up(asyncsync_loopback) -> None:
    policy = make_policy()
    scheme = sender(policy)
    async with asyncsync_loopback(scheme, make_policy) as lb:
        async with lb.faults.delay_acks(1):  # worker 1 answers nothing in this block
            assert await train(scheme, policy, steps=1, send_timeout=0.2) == ["slow: [1]"]
        assert await train(scheme, policy, steps=1) == ["sent"]
        assert torch.equal(lb.models[1].weight, policy.weight)


async def test_a_refused_update_is_reported_and_the_worker_keeps_its_weights(asyncsync_loopback) -> None:
    policy = make_policy()
    scheme = sender(policy)
    async with asyncsync_loopback(scheme, make_policy) as lb:
        before = lb.models[0].weight.detach().clone()
        async with lb.faults.reject(0, "NaN in the batch"):
            assert await train(scheme, policy, steps=1) == ["rejected by 0: NaN in the batch"]
        assert torch.equal(lb.models[0].weight, before)
        assert torch.equal(lb.models[1].weight, policy.weight)


async def test_a_dead_worker_process_ends_training(asyncsync_workers) -> None:
    policy = make_policy()
    scheme = sender(policy)
    async with asyncsync_workers(rollout_worker, 2, args=(scheme,), scheme=scheme) as workers:
        async with scheme:
            assert await train(scheme, policy, steps=2) == ["sent", "sent"]
            await workers.faults.kill(1)
            with pytest.raises(WorkerDiedError, match="worker 1"):
                await train(scheme, policy, steps=1)
    # Worker 0 got the send that raised (a dead worker holds up no other); the one we killed has no result.
    assert workers.results == {0: 3}
