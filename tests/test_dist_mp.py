"""The multi-host scheme on loopback: a trainer here, two simulated hosts (relays) with
probe workers, gloo on 127.0.0.1. One cluster is shared by the tests of this module."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

from tests._dist_cluster import DistCluster
from tests._targets import fill_

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALL = [(1, 0), (1, 1), (2, 0)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dc() -> AsyncIterator[DistCluster]:
    c = DistCluster({1: 2, 2: 1})
    await c.start()
    yield c
    await c.close()


def all_equal(sd: dict[str, torch.Tensor], value: float) -> bool:
    return all(bool((t == value).all()) for t in sd.values())


async def test_round_trip_reaches_every_remote_worker(dc: DistCluster) -> None:
    fill_(dc.model, 3.0)
    v = await dc.scheme.send()
    assert dc.scheme.sender.applied_versions() == {w: v for w in ALL}
    for wid in ALL:
        version, sd = await dc.state(wid)
        assert version == v and all_equal(sd, 3.0)
