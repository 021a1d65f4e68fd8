"""Polled workers behind a multi-host relay, in one process (trainer, relay and workers on
127.0.0.1, the gloo group and the control plane real): latest wins in a polled worker's
mailbox without its sender's loop, on a rank that is its own worker (its relay in a thread
of its own) and on a relay that fans out to a polled worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from asyncsync import DistributedWeightSyncScheme, loopback_worker
from tests._dist_cluster import free_port
from tests._targets import fill_, make_model

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 30.0


@asynccontextmanager
async def _polled_host(own_worker: bool) -> AsyncIterator[tuple[DistributedWeightSyncScheme, torch.nn.Module, Any, Any, torch.nn.Module]]:
    """A trainer and host 1 with one polled worker, connected: ``(trainer, its model, the
    relay, the worker's scheme, its model)``. *own_worker*: the rank is its own worker
    (``init_on_receiver(poll=True)``), else a relay with a polled loopback worker."""
    common: dict[str, Any] = dict(timeout=TIMEOUT, token="t0ken", world_size=2, master_addr="127.0.0.1", master_port=free_port(), heartbeat=0.5)
    model = make_model()
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender(model=model, hosts={1: 1})
    rank = DistributedWeightSyncScheme(rank=1, **common)
    policy = make_model()
    if own_worker:
        rank.init_on_receiver(model=policy, poll=True)
        worker: Any = rank
        sides = [rank]
    else:
        rank.init_on_relay(model=make_model(), num_workers=1)
        worker = loopback_worker(rank.local, 0)
        worker.init_on_receiver(worker_idx=0, model=policy, poll=True)
        sides = [rank, worker]
    try:
        await asyncio.gather(trainer.connect(), *(s.connect() for s in sides))
        yield trainer, model, rank.relay, worker, policy
    finally:
        await trainer.aclose()
        for s in sides:
            await s.aclose()


async def _landed(relay: Any, version: int) -> None:
    """Until *version* landed on the host and was published to its worker (the worker
    does not poll meanwhile: nothing it holds changes)."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while relay.version < version:
        assert asyncio.get_running_loop().time() < deadline, f"version {version} did not land (at {relay.version})"
        await asyncio.sleep(0.001)


async def _poll(worker: Any) -> int:
    """The first version a poll commits (polls commit nothing while a slot is being mapped)."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while (got := worker.poll_nowait()) is None:
        assert asyncio.get_running_loop().time() < deadline, "no poll committed anything"
        await asyncio.sleep(0.001)
    return got  # type: ignore[no-any-return]


@pytest.mark.parametrize("own_worker", [True, False], ids=["rank-is-its-worker", "relay-fan-out"])
async def test_a_polled_worker_on_a_host_commits_the_newest_version_that_landed_since_its_last_poll(own_worker: bool) -> None:
    async with _polled_host(own_worker) as (trainer, model, relay, worker, policy):
        assert worker.version == 0
        for round_, values in enumerate(((1.0, 2.0, 3.0), (4.0, 5.0))):
            for value in values:  # each lands on the host (the relay has no ack to read meanwhile)
                fill_(model, value)
                newest = await trainer.send_async()
                await _landed(relay, newest)
            assert await _poll(worker) == newest, f"round {round_}"
            assert all(bool((p == values[-1]).all()) for p in policy.parameters())
            await trainer.wait_async(newest)
        assert trainer.sender.applied_versions() == {(1, 0): newest}
