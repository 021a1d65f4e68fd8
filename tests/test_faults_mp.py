"""Fault isolation across real processes: dead workers, rejoin, dead trainer, timeouts."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from asyncsync import (
    AsyncQueue,
    ClosedError,
    MultiProcessWeightSyncScheme,
    SyncTimeoutError,
    WeightsError,
    WorkerDiedError,
    spawn_workers,
)
from asyncsync.testing import ProcessWorkers, open_loopback
from tests._targets import fill_, make_model, silent_from_file_worker, simple_worker, trainer_process
from tests.conftest import Cluster
from tests.test_hygiene_mp import shm_left

CTX = mp.get_context("spawn")


async def test_worker_killed_while_sender_waits_for_acks() -> None:
    # manual commit: the worker stages but never commits, so the sender is left waiting
    c = Cluster.of(["mlp", "mlp"], commit_mode="manual")
    scheme = c.scheme
    try:
        await c.start_manual()
        send = asyncio.ensure_future(scheme.send())
        # wait until worker 1 has the update staged: the sender is now waiting for acks
        assert (await c.probes[1].ask("wait_version", 1)) == 0
        c.groups[1].kill(1)
        with pytest.raises(WorkerDiedError) as info:
            await send
        assert info.value.worker_idx == 1
        assert info.value.exitcode == -signal.SIGKILL
        assert "worker 1" in str(info.value) and "-9" in str(info.value)
        stats = scheme.statistics()
        assert stats.worker(1).state == "dead" and stats.worker(1).exitcode == -9
        # the living worker is unaffected: commit its staged update
        assert (await c.probes[0].ask("commit"))[1] == 1
        # a send that targets the dead worker still reaches the living one, then names the dead one
        send = asyncio.ensure_future(scheme.send())
        assert (await c.probes[0].ask("wait_version", 2)) == 1  # staged
        assert (await c.probes[0].ask("commit"))[1] == 2
        with pytest.raises(WorkerDiedError) as again:
            await send
        assert again.value.worker_idx == 1 and again.value.applied_by == (0,)
    finally:
        await c.kill_close()


async def test_manual_commit_timeout_names_the_silent_worker() -> None:
    c = Cluster.of(["mlp", "mlp"], commit_mode="manual")
    scheme = c.scheme
    try:
        await c.start_manual()
        send = asyncio.ensure_future(scheme.send(timeout=30))
        await c.probes[0].ask("wait_version", 1)
        assert (await c.probes[0].ask("commit"))[1] == 1
        await c.probes[1].ask("wait_version", 1)
        send.cancel()  # worker 1 has it staged and never commits
        with pytest.raises(asyncio.CancelledError):
            await send
        with pytest.raises(SyncTimeoutError) as info:
            await scheme.wait_async(timeout=0.2)
        assert info.value.pending == {1: 0}
        assert "worker 1 (at version 0)" in str(info.value)
        assert isinstance(info.value, TimeoutError)
        assert (await c.probes[1].ask("commit"))[1] == 1
        await scheme.wait_async()
    finally:
        await c.kill_close()


async def test_skip_mode_rejoin_gets_latest_weights(asyncsync_workers: Callable[..., ProcessWorkers]) -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30, on_worker_error="skip")
    scheme.init_on_sender(model=model, num_workers=2)
    async with asyncsync_workers(simple_worker, 2, args=(scheme,), scheme=scheme) as group:
        async with scheme:
            await group.faults.kill(1)  # returns once the sender noticed
            fill_(model, 9.0)
            v = await scheme.send()  # goes on to the living worker
            assert scheme.statistics().worker(0).applied_version == v
            assert scheme.statistics().worker(1).state == "dead"
            await group.restart(1)  # a replacement attaches, gets the latest weights
            assert scheme.statistics().worker(1).applied_version == v
            assert scheme.statistics().worker(1).state == "connected"
            fill_(model, 10.0)
            v2 = await scheme.send()
        results = await group.join(timeout=30)
    assert results == {0: v2, 1: v2}


async def test_concurrent_restarts_of_a_worker_give_it_one_replacement() -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=model, num_workers=2)
    async with spawn_workers(simple_worker, 2, args=(scheme,), scheme=scheme) as group:
        async with scheme:
            killed = group.processes[1].pid
            group.kill(1)
            # Two tasks that each saw it die: the second waits for the first and returns with it.
            await asyncio.gather(group.restart(1, timeout=30), group.restart(1, timeout=30))
            assert group.processes[1].pid != killed and group.processes[1].is_alive()
            stats = scheme.statistics().worker(1)
            assert (stats.state, stats.generation) == ("connected", 2)  # one new connection, not two
            v = await scheme.send()
        assert await group.join(timeout=30) == {0: v, 1: v}


async def test_restart_bounds_the_replacements_connect_by_its_timeout_and_checks_its_index(
    asyncsync_workers: Callable[..., ProcessWorkers], tmp_path: Path
) -> None:
    mode = tmp_path / "mode"
    mode.write_text("normal")
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30, on_worker_error="skip")
    scheme.init_on_sender(model=model, num_workers=2)
    async with asyncsync_workers(silent_from_file_worker, 2, args=(scheme, str(mode)), scheme=scheme) as group:
        async with scheme:
            await group.faults.kill(1)
            mode.write_text("silent")  # the replacement starts, and never connects
            with pytest.raises(SyncTimeoutError) as info:
                # the outer bound only turns a restart that ignores its timeout into a failure
                await asyncio.wait_for(group.restart(1, timeout=0.5), 25)
            assert isinstance(info.value, SyncTimeoutError) and info.value.timeout == 0.5
            assert 1 in info.value.pending and "worker 1" in str(info.value), str(info.value)
            with pytest.raises(ValueError, match="worker 7.*0, 1"):
                await group.restart(7)
            await group.faults.kill(1)  # the silent replacement
            v = await scheme.send()
    assert group.results == {0: v}
    with pytest.raises(ClosedError, match="closed"):
        await group.restart(0)


async def test_worker_killed_before_connect_is_named(asyncsync_workers: Callable[..., ProcessWorkers]) -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=model, num_workers=2)
    async with asyncsync_workers(simple_worker, 2, args=(scheme,), scheme=scheme) as group:
        await group.faults.kill(0)
        with pytest.raises(WorkerDiedError, match="worker 0"):
            async with scheme:
                pass
        await group.aclose()  # worker 1 may have found the sender gone: no result to join


async def test_trainer_killed_workers_notice_and_keep_weights() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    a, b = CTX.Pipe()
    q: AsyncQueue[tuple[object, ...]] = AsyncQueue(a)
    group = spawn_workers(trainer_process, 1, args=(b,))
    group.start()
    worker_pid = None
    try:
        b.close()
        msgs = {}
        while "trainer-ready" not in msgs:
            m = await q.get(timeout=60)
            msgs[m[0]] = m
        worker_pid = msgs["worker-pid"][1]
        version = msgs["trainer-ready"][1]
        os.kill(group.processes[0].pid, signal.SIGKILL)
        done = await q.get(timeout=30)
        assert done[0] == "worker-done"
        outcome, kept_version, lo, hi = done[1:]
        assert outcome.startswith("SenderDiedError"), outcome
        assert kept_version == version and lo == hi == 6.0
        assert not shm_left(shm_before), shm_left(shm_before)  # memfd slots die with their users
    finally:
        await group.aclose(grace=0)
        await q.aclose()
        if worker_pid is not None:
            try:
                proc = psutil.Process(worker_pid)
                proc.wait(timeout=10)
            except psutil.NoSuchProcess:
                pass


async def test_bad_input_and_calls_after_close() -> None:
    """The trainer's own checks (a loopback worker: nothing here depends on its process)."""
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(check_finite=True, timeout=30)
    scheme.init_on_sender(model=model, num_workers=1)
    async with open_loopback(scheme, make_model):
        sd = {k: t.clone() for k, t in model.state_dict().items()}
        sd["0.bias"][3] = float("nan")
        with pytest.raises(WeightsError, match="NaN or inf in '0.bias'"):
            await scheme.send(weights=sd)
        meta = {k: t.to("meta") for k, t in model.state_dict().items()}
        with pytest.raises(WeightsError, match="meta device"):
            await scheme.send(weights=meta)
        with pytest.raises(WeightsError, match="no parameters"):
            await scheme.send(weights=torch.nn.ReLU())
        with pytest.raises(ValueError, match="quorum"):
            await scheme.wait_async(quorum=2)
        assert scheme.version == 0
    with pytest.raises(ClosedError):
        await scheme.send()
    with pytest.raises(ClosedError):
        await scheme.wait_async()
    await scheme.aclose()  # idempotent
