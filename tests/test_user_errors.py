"""Mistakes a user makes, and the errors that say what to do (loopback: no processes).

A wrong key is named before anything is sent; a device the worker cannot use fails at
``init_on_receiver``; a scheme unpickled twice says so quietly; a wait that times out
prints its duration rounded and, for a worker that never connected, says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from asyncsync import (
    DistributedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    SyncTimeoutError,
    WeightsError,
    WorkerLeftError,
    loopback_worker,
)
from asyncsync.testing import open_loopback, open_loopback_hosts
from tests._targets import fill_, make_model

KEYS = ["'0.weight'", "'0.bias'", "'2.weight'", "'2.bias'"]


def _wrong_key(kind: str) -> Any:
    if kind == "tensordict":
        return TensorDict({"nonexistent": torch.zeros(3)}, [])
    return {"nonexistent": torch.zeros(3)}


@pytest.mark.parametrize("strategy", ["tensordict", "state_dict"])
@pytest.mark.parametrize("sent", ["tensordict", "dict"])
@pytest.mark.parametrize("partial", [False, True])
async def test_an_unknown_key_is_named_before_anything_is_sent(strategy: str, sent: str, partial: bool) -> None:
    trainer = make_model()
    scheme = MultiProcessWeightSyncScheme(strategy=strategy, timeout=10)  # type: ignore[arg-type]
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, make_model) as lb:
        fill_(trainer, 2.0)
        with pytest.raises(WeightsError) as info:
            await scheme.send(_wrong_key(sent), partial=partial)
        message = str(info.value)
        assert "unexpected keys 'nonexistent' (3,)" in message
        assert "hold no tensors" not in message
        assert all(k in message for k in KEYS)  # what was expected (the missing keys, or the model's keys)
        assert scheme.version == 0 and lb.workers[0].version == 0  # nothing was sent
        assert not any(bool((p == 2.0).all()) for p in lb.models[0].parameters())
        await scheme.send()  # the scheme goes on
        assert lb.workers[0].version == 1


async def test_a_misspelt_key_in_a_partial_tensordict_is_not_dropped() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    async with open_loopback(scheme, make_model):
        td = TensorDict({"0.weight": torch.zeros(16, 4), "2.wieght": torch.zeros(3, 16)}, [])
        with pytest.raises(WeightsError, match=re.escape("unexpected keys '2.wieght' (3, 16) (did you mean '2.weight'?)")):
            await scheme.send(td, partial=True)
        assert scheme.version == 0


async def test_the_expected_keys_are_abbreviated() -> None:
    wide = nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=wide, num_workers=1)
    async with open_loopback(scheme, lambda: nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])):
        with pytest.raises(WeightsError, match=re.escape("'3.bias', ... (20 keys)")):
            await scheme.send({"nonexistent": torch.zeros(3)}, partial=True)


async def test_a_whole_module_tensordict_still_drops_its_non_persistent_buffers() -> None:
    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)

    trainer = Rotary()
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(weights=trainer.state_dict(), num_workers=1)
    async with open_loopback(scheme, Rotary) as lb:
        with torch.no_grad():
            trainer.lin.weight.fill_(3.0)
        await scheme.send(TensorDict.from_module(trainer).data)  # leaves are plain tensors here
        assert bool((lb.models[0].lin.weight == 3.0).all())
        with pytest.raises(WeightsError, match="unexpected keys 'inv_freq'"):
            await scheme.send(TensorDict({"inv_freq": torch.arange(2.0)}, []), partial=True)


@pytest.mark.parametrize("partial", [False, True])
async def test_an_unknown_key_is_named_by_the_multi_host_trainer(partial: bool) -> None:
    async with open_loopback_hosts(make_model(), make_model, timeout=10) as lh:
        with pytest.raises(WeightsError, match=re.escape("unexpected keys 'nonexistent' (3,)")) as info:
            await lh.trainer.send(_wrong_key("tensordict"), partial=partial)
        assert all(k in str(info.value) for k in KEYS)
        assert lh.trainer.version == 0 and lh.workers[1, 0].version == 0


async def test_a_scheme_unpickled_twice_is_refused_quietly(capfd: pytest.CaptureFixture[str]) -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    data = pickle.dumps(scheme)
    first = pickle.loads(data)
    for _ in range(2):  # the sharer thread answers in order: after the second refusal, the first is done
        with pytest.raises(RuntimeError, match="can be unpickled once"):
            pickle.loads(data)
    first.init_on_receiver(worker_idx=0, model=make_model())  # the first copy works
    await asyncio.gather(scheme.connect(), first.connect())
    await scheme.aclose()
    await first.aclose()
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "KeyError" not in err, err


async def test_a_timeout_prints_its_duration_rounded_and_names_workers_that_never_said_hello() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=2)
    with pytest.raises(SyncTimeoutError) as info:
        await scheme.connect(timeout=0.05)  # no worker was started
    message = str(info.value)
    assert message.startswith("connect timed out after 0.05 s; no answer from worker 0 (at version -1), worker 1 (at version -1)")
    assert "Workers 0, 1 never said hello" in message and "async with scheme" in message
    assert info.value.never_connected == {0: None, 1: None}  # no process is watched for them
    back = pickle.loads(pickle.dumps(info.value))
    assert str(back) == message and back.pending == info.value.pending
    await scheme.aclose()


async def test_a_worker_that_said_hello_gets_no_hint() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    async with open_loopback(scheme, make_model) as lb:
        async with lb.faults.delay_acks(0):
            with pytest.raises(SyncTimeoutError) as info:
                await scheme.send(timeout=0.2)
        assert re.search(r"timed out after \d+\.\d+ s; no answer from worker 0 \(at version 0\)$", str(info.value)), str(info.value)
        assert info.value.never_connected == {} and "hello" not in str(info.value)


@pytest.mark.parametrize("bad", ["cuda:x", "gpu", ""])
async def test_a_device_string_torch_cannot_read_is_named_before_anything_starts(bad: str) -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    named = rf"^worker 1: {re.escape(repr(bad))} is not a device \(such as 'cpu', 'cuda' or 'cuda:0'\)"
    with pytest.raises(ValueError, match=named):
        scheme.init_on_sender(model=model, devices=["cpu", bad])
    with pytest.raises(ValueError, match=named):
        scheme.init_on_sender(model=model, devices={0: "cpu", 1: bad})
    with pytest.raises(TypeError, match=r"^worker 1: a device is a torch.device or a string such as 'cuda:0', got float 3.5"):
        scheme.init_on_sender(model=model, devices=["cpu", 3.5])
    scheme.init_on_sender(model=model, devices=["cpu", torch.device("cpu")])  # nothing was left half set up
    worker = loopback_worker(scheme, 1)
    with pytest.raises(ValueError, match=named):
        worker.init_on_receiver(worker_idx=1, model=make_model(), device=bad)
    worker.init_on_receiver(worker_idx=1, model=make_model(), device="cpu")
    await scheme.aclose()
    await worker.aclose()


@pytest.mark.parametrize("bad", ["cuda:x", "gpu"])
def test_a_device_string_torch_cannot_read_is_named_by_a_rank_that_is_its_own_worker(bad: str) -> None:
    rank = DistributedWeightSyncScheme(timeout=10)
    with pytest.raises(ValueError, match=rf"^init_on_receiver: {re.escape(repr(bad))} is not a device"):
        rank.init_on_receiver(model=make_model(), device=bad)  # before the relay takes anything


async def test_watch_process_given_a_popen_says_what_it_takes() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with pytest.raises(TypeError, match=r"^watch_process\(worker 0\): expected a multiprocessing.Process .*got subprocess.Popen: .*attach by address"):
            scheme.watch_process(0, proc)
        with pytest.raises(TypeError, match=r"got builtins.int$"):
            scheme.watch_process(0, proc.pid)
    finally:
        proc.communicate()
    with pytest.raises(SyncTimeoutError) as info:
        await scheme.connect(timeout=0.05)
    assert info.value.never_connected == {0: None}  # no process was recorded for it
    await scheme.aclose()


def test_a_timeouts_hint_is_in_its_message_and_survives_pickling() -> None:
    err = SyncTimeoutError("worker 0 waiting for version 2", {0: 1}, 0.5, hint="Worker 0 is polled")
    assert str(err) == "worker 0 waiting for version 2 timed out after 0.5 s; no answer from worker 0 (at version 1). Worker 0 is polled"
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.hint == "Worker 0 is polled"


BAD_TIMEOUTS = [-1, -0.5, float("nan"), "5", True]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
async def test_a_bad_timeout_is_refused_before_anything_is_sent(bad: Any) -> None:
    trainer = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with open_loopback(scheme, make_model) as lb:
        fill_(trainer, 2.0)
        for call in (
            lambda: scheme.send(timeout=bad),
            lambda: scheme.send_async(timeout=bad),
            lambda: scheme.wait_async(timeout=bad),
            lambda: lb.workers[0].wait_for_version(1, timeout=bad),
        ):
            with pytest.raises(ValueError, match=re.escape(f"timeout must be a number of seconds >= 0, or None for no bound; got {bad!r}")):
                await call()
        assert scheme.version == 0 and lb.workers[0].version == 0  # nothing was sent
        assert await scheme.send(timeout=0.0 + 10) == 1  # the scheme goes on
        assert lb.workers[0].version == 1


async def test_a_bad_timeout_is_refused_on_the_multi_host_trainer() -> None:
    async with open_loopback_hosts(make_model(), make_model, hosts={1: 1}, timeout=30) as lh:
        for call in (
            lambda: lh.trainer.send(timeout=-1),
            lambda: lh.trainer.wait_async(timeout=float("nan")),
            lambda: lh.trainer.wait_lost(1, timeout=-1),
            lambda: lh.trainer.wait_host_joined(1, timeout=-1),
            lambda: lh.trainer.sender.wait_dead((1, 0), timeout=float("nan")),
        ):
            with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
                await call()
        assert lh.trainer.version == 0
        assert await lh.trainer.send() == 1


@pytest.mark.parametrize("timeout", [0.01, 1, 4.9, 60, None])
def test_any_valid_timeout_makes_a_multi_host_scheme_with_a_derived_silence_timeout(timeout: float | None) -> None:
    scheme = DistributedWeightSyncScheme(timeout=timeout)  # silence_timeout left to its default
    assert scheme.silence_timeout == (None if timeout is None else max(timeout, 5 * scheme.heartbeat))
    relay_side = DistributedWeightSyncScheme(**scheme._relay_kwargs())  # a relay started for it (Ray) takes it as is
    assert relay_side.silence_timeout == scheme.silence_timeout


@pytest.mark.parametrize("bad", [-1, float("nan"), "5"], ids=repr)
def test_a_silence_timeout_that_is_no_duration_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"silence_timeout must be a number of seconds >= 0, or None for no bound; got {bad!r}")):
        DistributedWeightSyncScheme(timeout=60, silence_timeout=bad)


def test_an_explicit_silence_timeout_not_longer_than_the_heartbeat_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=re.escape("silence_timeout (1) must be longer than heartbeat (1.0)")):
        DistributedWeightSyncScheme(timeout=60, silence_timeout=1)
    assert DistributedWeightSyncScheme(timeout=1, heartbeat=0.1, silence_timeout=0.5).silence_timeout == 0.5
    assert DistributedWeightSyncScheme(timeout=1, silence_timeout=None).silence_timeout is None


@contextlib.asynccontextmanager
async def _one_loopback_worker(**receiver: Any) -> AsyncIterator[tuple[MultiProcessWeightSyncScheme, MultiProcessWeightSyncScheme]]:
    """A trainer's scheme for one worker, and that worker's side in this loop (made with
    *receiver* options, not connected yet); both closed at the end."""
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    worker = loopback_worker(scheme, 0)
    worker.init_on_receiver(worker_idx=0, model=make_model(), **receiver)
    try:
        yield scheme, worker
    finally:
        await scheme.aclose()
        await worker.aclose()


async def _raise_in_the_block(scheme: MultiProcessWeightSyncScheme, worker: MultiProcessWeightSyncScheme, error: Exception) -> list[Any]:
    """Connect both; the worker's code raises *error* inside its own ``async with scheme:``
    block. Returns what the two gave (the trainer's version 0, the worker's error)."""

    async def worker_code() -> None:
        async with worker:  # the worker's own `async with scheme:` block
            await scheme.wait_async(0)
            raise error

    return await asyncio.gather(scheme.connect(), worker_code(), return_exceptions=True)


async def test_a_workers_code_that_raises_in_its_block_is_named_in_the_senders_error() -> None:
    async with _one_loopback_worker() as (scheme, worker):
        results = await _raise_in_the_block(scheme, worker, RuntimeError("the env server could not reset"))
        assert isinstance(results[1], RuntimeError)
        with pytest.raises(WorkerLeftError) as info:
            await scheme.send()
        assert re.fullmatch(r"worker 0 (\(pid \d+\) )?left at version 0: its code raised RuntimeError: the env server could not reset", str(info.value)), str(info.value)
        assert info.value.reason == "its code raised RuntimeError: the env server could not reset"


async def test_a_remote_workers_code_that_raises_in_its_block_is_named_on_the_multi_host_trainer() -> None:
    async with open_loopback_hosts(make_model(), make_model, hosts={1: 1}, timeout=30) as lh:
        with pytest.raises(ValueError, match="bad observation"):
            async with contextlib.AsyncExitStack() as block:
                block.push_async_exit(lh.workers[1, 0])  # the worker's `async with scheme:` (connected already)
                raise ValueError("bad observation shape (3,)")
        with pytest.raises(WorkerLeftError, match=re.escape(r"worker (1, 0)")) as info:
            await lh.trainer.send()
        assert "its code raised ValueError: bad observation shape (3,)" in str(info.value)


async def test_a_bad_timeout_is_refused_before_connect_starts_anything() -> None:
    async with _one_loopback_worker() as (scheme, worker):
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            await worker.connect(timeout=-1)
        assert worker.receiver.statistics().version == -1 and not worker.receiver.stopped  # nothing started
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            await scheme.connect(timeout=float("nan"))
        with pytest.raises(RuntimeError, match="connect"):
            await scheme.send()  # the sender was not opened
        assert await asyncio.gather(scheme.connect(), worker.connect()) == [0, 0]  # both go on
        for call in (lambda: scheme.sender.wait_dead(0, timeout=-1), lambda: scheme.sender.wait_joined(0, timeout=float("nan"))):
            with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
                await call()


async def test_any_real_number_is_a_timeout() -> None:
    import numpy as np

    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    async with open_loopback(scheme, make_model):
        assert await scheme.send(timeout=np.float32(5.0)) == 1
        assert await scheme.send(timeout=np.int64(5)) == 2


@pytest.mark.parametrize("scheme_class", [MultiProcessWeightSyncScheme, DistributedWeightSyncScheme])
def test_a_nan_scheme_timeout_is_refused_by_name(scheme_class: type) -> None:
    with pytest.raises(ValueError, match=r"^timeout must be a number of seconds >= 0, or None for no bound; got nan$"):
        scheme_class(timeout=float("nan"))


class _UnreadableError(Exception):
    def __str__(self) -> str:
        raise KeyError("broken __str__")


@pytest.mark.parametrize(
    "error, said",
    [
        (_UnreadableError(), "its code raised _UnreadableError: (its message could not be read)"),
        (ValueError("bad path /data/" + b"\xff".decode("utf-8", "surrogateescape") + ".bin"), r"its code raised ValueError: bad path /data/\udcff.bin"),
    ],
    ids=["unreadable", "surrogate"],
)
async def test_a_workers_error_whatever_its_message_ends_its_block_closed_and_named(error: Exception, said: str) -> None:
    async with _one_loopback_worker() as (scheme, worker):
        results = await _raise_in_the_block(scheme, worker, error)
        assert results[1] is error  # the user's own error leaves the block
        assert worker.receiver.stopped  # and the receiver was closed
        with pytest.raises(WorkerLeftError) as info:
            await scheme.send()
        assert info.value.reason == said


async def test_a_bad_timeout_is_refused_before_an_attaching_worker_dials() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    address = await scheme.listen()
    worker = MultiProcessWeightSyncScheme.attach(address, worker_idx=0)
    worker.init_on_receiver(worker_idx=0, model=make_model())
    try:
        for bad in (-1, float("nan"), "5"):
            with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
                await worker.connect(timeout=bad)
        assert scheme.listener is not None and scheme.listener.refused == 0  # it never dialled
        assert await asyncio.gather(scheme.connect(), worker.connect()) == [0, 0]
    finally:
        await scheme.aclose()
        await worker.aclose()


async def test_a_cancelled_worker_aclose_still_ends_everything() -> None:
    """A close cancelled as soon as it began (a task group cancelling at shutdown) goes on
    by itself: the goodbye goes out and the worker's running callback is cancelled."""
    running, cancelled = asyncio.Event(), asyncio.Event()

    async def on_update(weights: Any, version: int) -> None:
        if version == 1:
            running.set()
            try:
                await asyncio.Event().wait()  # a long callback
            except asyncio.CancelledError:
                cancelled.set()
                raise

    async with _one_loopback_worker(on_update=on_update) as (scheme, worker):
        await asyncio.gather(scheme.connect(), worker.connect())
        await scheme.send()
        await running.wait()
        closing = asyncio.ensure_future(worker.aclose())
        asyncio.get_running_loop().call_soon(closing.cancel)  # runs right after the close's first step
        with pytest.raises(asyncio.CancelledError):
            await closing
        await scheme.sender.wait_dead(0, timeout=10)  # its goodbye went out
        assert scheme.statistics().worker(0).state == "left"
        await asyncio.wait_for(cancelled.wait(), 10)  # and its callback was cancelled
        assert worker.receiver.stopped and worker.statistics().version == 1
