"""Strategies, transports and commit kinds across real processes; rejection and helper errors."""

from __future__ import annotations

import sys

import pytest
import torch

from asyncsync import (
    MultiProcessWeightSyncScheme,
    WeightsError,
    WorkerError,
    WorkerProcessError,
    spawn_workers,
)
from tests._targets import (
    failing_worker,
    fill_,
    make_model,
    returning_worker,
    simple_worker,
    state_dict_worker,
    strict_worker,
    unconnected_worker,
)
from tests.conftest import Cluster, assert_same


@pytest.mark.parametrize(
    "strategy,transport,commit",
    [("state_dict", "queue", "copy"), ("state_dict", "shm", "copy"), ("tensordict", "queue", "swap")],
)
async def test_one_worker_variants(strategy: str, transport: str, commit: str) -> None:
    c = Cluster.of(["bn"], strategy=strategy, transport=transport, commit=commit)
    scheme, model = c.scheme, c.model
    await c.start()
    try:
        _, sd = await c.state(0)
        assert_same(model, sd)
        for k in range(5):
            fill_(model, float(k))
            model[1].num_batches_tracked.fill_(k)  # an integer buffer travels too
            v = await scheme.send()
        version, sd = await c.state(0)
        assert version == v
        assert_same(model, sd)
        stats = scheme.statistics()
        if transport == "shm":
            assert stats.slots == scheme.num_slots  # allocated once, reused
        else:
            assert stats.slots <= 2  # fresh segments, freed once released
    finally:
        await c.close()


async def test_worker_with_other_architecture_rejects_and_keeps_weights() -> None:
    c = Cluster.of(["mlp", "wide"])
    scheme, model = c.scheme, c.model
    with pytest.raises(WorkerError) as info:
        await c.start()
    assert info.value.worker_idx == 1
    assert "'0.weight': sent shape (16, 4), model has (32, 4)" in str(info.value)
    try:
        # worker 1 keeps running with its own weights; worker 0 is fine
        fill_(model, 3.0)
        v = await scheme.send(worker_ids=[0])
        version0, sd0 = await c.state(0)
        assert version0 == v and all(bool((t == 3.0).all()) for t in sd0.values())
        version1, sd1 = await c.state(1)
        assert version1 == -1
        assert_same(make_model("wide"), sd1)
        with pytest.raises(WorkerError, match="worker 1 rejected version"):
            await scheme.send()
        assert scheme.statistics().worker(1).last_error is not None
    finally:
        await c.close()


async def test_spawn_workers_returns_results() -> None:
    async with spawn_workers(returning_worker, 2, args=(10,)) as group:
        results = await group.join(timeout=60)
    assert results == {0: 0, 1: 10}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
async def test_a_worker_that_returns_tensors_returns_them_by_value(start_method: str) -> None:
    """``return model.state_dict()``: the tensors come back by value, though the worker has
    exited by the time the parent reads them (shared by descriptor, they would be gone)."""
    policy = make_model()
    fill_(policy, 4.0)
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=policy, num_workers=2)
    async with spawn_workers(state_dict_worker, 2, args=(scheme,), scheme=scheme, start_method=start_method) as group:
        async with scheme:
            pass  # version 0 applied by both, then both are stopped
        results = await group.join(timeout=60)
    assert sorted(results) == [0, 1]
    for sd in results.values():
        assert_same(policy, sd)
        assert all(not t.is_shared() for t in sd.values())  # the parent's own memory


async def test_spawn_workers_raises_worker_exception() -> None:
    with pytest.raises(WorkerProcessError, match="boom from 1") as info:
        async with spawn_workers(failing_worker, worker_ids=[1], args=("boom",)) as group:
            await group.join(timeout=60)
    assert isinstance(info.value.__cause__, ValueError)
    assert "ValueError" in info.value.remote_traceback


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_workers_own_error_reaches_the_trainer_when_the_block_fails(start_method: str) -> None:
    # Worker 1 raises; the trainer's send fails first (worker 1 died): the error raised is
    # the worker's, with its type, message and traceback, not only "worker 1 died".
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=make_model(), num_workers=2)
    with pytest.raises(WorkerProcessError, match="^worker 1: RuntimeError: the receiver was not connected") as info:
        async with spawn_workers(unconnected_worker, 2, args=(scheme,), scheme=scheme, start_method=start_method) as group:
            assert group.ctx.get_start_method() == start_method
            async with scheme:
                await scheme.send()
    err = info.value
    assert err.worker_idx == 1
    assert isinstance(err.__cause__, RuntimeError) and str(err.__cause__) == "the receiver was not connected"
    # the traceback is the worker's: its function's frame, none of asyncsync's process plumbing
    assert "in unconnected_worker" in err.remote_traceback and "await scheme.wait_stopped()" in err.remote_traceback
    assert "_workers.py" not in err.remote_traceback
    assert err.remote_traceback in str(err.__cause__.__cause__)  # shown in the printed chain


async def test_the_trainers_own_error_leaves_the_block_not_a_worker_error_it_caused() -> None:
    # The trainer's send fails on its own (a key its model lacks); its block ends, the scheme
    # stops the workers early, and each raises for that: the trainer's error is what leaves
    # the block, the workers' errors are notes on it.
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    model = make_model()
    scheme.init_on_sender(model=model, num_workers=2)
    bad = {**model.state_dict(), "nonexistent": torch.zeros(3)}
    with pytest.raises(WeightsError, match="nonexistent") as info:
        async with spawn_workers(strict_worker, 2, args=(scheme, 3), scheme=scheme):
            async with scheme:
                await scheme.send()
                await scheme.send(weights=bad)
    if sys.version_info >= (3, 11):
        notes = info.value.__notes__
        for i in (0, 1):
            assert f"meanwhile, in a worker process: worker {i}: AssertionError: worker {i} was stopped at version 1, not 3" in notes, notes


async def test_a_worker_that_dies_before_it_starts_is_reported_at_once() -> None:
    # its function cannot be unpickled in the child: the process exits before running it
    with pytest.raises(WorkerProcessError, match=r"^worker 0: the process exited with code \S+ before it started"):
        async with spawn_workers(returning_worker, 1, args=(_Unloadable(),)):
            pass


class _Unloadable:
    """Pickles in the trainer, fails to unpickle in a worker."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_refuse, ())


def _refuse() -> None:
    raise RuntimeError("cannot be unpickled here")


async def test_stop_ends_every_receiver_and_workers_return_their_version() -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=model, num_workers=2)
    async with spawn_workers(simple_worker, 2, args=(scheme,), scheme=scheme) as group:
        async with scheme:
            fill_(model, 4.0)
            v = await scheme.send()
        results = await group.join(timeout=60)
    assert results == {0: v, 1: v}
    for w in scheme.statistics().workers:
        assert w.state == "stopped"


async def test_params_map_with_arbitrary_worker_ids() -> None:
    # torchrl indexed params_map by position; here its keys are the worker ids.
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    td = {k: v for k, v in model.state_dict().items()}
    scheme.init_on_sender(params_map={3: td, 7: td})
    assert scheme.sender.worker_ids == [3, 7]
    async with spawn_workers(simple_worker, worker_ids=[3, 7], args=(scheme,), scheme=scheme) as group:
        async with scheme:
            with torch.no_grad():
                for t in td.values():
                    t.fill_(2.0) if t.is_floating_point() else None
            v = await scheme.send(worker_ids=[7])
        results = await group.join(timeout=60)
    assert results == {3: 0, 7: v}
