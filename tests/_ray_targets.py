"""Worker functions for tests/test_ray.py (a module of their own: Ray actors import it by name)."""

from __future__ import annotations

import torch

from asyncsync import MultiProcessWeightSyncScheme
from tests._targets import make_model


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
