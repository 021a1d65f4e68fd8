"""A send's ``timeout`` bounds its wait for another send's snapshot, on both schemes."""

from __future__ import annotations

import asyncio

from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, SyncTimeoutError
from asyncsync.testing import open_loopback, open_loopback_hosts


def big_model() -> nn.Module:
    return nn.Linear(1024, 1024)  # 4 MiB: its snapshot copy runs in the copy thread


async def test_send_async_waiting_for_another_snapshot_honours_its_timeout_locally() -> None:
    model = big_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=model, num_workers=1)
    async with open_loopback(scheme, big_model), scheme:
        # The first send holds the send lock while its copy runs in the thread; the second
        # finds it taken and may not wait at all.
        first, second = await asyncio.gather(scheme.send_async(), scheme.send_async(timeout=0), return_exceptions=True)
        assert first == 1
        assert isinstance(second, SyncTimeoutError) and "another send's snapshot" in str(second)
        await scheme.wait_async(1)
        assert scheme.version == 1


async def test_send_async_waiting_for_another_snapshot_honours_its_timeout_across_hosts() -> None:
    async with open_loopback_hosts(big_model(), big_model, timeout=30) as lh:
        first, second = await asyncio.gather(lh.trainer.send_async(), lh.trainer.send_async(timeout=0), return_exceptions=True)
        assert first == 1
        assert isinstance(second, SyncTimeoutError) and "another send's snapshot" in str(second)
        await lh.trainer.wait_async(1)
        assert lh.trainer.version == 1 and lh.workers[1, 0].version == 1

