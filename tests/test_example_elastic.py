"""``python examples/elastic.py`` does what docs/examples.md says it does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_the_elastic_example_grows_to_four_members_and_shrinks_back_to_one() -> None:
    done = subprocess.run([sys.executable, "examples/elastic.py"], capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    counts = [int(m) for m in re.findall(r"version +\d+ +(\d) members?", done.stdout)]
    assert max(counts) == 4 and counts[-1] == 1, done.stdout
    for idx in (1, 2, 3):
        assert f"worker {idx} joined" in done.stdout and f"worker {idx} left" in done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert re.match(r"worker 0 ended at version (\d+), the others left at \{1: \d+, 2: \d+, 3: \d+\}", last), last
