"""The state machine of asyncsync/_stateful.py on every transport: the local shm transport
(loopback workers) and the multi-host transport (trainer + two relays on 127.0.0.1 gloo,
loopback workers), in this process."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from asyncsync._stateful import run_machine


@pytest.mark.parametrize("transport", ["local", "hosts"])
@pytest.mark.timeout(240)
def test_every_transport_keeps_every_guarantee_short(transport: str) -> None:
    steps = run_machine(settings(max_examples=6, stateful_step_count=12, deadline=None, database=None, suppress_health_check=list(HealthCheck)), (transport,))
    assert steps >= 6, f"only {steps} steps were checked"
