"""No leaked processes, threads, descriptors or /dev/shm segments after aclose() or a crash."""

from __future__ import annotations

import gc
import os
import threading
from multiprocessing import resource_tracker

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, spawn_workers
from tests._targets import simple_worker


class Big(nn.Module):
    """Large enough (8M params) for the off-loop copy thread to run."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2_000, 4_000))


async def big_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
    scheme.init_on_receiver(worker_idx=worker_idx, model=Big())
    async with scheme:
        await scheme.wait_stopped()
    return scheme.version


def snapshot() -> tuple[set[str], set[str], set[int]]:
    # multiprocessing's resource tracker is started once per interpreter and kept: not ours
    resource_tracker.ensure_running()
    gc.collect()
    return set(os.listdir("/proc/self/fd")), set(os.listdir("/dev/shm")), {t.ident or 0 for t in threading.enumerate()}


async def test_nothing_left_after_aclose_and_worker_crash() -> None:
    fds0, shm0, threads0 = snapshot()
    model = Big()
    for transport in ("shm", "queue"):
        scheme = MultiProcessWeightSyncScheme(timeout=30, transport=transport, on_worker_error="skip")  # type: ignore[arg-type]
        scheme.init_on_sender(model=model, num_workers=2)
        async with spawn_workers(big_worker, 2, args=(scheme,), scheme=scheme) as group:
            async with scheme:
                for k in range(3):
                    with torch.no_grad():
                        model.w.fill_(k)
                    await scheme.send()
                group.kill(1)  # a crash mid-life
                await scheme.sender.wait_dead(1, timeout=10)
                await scheme.send()
            await group.aclose()  # the crashed worker has no result to join
        fds1, shm1, threads1 = snapshot()
        assert fds1 == fds0, f"{transport}: descriptors left: {_describe(fds1 - fds0)}"
        assert shm1 == shm0, f"{transport}: /dev/shm entries left: {sorted(shm1 - shm0)}"
        assert threads1 == threads0, f"{transport}: threads left: {threading.enumerate()}"


async def test_nothing_left_after_plain_lifecycle() -> None:
    fds0, shm0, threads0 = snapshot()
    model = nn.Linear(3, 3)
    torch.manual_seed(1234)
    from tests._targets import make_model

    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=model, num_workers=1)
    async with spawn_workers(simple_worker, 1, args=(scheme,), scheme=scheme) as group:
        async with scheme:
            await scheme.send()
        await group.join(timeout=30)
    assert snapshot() == (fds0, shm0, threads0)


def _describe(fds: set[str]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(fd)
    return out
