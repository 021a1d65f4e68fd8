"""What ``asyncsync.ray`` gives a relay it starts on another node, checked without Ray.

A relay actor builds its scheme from the trainer's options and store address
(``DistributedWeightSyncScheme._relay_kwargs``) and its model from the trainer's layout
alone (:func:`asyncsync.ray.relay_template`: meta tensors, no memory; tied weights as CPU tensors). Here the trainer,
that relay and one worker share this event loop, over gloo on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from asyncsync import DistributedWeightSyncScheme, HostLostError, loopback_worker
from asyncsync.ray import RayHostGroup, relay_template, start_workers
from tests._dist_cluster import free_port
from tests._ray_targets import recording_worker
from tests._targets import fill_, make_model


def trainer_scheme(**options: object) -> DistributedWeightSyncScheme:
    return DistributedWeightSyncScheme(rank=0, timeout=30, token="relay", master_addr="127.0.0.1", master_port=free_port(), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("transfer_dtype", [None, torch.bfloat16])
async def test_a_relay_built_from_the_trainers_layout_and_options_delivers(transfer_dtype: torch.dtype | None) -> None:
    model = make_model()
    trainer = trainer_scheme(transfer_dtype=transfer_dtype)
    trainer.init_on_sender(model=model, hosts={1: 1})
    template = relay_template(trainer._source_layout)  # what RayHostGroup hands its relays
    assert all(t.is_meta for t in template.values()), "the relay's copy of the architecture takes no memory"
    host = DistributedWeightSyncScheme(rank=1, **trainer._relay_kwargs())
    host.init_on_relay(weights=template, num_workers=1)
    replica = make_model()
    fill_(replica, 0.0)
    worker = loopback_worker(host.local, 0)
    worker.init_on_receiver(worker_idx=0, model=replica)
    try:
        await asyncio.gather(trainer.connect(), host.connect(), worker.connect())
        fill_(model, 3.0)
        assert await trainer.send() == 1
        assert worker.version == 1
        assert all(bool((p == 3.0).all()) for p in replica.parameters())
        assert trainer.sender.applied_versions() == {(1, 0): 1}
    finally:
        await trainer.aclose()
        await host.aclose()
        await worker.aclose()


async def test_a_host_scheme_takes_its_worker_counts_from_its_hosts() -> None:
    trainer = trainer_scheme()
    trainer.init_on_sender(model=make_model(), hosts={1: 2})
    try:
        with pytest.raises(ValueError, match="init_on_sender"):
            start_workers(recording_worker, trainer, num_workers=2)
    finally:
        await trainer.aclose()


async def test_tied_weights_reach_the_worker_through_a_relay_built_from_the_layout() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 4)
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    trainer = trainer_scheme()
    trainer.init_on_sender(model=model, hosts={1: 1})
    template = relay_template(trainer._source_layout)  # what RayHostGroup hands its relays
    assert template["head.weight"] is template["emb.weight"]
    host = DistributedWeightSyncScheme(rank=1, **trainer._relay_kwargs())
    host.init_on_relay(weights=template, num_workers=1)
    replica = Tied()
    worker = loopback_worker(host.local, 0)
    worker.init_on_receiver(worker_idx=0, model=replica)
    try:
        await asyncio.gather(trainer.connect(), host.connect(), worker.connect())
        with torch.no_grad():
            model.emb.weight.fill_(3.0)
        assert await trainer.send() == 1
        assert replica.head.weight is replica.emb.weight
        assert bool((replica.emb.weight == 3.0).all())
    finally:
        await trainer.aclose()
        await host.aclose()
        await worker.aclose()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11's")
async def test_a_lost_host_leaving_the_group_names_its_ray_node() -> None:
    trainer = trainer_scheme()
    trainer.init_on_sender(model=make_model(), hosts={1: 1})
    try:
        group = RayHostGroup(  # as start_workers makes it (its placement check needs a cluster)
            recording_worker, trainer, (), {}, {1: "f00d"}, {}, {}, 30.0, 30.0
        )
        group.node_addresses[1] = "198.51.100.7"  # as start() records it
        lost = HostLostError(1, (1, 0), "relay at 198.51.100.7:4242 closed the connection")
        await group.__aexit__(HostLostError, lost, None)  # the error leaves `async with group`
        assert "host 1 ran on Ray node f00d (198.51.100.7)" in lost.__notes__
    finally:
        await trainer.aclose()
