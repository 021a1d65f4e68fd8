"""A hypothesis state machine over the multi-host scheme, in one process: a trainer, two
relays (hosts 1 and 2, each with two loopback workers) on a real gloo group and control
plane over 127.0.0.1. Random sends (all, subsets across hosts, partial), async sends and
waits; after every step each worker's model holds exactly the weights of the version it
reports, that version was sent to it, and versions only go up.
(Relay kills and rejoins are covered by tests/test_dist_faults_mp.py, not here.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from asyncsync import DistributedWeightSyncScheme, MultiProcessWeightSyncScheme, loopback_worker
from tests._dist_cluster import free_port
from tests._targets import make_model

WORKERS = [(1, 0), (1, 1), (2, 0), (2, 1)]
KEYS = ["0.weight", "0.bias", "2.weight", "2.bias"]


class DistMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.value = 0.0
        self.sent: dict[tuple[int, int], dict[int, dict[str, float]]] = {w: {} for w in WORKERS}  # version -> values per key
        self.seen: dict[tuple[int, int], list[int]] = {w: [] for w in WORKERS}
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        port = free_port()
        common: dict[str, Any] = dict(timeout=30, token="t", world_size=3, master_addr="127.0.0.1", master_port=port)
        self.model = make_model()
        self.trainer = DistributedWeightSyncScheme(rank=0, **common)
        self.trainer.init_on_sender(model=self.model, hosts={1: 2, 2: 2})
        self.relays = []
        self.workers: dict[tuple[int, int], tuple[MultiProcessWeightSyncScheme, torch.nn.Module]] = {}
        for h in (1, 2):
            relay = DistributedWeightSyncScheme(rank=h, **common)
            relay.init_on_relay(model=make_model(), num_workers=2)
            self.relays.append(relay)
            for i in range(2):
                w = loopback_worker(relay.local, i)
                m = make_model()
                wid = (h, i)
                w.init_on_receiver(worker_idx=i, model=m, on_update=lambda _w, v, wid=wid: self.seen[wid].append(v))
                self.workers[wid] = (w, m)
        self._fill(0.0)
        await asyncio.gather(self.trainer.connect(), *(r.connect() for r in self.relays), *(w.connect() for w, _ in self.workers.values()))
        for wid in WORKERS:
            self.sent[wid][0] = dict.fromkeys(KEYS, 0.0)

    def _fill(self, value: float, keys: list[str] | None = None) -> None:
        with torch.no_grad():
            for k, t in self.model.state_dict().items():
                if keys is None or k in keys:
                    t.fill_(value)

    def _record(self, version: int, targets: list[tuple[int, int]], values: dict[str, float]) -> None:
        for wid in targets:
            last = self.sent[wid][max(self.sent[wid])]
            self.sent[wid][version] = {k: values.get(k, last[k]) for k in KEYS}

    @rule(ids=st.lists(st.sampled_from(WORKERS), min_size=1, max_size=4, unique=True), sync=st.booleans())
    def send(self, ids: list[tuple[int, int]], sync: bool) -> None:
        targets = ids
        self.value += 1.0
        self._fill(self.value)
        coro = self.trainer.send(worker_ids=targets) if sync else self.trainer.send_async(worker_ids=targets)
        version = self.loop.run_until_complete(coro)
        self._record(version, targets, dict.fromkeys(KEYS, self.value))

    @rule(ids=st.lists(st.sampled_from(WORKERS), min_size=1, max_size=4, unique=True), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def partial(self, ids: list[tuple[int, int]], keys: list[str]) -> None:
        targets = ids
        self.value += 1.0
        part = {k: torch.full_like(t, self.value) for k, t in self.model.state_dict().items() if k in keys}
        version = self.loop.run_until_complete(self.trainer.send(weights=part, worker_ids=targets, partial=True))
        self._record(version, targets, dict.fromkeys(keys, self.value))

    @rule()
    def wait_all(self) -> None:
        self.loop.run_until_complete(self.trainer.wait_async())
        for wid in WORKERS:
            w, _ = self.workers[wid]
            assert w.version == max(self.sent[wid]), (wid, w.version, max(self.sent[wid]))

    @invariant()
    def every_worker_runs_exactly_a_version_sent_to_it(self) -> None:
        for wid, (w, m) in self.workers.items():
            v = w.version
            assert v in self.sent[wid], (wid, v)
            expected = self.sent[wid][v]
            for k, t in m.state_dict().items():
                assert bool((t == expected[k]).all()), (wid, v, k)
            assert self.seen[wid] == sorted(set(self.seen[wid])), (wid, self.seen[wid])

    def teardown(self) -> None:
        async def close() -> None:
            await self.trainer.aclose()
            for r in self.relays:
                await r.aclose()
            for w, _ in self.workers.values():
                await w.aclose()

        try:
            self.loop.run_until_complete(close())
        finally:
            self.loop.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dist_random_interleavings() -> None:
    DistMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    DistMachine.TestCase().runTest()


def test_dist_random_interleavings_short() -> None:
    """A few examples in the default suite (the slow variant runs more)."""
    DistMachine.TestCase.settings = settings(max_examples=5, stateful_step_count=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    DistMachine.TestCase().runTest()
