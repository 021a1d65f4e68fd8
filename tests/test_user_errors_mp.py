"""Newcomers' mistakes and surprises across processes: a worker that never connects its
receiver (the trainer's timeout says so), a worker that retries its connect, two processes
that claim one worker index, a scheme sent to workers before init_on_sender, more
workers than the scheme has."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle
import re
from typing import Any

import pytest

from asyncsync import AsyncQueue, MultiProcessWeightSyncScheme, SyncTimeoutError, WorkerDiedError, spawn_workers
from tests._targets import always_zero_worker, make_model, simple_worker


async def unconnected_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, done: Any) -> None:
    """The newcomer's mistake: serve without ``async with scheme`` (until the test is done)."""
    scheme.init_on_receiver(worker_idx=worker_idx, model=make_model())
    await asyncio.to_thread(done.wait, 60)


@pytest.mark.timeout(240)  # a spawned worker imports torch: slow on a loaded machine
async def test_a_worker_that_never_connects_its_receiver_is_named_with_the_fix() -> None:
    done = mp.get_context("spawn").Event()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    try:
        async with spawn_workers(unconnected_worker, 1, args=(scheme, done), scheme=scheme, join_timeout=120) as workers:
            try:
                with pytest.raises(SyncTimeoutError) as info:
                    await scheme.connect(timeout=1.0)  # never answered, however fast the machine
            finally:
                done.set()
            pid = workers.processes[0].aio_process.pid  # type: ignore[attr-defined]
    finally:
        await scheme.aclose()
    message = str(info.value)
    assert message.startswith("connect timed out after 1.0 s; no answer from worker 0 (at version -1)"), message
    assert "is running, but its receiver never connected" in message, message
    assert "the worker lacks `async with scheme` (or `await scheme.connect()`) after `init_on_receiver`" in message, message
    (pid_seen,) = info.value.never_connected.values()
    assert pid_seen == pid and f"worker 0 (pid {pid})" in message.lower()


async def retrying_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, report: Any) -> tuple[list[str], int]:
    """Connects before the trainer does: a connect that times out, one that is cancelled,
    then ``async with scheme`` (a third connect), which must get the weights."""
    scheme.init_on_receiver(worker_idx=worker_idx, model=make_model())
    seen = []
    try:
        await scheme.connect(timeout=0.2)
    except SyncTimeoutError as exc:
        seen.append(f"timeout: {exc}")
    try:
        await asyncio.wait_for(scheme.connect(timeout=None), 0.2)
    except asyncio.TimeoutError as exc:
        seen.append(f"cancelled: {type(exc).__name__}")
    q: AsyncQueue[Any] = AsyncQueue(report)
    await q.put("retrying")
    async with scheme:
        await scheme.wait_stopped()
    return seen, scheme.version


@pytest.mark.timeout(240)
async def test_a_workers_connect_can_be_retried_after_a_timeout_or_a_cancellation() -> None:
    ours, theirs = mp.get_context("spawn").Pipe()
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=model, num_workers=1)
    q: AsyncQueue[Any] = AsyncQueue(ours)
    try:
        async with spawn_workers(retrying_worker, 1, args=(scheme, theirs), scheme=scheme) as workers:
            theirs.close()
            assert await q.get(timeout=60) == "retrying"  # its first two connects gave up
            async with scheme:
                await scheme.send()
    finally:
        await q.aclose()
        await scheme.aclose()
    seen, version = workers.results[0]
    assert version == 1
    assert seen == ["timeout: worker 0 waiting for its initial weights timed out after 0.2 s; no answer from worker 0 (at version -1)", "cancelled: TimeoutError"], seen


@pytest.mark.timeout(240)
async def test_two_processes_claiming_one_worker_index_are_named() -> None:
    # A worker function that ignores the index it was given: both processes take worker 0's
    # channel. The trainer cuts it at the second hello and says why, naming the index.
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=make_model(), num_workers=2)
    with pytest.raises(WorkerDiedError) as info:
        async with spawn_workers(always_zero_worker, 2, args=(scheme,), scheme=scheme):
            async with scheme:
                await scheme.send()
    err = info.value
    assert err.worker_idx == 0
    assert re.match(
        r"worker 0 \(pid \d+\) was cut off: a second process \(pid \d+\) connected as worker 0 on the channel of worker 0 "
        r"\(pid \d+\); only one process can be worker 0: call init_on_receiver\(worker_idx=\.\.\.\) with the index each "
        r"worker process was started with",
        str(err),
    ), str(err)


BEFORE_INIT = r"this scheme was pickled \(sent to a worker\) before init_on_sender\(\) was called on it.*call scheme.init_on_sender\(\.\.\.\) in the trainer first"


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_scheme_sent_to_workers_before_init_on_sender_says_so_before_they_start(start_method: str) -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=30)  # init_on_sender forgotten
    group = spawn_workers(simple_worker, 2, args=(scheme,), start_method=start_method)
    with pytest.raises(RuntimeError, match=BEFORE_INIT):
        async with group:
            pass
    assert group.processes == {}  # none started (the suite's leak check: none left either)
    # Another pickler than a process start (Ray's, a queue): the worker's init_on_receiver says it.
    worker = pickle.loads(pickle.dumps(scheme))
    with pytest.raises(RuntimeError, match=BEFORE_INIT):
        worker.init_on_receiver(worker_idx=0, model=make_model())


async def test_more_workers_than_the_scheme_has_is_refused_before_any_starts() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=make_model(), num_workers=2)
    with pytest.raises(ValueError, match=r"^worker 2 to start, but the scheme has workers 0, 1 \(init_on_sender gave it 2\)"):
        spawn_workers(simple_worker, 3, args=(scheme,), scheme=scheme)
    with pytest.raises(ValueError, match=r"^workers 5, 7 to start, but the scheme has workers 0, 1"):
        spawn_workers(simple_worker, worker_ids=[0, 5, 7], args=(scheme,), scheme=scheme)
    assert spawn_workers(simple_worker, 1, args=(scheme,), scheme=scheme).worker_ids == [0]  # fewer is fine
    await scheme.aclose()
