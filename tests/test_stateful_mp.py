"""The ownership state machine across real processes (slow: ``python -m pytest -m slow``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.stateful import ProcessMachine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_random_interleavings_across_processes() -> None:
    ProcessMachine.steps = 0
    run_state_machine_as_test(
        ProcessMachine,
        settings=settings(max_examples=6, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)),
    )
    assert ProcessMachine.steps >= 60
