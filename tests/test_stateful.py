"""The state machines on an in-process loopback: tests/stateful.py's ownership machine (the
local scheme's options: shm and queue transports, several sources, cancellations, leaves,
kills), and asyncsync/_stateful.py's machine, which checks the same guarantees on every
transport (local shm here; the multi-host transport in tests/test_dist_stateful.py).

The ownership machine checks at least 500 steps (100 examples of up to 30 steps); at least
2,000 (400 examples) with ``-m slow``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from asyncsync import _stateful
from tests.stateful import run_machine


@pytest.mark.timeout(300)
def test_random_interleavings_keep_every_guarantee() -> None:
    """100 examples in the default suite; the slow variant runs 400."""
    steps = run_machine(settings(max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
    assert steps >= 500, f"only {steps} steps were checked"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_random_interleavings_keep_every_guarantee_longer() -> None:
    steps = run_machine(settings(max_examples=400, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
    assert steps >= 2000, f"only {steps} steps were checked"


@pytest.mark.timeout(240)
def test_cluster_machine_on_the_local_transport() -> None:
    quick = settings(max_examples=8, stateful_step_count=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    assert _stateful.run_machine(quick, ("local",)) >= 8


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("part", range(5))
def test_cluster_machine_on_every_transport(part: int) -> None:
    """150 examples in all, in 5 parts of 30: a slow run reports each part as it ends."""
    long = settings(max_examples=30, stateful_step_count=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    assert _stateful.run_machine(long) >= 200
