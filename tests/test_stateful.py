"""The ownership state machine (tests/stateful.py) on an in-process loopback.

A run checks at least 2,000 steps (400 examples of up to 30 steps; shorter ones are common).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.stateful import run_machine


@pytest.mark.timeout(600)
def test_random_interleavings_keep_every_guarantee() -> None:
    steps = run_machine(settings(max_examples=400, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
    assert steps >= 2000, f"only {steps} steps were checked"
