"""``scripts/bench_profile.py``: a send's CPU split by owner under cProfile (tiny runs)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_profile.py"


def _positive(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def bench_profile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_profile", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_splits_a_send_by_owner(bench_profile: ModuleType) -> None:
    r = bench_profile.profile_sends("1k/4", workers=2, sends=20, top=5)
    assert _positive(r["cpu_us_per_send"]) and _positive(r["profiled_cpu_us_per_send"])
    assert {"sender", "receiver", "channel"} <= set(r["shares"])
    assert math.isclose(sum(r["shares"].values()), 1.0)
    assert "function calls" in r["top"]  # which functions come first depends on the machine
    with pytest.raises(ValueError):
        bench_profile.profile_sends("1k", workers=0)


def test_profile_of_the_trainer_alone_with_worker_processes(bench_profile: ModuleType) -> None:
    r = bench_profile.profile_sends("1k/4", workers=1, sends=10, top=5, flat=True, spawned=True)
    assert r["spawned"] and _positive(r["cpu_us_per_send"]) and _positive(r["profiled_cpu_us_per_send"])
    assert "receiver" not in r["shares"]  # the receivers ran in their own processes
    assert math.isclose(sum(r["shares"].values()), 1.0)
    assert "function calls" in r["top"]


def test_profile_command_line(bench_profile: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    bench_profile.main(["--params", "1k/4", "--workers", "1", "--sends", "10", "--top", "3"])
    out = capsys.readouterr().out
    assert out.startswith("1k/4 to 1 in-process receiver, 10 sends")
    assert "profiled time by owner: " in out
