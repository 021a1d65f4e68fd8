"""No leaked processes, threads, descriptors or /dev/shm segments after aclose() or a crash."""

from __future__ import annotations

import contextlib
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
    """This process's descriptors, the /dev/shm entries, this process's threads; compare
    the /dev/shm entries with :func:`shm_left`."""
    # multiprocessing's resource tracker is started once per interpreter and kept: not ours
    resource_tracker.ensure_running()
    gc.collect()
    return set(os.listdir("/proc/self/fd")), set(os.listdir("/dev/shm")), {t.ident or 0 for t in threading.enumerate()}


def shm_left(before: set[str]) -> list[str]:
    """The /dev/shm entries made since *before* that are not another program's.

    /dev/shm is the machine's: a suite running beside this one (another pytest-xdist
    worker, say) makes and removes entries there at any time. An entry is another
    program's if a process outside this one's tree maps it or holds it open, or if it is
    torch's ``torch_<pid>_...`` for such a process; one that is gone by the end of the
    check was never left.
    """
    new = set(os.listdir("/dev/shm")) - before
    if not new:
        return []
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    ours = {os.getpid()}
    for pid in sorted(parents):
        chain = [pid]
        while chain[-1] in parents and chain[-1] not in ours and parents[chain[-1]] > 1:
            chain.append(parents[chain[-1]])
        if chain[-1] in ours:
            ours.update(chain)
    others = set(parents) - ours
    theirs = {n for n in new if n.startswith("torch_") and n.split("_")[1].isdigit() and int(n.split("_")[1]) in others}
    for pid in others:
        try:
            with open(f"/proc/{pid}/maps") as f:
                used = {line.rsplit("/dev/shm/", 1)[1].split(" ")[0].strip() for line in f if "/dev/shm/" in line}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        used.add(target[len("/dev/shm/") :].split(" ")[0])
        except OSError:
            continue  # gone meanwhile, or not ours to read
        theirs |= new & used
    return sorted(n for n in new - theirs if os.path.exists(f"/dev/shm/{n}"))


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
        assert not shm_left(shm0), f"{transport}: /dev/shm entries left: {shm_left(shm0)}"
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
    fds1, _, threads1 = snapshot()
    assert (fds1, threads1) == (fds0, threads0)
    assert not shm_left(shm0), f"/dev/shm entries left: {shm_left(shm0)}"


def _describe(fds: set[str]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(fd)
    return out
