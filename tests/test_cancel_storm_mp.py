"""Cancellation storms: random cancels of send / send_async / wait_async while workers apply."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._targets import fill_
from tests.conftest import Cluster, assert_same

pytestmark = pytest.mark.asyncio(loop_scope="module")

ops = st.lists(
    st.tuples(st.sampled_from(["send", "send_async", "wait_async"]), st.one_of(st.none(), st.integers(0, 6))),
    min_size=1,
    max_size=12,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=ops)
async def test_cancellation_storm_converges(cluster2: Cluster, plan: list[tuple[str, int | None]]) -> None:
    scheme = cluster2.scheme
    value = float(scheme.version)
    for kind, cancel_after in plan:
        value += 1.0
        fill_(cluster2.model, value)
        coro = {"send": scheme.send, "send_async": scheme.send_async, "wait_async": scheme.wait_async}[kind]()
        task = asyncio.ensure_future(coro)
        if cancel_after is not None:
            for _ in range(cancel_after):  # a random point inside the coroutine
                await asyncio.sleep(0)
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    versions_before = scheme.sender.applied_versions()
    fill_(cluster2.model, value + 0.5)
    v = await scheme.send()  # the next send succeeds
    assert v == scheme.version and all(v > b for b in versions_before.values())
    assert scheme.sender.applied_versions() == {0: v, 1: v}  # no ack lost or double-counted
    for i in range(2):
        version, sd = await cluster2.state(i)
        assert version == v
        assert_same(cluster2.model, sd)
        updates = await cluster2.probes[i].ask("updates")
        assert updates == sorted(set(updates)), "versions must be strictly increasing"
        assert updates[-1] == v
