"""The sender validates a configured source once, then only checks it cheaply: every change
that matters must still be noticed (on the loopback)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, WeightsError, loopback_worker
from tests._targets import fill_, make_model


async def _pair(source: object, **kw: object) -> tuple[MultiProcessWeightSyncScheme, MultiProcessWeightSyncScheme, nn.Module]:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(**{("model" if isinstance(source, nn.Module) else "weights"): source}, num_workers=1)
    worker = loopback_worker(scheme, 0)
    worker_model = make_model()
    worker.init_on_receiver(worker_idx=0, model=worker_model)
    joining = asyncio.ensure_future(worker.connect())
    await scheme.connect()
    await joining
    return scheme, worker, worker_model


async def test_a_module_source_is_read_again_after_every_kind_of_change() -> None:
    model = make_model()
    scheme, worker, worker_model = await _pair(model)
    try:
        fill_(model, 1.0)
        await scheme.send()  # cached from here on
        fill_(model, 2.0)
        await scheme.send()
        assert all(bool((t == 2.0).all()) for t in worker_model.state_dict().values())
        # a Parameter object replaced: the new one is sent
        model[0].weight = nn.Parameter(torch.full((16, 4), 3.0))
        await scheme.send()
        assert bool((worker_model[0].weight == 3.0).all())
        # a submodule replaced: its tensors are sent
        model[2] = nn.Linear(16, 3)
        fill_(model[2], 4.0)
        await scheme.send()
        assert bool((worker_model[2].weight == 4.0).all())
        # a shape change behind the same Parameter object is refused, naming the key
        with torch.no_grad():
            model[0].weight.data = torch.zeros(8, 4)
        with pytest.raises(WeightsError, match=r"'0.weight' has shape \(8, 4\), expected \(16, 4\)"):
            await scheme.send()
        with torch.no_grad():
            model[0].weight.data = torch.full((16, 4), 5.0)
        # a dtype change behind the same object, too
        with torch.no_grad():
            model[0].bias.data = torch.zeros(16, dtype=torch.float64)
        with pytest.raises(WeightsError, match="'0.bias' has dtype torch.float64"):
            await scheme.send()
        with torch.no_grad():
            model[0].bias.data = torch.full((16,), 5.0)
        await scheme.send()
        assert bool((worker_model[0].weight == 5.0).all()) and bool((worker_model[0].bias == 5.0).all())
    finally:
        await scheme.aclose()
        await worker.aclose()


async def test_a_dict_source_is_read_again_after_a_key_or_tensor_change() -> None:
    sd = {k: v.clone() for k, v in make_model().state_dict().items()}
    scheme, worker, worker_model = await _pair(sd)
    try:
        await scheme.send()
        sd["0.weight"] = torch.full((16, 4), 6.0)  # a new tensor under the same key
        await scheme.send()
        assert bool((worker_model[0].weight == 6.0).all())
        del sd["0.bias"]
        with pytest.raises(WeightsError, match="missing keys '0.bias'"):
            await scheme.send()
    finally:
        await scheme.aclose()
        await worker.aclose()
