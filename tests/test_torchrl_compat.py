"""What torchrl's collectors expect of a weight sync scheme, with AsyncSyncScheme.

Each collector below runs two worker processes on ``make_const_env`` (no gymnasium) and
a ``ValueNet`` policy, which acts ``param + buf``: a batch shows the weights each worker
ran. ``MultiSyncCollector`` collects every batch after the previous call returned, so a
batch taken after ``update_policy_weights_()`` shows the version it sent. Collectors are
shared by the tests of one fixture (they start processes); each test sets the weights it
checks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl")

from torchrl.collectors import MultiSyncCollector  # noqa: E402

from asyncsync.torchrl import AsyncSyncScheme  # noqa: E402
from tests._torchrl_targets import (  # noqa: E402
    make_const_env,
    random_value_policy,
    unpicklable_value_policy,
    value_policy,
    value_weights,
)

pytestmark = pytest.mark.timeout(300)
TIMEOUT = 120.0  # spawned workers import torch and torchrl first: slow on a loaded machine


class Run:
    """A collector, its scheme, the trainer's policy (if any) and a batch iterator."""

    def __init__(self, policy: Any = None, scheme: AsyncSyncScheme | None = None, **kwargs: Any) -> None:
        self.policy = policy
        self.scheme = scheme if scheme is not None else AsyncSyncScheme(timeout=TIMEOUT)
        self.collector = MultiSyncCollector(
            [make_const_env, make_const_env],
            policy=policy,
            frames_per_batch=4,
            total_frames=-1,
            cat_results="stack",
            weight_sync_schemes={"policy": self.scheme},
            **kwargs,
        )
        self.batches = iter(self.collector)

    def acts(self) -> list[list[float]]:
        """Each worker's actions in the next batch (one value each when it ran one version)."""
        batch = next(self.batches)
        return [sorted(set(batch["action"][i].flatten().tolist())) for i in range(2)]

    def close(self) -> None:
        try:
            self.collector.shutdown()
        finally:
            self.scheme.shutdown()


def set_value(policy: Any, param: float, buf: float = 0.0) -> None:
    with torch.no_grad():
        policy.module.param.fill_(param)
        policy.module.buf.fill_(buf)


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    """A collector with a trainer-side policy, tracking policy versions."""
    r = Run(value_policy(0.0), track_policy_version=True)
    yield r
    r.close()


@pytest.fixture(scope="module")
def distinct() -> Iterator[Run]:
    """A collector with no policy and one distinct policy_factory per worker (acting 1 and 2)."""
    r = Run(policy_factory=[functools.partial(value_policy, 1.0), functools.partial(value_policy, 2.0)])
    yield r
    r.close()


def test_update_reads_params_and_buffers_and_bumps_each_worker_policy_version_once(run: Run) -> None:
    before = next(run.batches)["next", "policy_version"]
    set_value(run.policy, 1.0, 2.0)
    run.collector.update_policy_weights_()
    batch = next(run.batches)
    assert batch["action"].unique().tolist() == [3.0]  # param and buffer both arrived
    assert (batch["next", "policy_version"] == before + 1).all()
    assert (next(run.batches)["next", "policy_version"] == before + 1).all()  # no update, no bump


def test_workers_run_a_snapshot_taken_at_each_update_not_the_trainers_live_tensors(run: Run) -> None:
    set_value(run.policy, 4.0)
    run.collector.update_policy_weights_()
    set_value(run.policy, 5.0)  # a training step in place, not sent
    assert run.acts() == [[4.0], [4.0]]
    states = run.collector.state_dict()
    assert [states[f"worker{i}"]["policy_state_dict"]["module.param"].item() for i in range(2)] == [4.0, 4.0]
    run.collector.update_policy_weights_()
    assert run.acts() == [[5.0], [5.0]]


def test_given_weights_and_worker_ids_reach_only_the_named_workers_and_leave_the_trainer_alone(run: Run) -> None:
    set_value(run.policy, 6.0)
    run.collector.update_policy_weights_()
    run.collector.update_policy_weights_(value_weights(7.0), worker_ids=[1])
    assert run.acts() == [[6.0], [7.0]]
    assert run.policy.module.param.item() == 6.0


def test_per_worker_weights_without_per_worker_weights_true_are_refused(run: Run) -> None:
    version = run.scheme.version
    with pytest.raises(ValueError, match="per_worker_weights=True"):
        run.collector.update_policy_weights_({0: value_weights(8.0)})
    assert run.scheme.version == version


def test_policy_factory_without_policy_starts_every_worker_from_one_trainer_built_policy() -> None:
    r = Run(policy_factory=random_value_policy)  # each call of the factory acts another value
    try:
        (first,), (second,) = r.acts()
        assert first == second  # version 0: the trainer's policy, not each worker's own build
        with pytest.raises(ValueError, match="policy_factory"):
            r.collector.update_policy_weights_()  # no policy on the trainer to read
        r.collector.update_policy_weights_(value_weights(3.0, 1.0))
        assert r.acts() == [[4.0], [4.0]]
    finally:
        r.close()


def test_distinct_policy_factories_start_each_worker_from_its_own_factory(distinct: Run) -> None:
    assert distinct.acts() == [[1.0], [2.0]]
    with pytest.raises(ValueError, match="policy_factory"):
        distinct.collector.update_policy_weights_()


def test_per_worker_update_reaches_each_named_worker_in_one_version(distinct: Run) -> None:
    version = distinct.scheme.version
    distinct.collector.update_policy_weights_({0: value_weights(10.0)})
    assert distinct.acts() == [[10.0], [2.0]]
    distinct.collector.update_policy_weights_({0: value_weights(100.0), 1: value_weights(200.0)})
    assert distinct.acts() == [[100.0], [200.0]]
    assert distinct.scheme.version == version + 2
    distinct.collector.update_policy_weights_(value_weights(5.0))  # one weights for all
    assert distinct.acts() == [[5.0], [5.0]]


def test_unserializable_trainer_policy_with_factory_and_per_worker_weights_true() -> None:
    scheme = AsyncSyncScheme(timeout=TIMEOUT, per_worker_weights=True)
    r = Run(unpicklable_value_policy(3.0), scheme, policy_factory=value_policy)
    try:
        assert r.acts() == [[3.0], [3.0]]  # version 0: the trainer's policy, not the factory's
        r.collector.update_policy_weights_({1: value_weights(9.0)})
        assert r.acts() == [[3.0], [9.0]]
        set_value(r.policy, 4.0)
        r.collector.update_policy_weights_()  # reads the trainer's policy, for every worker
        assert r.acts() == [[4.0], [4.0]]
    finally:
        r.close()
