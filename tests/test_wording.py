"""What the library says to its user: counts in the right grammatical number, and a worker
function that worker processes cannot import refused by name before any process starts."""

from __future__ import annotations

import functools
import logging

import pytest
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers
from asyncsync.testing import open_loopback

pytestmark = pytest.mark.timeout(60)


async def test_a_worker_function_defined_inside_a_function_is_refused_by_name() -> None:
    async def worker(worker_idx: int) -> int:
        return worker_idx

    message = r"the worker function '.*<locals>\.worker' is defined inside another function: .*top level of a module"
    for fn in (worker, functools.partial(worker)):
        with pytest.raises(TypeError, match=message):
            spawn_workers(fn, 1)


async def test_one_worker_is_one_worker_in_what_is_logged_and_raised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asyncsync")
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=nn.Linear(2, 2), num_workers=1)
    async with open_loopback(scheme, lambda: nn.Linear(2, 2)):
        version = await scheme.send()
        with pytest.raises(ValueError, match=f"quorum=2 but only 1 targeted worker was sent version {version}$"):
            await scheme.wait_async(version, quorum=2)
    assert "connected: 1/1 worker at version 0" in caplog.text
    with pytest.raises(ValueError, match="^1 device for 2 workers$"):
        MultiProcessWeightSyncScheme().init_on_sender(model=nn.Linear(2, 2), worker_ids=[0, 1], devices=["cpu"])
    with pytest.raises(ValueError, match="^num_workers=2 but 1 device was given$"):
        MultiProcessWeightSyncScheme().init_on_sender(model=nn.Linear(2, 2), num_workers=2, devices=["cpu"])
