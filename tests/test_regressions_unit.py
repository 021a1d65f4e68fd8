"""Regressions found by trying the library as a new user would, on an in-process loopback
(the real sockets and shared memory, sender and workers in one event loop)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from asyncsync import (
    CapacityError,
    ClosedError,
    DistributedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    SyncTimeoutError,
    WeightsError,
    loopback_worker,
)
from asyncsync.testing import LoopbackWorkers
from tests._targets import fill_, make_model

Loopback = Callable[..., LoopbackWorkers]  # the asyncsync_loopback fixture (asyncsync's pytest plugin)


def constant(model: nn.Module) -> set[float]:
    return {float(v) for t in model.state_dict().values() if t.is_floating_point() for v in t.unique()}


class Holder:
    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy


async def test_context_model_id_is_looked_up_at_every_send(asyncsync_loopback: Loopback) -> None:
    ctx = Holder(make_model())
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model_id="policy", context=ctx, num_workers=1)
    worker_model = make_model()
    async with asyncsync_loopback(scheme, {0: worker_model}):
        replacement = make_model()
        fill_(replacement, 4.0)
        ctx.policy = replacement  # torchrl looks the model up again at every send
        await scheme.send()
        assert constant(worker_model) == {4.0}
        ctx.policy = None  # type: ignore[assignment]
        with pytest.raises(WeightsError, match="context.policy is no longer an nn.Module"):
            await scheme.send()


class Tied(nn.Module):
    """Tied embeddings and a non-persistent buffer (like a rotary inv_freq)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)


@pytest.mark.parametrize("source", ["model", "state_dict"])
@pytest.mark.parametrize("sent", ["model", "state_dict", "tensordict"])
async def test_tied_weights_and_non_persistent_buffers_in_every_format(asyncsync_loopback: Loopback, source: str, sent: str) -> None:
    trainer = Tied()
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    if source == "model":
        scheme.init_on_sender(model=trainer, num_workers=1)
    else:
        scheme.init_on_sender(weights=trainer.state_dict(), num_workers=1)
    worker_model = Tied()
    worker_model.inv_freq.fill_(7.0)  # its own, never sent
    async with asyncsync_loopback(scheme, {0: worker_model}):
        with torch.no_grad():
            trainer.emb.weight.fill_(3.0)
        weights = {"model": trainer, "state_dict": trainer.state_dict(), "tensordict": TensorDict.from_module(trainer)}[sent]
        await scheme.send(weights)
        assert bool((worker_model.emb.weight == 3.0).all())
        assert worker_model.head.weight is worker_model.emb.weight  # still tied
        assert bool((worker_model.inv_freq == 7.0).all())


async def test_check_finite_checks_the_wire_dtype(asyncsync_loopback: Loopback) -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=10, check_finite=True, transfer_dtype=torch.float16)
    scheme.init_on_sender(model=model, num_workers=1)
    worker_model = make_model()
    async with asyncsync_loopback(scheme, {0: worker_model}):
        fill_(model, 1e5)  # finite in float32, inf in float16
        with pytest.raises(WeightsError, match="float16"):
            await scheme.send()
        fill_(model, 1e3)
        await scheme.send()
        assert constant(worker_model) == {1e3}


async def test_a_failed_async_with_leaves_nothing_running_and_connect_can_be_retried(asyncsync_loopback: Loopback) -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=0.2)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    with pytest.raises(SyncTimeoutError):
        async with scheme:  # nobody connects
            pass
    assert scheme.statistics().workers[0].state == "waiting"
    with pytest.raises(ClosedError):
        await scheme.send()
    # a bare connect() that timed out can be awaited again once the worker is there
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    with pytest.raises(SyncTimeoutError):
        await scheme.connect(timeout=0.05)
    async with asyncsync_loopback(scheme, make_model):  # connect() again, with the worker there
        assert scheme.version == 0 and scheme.sender.applied_versions() == {0: 0}


async def test_devices_that_cannot_be_used_fail_early_with_the_real_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(ValueError, match="worker 0: device cuda:0 requested, but CUDA is not available"):
        MultiProcessWeightSyncScheme().init_on_sender(model=make_model(), devices=["cuda:0"])
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    worker = loopback_worker(scheme, 0)
    with pytest.raises(ValueError, match="worker 0: device cuda:0 requested, but CUDA is not available"):
        worker.init_on_receiver(worker_idx=0, model=make_model(), device="cuda:0")
    worker.init_on_receiver(worker_idx=0, model=make_model())  # nothing was taken: it can be fixed
    await asyncio.gather(scheme.connect(), worker.connect())
    await scheme.aclose()
    await worker.aclose()
    # a rank that is its own worker checks the device before its relay takes anything
    rank = DistributedWeightSyncScheme(rank=1, world_size=2, master_addr="127.0.0.1", master_port=1, token="t")
    with pytest.raises(ValueError, match="init_on_receiver: device cuda:0 requested, but CUDA is not available"):
        rank.init_on_receiver(model=make_model(), device="cuda:0")
    with pytest.raises(RuntimeError, match="init_on_receiver"):
        rank.worker  # nothing was set up


async def test_waiting_for_a_version_not_sent_yet_is_an_error(asyncsync_loopback: Loopback) -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    async with asyncsync_loopback(scheme, make_model):
        with pytest.raises(ValueError, match="version 5 was not sent yet"):
            await scheme.wait_async(version=5)


def _init_in_a_forked_child(scheme: MultiProcessWeightSyncScheme, model: nn.Module) -> str:
    """What ``init_on_receiver`` says in a child that inherited *scheme* by a real fork."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: "fork() may lead to deadlocks" (it is the point)
        pid = os.fork()
    if pid == 0:
        try:
            try:
                scheme.init_on_receiver(worker_idx=0, model=model)
                said = "initialised"
            except RuntimeError as exc:
                said = str(exc)
            os.write(w, said.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


async def test_fork_and_double_unpickling_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="'spawn'"):
        MultiProcessWeightSyncScheme().init_on_sender(model=make_model(), num_workers=1, ctx=mp.get_context("fork"))
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    assert "reached the worker by fork" in _init_in_a_forked_child(scheme, make_model())
    data = pickle.dumps(scheme)
    first = pickle.loads(data)
    with pytest.raises(RuntimeError, match="can be unpickled once"):
        pickle.loads(data)
    for end in first._endpoints.values():
        end.close()
    await scheme.aclose()


async def test_subset_then_partial_to_all_needs_no_wait(asyncsync_loopback: Loopback) -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=2)
    scheme.init_on_sender(model=model, num_workers=2)
    models = {0: make_model(), 1: make_model()}
    async with asyncsync_loopback(scheme, models):
        fill_(model, 1.0)
        await scheme.send(worker_ids=[1])
        v = await scheme.send({"0.bias": torch.full((16,), 5.0)}, partial=True)  # two bases: two slots
        assert scheme.sender.applied_versions() == {0: v, 1: v}
        assert bool((models[1].state_dict()["0.weight"] == 1.0).all())
        assert bool((models[0].state_dict()["0.bias"] == 5.0).all())
        assert torch.equal(models[0].state_dict()["0.weight"], make_model().state_dict()["0.weight"])


async def test_manual_workers_on_different_versions_never_block_send_async(asyncsync_loopback: Loopback) -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=2, commit_mode="manual")
    scheme.init_on_sender(model=model, num_workers=2)
    async with asyncsync_loopback(scheme, make_model) as lb:
        for k in range(10):  # worker 0 commits everything, worker 1 nothing
            fill_(model, float(k))
            v = await scheme.send_async()
            await lb.workers[0].wait_for_version(v)
            lb.workers[0].commit()
        await scheme.wait_async(worker_ids=[0])
        assert lb.workers[1].version == 0 and lb.workers[1].update_pending
        assert lb.workers[1].commit() == v
        await scheme.wait_async()


async def test_sends_cancelled_during_a_threaded_copy_keep_the_books_straight(asyncsync_loopback: Loopback) -> None:
    # 8 MB: the trainer's copy into the slot runs in its copy thread, which a cancel cannot stop
    model = nn.Sequential(nn.Linear(1024, 2048))
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=model, num_workers=1)
    worker_model = nn.Sequential(nn.Linear(1024, 2048))
    async with asyncsync_loopback(scheme, {0: worker_model}):
        for k in range(6):
            fill_(model, float(k))
            task = asyncio.ensure_future(scheme.send())
            for _ in range(k):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            scheme._transport.ledger.check()
        fill_(model, 42.0)
        v = await scheme.send()
        assert scheme.sender.applied_versions() == {0: v}
        assert constant(worker_model) == {42.0}
        assert scheme.statistics().slots <= 4  # k·W + L + G + 1 with W = 1


async def test_a_slot_cap_that_nothing_can_free_raises_capacity_error(asyncsync_loopback: Loopback) -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=10, max_slots=2)
    scheme.init_on_sender(model=model, num_workers=2)
    async with asyncsync_loopback(scheme, make_model):
        fill_(model, 1.0)
        await scheme.send(worker_ids=[0])  # workers 0 and 1 now run on two different slots
        fill_(model, 2.0)
        with pytest.raises(CapacityError, match="max_slots=2") as info:
            await scheme.send()  # a third slot is needed and no answer is outstanding
        assert "worker 0 live" in str(info.value) and "worker 1 live" in str(info.value)
        assert scheme.sender.applied_versions() == {0: 1, 1: 0}  # nothing was published


async def test_a_slot_still_written_by_an_abandoned_receive_is_unmapped_only_when_it_is_done() -> None:
    """A relay's network receive cannot be stopped: closing the pool must not unmap its slot
    under it (the backend would write into freed memory); the slot is unmapped once it is done."""
    from asyncsync._io._slots import Slot

    slot = Slot(0, 4096, transient=False)
    writer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    slot.writer = writer
    slot.close()
    assert slot.segment._mmap is not None and slot.segment.buf.numel() == 4096  # still mapped
    slot.segment.buf.fill_(1)  # and writable, as the backend would
    after_close: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    writer.add_done_callback(lambda _f: after_close.set_result(None))  # runs after the slot's own callback
    writer.set_result(None)
    await after_close
    assert slot.segment._mmap is None
