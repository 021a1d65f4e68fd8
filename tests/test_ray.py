"""Ray actors as workers (``asyncsync.ray``), on a local Ray instance: ``python -m pytest -m ray``.

CI runs this module in a step of its own that installs the ``ray`` extra; the default run
deselects the ``ray`` marker (pyproject's addopts).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncsync import MultiProcessWeightSyncScheme, WorkerDiedError
from asyncsync.ray import start_workers
from asyncsync.testing import no_leaks
from tests._ray_targets import assert_exited, assert_versions_then_the_latest, recording_worker, send_versions_then_a_burst
from tests._targets import fill_, make_model

ray = pytest.importorskip("ray")  # only where CI installed the `ray` extra for this module
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]  # actors start and import torch on a busy machine

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _no_leaked_children() -> Iterator[None]:
    """Replaces the suite's check: Ray's raylet keeps a pool of worker processes of its own.
    What is ours, the actors, is checked by :func:`assert_exited` after each group; the
    rest (/dev/shm entries) here."""
    with no_leaks(processes=False, descriptors=False):
        yield


def _quickstart_worker():  # type: ignore[no-untyped-def]
    """examples/quickstart.py's worker function, shipped to the actors by value (unchanged)."""
    spec = importlib.util.spec_from_file_location("asyncsync_quickstart", ROOT / "examples" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module.rollout_worker, module.make_policy


async def test_the_quickstart_worker_runs_unchanged_in_ray_actors() -> None:
    rollout_worker, make_policy = _quickstart_worker()
    policy = make_policy()
    scheme = MultiProcessWeightSyncScheme(timeout=120)
    scheme.init_on_sender(model=policy, num_workers=2)
    async with start_workers(rollout_worker, scheme, num_workers=2) as group:
        assert set(group.pids) == {0, 1} and len(set(group.pids.values())) == 2
        async with scheme:
            for _ in range(3):
                with torch.no_grad():
                    policy[0].weight.add_(0.01)
                await scheme.send()
            assert scheme.sender.applied_versions() == {0: 3, 1: 3}
    assert {i: r["version"] for i, r in group.results.items()} == {0: 3, 1: 3}
    assert_exited(group.pids)
    assert all(r["steps"] > 0 for r in group.results.values())


async def test_actors_receive_every_version_and_the_latest_wins() -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=120)
    scheme.init_on_sender(model=model, num_workers=2)
    fill_(model, 0.0)
    async with start_workers(recording_worker, scheme, num_workers=2) as group:
        async with scheme:
            await send_versions_then_a_burst(scheme, model)
    assert_exited(group.pids)
    assert_versions_then_the_latest(group.results)


async def test_a_killed_actor_is_named_and_its_replacement_gets_the_newest_version() -> None:
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=120)
    scheme.init_on_sender(model=model, num_workers=2)
    async with start_workers(recording_worker, scheme, num_workers=2) as group:
        async with scheme:
            fill_(model, 1.0)
            await scheme.send()
            group.kill(1)
            await scheme.sender.wait_dead(1, timeout=60)  # through its socket's end
            # The send goes to the living worker (and is worker 1's newest), then names the dead one.
            with pytest.raises(WorkerDiedError, match="worker 1") as info:
                await scheme.send()
            assert info.value.worker_idx == 1 and info.value.applied_by == (0,) and scheme.version == 2
            fill_(model, 2.0)
            assert await scheme.send(worker_ids=0) == 3
            await group.restart(1, timeout=120)
            assert scheme.sender.applied_versions() == {0: 3, 1: 2}  # 1: the newest it was sent (the send that raised)
            fill_(model, 3.0)
            assert await scheme.send() == 4
    assert_exited(group.pids)
    assert group.results[1] == [(2, [1.0]), (4, [3.0])], "the replacement starts at the newest version it was sent"
    assert [v for v, _ in group.results[0]] == [0, 1, 2, 3, 4]
