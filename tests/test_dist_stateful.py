"""A hypothesis state machine over the multi-host scheme, in one process: a trainer, two
relays (hosts 1 and 2, each with two loopback workers) on a real gloo group and control
plane over 127.0.0.1. Random sends (all, subsets across hosts, partial), async sends and
waits, relay crashes (some right after a send, so mid-transfer) and rejoins; after every
step each live worker's model holds exactly the weights of the version it reports, that
version was sent to it, and versions only go up. A crashed host's workers keep a complete
version; a send to them is refused with :class:`HostLostError` before anything is sent; a
rejoined host's workers get their newest version first; the survivors get everything.

A relay "crash" here leaves its gloo connections open while a receive runs in them (the
process lives on): the trainer must give up that transfer when the host's control
connection ends, not wait for the backend's timeout. Real kills (SIGKILL) are in
tests/test_dist_faults_mp.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncsync import DistributedWeightSyncScheme, HostLostError, MultiProcessWeightSyncScheme, loopback_worker
from tests._dist_cluster import free_port
from tests._targets import make_model

HOSTS = (1, 2)
WORKERS = [(1, 0), (1, 1), (2, 0), (2, 1)]
KEYS = ["0.weight", "0.bias", "2.weight", "2.bias"]
WorkerId = tuple[int, int]


class DistMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.value = 0.0
        self.sent: dict[WorkerId, dict[int, dict[str, float]]] = {w: {} for w in WORKERS}  # version -> values per key
        self.seen: dict[WorkerId, list[int]] = {w: [] for w in WORKERS}
        self.alive = dict.fromkeys(HOSTS, True)
        self.relays: dict[int, DistributedWeightSyncScheme] = {}
        self.workers: dict[WorkerId, tuple[MultiProcessWeightSyncScheme, torch.nn.Module]] = {}
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        self.common: dict[str, Any] = dict(timeout=30, token="t", world_size=3, master_addr="127.0.0.1", master_port=free_port())
        self.model = make_model()
        self.trainer = DistributedWeightSyncScheme(rank=0, **self.common)
        self.trainer.init_on_sender(model=self.model, hosts={1: 2, 2: 2})
        self._fill(0.0)
        await asyncio.gather(self.trainer.connect(), *(self._join(h) for h in HOSTS))
        for wid in WORKERS:
            self.sent[wid][0] = dict.fromkeys(KEYS, 0.0)

    async def _join(self, h: int) -> None:
        """Start host *h*'s relay and two loopback workers; return once they run weights."""
        relay = DistributedWeightSyncScheme(rank=h, **self.common)
        relay.init_on_relay(model=make_model(), num_workers=2)
        self.relays[h] = relay
        joining = []
        for i in range(2):
            w = loopback_worker(relay.local, i)
            m = make_model()
            wid = (h, i)
            self.seen[wid] = []
            w.init_on_receiver(worker_idx=i, model=m, on_update=lambda _w, v, wid=wid: self.seen[wid].append(v))
            self.workers[wid] = (w, m)
            joining.append(w.connect())
        await asyncio.gather(relay.connect(), *joining)

    def _fill(self, value: float, keys: list[str] | None = None) -> None:
        with torch.no_grad():
            for k, t in self.model.state_dict().items():
                if keys is None or k in keys:
                    t.fill_(value)

    def _record(self, version: int, targets: list[WorkerId], values: dict[str, float]) -> None:
        for wid in targets:
            last = self.sent[wid][max(self.sent[wid])]
            self.sent[wid][version] = {k: values.get(k, last[k]) for k in KEYS}

    def _live(self, ids: list[WorkerId]) -> list[WorkerId]:
        return [wid for wid in ids if self.alive[wid[0]]]

    def _check(self, wid: WorkerId) -> None:
        w, m = self.workers[wid]
        v = w.version
        assert v in self.sent[wid], (wid, v)
        expected = self.sent[wid][v]
        for k, t in m.state_dict().items():
            assert bool((t == expected[k]).all()), (wid, v, k)
        assert self.seen[wid] == sorted(set(self.seen[wid])), (wid, self.seen[wid])

    @rule(ids=st.lists(st.sampled_from(WORKERS), min_size=1, max_size=4, unique=True), sync=st.booleans())
    def send(self, ids: list[WorkerId], sync: bool) -> None:
        targets = self._live(ids)
        assume(targets)
        self.value += 1.0
        self._fill(self.value)
        coro = self.trainer.send(worker_ids=targets) if sync else self.trainer.send_async(worker_ids=targets)
        version = self.loop.run_until_complete(coro)
        self._record(version, targets, dict.fromkeys(KEYS, self.value))

    @rule(ids=st.lists(st.sampled_from(WORKERS), min_size=1, max_size=4, unique=True), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def partial(self, ids: list[WorkerId], keys: list[str]) -> None:
        targets = self._live(ids)
        assume(targets)
        self.value += 1.0
        part = {k: torch.full_like(t, self.value) for k, t in self.model.state_dict().items() if k in keys}
        version = self.loop.run_until_complete(self.trainer.send(weights=part, worker_ids=targets, partial=True))
        self._record(version, targets, dict.fromkeys(keys, self.value))

    @rule()
    def wait_all(self) -> None:
        live = self._live(WORKERS)
        self.loop.run_until_complete(self.trainer.wait_async(worker_ids=live))
        for wid in live:
            w, _ = self.workers[wid]
            assert w.version == max(self.sent[wid]), (wid, w.version, max(self.sent[wid]))

    @precondition(lambda self: all(self.alive.values()))
    @rule(h=st.sampled_from(HOSTS), mid_transfer=st.booleans())
    def crash(self, h: int, mid_transfer: bool) -> None:
        """Host *h*'s relay dies; with *mid_transfer*, right after a send to everybody."""

        async def go() -> None:
            if mid_transfer:
                self.value += 1.0
                self._fill(self.value)
                version = await self.trainer.send_async()
                self._record(version, WORKERS, dict.fromkeys(KEYS, self.value))
            await self.relays[h].relay._crash()
            await self.trainer.sender.wait_lost(h, timeout=10)

        self.loop.run_until_complete(go())
        self.alive[h] = False
        for wid in [(h, 0), (h, 1)]:
            self._check(wid)  # its workers keep a complete version they were sent
            w, _ = self.workers.pop(wid)
            self.loop.run_until_complete(w.aclose())
        before = self.trainer.version
        with pytest.raises(HostLostError) as err:
            self.loop.run_until_complete(self.trainer.send(worker_ids=[(h, 0)]))
        assert err.value.host == h and self.trainer.version == before  # refused before anything was sent

    @precondition(lambda self: not all(self.alive.values()))
    @rule()
    def rejoin(self) -> None:
        h = next(h for h, up in self.alive.items() if not up)
        self.loop.run_until_complete(self.relays[h].aclose())
        self.loop.run_until_complete(self._join(h))
        self.alive[h] = True
        ids = [(h, 0), (h, 1)]
        self.loop.run_until_complete(self.trainer.wait_async(worker_ids=ids))
        for wid in ids:  # the newest version sent to it (even one sent while its host was down), first
            w, _ = self.workers[wid]
            assert w.version == max(self.sent[wid]) and self.seen[wid] == [w.version], (wid, w.version, self.seen[wid])

    @invariant()
    def every_worker_runs_exactly_a_version_sent_to_it(self) -> None:
        for wid in self.workers:
            self._check(wid)

    def teardown(self) -> None:
        async def close() -> None:
            await self.trainer.aclose()
            for r in self.relays.values():
                await r.aclose()
            for w, _ in self.workers.values():
                await w.aclose()

        try:
            self.loop.run_until_complete(close())
        finally:
            self.loop.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dist_random_interleavings() -> None:
    DistMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    DistMachine.TestCase().runTest()


def test_dist_random_interleavings_short() -> None:
    """A few examples in the default suite (the slow variant runs more)."""
    DistMachine.TestCase.settings = settings(max_examples=5, stateful_step_count=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    DistMachine.TestCase().runTest()
