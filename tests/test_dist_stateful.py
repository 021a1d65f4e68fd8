"""The state machine of asyncsync/_stateful.py on the multi-host transport: a trainer and
two relays (hosts 1 and 2, 1-2 loopback workers each) on a real gloo group and control
plane over 127.0.0.1, in this process. Random sends (all, subsets across hosts, partial,
bfloat16 transfers), async sends and waits, manual commits, busy workers, stalled relays,
a blocked trainer loop, relay crashes (the control connection ends without goodbye, the
gloo connections stay open while a receive runs in them) and leaves, and rejoins. After
every step each worker holds exactly the version it reports, sent to it, versions only go
up; a lost host's workers keep a complete version and a send to them is refused with
:class:`HostLostError` before anything is sent; a rejoined host's workers get their
newest version first. Real kills (SIGKILL) are in tests/test_dist_faults_mp.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from asyncsync._stateful import run_machine


def _settings(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.timeout(240)
def test_dist_random_interleavings_short() -> None:
    """A few examples in the default suite (the slow variant runs more)."""
    assert run_machine(_settings(6, 12), ("hosts",)) >= 6


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dist_random_interleavings() -> None:
    assert run_machine(_settings(100, 20), ("hosts",)) >= 500
