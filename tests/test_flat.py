"""flatten_parameters: a model's tensors in one flat buffer per dtype, and sends of it
(in-process loopback workers: the same sockets and shared memory as across processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncsync import Layout, MultiProcessWeightSyncScheme, WeightsError, flatten_parameters
from asyncsync._core._flat import contiguous_runs
from asyncsync.testing import open_loopback
from tests._targets import fill_, make_model


def _equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_flatten_keeps_parameters_requires_grad_state_dict_and_optimizer() -> None:
    model = make_model("bn")
    model[2].bias.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    grads = [p.requires_grad for p in params]
    optim = torch.optim.SGD(model.parameters(), lr=0.5)  # built before flattening
    assert flatten_parameters(model) is model
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert [p.requires_grad for p in model.parameters()] == grads
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    # one storage per dtype: every float tensor views the same memory
    floats = [t for t in after.values() if t.dtype == torch.float32]
    assert len({t.untyped_storage().data_ptr() for t in floats}) == 1
    # the optimizer (built before) and a new one (built after) both update the model
    w0 = model[0].weight.detach().clone()
    model(torch.randn(6, 4)).sum().backward()
    optim.step()
    assert not torch.equal(model[0].weight, w0)
    w1 = model[0].weight.detach().clone()
    optim2 = torch.optim.SGD(model.parameters(), lr=0.5)
    optim2.step()
    assert not torch.equal(model[0].weight, w1)
    assert floats[0].untyped_storage().data_ptr() == model[0].weight.untyped_storage().data_ptr()


def test_a_flattened_model_is_one_span_per_dtype() -> None:
    model = flatten_parameters(make_model("bn"))
    flat = model.state_dict(keep_vars=True)
    layout = Layout.from_tensors(flat)
    runs = contiguous_runs(layout, [flat[k] for k in layout.keys])
    assert runs is not None and len(runs) == 2  # float32 and int64 (num_batches_tracked)
    assert contiguous_runs(layout, [make_model("bn").state_dict()[k] for k in layout.keys]) is None


async def test_flattened_model_sends_full_and_partial_updates() -> None:
    trainer = flatten_parameters(make_model("bn"))
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=2)
    async with open_loopback(scheme, lambda: make_model("bn")) as lb:
        for value in (1.5, -2.0):
            fill_(trainer, value)
            with torch.no_grad():
                trainer[1].num_batches_tracked.fill_(int(value * 10))
            await scheme.send()
            assert all(_equal(m, trainer) for m in lb.models.values())
        with torch.no_grad():
            trainer[0].bias.fill_(7.0)
            trainer[0].weight.fill_(8.0)  # not part of the partial send below
        await scheme.send({"0.bias": trainer[0].bias.detach()}, partial=True)
        for m in lb.models.values():
            assert bool((m[0].bias == 7.0).all()) and bool((m[0].weight == -2.0).all())
        await scheme.send()
        assert all(_equal(m, trainer) for m in lb.models.values())


async def test_replaced_tensors_are_never_sent_from_stale_memory() -> None:
    trainer = flatten_parameters(make_model("mlp"))
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, lambda: make_model("mlp")) as lb:
        worker = lb.models[0]
        fill_(trainer, 1.0)
        await scheme.send()
        assert _equal(worker, trainer)
        # `.data = other`: same Parameter object, other memory; the old view keeps changing
        old = trainer[0].weight.data
        trainer[0].weight.data = torch.full_like(old, 3.0)
        old.fill_(99.0)
        await scheme.send()
        assert bool((worker[0].weight == 3.0).all()) and _equal(worker, trainer)
        # a new Parameter object in place of a view
        trainer[2].bias = nn.Parameter(torch.full((3,), 4.0))
        await scheme.send()
        assert bool((worker[2].bias == 4.0).all()) and _equal(worker, trainer)
        # in-place updates of what is still flat keep reaching the worker
        with torch.no_grad():
            trainer[0].bias.fill_(5.0)
            trainer[2].weight.fill_(6.0)
        await scheme.send()
        assert _equal(worker, trainer)


async def test_same_memory_other_strides_is_not_sent_as_a_span() -> None:
    trainer = flatten_parameters(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))) as lb:
        with torch.no_grad():
            trainer[0].weight.copy_(torch.arange(9.0).view(3, 3))
        await scheme.send()
        assert _equal(lb.models[0], trainer)
        # a transposed view of the same memory: same shape, same data pointer, other strides
        trainer[0].weight.data = trainer[0].weight.data.t()
        await scheme.send()
        assert torch.equal(lb.models[0][0].weight, torch.arange(9.0).view(3, 3).t())
        assert _equal(lb.models[0], trainer)


async def test_a_fresh_state_dict_per_send_of_a_flattened_model() -> None:
    trainer = flatten_parameters(make_model("bn"))
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, lambda: make_model("bn")) as lb:
        for value in (1.0, 2.0, 3.0):
            fill_(trainer, value)
            await scheme.send(trainer.state_dict())  # new tensor objects, the same memory
            assert _equal(lb.models[0], trainer)
        trainer[0].weight.data = torch.full_like(trainer[0].weight, 9.0)  # now other memory
        await scheme.send(trainer.state_dict())
        assert bool((lb.models[0][0].weight == 9.0).all()) and _equal(lb.models[0], trainer)


async def test_same_memory_shape_and_strides_in_another_dtype_is_refused() -> None:
    # After a few sends the flat model's check is its memory: pointer, contiguity, shape and dtype.
    trainer = flatten_parameters(make_model("bn"))
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, lambda: make_model("bn")) as lb:
        fill_(trainer, 1.0)
        for _ in range(3):
            await scheme.send()
        mean = trainer[1].running_mean  # a buffer: its data may take any dtype
        mean.data = mean.data.view(torch.int32)  # the same bytes, read as int32
        with pytest.raises(WeightsError, match=r"'1.running_mean' has dtype torch.int32, expected torch.float32"):
            await scheme.send()
        assert bool((lb.models[0][1].running_mean == 1.0).all())
        mean.data = mean.data.view(torch.float32)
        fill_(trainer, 2.0)
        await scheme.send()
        assert _equal(lb.models[0], trainer)


def _strided_model() -> nn.Module:
    """A channels_last convolution, then a Linear whose weight is stored transposed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(16, 5))
    model[0].to(memory_format=torch.channels_last)
    model[2].weight = nn.Parameter(torch.randn(16, 5).t())
    return model


async def test_flatten_keeps_each_tensors_strides_and_sends_it_right() -> None:
    trainer = _strided_model()
    strides = {k: t.stride() for k, t in trainer.state_dict().items()}
    before = {k: t.clone() for k, t in trainer.state_dict().items()}
    x = torch.randn(2, 3, 4, 4)
    out = trainer(x)
    flatten_parameters(trainer)
    assert trainer[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert {k: t.stride() for k, t in trainer.state_dict().items()} == strides
    assert all(torch.equal(trainer.state_dict()[k], v) for k, v in before.items())
    assert len({t.untyped_storage().data_ptr() for t in trainer.state_dict().values()}) == 1
    assert torch.equal(trainer(x), out)
    # the flat buffer holds each tensor in its own order: no two tensors overlap
    spans = sorted((t.storage_offset(), t.storage_offset() + t.numel()) for t in trainer.state_dict().values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, _strided_model) as lb:
        for value in (1.0, 2.0):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.copy_(torch.randn_like(p) + value)
            await scheme.send()
            assert _equal(lb.models[0], trainer)


def test_flatten_names_a_lazy_parameter_that_is_not_initialised() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"flatten_parameters: '1.weight' is not initialised yet .*forward pass"):
        flatten_parameters(model)
    model(torch.randn(2, 4))  # initialised: now it flattens
    flatten_parameters(model)
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
