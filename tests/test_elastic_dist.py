"""Elastic membership across hosts (loopback hosts over a real gloo group): relays with
new host ids join after start and catch up, a lost host stops being a target, and comes
back under its id."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import torch
from torch import nn

from asyncsync import DistributedWeightSyncScheme, MultiProcessWeightSyncScheme, loopback_worker

pytestmark = pytest.mark.timeout(120)


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Host:
    """A relay with one loopback worker, in this process."""

    def __init__(self, common: dict[str, Any], host: int) -> None:
        self.scheme = DistributedWeightSyncScheme(rank=host, **common)
        self.scheme.init_on_relay(model=make(), num_workers=1)
        self.model = make()
        self.worker: MultiProcessWeightSyncScheme = loopback_worker(self.scheme.local, 0)
        self.worker.init_on_receiver(worker_idx=0, model=self.model)

    async def connect(self) -> None:
        await asyncio.gather(self.scheme.connect(), self.worker.connect())

    async def aclose(self) -> None:
        await self.scheme.aclose()
        await self.worker.aclose()


async def test_hosts_join_catch_up_are_lost_and_come_back() -> None:
    common = dict(timeout=30, token="s3cret", world_size=3, master_addr="127.0.0.1", master_port=free_port())
    policy = make()
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender(model=policy, hosts={}, elastic=True)
    hosts: list[Host] = []
    try:
        await trainer.connect()  # no host yet
        with torch.no_grad():
            policy.weight.fill_(1.0)
        assert await trainer.send() == 1  # to nobody: kept for those that join
        one = Host(common, 1)
        hosts.append(one)
        await one.connect()
        assert one.worker.version == 1 and torch.equal(one.model.weight, policy.weight)  # its first version
        two = Host(common, 2)
        hosts.append(two)
        await two.connect()
        assert trainer.sender.members == [(1, 0), (2, 0)] and trainer.hosts == [1, 2]
        with torch.no_grad():
            policy.weight.fill_(2.0)
        assert await trainer.send() == 2
        assert trainer.sender.applied_versions() == {(1, 0): 2, (2, 0): 2}

        await one.aclose()  # host 1 leaves: later sends to all leave it out, without an error
        await trainer.wait_lost(1)
        with torch.no_grad():
            policy.weight.fill_(3.0)
        assert await trainer.send() == 3
        assert trainer.sender.members == [(2, 0)]
        assert trainer.statistics().worker((1, 0)).applied_version == 2  # still visible

        back = Host(common, 1)  # host 1 again, a new relay: it catches up to version 3
        hosts.append(back)
        await back.connect()
        assert back.worker.version == 3 and torch.equal(back.model.weight, policy.weight)
        with torch.no_grad():
            policy.weight.fill_(4.0)
        assert await trainer.send() == 4
        assert trainer.sender.applied_versions() == {(1, 0): 4, (2, 0): 4}
    finally:
        await trainer.aclose()
        for h in hosts:
            await h.aclose()


async def test_a_new_host_is_refused_without_elastic() -> None:
    common = dict(timeout=10, token="s3cret", world_size=3, master_addr="127.0.0.1", master_port=free_port())
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender(model=make(), hosts={1: 1})
    stranger = Host(common, 2)
    try:
        await trainer.listen()
        with pytest.raises(ValueError, match="not one of the trainer's hosts"):
            await stranger.scheme.connect(timeout=10)
    finally:
        await trainer.aclose()
        await stranger.aclose()
