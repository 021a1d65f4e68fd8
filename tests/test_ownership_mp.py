"""Regressions for the ownership guarantees, across real processes (issue: guarantees on
every path). Each test names the path that used to break."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from anyio import wait_all_tasks_blocked

from asyncsync import (
    MultiProcessWeightSyncScheme,
    SyncTimeoutError,
    WorkerError,
    WorkerLeftError,
    spawn_workers,
)
from asyncsync._core._ownership import slot_bound
from tests._targets import fill_, kind_from_file_worker, make_model, simple_worker
from tests.conftest import Cluster


@pytest.mark.parametrize("commit", ["swap", "copy"])
async def test_manual_commits_never_mix_versions_while_the_next_one_stages(commit: str) -> None:
    # bf16 on the wire: every version is staged (cast) off the loop into a buffer set, and
    # commit() is called while the next version is being staged into another one.
    c = Cluster.of(["big"], commit_mode="manual", transfer_dtype=torch.bfloat16, commit=commit)
    scheme, model = c.scheme, c.model
    fill_(model, 0.5)  # every version is one constant: a mix of two shows as min != max
    try:
        await c.start_manual()
        assert await c.probes[0].ask("watch_start") == "started"
        for k in range(40):
            fill_(model, float(k + 1))  # small integers: exact in bfloat16
            await scheme.send_async()
        await c.probes[0].ask("wait_version", scheme.version)  # the newest is staged (or committed)
        while await c.probes[0].ask("version") < 1:  # only the watch commits: wait for one of its commits
            pass
        report = await c.probes[0].ask("watch_stop")
        assert report["commits"] >= 1 and report["mixed"] == 0 and report["silent"] == 0, report
        # after the last commit the model holds exactly the newest version
        _, committed, version = await c.probes[0].ask("commit")
        assert version == scheme.version and committed in (None, version)
        _, sd = await c.state(0)
        assert all(bool((t == float(version)).all()) for t in sd.values()), version
    finally:
        await c.kill_close()


async def test_a_worker_that_leaves_keeps_its_weights_while_the_others_go_on() -> None:
    c = Cluster.of(["mlp", "mlp"])  # commit="swap" on CPU: parameters view the shared slot
    scheme, model = c.scheme, c.model
    await c.start()
    try:
        fill_(model, 1.0)
        v = await scheme.send()
        assert await c.probes[1].ask("leave") == v
        await scheme.sender.wait_dead(1, timeout=10)
        stats = scheme.statistics().worker(1)
        assert stats.state == "left" and stats.reason == "the worker closed its receiver"
        with pytest.raises(WorkerLeftError, match="worker 1 .*left at version"):
            await scheme.send()  # on_worker_error="raise": a send that targets it fails at once
        for k in range(2, 8):  # reuse every slot many times over
            fill_(model, float(k))
            await scheme.send(worker_ids=[0])
        version, sd = await c.state(1)
        assert version == v and all(bool((t == 1.0).all()) for t in sd.values())
    finally:
        await c.kill_close()


async def test_a_raising_on_update_does_not_end_the_receiver() -> None:
    c = Cluster.of(["mlp"])
    c.opts = {"raise_on_update": True}
    scheme, model = c.scheme, c.model
    await c.start()
    try:
        for k in range(3):
            fill_(model, float(k + 1))
            v = await scheme.send()  # applied and acknowledged although the callback raised
        version, sd = await c.state(0)
        assert version == v and all(bool((t == 3.0).all()) for t in sd.values())
        stats = await c.probes[0].ask("stats")
        assert stats.callback_errors == 3 and "callback failed on version 3" in stats.last_callback_error
        assert scheme.statistics().worker(0).state == "connected"
    finally:
        await c.close()


async def test_a_manual_worker_leaving_with_a_staged_version_is_not_overwritten() -> None:
    c = Cluster.of(["mlp", "mlp"], commit_mode="manual")
    scheme, model = c.scheme, c.model
    try:
        await c.start_manual()
        fill_(model, 1.0)
        v = await scheme.send_async()
        assert await c.probes[1].ask("wait_version", v) == 0  # staged, not committed
        assert await c.probes[1].ask("leave") == 0
        for k in range(2, 8):
            fill_(model, float(k))
            send = asyncio.ensure_future(scheme.send(worker_ids=[0]))
            await c.probes[0].ask("wait_version", v + k - 1)  # the version this send publishes
            assert (await c.probes[0].ask("commit"))[1] == v + k - 1
            assert await send == v + k - 1
        version, sd = await c.state(1)
        assert version == 0
        # it still runs version 0's weights: the trainer's initial model
        initial = make_model()
        assert all(torch.equal(sd[k], initial.state_dict()[k]) for k in sd)
        # ... and its staged version 1 can still be committed by the worker itself
        assert (await c.probes[1].ask("commit"))[1:] == (v, v)
        _, sd = await c.state(1)
        assert all(bool((t == 1.0).all()) for t in sd.values())
    finally:
        await c.kill_close()


async def test_a_busy_worker_never_slows_sends_that_exclude_it() -> None:
    c = Cluster.of(["mlp", "mlp"], timeout=None)  # no default bound: only per-call timeouts
    scheme, model = c.scheme, c.model
    await c.start()
    try:
        assert await c.probes[1].ask("block") == "blocked"  # worker 1's loop is stuck
        for k in range(20):
            fill_(model, float(k))
            await scheme.send(worker_ids=[0], timeout=5)  # needs nothing from worker 1
        for k in range(50):  # never waits on worker 1, however far behind it falls
            fill_(model, 100.0 + k)
            await scheme.send_async()
        last = scheme.version
        with pytest.raises(SyncTimeoutError) as info:
            await scheme.wait_async(timeout=0.2)
        assert set(info.value.pending) == {1}
        assert scheme.statistics().slots <= slot_bound(2, manual=False, latest=1, writing=1)
        assert scheme.statistics().worker(1).in_flight_version is not None
        await c.probes[1].q.put(("release",))
        assert await c.probes[1].q.get(timeout=30) == "released"
        await scheme.wait_async(timeout=30)  # the newest version reaches it next
        version, sd = await c.state(1)
        assert version == last and all(bool((t == 149.0).all()) for t in sd.values())
        assert (await c.probes[1].ask("stats")).skipped >= 40
    finally:
        await c.close()


async def test_with_a_slot_cap_the_call_timeout_bounds_the_slot_wait_and_aclose_wakes_it() -> None:
    c = Cluster.of(["mlp", "mlp"], timeout=None, max_slots=2)
    scheme, model = c.scheme, c.model
    await c.start()
    try:
        assert await c.probes[1].ask("block") == "blocked"
        fill_(model, 1.0)
        await scheme.send_async()  # in flight to worker 1, which holds its live slot too
        fill_(model, 2.0)
        with pytest.raises(SyncTimeoutError, match="free shared-memory slot"):
            await scheme.send_async(timeout=0.2)  # the call's timeout, not the scheme's (None)
        waiting = asyncio.ensure_future(scheme.send_async(timeout=None))
        await wait_all_tasks_blocked()  # parked on the slot wait
        closing = asyncio.ensure_future(scheme.aclose())
        with pytest.raises(Exception, match="closed") as info:
            await waiting
        assert "ClosedError" in type(info.value).__name__
        await c.probes[1].q.put(("release",))
        assert await c.probes[1].q.get(timeout=30) == "released"
        await closing
    finally:
        await c.kill_close()


async def test_a_replacement_that_rejects_fails_restart_and_old_acks_never_count(tmp_path: Path) -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30, on_worker_error="skip")
    scheme.init_on_sender(model=model, num_workers=2)
    kind = tmp_path / "kind"
    kind.write_text("mlp")
    async with spawn_workers(kind_from_file_worker, 2, args=(scheme, str(kind)), scheme=scheme) as group:
        async with scheme:
            fill_(model, 2.0)
            v = await scheme.send()
            group.kill(1)
            await scheme.sender.wait_dead(1, timeout=10)
            stats = scheme.statistics().worker(1)
            # The dead connection's last applied version stays visible, with its state...
            assert (stats.state, stats.applied_version, stats.generation) == ("dead", v, 1)
            kind.write_text("wide")  # the replacement cannot take these weights
            with pytest.raises(WorkerError, match="worker 1 rejected") as info:
                await group.restart(1)
            assert "sent shape (16, 4), model has (32, 4)" in str(info.value)
            stats = scheme.statistics().worker(1)
            assert stats.generation == 2 and stats.applied_version == -1 and stats.state == "connected"  # ...never counted for the new one
            with pytest.raises(WorkerError):
                await scheme.wait_async(version=v)  # not satisfied by the first process's ack
    assert group.results == {0: v, 1: -1}  # the replacement kept its own weights


async def test_params_map_with_three_distinct_sources_connects_and_sends() -> None:
    sources = {i: make_model().state_dict() for i in range(3)}
    for i, sd in sources.items():
        fill_values = float(i)
        for t in sd.values():
            t.fill_(fill_values)
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(params_map=sources)
    async with spawn_workers(simple_worker, 3, args=(scheme,), scheme=scheme) as group:
        async with scheme:  # three slots written by one send: none waits for itself
            for sd in sources.values():
                for t in sd.values():
                    t.add_(10.0)
            v = await scheme.send()
            v2 = await scheme.send(worker_ids=[1])
            part = {"0.bias": torch.full((16,), 7.0)}
            v3 = await scheme.send(part, partial=True)  # bases: three different slots
        results = await group.join(timeout=60)
    assert v2 == v + 1 and v3 == v + 2
    assert results == {0: v3, 1: v3, 2: v3}


async def test_a_dead_worker_is_named_and_its_slots_return() -> None:
    c = Cluster.of(["mlp", "mlp"], on_worker_error="skip")
    scheme, model = c.scheme, c.model
    await c.start()
    try:
        assert await c.probes[1].ask("block") == "blocked"
        for k in range(5):
            fill_(model, float(k))
            await scheme.send_async()
        c.groups[1].kill(1)
        await scheme.sender.wait_dead(1, timeout=10)
        assert scheme.statistics().worker(1).state == "dead"  # died (a WorkerDiedError), not left
        ledger = scheme._transport.ledger
        held = {s for s in ledger.owned()}
        assert all("worker 1 live" not in ledger.owners(s) for s in held)
        fill_(model, 9.0)
        v = await scheme.send()
        version, sd = await c.state(0)
        assert version == v
    finally:
        await c.kill_close()
