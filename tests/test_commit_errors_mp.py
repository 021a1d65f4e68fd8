"""Worker models a commit must not tear: inference tensors, overlapping memory (processes).

A model built under ``torch.inference_mode()`` takes every version with either commit and
stays usable inside and outside inference mode. A ``commit="copy"`` into memory that cannot
hold the sent values (a buffer made with ``expand()``) is refused whole, before anything is
written: the worker keeps its own weights, its receiver goes on answering, and the sender
gets a :class:`WorkerError` naming the key.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, WorkerError, spawn_workers
from tests._targets import fill_

# Spawned workers import torch: on a loaded machine that alone can take most of a minute.
pytestmark = pytest.mark.timeout(240)
START_S = 120.0  # the scheme's bound on every wait, connect included

def _model(kind: str) -> nn.Module:
    """A Linear and an 8-element buffer; ``expand``: the buffer has stride 0; ``inference``:
    built under ``torch.inference_mode()``."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        m.register_buffer("buf", torch.zeros(1).expand(8) if "expand" in kind else torch.zeros(8))
        return m

    if "inference" in kind:
        with torch.inference_mode():
            return build()
    return build()


async def commit_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, kinds: list[str]) -> dict[str, Any]:
    """Serve until stopped; report what the model holds and whether it still runs."""
    model = _model(kinds[worker_idx])
    initial = model.weight.detach().clone()
    scheme.init_on_receiver(worker_idx=worker_idx, model=model)
    async with scheme:
        await scheme.wait_stopped()
    x = torch.ones(3, 4)
    with torch.inference_mode():
        inside = model(x)
    outside = model(x)  # outside inference mode too, as the model ran before
    stats = scheme.statistics()
    return {
        "version": scheme.version,
        "weight": sorted(set(model.weight.flatten().tolist())),
        "bias": sorted(set(model.bias.flatten().tolist())),
        "buf": model.buf.tolist(),
        "kept_own": torch.equal(model.weight.detach(), initial),
        "inference": model.weight.is_inference(),
        "forward": torch.equal(inside, outside),
        "updates": stats.updates,  # type: ignore[union-attr]
        "rejected": stats.rejected,  # type: ignore[union-attr]
    }


@pytest.mark.parametrize(
    "commit, transfer_dtype",
    [("swap", None), ("swap", torch.bfloat16), ("copy", None)],
    ids=["swap", "swap-bf16", "copy"],
)
async def test_models_built_under_inference_mode_take_every_version(commit: str, transfer_dtype: torch.dtype | None) -> None:
    kinds = ["inference", "inference+expand" if commit == "swap" else "inference"]
    trainer = _model("")
    scheme = MultiProcessWeightSyncScheme(timeout=START_S, commit=commit, transfer_dtype=transfer_dtype)  # type: ignore[arg-type]
    scheme.init_on_sender(model=trainer, num_workers=len(kinds))
    async with spawn_workers(commit_worker, len(kinds), args=(scheme, kinds), scheme=scheme) as workers:
        async with scheme:
            for value in (1.0, 2.0, 3.0):  # exactly representable in bfloat16
                fill_(trainer, value)
                await scheme.send()
            assert [scheme.statistics().worker(i).state for i in range(len(kinds))] == ["connected"] * len(kinds)
    for i, report in workers.results.items():
        assert report["version"] == 3, (i, report)
        assert report["weight"] == report["bias"] == [3.0] and report["buf"] == [3.0] * 8, (i, report)
        assert report["inference"], (i, report)  # still an inference model: no plain tensor swapped in
        assert report["forward"], (i, report)
        assert (report["updates"], report["rejected"]) == (4, 0), (i, report)


async def test_a_copy_commit_that_cannot_be_written_whole_is_refused_whole() -> None:
    trainer = _model("")
    scheme = MultiProcessWeightSyncScheme(timeout=START_S, commit="copy")
    scheme.init_on_sender(model=trainer, num_workers=1)
    async with spawn_workers(commit_worker, 1, args=(scheme, ["expand"]), scheme=scheme) as workers:
        try:
            with pytest.raises(WorkerError, match=r"'buf' \(8,\) has overlapping memory \(strides \(0,\)") as info:
                await scheme.connect()
            assert (info.value.worker_idx, info.value.version) == (0, 0)
            assert "commit='swap'" in info.value.message  # what to do instead
            for value in (1.0, 2.0):  # the receiver goes on: each version is refused, whole
                fill_(trainer, value)
                with pytest.raises(WorkerError, match="'buf'"):
                    await scheme.send()
            row = scheme.statistics().worker(0)  # type: ignore[union-attr]
            assert (row.state, row.applied_version) == ("connected", -1)  # not "left"
            assert "'buf'" in (row.last_error or "")
        finally:
            await scheme.aclose()
    report = workers.results[0]
    assert report["version"] == -1 and report["kept_own"], report  # its own weights, untouched
    assert report["buf"] == [0.0] * 8 and report["forward"], report
    assert (report["updates"], report["rejected"]) == (0, 3), report
