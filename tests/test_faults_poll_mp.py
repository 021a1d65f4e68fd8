"""``asyncsync.testing``'s faults on polled workers (``init_on_receiver(..., poll=True)``),
across real processes: a refusal reaches the trainer as the worker's ``WorkerError``, a
delay holds the version in the mailbox until the block ends, a kill is named."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from asyncsync import MultiProcessWeightSyncScheme, SyncTimeoutError, WorkerDiedError, WorkerError
from asyncsync.testing import ProcessWorkers
from tests._targets import LogRecords, fill_, make_model

pytestmark = pytest.mark.timeout(180)


async def polling_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> tuple[int, list[str]]:
    """A polled worker's step loop: ``poll_nowait()`` every millisecond until stopped;
    returns its last version and what asyncsync logged in it."""
    torch.set_num_threads(1)
    records = LogRecords.install()
    model = make_model()
    scheme.init_on_receiver(worker_idx=worker_idx, model=model, poll=True)
    async with scheme:
        while not scheme.receiver.stopped:
            scheme.poll_nowait()
            await asyncio.sleep(0.001)  # a step: the loop runs meanwhile
    return scheme.version, records.messages


def _scheme(model: torch.nn.Module) -> MultiProcessWeightSyncScheme:
    scheme = MultiProcessWeightSyncScheme(timeout=60)  # spawned workers first import torch
    scheme.init_on_sender(model=model, num_workers=2)
    return scheme


async def test_a_polled_worker_refuses_under_reject(asyncsync_workers: Callable[..., ProcessWorkers]) -> None:
    model = make_model()
    scheme = _scheme(model)
    async with asyncsync_workers(polling_worker, 2, args=(scheme,), scheme=scheme) as workers:
        async with scheme:
            fill_(model, 1.0)
            async with workers.faults.reject(0, "corrupt"):
                with pytest.raises(WorkerError, match="worker 0 rejected version 1: corrupt") as info:
                    await scheme.send()
                assert (info.value.worker_idx, info.value.version, info.value.message) == (0, 1, "corrupt")
                assert scheme.statistics().worker(0).last_error == "corrupt"
                await scheme.wait_async(1, worker_ids=[1])  # the other worker applies it
                assert scheme.sender.applied_versions() == {0: 0, 1: 1}
            fill_(model, 2.0)
            assert await scheme.send() == 2  # the block ended: worker 0 applies again
    assert workers.results == {0: (2, ["worker 0 rejected version 1: corrupt"]), 1: (2, [])}


async def test_a_polled_worker_holds_its_version_under_delay_acks(asyncsync_workers: Callable[..., ProcessWorkers]) -> None:
    model = make_model()
    scheme = _scheme(model)
    async with asyncsync_workers(polling_worker, 2, args=(scheme,), scheme=scheme) as workers:
        async with scheme:
            async with workers.faults.delay_acks(1):
                version = await scheme.send_async()
                await scheme.wait_async(version, worker_ids=[0])
                with pytest.raises(SyncTimeoutError) as info:
                    await scheme.wait_async(version, timeout=0.3)  # worker 1 polls on, and takes nothing
                assert info.value.pending == {1: 0}
                assert scheme.sender.applied_versions() == {0: 1, 1: 0}
            await scheme.wait_async(version)  # its first poll after the block applies it
            assert scheme.sender.applied_versions() == {0: 1, 1: 1}
            await workers.faults.kill(1)
            # A send to both delivers to the living worker; its wait names the dead one.
            with pytest.raises(WorkerDiedError, match="worker 1") as died:
                await scheme.send()
            assert died.value.applied_by == (0,)
    assert workers.results == {0: (2, [])}
