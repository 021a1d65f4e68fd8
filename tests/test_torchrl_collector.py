"""AsyncSyncScheme inside real torchrl collectors (CartPole through torchrl's GymEnv).

The policy (``tests._torchrl_targets.VersionNet``) holds the version number in every
parameter and reports, per frame, the smallest and largest parameter value its forward
pass read: a forward that saw two versions has ``lo != hi``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl")
pytest.importorskip("gymnasium")

from torchrl.collectors import Collector, MultiSyncCollector  # noqa: E402

from asyncsync import WorkerDiedError  # noqa: E402
from asyncsync.torchrl import AsyncSyncScheme  # noqa: E402
from tests._torchrl_targets import make_env, set_version, version_policy  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _versions(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["lo"].reshape(-1), batch["hi"].reshape(-1)


def test_no_forward_sees_two_versions_while_updates_land_during_collection() -> None:
    policy = version_policy()
    scheme = AsyncSyncScheme(timeout=120)
    # Collector(num_collectors=2, sync=False): two worker processes collecting freely,
    # so the updates below land while their rollouts run.
    collector = Collector(
        make_env,
        policy,
        num_collectors=2,
        sync=False,
        frames_per_batch=50,
        total_frames=1_500,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        version, frames, mixed = 0, 0, 0
        for batch in collector:
            lo, hi = _versions(batch)
            frames += lo.numel()
            mixed += int((lo != hi).sum())
            assert bool((lo[1:] >= lo[:-1]).all()), "a worker went back to an older version"
            for _ in range(3):
                version += 1
                set_version(policy, version)
                collector.update_policy_weights_()  # scheme.send(): every worker runs it on return
        assert mixed == 0, f"{mixed} of {frames} forward passes read two versions"
        assert version == 90 and scheme.version == version
        assert [(w.applied_version, w.lag) for w in scheme.statistics().workers] == [(version, 0)] * 2
    finally:
        collector.shutdown()
        scheme.shutdown()


def test_multi_sync_collector_runs_each_version_and_names_a_killed_worker() -> None:
    policy = version_policy()
    scheme = AsyncSyncScheme(timeout=120)
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy,
        frames_per_batch=100,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        seen = []
        for step, batch in enumerate(collector):
            lo, hi = _versions(batch)
            assert bool((lo == hi).all())
            seen.append(sorted(set(lo.tolist())))
            if step == 4:
                break
            set_version(policy, step + 1)
            collector.update_policy_weights_()
        assert seen == [[0.0], [1.0], [2.0], [3.0], [4.0]]  # each batch after update v runs v
        collector.procs[1].kill()
        t0 = time.perf_counter()
        set_version(policy, 99)
        # The scheme's timeout is 120 s: a WorkerDiedError (not a SyncTimeoutError) shows the
        # death was noticed by itself, not by waiting.
        with pytest.raises(WorkerDiedError, match="worker 1"):
            collector.update_policy_weights_()
        print(f"dead worker named after {time.perf_counter() - t0:.3f} s")
        states = {w.worker_idx: w.state for w in scheme.statistics().workers}
        assert states[0] == "connected" and states[1] != "connected"
    finally:
        collector.procs[1].join(10)
        _quiet_shutdown(collector)
        scheme.shutdown()


def _quiet_shutdown(collector: Any) -> None:
    try:
        collector.shutdown()
    except Exception as exc:  # torchrl's own teardown of a collector whose worker was killed
        print(f"collector.shutdown(): {exc!r}")
