"""Configuration, errors and callbacks, on an in-process loopback (sender and receiver in one
loop, talking over the same sockets and shared memory as across processes)."""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
import pickle
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

import asyncsync
from asyncsync import ClosedError, MultiProcessWeightSyncScheme, WeightsError
from tests._targets import fill_, make_model

# The public API, in ``__all__``'s order (constants, then classes, then functions). A
# change to it is deliberate: edit this list with it.
PUBLIC_API = [
    "DEFAULT",
    "AsyncQueue", "AsyncSyncError", "AuthenticationError", "BrokenChannelError", "CapacityError", "ClosedError",
    "DistributedStatistics", "DistributedWeightSyncScheme", "HostLostError", "HostStatistics", "Layout", "MembershipEvent",
    "MultiProcessWeightSyncScheme", "ProtocolError", "Receiver", "ReceiverStatistics", "Sender", "SenderDiedError",
    "SenderStatistics", "SyncTimeoutError", "TensorSpec", "WeightsError", "WorkerAddress", "WorkerDiedError", "WorkerError",
    "WorkerGoneError", "WorkerGroup", "WorkerLeftError", "WorkerProcessError", "WorkerStatistics", "WouldBlock",
    "flatten_parameters", "loopback_worker", "spawn_workers",
]  # fmt: skip


def test_public_api_is_exported() -> None:
    assert asyncsync.__all__ == PUBLIC_API
    star: dict[str, Any] = {}
    exec("from asyncsync import *", star)
    assert sorted(set(star) - {"__builtins__"}) == sorted(PUBLIC_API)
    for name in PUBLIC_API:
        obj = getattr(asyncsync, name)
        if not hasattr(obj, "__qualname__"):  # a constant (DEFAULT): asyncsync's own type, defined under that name
            assert type(obj).__module__.startswith("asyncsync."), (name, type(obj).__module__)
            assert getattr(importlib.import_module(type(obj).__module__), name) is obj, name
            continue
        # defined by asyncsync under that very name (not a re-export of another library's object)
        assert obj.__module__.startswith("asyncsync.") and obj.__qualname__ == name, (name, obj.__module__, obj.__qualname__)
        assert getattr(importlib.import_module(obj.__module__), name) is obj, name


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"num_workers": 1, "weights": {}, "model": "x"}, ValueError, "either weights or model"),
        ({"params_map": {0: {}}, "devices": ["cpu"]}, ValueError, "params_map already fixes"),
        ({"num_workers": 2, "devices": ["cpu"], "device_map_fn": lambda i, w: w}, ValueError, "either devices or device_map_fn"),
        ({"device_map_fn": lambda i, w: w}, ValueError, "needs num_workers"),
        ({}, ValueError, "say how many workers"),
        ({"num_workers": 0}, ValueError, "positive int"),
        ({"num_workers": 3, "devices": ["cpu", "cpu"]}, ValueError, "num_workers=3 but 2 devices"),
        ({"worker_ids": [1, 1]}, ValueError, "distinct"),
        ({"num_workers": 1, "ctx": "spawn"}, TypeError, "multiprocessing context"),
    ],
)
def test_init_on_sender_rejects_bad_combinations(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    scheme = MultiProcessWeightSyncScheme()
    kwargs = dict(kwargs)
    if "model" in kwargs:
        kwargs["model"] = make_model()
    elif "weights" not in kwargs and "params_map" not in kwargs:
        kwargs["model"] = make_model()
    with pytest.raises(error, match=match):
        scheme.init_on_sender(**kwargs)


def test_nothing_to_send_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing to send"):
        MultiProcessWeightSyncScheme().init_on_sender(num_workers=1)
    with pytest.raises(WeightsError, match="no parameters"):
        MultiProcessWeightSyncScheme().init_on_sender(model=torch.nn.ReLU(), num_workers=1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"strategy": "pickle"}, "strategy"),
        ({"transport": "tcp"}, "transport"),
        ({"commit": "maybe"}, "commit"),
        ({"timeout": 0}, "timeout"),
        ({"transfer_dtype": torch.int8}, "transfer_dtype"),
    ],
)
def test_constructor_rejects_bad_options(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MultiProcessWeightSyncScheme(**kwargs)


def test_device_map_fn_is_called_one_worker_at_a_time() -> None:
    calls: list[int] = []

    def to_device(worker_idx: int, weights: Any) -> Any:
        calls.append(worker_idx)
        return weights

    scheme = MultiProcessWeightSyncScheme()
    scheme.init_on_sender(model=make_model(), device_map_fn=to_device, num_workers=3)
    assert calls == [0, 1, 2]
    assert scheme.sender.worker_ids == [0, 1, 2]


class Collector:
    """A torchrl-like context: the model at .policy, and update_policy_weights_."""

    def __init__(self) -> None:
        self.policy = make_model()
        self.received: list[Any] = []

    def update_policy_weights_(self, weights: Any) -> None:
        self.received.append(weights)


@pytest.mark.parametrize("strategy", ["tensordict", "state_dict"])
async def test_context_model_id_and_cascade(strategy: str) -> None:
    trainer = Collector()
    scheme = MultiProcessWeightSyncScheme(strategy=strategy, timeout=10)  # type: ignore[arg-type]
    scheme.init_on_sender(model_id="policy", context=trainer, num_workers=1)
    worker_scheme = pickle.loads(pickle.dumps(scheme))
    worker = Collector()
    callbacks: list[int] = []
    worker_scheme.init_on_receiver(model_id="policy", context=worker, worker_idx=0, on_update=lambda w, v: callbacks.append(v))
    receiving = asyncio.ensure_future(worker_scheme.connect())
    await scheme.connect()
    await receiving
    fill_(trainer.policy, 2.0)
    v = await scheme.send()
    assert callbacks == [0, v]
    weights = worker.received[-1]
    if strategy == "tensordict":
        assert isinstance(weights, TensorDictBase)
        assert bool((weights["0", "weight"] == 2.0).all())
    else:
        assert isinstance(weights, dict) and bool((weights["0.weight"] == 2.0).all())
    assert all(bool((p == 2.0).all()) for p in worker.policy.parameters())
    await scheme.aclose()
    await worker_scheme.wait_stopped()
    await worker_scheme.aclose()
    with pytest.raises(ClosedError):
        await scheme.send()


async def test_calls_in_the_wrong_state() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    with pytest.raises(RuntimeError, match="init_on_sender"):
        await scheme.connect()
    scheme.init_on_sender(model=make_model(), num_workers=1)
    with pytest.raises(RuntimeError, match="connect"):
        await scheme.send()
    with pytest.raises(RuntimeError, match="already initialised"):
        scheme.init_on_sender(model=make_model(), num_workers=1)
    worker_scheme = pickle.loads(pickle.dumps(scheme))
    with pytest.raises(ValueError, match="no channel for worker 5"):
        worker_scheme.init_on_receiver(worker_idx=5, model=make_model())
    await scheme.aclose()


async def test_worker_connect_times_out_without_a_sender() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1, ctx=mp.get_context("spawn"))
    worker_scheme = pickle.loads(pickle.dumps(scheme))
    worker_scheme.init_on_receiver(worker_idx=0, model=make_model())
    with pytest.raises(asyncsync.SyncTimeoutError, match="initial weights"):
        await worker_scheme.connect(timeout=0.05)
    await worker_scheme.aclose()
    await scheme.aclose()


async def test_in_place_write_into_shared_weights_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)  # commit="swap": CPU params view the slot
    scheme.init_on_sender(model=make_model("bn"), num_workers=1)
    worker_scheme = pickle.loads(pickle.dumps(scheme))
    worker_model = make_model("bn")
    worker_scheme.init_on_receiver(worker_idx=0, model=worker_model)
    receiving = asyncio.ensure_future(worker_scheme.connect())
    await scheme.connect()
    await receiving
    await scheme.send()
    assert "wrote in place" not in caplog.text  # read-only use: nothing to report
    worker_model.train()
    worker_model(torch.randn(4, 4))  # BatchNorm updates its running stats in place
    await scheme.send()
    # (BatchNorm's kernel updates running_mean/var without bumping version counters; the
    # Python-level num_batches_tracked += 1 does)
    assert "worker 0 wrote in place into weights that view a shared slot (1.num_batches_tracked" in caplog.text
    await scheme.aclose()
    await worker_scheme.aclose()
