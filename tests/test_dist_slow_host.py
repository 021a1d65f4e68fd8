"""A slow host slows no other host: each host has at most one transfer in flight, a busy
one is left out of the next transfer and gets its newest version once it is ready.
Two ranks that are their own worker (``init_on_receiver``), one process: host 2 runs in
an event loop of its own thread, which the test blocks as a long synchronous step would."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from asyncsync import DistributedWeightSyncScheme
from tests._dist_cluster import free_port
from tests._targets import fill_, make_model

T = TypeVar("T")


class OtherLoop:
    """An event loop in a thread of its own (another rank's, as far as the test goes)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-host-2-loop", daemon=True)
        self.thread.start()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def block_until(self, release: threading.Event) -> None:
        """Block this loop (a synchronous step) until *release* is set; return once it is blocked."""
        blocked = threading.Event()

        def step() -> None:
            blocked.set()
            release.wait(60)

        self.loop.call_soon_threadsafe(step)
        await asyncio.get_running_loop().run_in_executor(None, blocked.wait, 30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


async def test_a_host_whose_loop_is_blocked_slows_no_other_host() -> None:
    common: dict[str, Any] = dict(timeout=30, token="t0ken", world_size=3, master_addr="127.0.0.1", master_port=free_port(), heartbeat=0.2)
    model = make_model()
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender(model=model, hosts={1: 1, 2: 1})
    policies = {h: make_model() for h in (1, 2)}
    ranks = {h: DistributedWeightSyncScheme(rank=h, **common) for h in (1, 2)}
    for h, rank in ranks.items():
        rank.init_on_receiver(model=policies[h])
    other = OtherLoop()
    release = threading.Event()
    try:
        await asyncio.gather(trainer.connect(), ranks[1].connect(), other.run(ranks[2].connect()))
        await other.block_until(release)
        applied: list[int] = []
        for k in range(1, 6):  # sends to everybody, while host 2's loop is blocked
            fill_(model, float(k))
            v = await trainer.send_async()
            await trainer.wait_async(v, worker_ids=[(1, 0)], timeout=20)
            applied.append(ranks[1].version)
        fill_(model, 6.0)
        v = await trainer.send(worker_ids=[(1, 0)], timeout=20)  # and one to host 1 alone
        applied.append(ranks[1].version)
        assert applied == [1, 2, 3, 4, 5, 6]
        assert all(bool((p == 6.0).all()) for p in policies[1].parameters())
        assert ranks[2].version == 0 and not release.is_set()  # host 2 was blocked all along
        release.set()
        await trainer.wait_async(5, worker_ids=[(2, 0)], timeout=20)  # it gets the newest it was sent
        assert ranks[2].version == 5 and all(bool((p == 5.0).all()) for p in policies[2].parameters())
        stats = trainer.statistics()
        assert all(h.state == "connected" and h.connections == 1 for h in stats.hosts)
    finally:
        release.set()
        await trainer.aclose()
        await ranks[1].aclose()
        await other.run(ranks[2].aclose())
        other.close()
