"""examples/multihost.py under torchrun (3 ranks on this machine): slow-marked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [["--workers-per-host", "1"], ["--rank-is-worker"]], ids=["relay-and-workers", "rank-is-worker"])
def test_multihost_example_runs_under_torchrun(layout: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "examples/multihost.py", "--steps", "3", *layout]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[trainer] step  3" in out.stdout
    assert "[host 1] worker 0: finished at version 3" in out.stdout
    assert "[host 2] worker 0: finished at version 3" in out.stdout
