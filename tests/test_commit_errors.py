"""Commits that fail, and models a commit must write carefully (loopback: no processes).

The checks made when the layout arrives leave a commit nothing foreseeable to fail on;
these tests cover what they cannot foresee (a tensor that refuses writes) and the manual
commit of a model built under ``torch.inference_mode()``. The same models across real
processes: tests/test_commit_errors_mp.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, WorkerError
from asyncsync.testing import open_loopback
from tests._targets import fill_


class Brittle(nn.Parameter):
    """A parameter whose writes fail while ``armed`` (as no check can foresee)."""

    armed = False

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if cls.armed and getattr(func, "__name__", "") in ("copy_", "_foreach_copy_", "__set__"):
            raise RuntimeError("this tensor refuses writes")
        return super().__torch_function__(func, types, args, kwargs or {})


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _brittle() -> nn.Module:
    m = _two_layers()
    m[1].weight = Brittle(m[1].weight.detach().clone())
    return m


@pytest.mark.parametrize("commit", ["swap", "copy"])
async def test_a_commit_that_fails_is_refused_and_the_receiver_goes_on(commit: str) -> None:
    trainer = _two_layers()
    scheme = MultiProcessWeightSyncScheme(timeout=10, commit=commit)  # type: ignore[arg-type]
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, {0: _brittle()}) as lb:
        model = lb.models[0]
        fill_(trainer, 2.0)
        Brittle.armed = True
        try:
            with pytest.raises(WorkerError, match=f"commit='{commit}' failed at '1.weight'") as info:
                await scheme.send()
        finally:
            Brittle.armed = False
        written = [bool((p == 2.0).all()) for p in model.parameters()]
        if commit == "swap":  # undone: the model runs version 0, whole
            assert "the model keeps version 0" in info.value.message
            assert written == [False] * 4
        else:  # a copy cannot be undone: the error says what the model holds
            assert "the tensors before it already hold version 1, the others version 0" in info.value.message
            assert written == [True, True, False, False]
        assert lb.workers[0].version == 0
        assert scheme.statistics().worker(0).state == "connected"  # type: ignore[union-attr]
        fill_(trainer, 3.0)
        await scheme.send()  # the receiver goes on: the next version applies, whole
        assert lb.workers[0].version == 2
        assert all(bool((p == 3.0).all()) for p in model.parameters())


@pytest.mark.parametrize("commit", ["swap", "copy"])
async def test_a_manual_commit_writes_an_inference_model_from_outside_inference_mode(commit: str) -> None:
    def inference_model() -> nn.Module:
        with torch.inference_mode():
            return _two_layers()

    trainer = _two_layers()
    scheme = MultiProcessWeightSyncScheme(timeout=10, commit=commit, commit_mode="manual")  # type: ignore[arg-type]
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, inference_model) as lb:
        worker, model = lb.workers[0], lb.models[0]
        fill_(trainer, 2.0)
        version = await scheme.send_async()
        await worker.wait_for_version(version)
        assert not torch.is_inference_mode_enabled()
        assert worker.commit() == version  # called where the worker chooses, outside inference mode
        await scheme.wait_async(version)
        assert all(bool((p == 2.0).all()) and p.is_inference() for p in model.parameters())
        with torch.no_grad():  # as the model ran before: it was built for inference
            assert model(torch.ones(1, 4)).shape == (1, 2)
        with torch.inference_mode():
            assert model(torch.ones(1, 4)).shape == (1, 2)


async def test_a_copy_commit_writes_non_contiguous_tensors_in_place() -> None:
    def transposed() -> nn.Module:
        m = _two_layers()
        m[0].weight = nn.Parameter(m[0].weight.detach().t().contiguous().t())  # same shape, strides (1, 3)
        return m

    trainer = _two_layers()
    scheme = MultiProcessWeightSyncScheme(timeout=10, commit="copy")
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, transposed) as lb:
        weight = lb.models[0][0].weight
        assert not weight.is_contiguous()
        ptr = weight.data_ptr()
        with torch.no_grad():
            trainer[0].weight.copy_(torch.arange(12.0).view(3, 4))
        await scheme.send()
        assert lb.models[0][0].weight.data_ptr() == ptr and not lb.models[0][0].weight.is_contiguous()
        assert torch.equal(lb.models[0][0].weight, trainer[0].weight)
