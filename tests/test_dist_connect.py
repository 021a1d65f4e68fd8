"""The multi-host control plane's promises, in one process (trainer, relays and loopback
workers in this loop, on 127.0.0.1): a relay's ``connect`` is bounded by its own
timeout, never blocks the loop and can be retried; trainer and relay agree on whether a
host is there, also after a long blocked loop; a displaced relay is told why."""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from asyncsync import (
    BrokenChannelError,
    ClosedError,
    DistributedWeightSyncScheme,
    HostLostError,
    SenderDiedError,
    SyncTimeoutError,
    loopback_worker,
)
from tests._dist_cluster import free_port
from tests._targets import fill_, make_model


def _common(port: int, **kw: Any) -> dict[str, Any]:
    return {"timeout": 30, "token": "t0ken", "world_size": 2, "master_addr": "127.0.0.1", "master_port": port, "heartbeat": 0.2, **kw}


def _relay(common: dict[str, Any]) -> tuple[DistributedWeightSyncScheme, Any, Any]:
    relay = DistributedWeightSyncScheme(rank=1, **common)
    relay.init_on_relay(model=make_model(), num_workers=1)
    worker = loopback_worker(relay.local, 0)
    model = make_model()
    worker.init_on_receiver(worker_idx=0, model=model)
    return relay, worker, model


class Ticker:
    """Counts turns of the event loop, to show that it was not blocked."""

    def __init__(self) -> None:
        self.ticks = 0
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.001)

    async def reach(self, n: int) -> None:
        target = self.ticks + n
        while self.ticks < target:
            await asyncio.sleep(0.001)

    async def aclose(self) -> None:
        self.task.cancel()
        await asyncio.wait({self.task})


def _store_waits() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "asyncsync-blocking-call")


async def test_relay_connect_is_bounded_off_the_loop_cancel_safe_and_can_be_retried() -> None:
    """The trainer's store is up but the trainer is not connected yet: the relay's wait for
    its address runs off the loop, ends at connect's own timeout with a SyncTimeoutError
    that says what it waited for, can be cancelled without waiting for the store, and a
    later connect() succeeds; after aclose() connect() raises ClosedError."""
    common = _common(free_port())
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    model = make_model()
    trainer.init_on_sender(model=model, hosts={1: 1})  # hosts the store; not listening yet
    relay, worker, local = _relay(common)
    ticker = Ticker()
    try:
        with pytest.raises(SyncTimeoutError, match="host 1 waiting for the trainer to publish its control address in the rendezvous store"):
            await relay.connect(timeout=0.3)

        pending = asyncio.ensure_future(relay.connect(timeout=None))  # bounded by the store's 30 s only
        await ticker.reach(20)  # the loop turns while connect waits
        assert not pending.done()
        waits = _store_waits()
        assert waits >= 1
        pending.cancel()
        await asyncio.wait({pending})
        assert pending.cancelled()
        while _store_waits() >= waits:  # its store wait ends with it, on its own thread
            await asyncio.sleep(0.001)

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(relay.connect(), 0.3)

        fill_(model, 2.0)
        await asyncio.gather(trainer.connect(), relay.connect(timeout=20), worker.connect())  # the retry joins
        assert worker.version == 0 and all(bool((p == 2.0).all()) for p in local.parameters())
        assert await trainer.send() == 1 and worker.version == 1
        await relay.aclose()
        with pytest.raises(ClosedError, match="host 1: the relay is closed"):
            await relay.connect()
    finally:
        await ticker.aclose()
        await trainer.aclose()
        await relay.aclose()
        await worker.aclose()


async def test_relay_connect_to_a_store_that_never_answers_ends_at_its_timeout() -> None:
    """MASTER_ADDR:port reaches a listener that accepts and never answers: init_on_relay
    returns at once and connect() raises SyncTimeoutError at its own timeout. The store's
    client, left connecting in a thread of its own, ends once the listener is gone (at the
    store's timeout): within this test, which captures what torch prints about it."""
    before = set(threading.enumerate())
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        common = _common(silent.getsockname()[1], timeout=3)
        relay, worker, _ = _relay(common)
        ticker = Ticker()
        try:
            pending = asyncio.ensure_future(relay.connect(timeout=1.0))
            await ticker.reach(20)
            assert not pending.done()
            with pytest.raises(SyncTimeoutError, match=r"host 1 connecting to the rendezvous store at 127\.0\.0\.1:\d+"):
                await pending
        finally:
            await ticker.aclose()
            await relay.aclose()
            await worker.aclose()
    for t in set(threading.enumerate()) - before:
        if t.name == "asyncsync-blocking-call":
            await asyncio.to_thread(t.join, 60)
            assert not t.is_alive(), "the store's client still connects to a listener that is gone"


# A rank whose trainer never publishes its address: connect(timeout=2) is cancelled by an
# enclosing timeout, the scheme closed, and the process exits about when connect's own wait
# in the store would have ended (argv[2] seconds before), the moment that used to abort it.
_EXIT_AFTER_A_CONNECT_GIVEN_UP = """
import asyncio, sys, time
import torch
from asyncsync import DistributedWeightSyncScheme

async def main(port, early):
    host = DistributedWeightSyncScheme(rank=1, token="t0ken", world_size=2, master_addr="127.0.0.1", master_port=port)
    host.init_on_receiver(model=torch.nn.Linear(2, 2))
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(host.connect(timeout=2.0), 1.5)
    except asyncio.TimeoutError:
        pass
    await host.aclose()
    await asyncio.sleep(max(t0 + 2.0 - early - time.monotonic(), 0.0))

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
"""


@pytest.mark.timeout(600)
async def test_a_process_exits_cleanly_after_a_relays_connect_was_given_up() -> None:
    """No store call may return while the interpreter finalizes (torch aborts the process):
    12 processes exit at moments around the end of connect's store wait, each with code 0."""
    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    two_at_a_time = asyncio.Semaphore(2)

    async def run(early: float) -> tuple[int | None, str]:
        async with two_at_a_time:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _EXIT_AFTER_A_CONNECT_GIVEN_UP, str(store.port), str(early),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env, cwd=root,
            )  # fmt: skip
            _, err = await proc.communicate()
            return proc.returncode, err.decode(errors="replace")[-2000:]

    outcomes = await asyncio.gather(*(run(0.01 * (k % 6)) for k in range(12)))
    failed = [(code, err) for code, err in outcomes if code != 0]
    assert not failed, f"{len(failed)}/12 exited with {[code for code, _ in failed]}; the first's stderr:\n{failed[0][1]}"


async def test_a_blocked_loop_longer_than_the_silence_timeout_loses_nobody() -> None:
    """Heartbeats come from each control connection's thread: a synchronous step that
    blocks the loop (trainer's and relay's: they share it here) for longer than
    silence_timeout leaves every host connected, and the next send is applied."""
    common = _common(free_port(), silence_timeout=0.6)
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    model = make_model()
    trainer.init_on_sender(model=model, hosts={1: 1})
    relay, worker, local = _relay(common)
    try:
        await asyncio.gather(trainer.connect(), relay.connect(), worker.connect())
        for _ in range(2):
            time.sleep(1.5)  # a long synchronous training step, on the loop
            await asyncio.sleep(0)
        fill_(model, 3.0)
        assert await trainer.send(timeout=20) == 1
        assert worker.version == 1 and all(bool((p == 3.0).all()) for p in local.parameters())
        host = trainer.statistics().host(1)
        assert host.state == "connected" and host.connections == 1
        assert relay.relay._error is None
    finally:
        await trainer.aclose()
        await relay.aclose()
        await worker.aclose()


async def test_a_relay_that_gives_up_on_a_silent_trainer_ends_the_connection_and_the_trainer_loses_it() -> None:
    """The trainer beats every 10 s, the relay hears nothing for its 0.5 s: it gives up
    (its worker keeps its weights) and closes the connection, so the trainer declares the
    host lost and a send raises HostLostError at once, not a timeout."""
    port = free_port()
    trainer = DistributedWeightSyncScheme(rank=0, **_common(port, heartbeat=10.0, silence_timeout=None))
    model = make_model()
    trainer.init_on_sender(model=model, hosts={1: 1})
    relay, worker, _ = _relay(_common(port, silence_timeout=0.5))
    try:
        # On a busy machine the relay may give up before its first weights arrive: then its
        # connect (and its worker's) raise what wait_stopped raises below, and the trainer's
        # connect may already see the host lost.
        outcomes = await asyncio.gather(trainer.connect(), relay.connect(), worker.connect(), return_exceptions=True)
        assert outcomes[0] == 0 or isinstance(outcomes[0], HostLostError), outcomes
        assert all(o == 0 or isinstance(o, SenderDiedError) for o in outcomes[1:]), outcomes
        with pytest.raises(SenderDiedError, match="host 1: the trainer is gone .*sent nothing for 0.5 s"):
            await relay.wait_stopped()
        await trainer.wait_lost(1, timeout=20)
        with pytest.raises(HostLostError, match="host 1 .* is lost") as info:
            await trainer.send(timeout=20)
        assert info.value.host == 1
        with pytest.raises(SenderDiedError):
            await worker.wait_stopped()
        assert worker.version == (0 if outcomes[2] == 0 else -1)  # what it had when the trainer went silent
    finally:
        await trainer.aclose()
        await relay.aclose()
        await worker.aclose()


async def test_a_relay_replaced_by_another_for_its_host_is_told_so() -> None:
    """A second relay for host 1 connects: the trainer serves it, and the first one's
    wait_stopped says it was replaced (not that the trainer died); its worker is stopped."""
    common = _common(free_port())
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    model = make_model()
    trainer.init_on_sender(model=model, hosts={1: 1})
    first, first_worker, _ = _relay(common)
    second, second_worker, second_model = _relay(common)
    try:
        await asyncio.gather(trainer.connect(), first.connect(), first_worker.connect())
        await asyncio.gather(second.connect(), second_worker.connect())
        with pytest.raises(BrokenChannelError, match=r"host 1: replaced by another relay for host 1 \(pid \d+ at 127\.0\.0\.1:\d+\)") as info:
            await first.wait_stopped()
        assert not isinstance(info.value, SenderDiedError)
        await first_worker.wait_stopped()  # stopped, keeping its weights
        assert first_worker.version == 0
        fill_(model, 6.0)
        assert await trainer.send() == 1
        assert second_worker.version == 1 and all(bool((p == 6.0).all()) for p in second_model.parameters())
        assert trainer.statistics().host(1).connections == 2
    finally:
        await trainer.aclose()
        for s in (first, second, first_worker, second_worker):
            await s.aclose()


@pytest.mark.parametrize("host,num_workers,reason", [
    (5, 1, "host 5 is not one of the trainer's hosts [1]"),
    (1, 2, "host 1 has 2 workers (num_workers), the trainer expects 1"),
])
async def test_a_relay_the_trainer_refuses_is_told_why(host: int, num_workers: int, reason: str) -> None:
    """A relay with the right token but a host id or a worker count the trainer does not
    expect: its connect raises ValueError with the trainer's reason (not a generic
    disconnect), and the trainer goes on waiting for the right relay, which joins."""
    common = _common(free_port())
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    model = make_model()
    trainer.init_on_sender(model=model, hosts={1: 1})
    wrong = DistributedWeightSyncScheme(rank=1, **common)
    wrong_local = wrong.init_on_relay(model=make_model(), num_workers=num_workers, host=host)
    wrong_workers = [loopback_worker(wrong_local, i) for i in range(num_workers)]
    for i, w in enumerate(wrong_workers):
        w.init_on_receiver(worker_idx=i, model=make_model())
    relay, worker, local = _relay(common)
    joining = asyncio.ensure_future(trainer.connect())
    try:
        with pytest.raises(ValueError, match=re.escape(f"host {host}: the trainer at 127.0.0.1:") + r"\d+" + re.escape(f" refused this relay: {reason}")):
            await wrong.connect()
        assert trainer.statistics().host(1).state == "waiting" and not joining.done()
        fill_(model, 3.0)
        await asyncio.gather(relay.connect(), worker.connect())
        assert await joining == 0
        assert await trainer.send() == 1 and worker.version == 1
    finally:
        joining.cancel()
        await asyncio.gather(joining, return_exceptions=True)
        await trainer.aclose()
        for s in (wrong, *wrong_workers, relay, worker):
            await s.aclose()


async def test_a_rank_that_is_its_own_worker_can_poll() -> None:
    """``init_on_receiver(model=..., poll=True)`` on a rank that is its own worker: its
    local receiver is a polled one behind its relay; versions switch only inside
    ``poll_nowait()``, and the trainer's send returns once it polled."""
    common = _common(free_port())
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    model = make_model()
    trainer.init_on_sender(model=model, hosts={1: 1})
    policy = make_model()
    rank = DistributedWeightSyncScheme(rank=1, **common)
    rank.init_on_receiver(model=policy, poll=True)
    try:
        await asyncio.gather(trainer.connect(), rank.connect())
        assert rank.version == 0 and rank.poll_nowait() is None  # nothing new
        for k in (1, 2):
            fill_(model, float(k))
            sending = asyncio.ensure_future(trainer.send())
            while (got := rank.poll_nowait()) is None:
                await asyncio.sleep(0.001)
            assert got == k and rank.version == k and rank.receiver is rank.worker.receiver
            assert all(bool((p == float(k)).all()) for p in policy.parameters())
            assert await sending == k
    finally:
        await trainer.aclose()
        await rank.aclose()


def test_poll_with_manual_commits_is_refused_before_a_rank_builds_its_relay() -> None:
    rank = DistributedWeightSyncScheme(rank=1, commit_mode="manual", **_common(free_port()))
    with pytest.raises(ValueError, match="poll=True commits at each poll_nowait"):
        rank.init_on_receiver(model=make_model(), poll=True)
    with pytest.raises(RuntimeError, match="init_on_relay"):
        _ = rank.relay  # nothing was built: the scheme can still be set up
    rank.init_on_receiver(model=make_model())  # e.g. without polling


async def test_a_rank_whose_own_code_raises_in_its_block_names_the_error_on_the_trainer() -> None:
    common = _common(free_port())
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender(model=make_model(), hosts={1: 1})
    rank = DistributedWeightSyncScheme(rank=1, **common)
    rank.init_on_receiver(model=make_model())

    async def rank_code() -> None:
        async with rank:  # the rank's `async with scheme:` block
            raise ValueError("bad observation shape (3,)")

    try:
        results = await asyncio.gather(trainer.connect(), rank_code(), return_exceptions=True)
        assert results[0] == 0 and isinstance(results[1], ValueError)
        await trainer.sender.wait_dead((1, 0), timeout=30)
        row = trainer.statistics().worker((1, 0))
        assert row.state == "left" and row.reason is not None, (row.state, row.reason)
        assert "its code raised ValueError: bad observation shape (3,)" in row.reason, row.reason
    finally:
        await trainer.aclose()
        await rank.aclose()
