"""Many-tensor models across spawned workers: every commit after the first is one storage swap,
and every parameter holds what was sent, in the same ``Parameter`` objects."""

from __future__ import annotations

from typing import Any

import torch

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers
from tests.test_bucket import Many
from tests.test_bucket import _stamp as stamp


async def checking_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> dict[str, Any]:
    """Check every committed version in ``on_update``; return what was seen."""
    torch.set_num_threads(1)
    model = Many(n=128).eval()  # 256 parameters and 4 buffers, two dtypes; read-only, as swap asks
    params = list(model.parameters())
    seen: dict[str, Any] = {"versions": [], "wrong": [], "storages": set(), "addresses": set(), "grads": True}

    def on_update(weights: Any, version: int) -> None:
        sd = model.state_dict()
        base = float(sd["layers.0.weight"].flatten()[0]) - list(sd).index("layers.0.weight")  # what the sender stamped
        wrong = [k for i, (k, t) in enumerate(sd.items()) if not bool((t == base + i).all())]
        if wrong or not all(a is b for a, b in zip(params, model.parameters(), strict=True)):
            seen["wrong"].append((version, wrong[:4]))
        seen["versions"].append(version)
        if version > 1:  # arranged at the first commit: the same storage object from then on
            seen["storages"].add(model.layers[7].weight.untyped_storage()._cdata)
            seen["addresses"].add(model.layers[7].weight.data_ptr())
        model.zero_grad()
        model(torch.randn(3, 3)).sum().backward()  # gradients still flow into the same Parameters
        seen["grads"] &= all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters() if p.requires_grad)

    scheme.init_on_receiver(worker_idx=worker_idx, model=model, on_update=on_update)
    async with scheme:
        await scheme.wait_stopped()
    seen["swaps"] = scheme.receiver._committer.bucket.swaps if scheme.receiver._committer.bucket is not None else 0
    seen["final"] = [float(t.flatten()[0]) for t in model.state_dict().values() if t.numel()][:3]
    return seen


async def test_many_tensor_versions_reach_spawned_workers_by_one_swap() -> None:
    trainer = Many(n=128)
    stamp(trainer, 0.0)
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=2)
    async with spawn_workers(checking_worker, 2, args=(scheme,), scheme=scheme) as group:
        async with scheme:
            for k in range(1, 9):
                stamp(trainer, 1000.0 * k)
                await scheme.send()
        results = await group.join(timeout=60)
    for seen in results.values():
        assert seen["wrong"] == []
        assert seen["versions"][-1] == 8
        assert seen["grads"]
        assert seen["swaps"] >= len(seen["versions"]) - 2  # all but the first commit or two
        assert len(seen["storages"]) == 1  # one storage object for the whole model ...
        assert len(seen["addresses"]) > 1  # ... whose memory moved from slot to slot
        assert seen["final"] == [8001.0, 8002.0, 8003.0]  # kept after the receiver closed (tensor 0 is empty)
