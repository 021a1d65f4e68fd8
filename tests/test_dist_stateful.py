"""The state machine of asyncsync/_stateful.py on the multi-host transport: a trainer and
two relays (hosts 1 and 2, 1-2 loopback workers each) on a real gloo group and control
plane over 127.0.0.1, in this process. Random sends (all, subsets across hosts, partial,
bfloat16 transfers), async sends and waits, manual commits, busy workers, stalled relays,
a blocked trainer loop, relay crashes (the control connection ends without goodbye, the
gloo connections stay open while a receive runs in them) and leaves, and rejoins. After
every step each worker holds exactly the version it reports, sent to it, versions only go
up; a lost host's workers keep a complete version, and a send or wait naming them raises
:class:`HostLostError` once the living targets answered; a rejoined host's workers get their
newest version first. Real kills (SIGKILL) are in tests/test_dist_faults_mp.py."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

import pytest
from anyio import wait_all_tasks_blocked
from hypothesis import HealthCheck, settings
from torch import nn

from asyncsync import SyncTimeoutError
from asyncsync._stateful import SETTLE, ClusterMachine, run_machine
from asyncsync.testing import open_loopback_hosts


def _settings(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.timeout(240)
def test_dist_random_interleavings_short() -> None:
    """A few examples in the default suite (the slow variant runs more)."""
    assert run_machine(_settings(6, 12), ("hosts",)) >= 6


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("part", range(5))
def test_dist_random_interleavings(part: int) -> None:
    """100 examples in all, in 5 parts of 20: a slow run reports each part as it ends."""
    assert run_machine(_settings(20, 20), ("hosts",)) >= 100


@pytest.mark.timeout(300)
def test_the_multi_host_state_machine_drives_polled_workers() -> None:
    """Every example has a polled worker on each host (worker 0), committed only by the
    machine's poll rule, beside an event-driven one when there are two per host."""
    from asyncsync import _stateful

    machine = type("PolledHosts", (ClusterMachine,), {"transports": ("hosts",), "always_poll": True})
    ClusterMachine.steps = 0
    _stateful._warm_up()
    _stateful.run_without_leaks(machine, _settings(6, 15))
    assert ClusterMachine.steps >= 6


class _Hosts(ClusterMachine):
    transports = ("hosts",)


# One worker per host, automatic commits; options the machine has and these tests do not
# need are off (only those its setup takes are passed).
SETUP: dict[str, Any] = dict(transport="hosts", manual=False, cast=False, commit="swap", n=1, poll=False)


def set_up(m: ClusterMachine) -> None:
    params = inspect.signature(m.setup).parameters
    m.setup(**{k: v for k, v in SETUP.items() if k in params})


def run_steps(*steps: tuple[str, dict[str, Any]]) -> _Hosts:
    """Run the machine's rules *steps* in order on the multi-host transport (one worker per
    host, automatic commits), checking the invariants after each, then its teardown (which
    converges every living worker to a last version)."""
    m = _Hosts()
    try:
        set_up(m)
        for name, kwargs in steps:
            getattr(m, name)(**kwargs)
            m.every_worker_runs_exactly_a_version_sent_to_it()
            m.slots_within_bound()
    finally:
        m.teardown()
    return m


@pytest.mark.timeout(240)
def test_a_host_rejoins_while_another_host_is_stalled() -> None:
    """Found by the slow run: host 2 stalls, host 1's relay dies and a new one joins. The new
    group needs host 2, so the rejoin is held up until host 2 resumes, and then completes
    (the machine used to keep host 2 stalled for the whole rejoin, which then timed out)."""
    run_steps(("make_host_busy", dict(i=1, busy=True)), ("crash", dict(i=0, graceful=False)), ("rejoin", dict(i=0)))


@pytest.mark.timeout(240)
def test_a_stalled_host_lands_nothing_until_it_resumes() -> None:
    """A stall starts with the next operation the relay takes (its ops task may already be
    parked waiting for one): a send to the stalled host times out, and lands once it resumes."""
    m = _Hosts()
    try:
        set_up(m)
        m.make_host_busy(i=1, busy=True)
        c = m.cluster
        with pytest.raises(SyncTimeoutError):
            m.run(c.send(None, [(2, 0)], partial=False, timeout=1.0, sync=True), 1.0)
        assert c.workers[(2, 0)].scheme.version == 0
        m.make_host_busy(i=1, busy=False)
        m.run(c.wait([(2, 0)], None, SETTLE), SETTLE)
        assert c.workers[(2, 0)].scheme.version == 1
    finally:
        m.teardown()


async def test_a_version_replaced_before_its_transfer_started_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """Found by the slow run: the trainer starts a transfer of version v to a host, and a
    newer send replaces v for the same workers before that transfer's first step (latest
    wins). The transfer goes away without an error (it used to log a KeyError), and the
    newer version arrives. Every loop turn between the two sends is tried."""
    async with open_loopback_hosts(nn.Linear(3, 2), lambda: nn.Linear(3, 2), hosts={1: 1}, timeout=20) as lh:
        with caplog.at_level(logging.ERROR, logger="asyncsync"):
            for turns in range(4):
                await lh.trainer.send_async()
                for _ in range(turns):  # the point between the two sends
                    await asyncio.sleep(0)
                await lh.trainer.send_async()
            v = await lh.trainer.send()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        assert lh.workers[1, 0].version == v


async def test_a_relay_that_leaves_is_not_told_its_trainer_died() -> None:
    """Found by the machine: a relay's aclose() says Bye and waits for it to be written;
    if the trainer, having read the Bye, closes the connection first, the relay's reader
    took that end for the trainer's death (SenderDiedError from wait_stopped, for a relay
    that left on its own). That order is forced here: the relay's wait for its Bye to be
    written ends only once the trainer let the host go and every task ran."""
    async with open_loopback_hosts(nn.Linear(3, 2), lambda: nn.Linear(3, 2), hosts={1: 1, 2: 1}, timeout=20) as lh:
        stream = lh.hosts[1].relay._stream
        real_drain = stream.drain

        async def drain_after_the_trainer_closed() -> None:
            await lh.trainer.wait_lost(1, timeout=20)
            await wait_all_tasks_blocked()  # the relay's reader saw the connection end
            await real_drain()

        stream.drain = drain_after_the_trainer_closed  # type: ignore[method-assign]
        await lh.hosts[1].aclose()
        await lh.hosts[1].wait_stopped()  # left on its own: no SenderDiedError
        assert lh.trainer.statistics().host(1).state == "left"
