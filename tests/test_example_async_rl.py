"""Smoke test of examples/async_rl.py: an asynchronous actor-learner on CartPole, end to end.

Tiny settings (a fixed number of policy versions, not a time budget): the run must finish,
versions must advance on the workers and in the rollouts they stamp, and the learned
policy, played greedily on fixed seeds, must beat a random policy on the same seeds.
gymnasium is part of the ``test`` extra: an import error here is a broken install.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from examples import async_rl

UPDATES = 12


@pytest.mark.timeout(120)  # two spawned workers import torch and gymnasium: slow on a loaded machine
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_async_rl_learns(mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--seed", "0", "--envs-per-worker", "4", "--fragment", "32", "--max-updates", str(UPDATES), "--target", "500"]
    argv += ["--time-limit", "100", "--eval-episodes", "10", "--out", str(tmp_path), "--no-plot"]
    if mode == "sync":
        argv += ["--sync", "--max-lag", "0", "--no-progress"]
    summary = async_rl.main(argv)

    # not a terminal here: progress comes as plain lines (the last one at the end), unless turned off
    out = capsys.readouterr().out
    assert "2 workers run version 0" in out
    progress = re.findall(rf"^ *[0-9.]+ s  \d+ episodes  ret \S+  v {UPDATES}  lag", out, re.MULTILINE)
    assert bool(progress) == (mode == "async"), out

    written = json.loads((tmp_path / "summary.json").read_text())
    assert {k: written[k] for k in ("mode", "updates", "env_steps", "sync_latency_ms", "dropped_rollouts")} == {
        k: summary[k] for k in ("mode", "updates", "env_steps", "sync_latency_ms", "dropped_rollouts")
    }
    assert summary["mode"] == mode
    assert summary["stop_reason"] == "max updates"
    assert summary["updates"] == UPDATES
    # every worker ran the newest weights, and stamped its transitions with the versions it ran
    for worker in summary["workers"].values():
        assert worker["version"] == UPDATES
        assert worker["updates"] == UPDATES + 1  # version 0 at connect, then each one
    assert UPDATES - 2 <= summary["newest_rollout_version"] <= UPDATES
    lags = {int(k): n for k, n in summary["rollout_lag_histogram"].items()}
    assert sum(lags.values()) == summary["fragments_used"] + summary["dropped_rollouts"]
    assert summary["fragments_used"] == UPDATES * 2 * 4  # one fragment per env per version
    if mode == "sync":
        assert set(lags) == {0} and summary["dropped_rollouts"] == 0  # on-policy: nothing stale
    assert summary["episodes"] > 0 and summary["env_steps"] >= UPDATES * 2 * 4 * 32
    # it learned: the greedy policy beats a random one on the same fixed episode seeds
    assert summary["eval_greedy_return"] > 2 * summary["eval_random_return"], summary
