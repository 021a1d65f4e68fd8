"""uvloop: the tests' loop is the one asked for, and workers run on uvloop when the trainer asks.

CI runs the sender, receiver and stateful tests again with ``ASYNCSYNC_TEST_LOOP=uvloop``
(see ``tests/conftest.py``); these tests check that this really puts them on uvloop, and
run a full scheme round trip with uvloop on both sides in any pass.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers
from tests._targets import make_model

START_S = 120.0  # a spawned worker imports torch before it answers: slow on a loaded machine

pytestmark = pytest.mark.timeout(300)


def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


async def loop_kind_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> tuple[str, int, list[float]]:
    scheme.init_on_receiver(worker_idx=worker_idx, model=make_model("mlp"))
    async with scheme:
        await scheme.wait_stopped()
    model = scheme.receiver.model
    assert model is not None
    return _loop_kind(), scheme.version, [float(p.detach().sum()) for p in model.parameters()]


async def test_the_tests_run_on_the_loop_asked_for() -> None:
    wanted = os.environ.get("ASYNCSYNC_TEST_LOOP", "asyncio")
    assert _loop_kind() == wanted


async def test_spawned_workers_run_on_the_trainers_loop_kind_and_receive_every_version() -> None:
    model = make_model("mlp")
    scheme = MultiProcessWeightSyncScheme(timeout=START_S)
    scheme.init_on_sender(model=model, num_workers=2)
    async with spawn_workers(loop_kind_worker, 2, args=(scheme,), scheme=scheme) as group:
        async with scheme:
            for _ in range(5):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                await scheme.send()
    sums = [float(p.detach().sum()) for p in model.parameters()]
    assert group.results == {i: (_loop_kind(), 5, sums) for i in range(2)}


async def test_workers_run_on_uvloop_when_the_trainer_asks_for_it() -> None:
    uvloop = pytest.importorskip("uvloop")
    model = make_model("mlp")
    scheme = MultiProcessWeightSyncScheme(timeout=START_S, commit="copy")
    scheme.init_on_sender(model=model, num_workers=1)
    async with spawn_workers(loop_kind_worker, 1, args=(scheme,), scheme=scheme, loop_factory=uvloop.new_event_loop) as group:
        async with scheme:
            await scheme.send()
    assert group.results[0][:2] == ("uvloop", 1)
