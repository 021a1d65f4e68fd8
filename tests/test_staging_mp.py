"""Stage-then-commit: manual commits, quorum waits, transfer dtype, partial updates, addresses."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import TensorDict

from asyncsync import MultiProcessWeightSyncScheme, SyncTimeoutError, WeightsError
from tests._targets import fill_, make_model
from tests.conftest import Cluster, assert_same


async def test_manual_commit_and_quorum() -> None:
    c = Cluster.of(["mlp", "mlp"], commit_mode="manual")
    scheme, model = c.scheme, c.model
    try:
        await c.start_manual()
        fill_(model, 2.0)
        v = await scheme.send_async()
        for p in c.probes:  # staged on both, committed on neither
            assert await p.ask("wait_version", v) == v - 1
        pending, committed, version = await c.probes[0].ask("commit")
        assert (pending, committed, version) == (True, v, v)
        await scheme.wait_async(version=v, quorum=1)  # one worker is enough
        with pytest.raises(SyncTimeoutError) as info:
            await scheme.wait_async(version=v, quorum=2, timeout=0.2)
        assert info.value.pending == {1: v - 1}
        assert scheme.statistics().worker(1).lag == 1
        assert (await c.probes[1].ask("commit"))[1] == v
        await scheme.wait_async(version=v)
        _, sd = await c.state(1)
        assert all(bool((t == 2.0).all()) for t in sd.values())
        assert (await c.probes[1].ask("commit")) == (False, None, v)  # nothing pending
        # latest wins: three versions arrive while none is committed; only the newest applies
        for k in range(3):
            fill_(model, 5.0 + k)
            last = await scheme.send_async()
        for p in c.probes:
            assert await p.ask("wait_version", last) == v  # the newest is staged
            assert (await p.ask("commit"))[1:] == (last, last)
            assert (await p.ask("stats")).skipped >= 2
        await scheme.wait_async()
    finally:
        await c.kill_close()


@pytest.mark.parametrize("commit", ["swap", "copy"])
async def test_transfer_dtype_partial_updates_and_addresses(commit: str) -> None:
    c = Cluster.of(["mlp"], transfer_dtype=torch.bfloat16, commit=commit)
    scheme, model = c.scheme, c.model
    await c.start()
    try:
        full_bytes = sum(t.numel() * 4 for t in model.state_dict().values())
        assert scheme.statistics().slot_bytes <= full_bytes // 2 + 64  # bf16 on the wire (+ alignment)
        ptrs0 = await c.probes[0].ask("ptrs")
        fill_(model, 1.5)  # exactly representable in bfloat16
        await scheme.send()
        _, sd = await c.state(0)
        assert_same(model, sd)
        assert set((await c.probes[0].ask("dtypes")).values()) == {"torch.float32"}  # cast back
        ptrs1 = await c.probes[0].ask("ptrs")
        if commit == "copy":
            assert ptrs1 == ptrs0  # stable addresses (CUDA graphs, compiled modules)
        # partial: only the first layer's weight changes
        fill_(model, 3.0)
        td = TensorDict.from_module(model).flatten_keys(".").select("0.weight")
        v = await scheme.send(weights=td, partial=True)
        version, sd = await c.state(0)
        assert version == v
        assert bool((sd["0.weight"] == 3.0).all())
        assert all(bool((t == 1.5).all()) for k, t in sd.items() if k != "0.weight")
        with pytest.raises(WeightsError, match="missing keys"):
            await scheme.send(weights=td)  # a subset without partial=True is an error
        with pytest.raises(WeightsError, match="unexpected keys 'nope'"):
            await scheme.send(weights={"nope": torch.zeros(1)}, partial=True)
    finally:
        await c.close()


async def test_swap_commit_points_cpu_workers_at_the_shared_slot() -> None:
    c = Cluster.of(["mlp"])  # commit="swap": zero-copy on CPU
    scheme, model = c.scheme, c.model
    await c.start()
    try:
        seen = set()
        for k in range(4):
            fill_(model, float(k))
            await scheme.send()
            seen.add(tuple(sorted((await c.probes[0].ask("ptrs")).values())))
        assert len(seen) == scheme.num_slots  # alternates between the two slots
        assert scheme.statistics().slots == scheme.num_slots
    finally:
        await c.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("commit", ["swap", "copy"])
async def test_cuda_staging_in_process(commit: str) -> None:
    """Sender and receiver in one process (a loopback): staging onto cuda:0."""
    import pickle

    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30, commit=commit)  # type: ignore[arg-type]
    scheme.init_on_sender(model=model, devices=["cuda:0"])
    worker_scheme = pickle.loads(pickle.dumps(scheme))
    worker_model = make_model().cuda()
    worker_scheme.init_on_receiver(worker_idx=0, model=worker_model)
    receiver = asyncio.ensure_future(worker_scheme.connect())
    await scheme.connect()
    await receiver
    try:
        ptrs = [p.data_ptr() for p in worker_model.parameters()]
        fill_(model, 4.0)
        await scheme.send()
        assert all(p.device.type == "cuda" and bool((p == 4.0).all()) for p in worker_model.parameters())
        if commit == "copy":
            assert ptrs == [p.data_ptr() for p in worker_model.parameters()]
    finally:
        await scheme.aclose()
        await worker_scheme.aclose()
