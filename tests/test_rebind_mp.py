"""A worker whose model's tensors are replaced after ``connect()``, across real processes.

The worker reloads a checkpoint with ``load_state_dict(..., assign=True)``, swaps in a new
submodule, registers or deletes a parameter, or gives the receiver another model. Every
version it acknowledges is then what the model runs (the receiver follows the model's
current tensors), or the version is refused with a ``WorkerError`` naming the key that no
longer fits, the worker keeping its weights and running on. Tensors the model dropped keep
the values they had (they no longer view a shared slot that later versions overwrite).
Run for ``commit="swap"`` and ``"copy"``, auto and manual commits, polled and
event-driven workers, ``transfer_dtype``, ``params_map`` and partial updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from torch import nn

from asyncsync import AsyncQueue, MultiProcessWeightSyncScheme, WorkerError, spawn_workers
from tests._targets import LogRecords, fill_, make_model

pytestmark = pytest.mark.timeout(240)
START_S = 120.0  # spawned workers import torch: on a loaded machine that takes a while

Values = dict[str, list[float]]


def _values(model: nn.Module) -> Values:
    return {k: sorted({float(v) for v in t.detach().float().flatten().tolist()}) for k, t in model.state_dict().items()}


def _filled(module: nn.Module, value: float) -> nn.Module:
    fill_(module, value)
    return module


def _mutate(model: nn.Module, how: str, kept: dict[str, Any]) -> nn.Module | None:
    """Change *model*'s tensors as a worker's own code might; a new model to give the
    receiver, else None."""
    if how == "assign":  # reload a checkpoint: new Parameter objects, the checkpoint's memory
        model.load_state_dict({k: torch.full_like(t, -7.0) for k, t in model.state_dict().items()}, assign=True)
    elif how == "submodule":
        kept["old"] = model[2]  # the worker keeps the module it replaced
        model[2] = _filled(nn.Linear(16, 3), -5.0)
    elif how == "wrong-shape":
        model[2] = _filled(nn.Linear(16, 5), -5.0)
    elif how == "wrong-dtype":
        model[2] = _filled(nn.Linear(16, 3).double(), -5.0)
    elif how == "fix":
        model[2] = _filled(nn.Linear(16, 3), -5.0)
    elif how == "new-key":
        model[0].register_parameter("extra", nn.Parameter(torch.full((2,), -5.0)))
    elif how == "drop-key":
        del model[0].extra
    elif how == "no-bias":
        del model[2].bias  # a key of the weights the model no longer has
    elif how == "new-model":
        kept["old"] = model
        return _filled(make_model(), -5.0)
    else:
        raise ValueError(how)
    return None


async def mutating_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, ctrl: Any, poll: bool) -> tuple[int, list[str]]:
    """A worker that changes its model's tensors on command (between two versions) and
    reports its values; with *poll*, a step loop polls meanwhile. Returns its last version
    and what asyncsync logged in it."""
    torch.set_num_threads(1)
    records = LogRecords.install()
    model = make_model()
    kept: dict[str, Any] = {}
    scheme.init_on_receiver(worker_idx=worker_idx, model=model, poll=poll)
    q: AsyncQueue[Any] = AsyncQueue(ctrl)
    stop = asyncio.Event()

    async def poller() -> None:
        while not stop.is_set():
            scheme.poll_nowait()
            await asyncio.sleep(0.001)

    async with scheme:
        if scheme.commit_mode == "manual":
            scheme.commit()  # version 0: the trainer's connect waits for it
        polling = asyncio.ensure_future(poller()) if poll else None
        try:
            while (req := await q.get())[0] != "exit":
                if req[0] == "mutate":
                    new = _mutate(model, req[1], kept)
                    if new is not None:
                        model = scheme.receiver.model = new
                    await q.put("done")
                elif req[0] == "commit":  # commit_mode="manual": once version req[1] is staged
                    await scheme.wait_for_version(req[1], timeout=START_S)
                    await q.put(scheme.commit())
                elif req[0] == "values":
                    old = kept.get("old")
                    await q.put((scheme.version, _values(model), None if old is None else _values(old)))
        finally:
            stop.set()
            if polling is not None:
                await polling
    return scheme.version, records.messages


class _Worker:
    """The trainer's handle on one :func:`mutating_worker`."""

    def __init__(self, scheme: MultiProcessWeightSyncScheme, trainer: nn.Module, q: AsyncQueue[Any]) -> None:
        self.scheme = scheme
        self.trainer = trainer
        self.q = q

    async def ask(self, *cmd: Any) -> Any:
        await self.q.put(cmd)
        return await asyncio.wait_for(self.q.get(), START_S)

    async def deliver(self, value: float, **send: Any) -> int:
        """The trainer's next version (its model filled with *value*); returns once applied."""
        fill_(self.trainer, value)
        version = await self.scheme.send_async(**send)
        if self.scheme.commit_mode == "manual":
            await self.ask("commit", version)
        await self.scheme.wait_async(version)
        return version

    async def values(self) -> tuple[int, Values, Values | None]:
        return await self.ask("values")  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def _one_worker(poll: bool, params_map: bool, **options: Any) -> AsyncIterator[_Worker]:
    trainer = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=START_S, **options)
    if params_map:
        scheme.init_on_sender(params_map={0: trainer})
    else:
        scheme.init_on_sender(model=trainer, num_workers=1)
    ours, theirs = mp.get_context("spawn").Pipe(duplex=True)
    q: AsyncQueue[Any] = AsyncQueue(ours)
    try:
        async with spawn_workers(mutating_worker, 1, args=(scheme, theirs, poll), scheme=scheme) as workers:
            async with scheme:
                yield _Worker(scheme, trainer, q)
                await q.put(("exit",))
        version, logged = workers.results[0]
        assert version == scheme.version  # it ran on to the end
        assert [m.split(":")[0] for m in logged] == [f"worker 0 rejected version {v}" for v in (6, 8, 10, 12)], logged
    finally:
        await q.aclose()
        theirs.close()


def _all(value: float) -> Values:
    return {k: [value] for k in make_model().state_dict()}


CASES = {
    "swap": ({}, False, False),
    "copy-polled": ({"commit": "copy"}, True, False),
    "swap-transfer_dtype-manual": ({"transfer_dtype": torch.bfloat16, "commit_mode": "manual"}, False, False),
    "copy-manual-params_map": ({"commit": "copy", "commit_mode": "manual"}, False, True),
    "swap-polled": ({}, True, False),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_every_acknowledged_version_is_what_the_model_runs(case: str) -> None:
    options, poll, params_map = CASES[case]
    async with _one_worker(poll, params_map, **options) as w:
        assert await w.deliver(1.0) == 1
        assert await w.ask("mutate", "assign") == "done"
        assert await w.deliver(2.0) == 2
        assert await w.values() == (2, _all(2.0), None)

        assert await w.ask("mutate", "submodule") == "done"
        await w.deliver(3.0)
        assert await w.values() == (3, _all(3.0), {"weight": [2.0], "bias": [2.0]})
        await w.deliver(3.0, weights={"0.bias": torch.full((16,), 40.0)}, partial=True)
        await w.deliver(3.0, weights={"0.bias": torch.full((16,), 41.0)}, partial=True)
        last, values, dropped = await w.values()
        assert (last, values, dropped) == (5, {**_all(3.0), "0.bias": [41.0]}, {"weight": [2.0], "bias": [2.0]})

        for how, match in [
            ("wrong-shape", r"'2\.weight': sent shape \(3, 16\), model has \(5, 16\)"),
            ("wrong-dtype", r"'2\.weight'.*torch\.float64"),
            ("new-key", r"0\.extra"),
            ("no-bias", r"2\.bias"),
        ]:
            assert await w.ask("mutate", how) == "done"
            with pytest.raises(WorkerError, match=match) as info:
                await w.deliver(6.0)
            assert info.value.worker_idx == 0
            version, values, _ = await w.values()  # the model keeps what it ran, and its own new tensors
            assert version == last and values["0.weight"] == [3.0 if last == 5 else 7.0], how
            assert values["2.weight"] == ([-5.0] if how in ("wrong-shape", "wrong-dtype") else [7.0]), (how, values)
            assert await w.ask("mutate", "drop-key" if how == "new-key" else "fix") == "done"
            last = await w.deliver(7.0)
            assert await w.values() == (last, _all(7.0), {"weight": [2.0], "bias": [2.0]}), how

        assert await w.ask("mutate", "new-model") == "done"
        version = await w.deliver(8.0)
        assert await w.values() == (version, _all(8.0), _all(7.0))
        version = await w.deliver(9.0)
        assert await w.values() == (version, _all(9.0), _all(7.0))  # the old model is left alone
