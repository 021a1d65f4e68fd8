"""The benchmark's machine floors (socket round trip, shared-memory spin), its per-worker
trainer CPU and its flat-model rows (asyncsync.bench). Tiny runs; no timing asserts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from asyncsync.bench import run_benchmark
from asyncsync.bench.__main__ import main as bench_main
from asyncsync.bench._floors import measure_floors
from asyncsync.bench._report import markdown


def _positive(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("workers", [1, 3])
def test_machine_floors(workers: int) -> None:
    # The autouse fixture in conftest.py fails the test if a peer is left behind.
    got = measure_floors(workers, 5, warmup=2)
    assert set(got) == {"socket_rtt_ms", "socket_rtt_p90_ms", "spin_rtt_ms", "spin_rtt_p90_ms"}
    for name in ("socket_rtt", "spin_rtt"):
        assert _positive(got[f"{name}_ms"]) and got[f"{name}_ms"] <= got[f"{name}_p90_ms"], got


def test_machine_floors_reject_bad_arguments() -> None:
    with pytest.raises(ValueError):
        measure_floors(0, 5)
    with pytest.raises(ValueError):
        measure_floors(1, 0)


@pytest.mark.timeout(300)  # eight process starts on a loaded machine
def test_bench_rows_have_floors_per_worker_cpu_and_flat_rows() -> None:
    # run_asyncsync checks that every worker ends with the trainer's weights: the flat
    # rows also check the one-copy send across real processes.
    rows = run_benchmark(["shm"], params=["1k/8"], workers=[1, 2], repeats=3, memory=False, echo=False, flat=True)
    assert [(r["workers"], r["flat"]) for r in rows] == [(1, False), (1, True), (2, False), (2, True)]
    for row in rows:
        for name in ("socket_rtt", "spin_rtt"):
            assert _positive(row[f"{name}_ms"]), (name, row)
            assert row[f"{name}_ratio"] == pytest.approx(row["median_ms"] / row[f"{name}_ms"])
        assert row["trainer_cpu_ms_per_worker"] == pytest.approx(row["trainer_cpu_ms_per_send"] / row["workers"])
        one = next(r for r in rows if r["workers"] == 1 and r["flat"] == row["flat"])
        assert row["trainer_cpu_vs_1w"] == pytest.approx(row["trainer_cpu_ms_per_send"] / one["trainer_cpu_ms_per_send"])
        json.dumps(row)  # what --json writes
    table = markdown(rows)
    assert "| x socket | x spin | CPU ms/send | trainer ms/worker | trainer CPU vs 1 worker |" in table
    assert "| shm flat | 1k/8 | 2 |" in table


def test_cli_no_floors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line's ``main`` in this process (its workers come from this process's
    forkserver); tests/test_bench_echo.py runs ``python -m asyncsync.bench`` itself."""
    out = tmp_path / "bench.json"
    argv = ["--transports", "shm", "--params", "1k", "--workers", "1"]
    argv += ["--repeats", "3", "--no-memory", "--no-echo", "--no-floors", "--json", str(out)]
    assert bench_main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["socket_rtt_ms"] is None and row["spin_rtt_ratio"] is None and row["flat"] is False
    assert "| x socket | x spin |" in capsys.readouterr().out
