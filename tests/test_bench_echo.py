"""The benchmark's echo floor and CPU-per-send accounting (asyncsync.bench)."""

from __future__ import annotations

import json
import math
import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import asyncsync.bench
from asyncsync.bench import _cpu, run_benchmark
from asyncsync.bench._echo import measure_echo
from asyncsync.bench._report import markdown


def _positive(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_echo_round_trip(workers: int) -> None:
    # The autouse fixture in conftest.py fails the test if a worker is left behind.
    got = measure_echo(workers, 5, warmup=2)
    assert set(got) == {"echo_ms", "echo_p90_ms", "echo_min_ms"}
    assert all(_positive(v) for v in got.values()), got
    assert got["echo_min_ms"] <= got["echo_ms"] <= got["echo_p90_ms"]


def test_echo_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        measure_echo(0, 5)
    with pytest.raises(ValueError):
        measure_echo(1, 0)


def _wait_until_sleeping(pid: int, timeout_s: float = 30.0) -> None:
    """Until *pid* sleeps (state ``S`` in ``/proc/<pid>/stat``): its CPU counters are final."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
        if stat[stat.rindex(")") + 2] == "S":
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not go to sleep within {timeout_s} s")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_cpu_of_another_process() -> None:
    """A child burns 0.2 s of CPU, reports its own clock, then sleeps on its stdin: the
    sample counts all the CPU it had used, and a window in which it sleeps counts none."""
    code = (
        "import sys, time\n"
        "while time.process_time() < 0.2:\n"
        "    pass\n"
        "print(repr(time.process_time()), flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            own = float(child.stdout.readline())
            _wait_until_sleeping(child.pid)
            first = _cpu.sample([child.pid])
            second = _cpu.sample([child.pid])
        finally:
            child.stdin.close()
            child.wait(timeout=10)
    used = _cpu.elapsed_s([{}], first)
    assert used is not None
    # the scheduler's counters are exact (ns); psutil's fallback counts clock ticks
    tick = 0.01 if first[0] is not None and -1 in first[0] else 0.0
    assert used >= own - tick, (used, own)
    assert _cpu.elapsed_s(first, second) == 0.0  # asleep: nothing to count
    assert _cpu.elapsed_s([None], [None]) is None
    assert _cpu.sample([None]) == [None]


def test_bench_row_has_echo_and_cpu() -> None:
    rows = run_benchmark(["shm"], params=["10k"], workers=[1], repeats=3, memory=False)
    assert len(rows) == 1
    row = rows[0]
    assert row["kind"] == "latency"
    for key in ("echo_ms", "echo_ratio", "cpu_ms_per_send", "trainer_cpu_ms_per_send"):
        assert _positive(row[key]), (key, row[key])
    assert row["echo_ratio"] == pytest.approx(row["median_ms"] / row["echo_ms"])
    assert row["cpu_ms_per_send"] > row["trainer_cpu_ms_per_send"]
    json.dumps(row)  # what --json writes
    table = markdown(rows)
    assert "| x echo | x socket | x spin | CPU ms/send |" in table
    assert f"({row['trainer_cpu_ms_per_send']:.3f})" in table


def test_cli_no_echo(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m asyncsync.bench`` itself, run in this process as ``-m`` runs it (the
    package's ``__main__`` module as ``__main__``; its worker, from the suite's forkserver,
    must find the benchmark's functions elsewhere)."""
    out = tmp_path / "bench.json"
    argv = ["--transports", "shm", "--params", "10k", "--workers", "1"]
    argv += ["--repeats", "3", "--no-memory", "--no-echo", "--json", str(out)]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["asyncsync.bench", *argv])
    # The file itself, not the module through the import system: pytest's assertion
    # rewriting may own the import of an installed plugin's package, and runpy cannot
    # get the code of a module from it.
    main = Path(asyncsync.bench.__file__).with_name("__main__.py")
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(main), run_name="__main__")
    assert info.value.code == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["echo_ms"] is None and row["echo_ratio"] is None
    assert _positive(row["cpu_ms_per_send"]) and _positive(row["trainer_cpu_ms_per_send"])
    assert "| x echo |" in capsys.readouterr().out


def test_markdown_without_measurements() -> None:
    row = {
        "kind": "latency",
        "transport": "torchrl-mp",
        "params": "10k",
        "workers": 1,
        "median_ms": 3.0,
        "p90_ms": 4.0,
        "gbps": 0.01,
        "floor_ms": 0.005,
        "floor_ratio": 600.0,
        "echo_ms": None,
        "echo_ratio": None,
        "cpu_ms_per_send": None,
        "trainer_cpu_ms_per_send": 1.25,
    }
    line = markdown([row]).splitlines()[2]
    assert "| 600x | - | - | - | - (1.250) |" in line
