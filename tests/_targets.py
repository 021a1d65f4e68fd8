"""Worker functions for the multi-process tests (module level: spawn pickles them by name)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from torch import nn

from asyncsync import AsyncQueue, MultiProcessWeightSyncScheme


class LogRecords(logging.Handler):
    """What asyncsync logs in a worker process: its expected warnings, for the test to check
    (kept off the test run's output). ``LogRecords.install()`` in the worker function."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    @classmethod
    def install(cls) -> LogRecords:
        handler = cls()
        logging.getLogger("asyncsync").addHandler(handler)
        return handler

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def make_model(kind: str = "mlp") -> nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    if kind == "wide":  # another architecture: same keys, other shapes
        return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3))
    if kind == "big":  # 4 MB: staging copies run off the loop, so commits can interleave
        return nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 2))
    if kind == "bn":
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    raise ValueError(kind)


def fill_(model: nn.Module, value: float) -> None:
    """Set every parameter and floating buffer of *model* to *value*."""
    with torch.no_grad():
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            t.fill_(value)


async def forward_loop(model: nn.Module, stop: asyncio.Event) -> dict[str, int]:
    """Forward passes between awaits; each must see one version (all params equal)."""
    passes = mixed = 0
    seen: set[float] = set()
    while not stop.is_set():
        values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        lo, hi = float(values.min()), float(values.max())
        passes += 1
        if lo != hi:
            mixed += 1
        seen.add(lo)
        x = torch.ones(2, 4)
        model(x)
        await asyncio.sleep(0)
    return {"passes": passes, "mixed": mixed, "versions_seen": len(seen)}


def _values(model: nn.Module) -> tuple[float, float]:
    values = torch.cat([t.detach().float().reshape(-1) for t in model.state_dict().values() if t.is_floating_point()])
    return float(values.min()), float(values.max())


async def commit_watch(scheme: MultiProcessWeightSyncScheme, model: nn.Module, stop: asyncio.Event) -> dict[str, int]:
    """Manual commits at loop iterations of our choosing; between two awaits the model must
    hold one version, and it may change only at our own commits."""
    commits = mixed = silent = 0
    k = 0
    while not stop.is_set():
        before = _values(model)
        await asyncio.sleep(0)
        after = _values(model)
        if after != before:
            silent += 1  # changed although nobody committed
        if after[0] != after[1]:
            mixed += 1
        k += 1
        if k % 3 == 0 and scheme.commit() is not None:
            commits += 1
            lo, hi = _values(model)
            if lo != hi:
                mixed += 1
    return {"commits": commits, "mixed": mixed, "silent": silent}


async def probe_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, ctrl: Any, kind: str = "mlp", opts: dict[str, Any] | None = None) -> dict[str, Any]:
    """A worker that answers probes on *ctrl* while its receiver applies updates."""
    opts = dict(opts or {})
    raise_on_update = opts.pop("raise_on_update", False)
    torch.set_num_threads(1)
    model = make_model(kind)
    updates: list[int] = []

    def on_update(weights: Any, version: int) -> None:
        updates.append(version)
        if raise_on_update and version > 0:
            raise RuntimeError(f"callback failed on version {version}")

    scheme.init_on_receiver(worker_idx=worker_idx, model=model, on_update=on_update, **opts)
    q: AsyncQueue[Any] = AsyncQueue(ctrl)
    stop_forward = asyncio.Event()
    forward: asyncio.Task[dict[str, int]] | None = None
    watch: asyncio.Task[dict[str, int]] | None = None
    async with scheme:
        while True:
            req = await q.get()
            cmd = req[0]
            if cmd == "block":  # a long synchronous step: the loop does nothing until released
                await q.put("blocked")
                q.endpoint.recv()  # type: ignore[union-attr]
                await q.put("released")
            elif cmd == "leave":  # close the receiver, keep the model and keep answering probes
                await scheme.aclose()
                await q.put(scheme.version)
            elif cmd == "watch_start":
                stop_forward.clear()
                watch = asyncio.ensure_future(commit_watch(scheme, model, stop_forward))
                await q.put("started")
            elif cmd == "watch_stop":
                stop_forward.set()
                assert watch is not None
                await q.put(await watch)
            elif cmd == "state":
                await q.put((scheme.version, {k: v.detach().clone() for k, v in model.state_dict().items()}))
            elif cmd == "version":
                await q.put(scheme.version)
            elif cmd == "wait_version":
                await q.put(await scheme.wait_for_version(req[1], timeout=30))
            elif cmd == "forward_start":
                stop_forward.clear()
                forward = asyncio.ensure_future(forward_loop(model, stop_forward))
                await q.put("started")
            elif cmd == "forward_stop":
                stop_forward.set()
                assert forward is not None
                await q.put(await forward)
            elif cmd == "ptrs":
                await q.put({k: p.data_ptr() for k, p in model.named_parameters()})
            elif cmd == "dtypes":
                await q.put({k: str(p.dtype) for k, p in model.state_dict().items()})
            elif cmd == "updates":
                await q.put(list(updates))
            elif cmd == "stats":
                await q.put(scheme.statistics())
            elif cmd == "commit":
                await q.put((scheme.update_pending, scheme.commit(), scheme.version))
            elif cmd == "wait_stopped":
                try:
                    await scheme.wait_stopped()
                    await q.put("stopped")
                except Exception as exc:
                    await q.put(repr(exc))
                break
            elif cmd == "exit":
                break
    return {"version": scheme.version, "updates": updates}


async def simple_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, kind: str = "mlp") -> int:
    """Receive until stopped; return the last version applied."""
    torch.set_num_threads(1)
    model = make_model(kind)
    scheme.init_on_receiver(worker_idx=worker_idx, model=model)
    async with scheme:
        await scheme.wait_stopped()
    return scheme.version


async def unconnected_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
    """The newcomer's mistake on worker 1: waiting on the receiver without ``async with scheme``."""
    scheme.init_on_receiver(worker_idx=worker_idx, model=make_model())
    if worker_idx == 1:
        await scheme.wait_stopped()  # RuntimeError: the receiver was not connected
    async with scheme:
        await scheme.wait_stopped()
    return scheme.version


async def failing_worker(worker_idx: int, message: str) -> None:
    raise ValueError(f"{message} from {worker_idx}")


async def returning_worker(worker_idx: int, factor: int) -> int:
    await asyncio.sleep(0)
    return worker_idx * factor


async def trainer_process(worker_idx: int, report: Any) -> None:
    """A trainer in its own process (so a test can SIGKILL it) with one worker of its own."""
    from asyncsync import spawn_workers

    torch.set_num_threads(1)
    model = make_model()
    fill_(model, 5.0)
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=model, num_workers=1)
    group = spawn_workers(orphan_worker, 1, args=(scheme, report), scheme=scheme)
    group.start()
    await scheme.connect()
    fill_(model, 6.0)
    await scheme.send()
    report.send(("trainer-ready", scheme.version))
    await asyncio.Event().wait()  # until killed


async def orphan_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, report: Any) -> None:
    """Reports how it learns of its trainer's death, and what weights it kept."""
    model = make_model()
    scheme.init_on_receiver(worker_idx=worker_idx, model=model)
    import os

    report.send(("worker-pid", os.getpid()))
    async with scheme:
        try:
            await scheme.wait_stopped()
            outcome = "stopped"
        except Exception as exc:
            outcome = type(exc).__name__ + ": " + str(exc)
        values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        report.send(("worker-done", outcome, scheme.version, float(values.min()), float(values.max())))


async def kind_from_file_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, path: str) -> int:
    """simple_worker whose model kind is read from the file *path* when it starts (a test
    rewrites it before a restart; an environment variable would not reach a forkserver's child)."""
    with open(path) as f:
        kind = f.read().strip()
    return await simple_worker(worker_idx, scheme, kind)


async def silent_from_file_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, path: str) -> int | None:
    """simple_worker, unless the file *path* says "silent" when it starts: then it never
    connects (a test writes it before a restart, to get a replacement that stays silent)."""
    with open(path) as f:
        silent = f.read().strip() == "silent"
    if silent:
        await asyncio.Event().wait()  # until the process is killed
        return None
    return await simple_worker(worker_idx, scheme)


async def strict_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, expected: int) -> int:
    """simple_worker that raises if the trainer stopped it before version *expected*: a worker
    that fails only because the trainer's block ended early."""
    version = await simple_worker(worker_idx, scheme)
    if version != expected:
        raise AssertionError(f"worker {worker_idx} was stopped at version {version}, not {expected}")
    return version


async def always_zero_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
    """The mistake of a worker function that ignores its worker_idx: every process claims worker 0."""
    scheme.init_on_receiver(worker_idx=0, model=make_model())
    async with scheme:
        await scheme.wait_stopped()
    return scheme.version


async def state_dict_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> dict[str, torch.Tensor]:
    """Receive until stopped; return the model's state dict (its tensors view the shared
    slot of the last version until the receiver detaches them, then its own memory)."""
    torch.set_num_threads(1)
    model = make_model()
    scheme.init_on_receiver(worker_idx=worker_idx, model=model)
    async with scheme:
        await scheme.wait_stopped()
    return model.state_dict()
