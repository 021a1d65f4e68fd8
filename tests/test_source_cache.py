"""The cached check of a configured source sees every structural change of a nested module,
a flattened model and NaN values on every send (on the loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, WeightsError, flatten_parameters, loopback_worker
from tests._targets import fill_, make_model


@asynccontextmanager
async def _pair(model: nn.Module, worker_model: nn.Module, **kw: object) -> AsyncIterator[MultiProcessWeightSyncScheme]:
    """A connected sender of *model* and a loopback worker holding *worker_model*."""
    scheme = MultiProcessWeightSyncScheme(timeout=10, **kw)  # type: ignore[arg-type]
    scheme.init_on_sender(model=model, num_workers=1)
    worker = loopback_worker(scheme, 0)
    worker.init_on_receiver(worker_idx=0, model=worker_model)
    try:
        joining = asyncio.ensure_future(worker.connect())
        await scheme.connect()
        await joining
        yield scheme
    finally:
        await scheme.aclose()
        await worker.aclose()


async def test_structural_changes_of_a_nested_module_are_refused_naming_the_key() -> None:
    model = make_model("bn")
    worker_model = make_model("bn")
    async with _pair(model, worker_model) as scheme:
        await scheme.send()
        await scheme.send()  # the cached check from here on
        # a parameter added to a submodule: named, nothing sent
        model[2].register_parameter("extra", nn.Parameter(torch.zeros(3)))
        with pytest.raises(WeightsError, match=r"unexpected keys '2.extra' \(3,\)"):
            await scheme.send()
        del model[2]._parameters["extra"]
        # a buffer removed
        mean = model[1]._buffers.pop("running_mean")
        with pytest.raises(WeightsError, match="missing keys '1.running_mean'"):
            await scheme.send()
        model[1].register_buffer("running_mean", mean)
        # a submodule added under a new name
        model[2].add_module("head", nn.Linear(2, 2))
        with pytest.raises(WeightsError, match="unexpected keys '2.head.weight'"):
            await scheme.send()
        del model[2]._modules["head"]
        # a submodule replaced by another with the same number of tensors but other shapes
        model[2] = nn.Linear(8, 5)
        with pytest.raises(WeightsError, match=r"'2.weight' has shape \(5, 8\), expected \(2, 8\)"):
            await scheme.send()
        model[2] = nn.Linear(8, 2)
        fill_(model, 7.0)
        await scheme.send()
        assert all(bool((t == 7.0).all()) for t in worker_model.parameters())


async def test_a_view_of_the_same_memory_with_another_shape_is_refused() -> None:
    # The memory (data_ptr) is unchanged: only the shape says that this no longer fits.
    model = flatten_parameters(make_model())
    worker_model = make_model()
    async with _pair(model, worker_model) as scheme:
        fill_(model, 1.0)
        await scheme.send()
        await scheme.send()
        weight = model[0].weight
        with torch.no_grad():
            weight.data = weight.data.view(64)
        with pytest.raises(WeightsError, match=r"'0.weight' has shape \(64,\), expected \(16, 4\)"):
            await scheme.send()
        with torch.no_grad():
            weight.data = weight.data.view(16, 4)
        fill_(model, 2.0)
        await scheme.send()
        assert all(bool((t == 2.0).all()) for t in worker_model.parameters())
        # a parameter of the flattened model pointed at its own memory: its new values are sent
        with torch.no_grad():
            weight.data = torch.full((16, 4), 3.0)
        await scheme.send()
        assert bool((worker_model[0].weight == 3.0).all()) and bool((worker_model[2].weight == 2.0).all())


async def test_check_finite_reads_the_values_on_every_cached_send() -> None:
    model = make_model()
    worker_model = make_model()
    async with _pair(model, worker_model, check_finite=True) as scheme:
        fill_(model, 1.0)
        await scheme.send()
        await scheme.send()
        with torch.no_grad():
            model[2].bias[1] = float("nan")
        with pytest.raises(WeightsError, match="NaN or inf in '2.bias'"):
            await scheme.send()
        assert bool((worker_model[2].bias == 1.0).all())  # nothing was sent
        fill_(model, 4.0)
        await scheme.send()
        assert all(bool((t == 4.0).all()) for t in worker_model.parameters())
