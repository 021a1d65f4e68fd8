"""Worker functions for the Ray tests (a module of their own: Ray actors import it by name), and what they check."""

from __future__ import annotations

import os
import select
from collections.abc import Mapping
from typing import Any

import torch

from asyncsync import MultiProcessWeightSyncScheme
from tests._targets import fill_, make_model


async def recording_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> list[tuple[int, list[float]]]:
    """Receive until stopped; return each version the model ran with the distinct values of its weights."""
    torch.set_num_threads(1)
    model = make_model()
    seen: list[tuple[int, list[float]]] = []

    def on_update(weights: object, version: int) -> None:
        values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        seen.append((version, sorted({float(v) for v in values})))

    scheme.init_on_receiver(worker_idx=worker_idx, model=model, on_update=on_update)
    async with scheme:
        await scheme.wait_stopped()
    return seen


async def send_versions_then_a_burst(scheme: Any, model: torch.nn.Module) -> None:
    """Versions 1-3 sent and awaited one by one (every worker applies each), then 4-11 in
    a burst without waiting (a busy worker skips to the newest); each version's weights
    all equal its number."""
    for v in (1, 2, 3):
        fill_(model, float(v))
        assert await scheme.send() == v
    for v in range(4, 12):
        fill_(model, float(v))
        await scheme.send_async()
    await scheme.wait_async(11)


def assert_versions_then_the_latest(results: dict[Any, list[tuple[int, list[float]]]]) -> None:
    """What each :func:`recording_worker` of :func:`send_versions_then_a_burst` saw."""
    for seen in results.values():
        assert seen[:4] == [(v, [float(v)]) for v in range(4)]
        versions = [v for v, _ in seen]
        assert versions == sorted(set(versions)) and versions[-1] == 11
        assert all(values == [float(v)] for v, values in seen), "each version's weights, exactly as sent"


def assert_exited(pids: Mapping[Any, int], what: str = "worker {}") -> None:
    """Every actor process of *pids* (``{key: pid}``, on this machine; *what* names one by its
    key) has exited: it is gone, or its exit waits for its raylet to reap it (psutil then
    says zombie, or dead)."""
    for key, pid in pids.items():
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            running = not select.select([fd], [], [], 0)[0]  # a pidfd reads ready once its process exited
        finally:
            os.close(fd)
        assert not running, f"{what.format(key)}'s actor (pid {pid}) still runs after the group closed"
