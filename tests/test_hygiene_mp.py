"""No leaked processes, threads, descriptors or /dev/shm segments after aclose() or a crash;
the leak check counts what this process tree left, never another program's /dev/shm entries."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme, loopback_worker, spawn_workers
from asyncsync.testing import LeakError, _shm_left, _shm_names, no_leaks
from tests._targets import make_model, simple_worker


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
    return set(os.listdir("/proc/self/fd")), _shm_names(), {t.ident or 0 for t in threading.enumerate()}


def shm_left(before: set[str]) -> list[str]:
    """The /dev/shm entries made since *before* by this process tree (the rule of
    :func:`asyncsync.testing.no_leaks`: never another program's)."""
    return _shm_left(before)


async def test_nothing_left_after_aclose_and_worker_crash() -> None:
    model = Big()
    for transport in ("shm", "queue"):
        with no_leaks(threads=True):
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


async def test_nothing_left_after_plain_lifecycle() -> None:
    with no_leaks(threads=True):
        scheme = MultiProcessWeightSyncScheme(timeout=30)
        scheme.init_on_sender(model=make_model(), num_workers=1)
        async with spawn_workers(simple_worker, 1, args=(scheme,), scheme=scheme) as group:
            async with scheme:
                await scheme.send()
            await group.join(timeout=30)


NEIGHBOUR = str(Path(__file__).with_name("_shm_neighbour.py"))


class Neighbour:
    """Another program making and removing /dev/shm entries (tests/_shm_neighbour.py): with
    *detach*, no descendant of this process, else a child of it."""

    def __init__(self, *, detach: bool) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            argv = [sys.executable, NEIGHBOUR, str(theirs.fileno()), *(["--detach"] if detach else [])]
            self.proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()])
        if detach:
            assert self.proc.wait(timeout=60) == 0  # its first process exits at once
        ours.settimeout(60)
        self._sock = ours
        self._lines = ours.makefile("r")
        self.pid = self.proc.pid

    def make(self) -> list[str]:
        """Remove the entries it made before, make three more (one mapped, one held open,
        one held by nobody); their names."""
        self._sock.sendall(b"make\n")
        ok, pid, *names = self._lines.readline().split()
        assert ok == "ok"
        self.pid = int(pid)
        return names

    def close(self) -> None:
        """It removes what it made and exits (a child killed meanwhile is reaped)."""
        with contextlib.suppress(OSError):  # (one that was killed takes nothing)
            self._sock.sendall(b"end\n")
            self._lines.readline()
        self._lines.close()
        self._sock.close()
        self.proc.wait(timeout=60)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_the_leak_check_counts_no_entry_another_program_makes_or_removes() -> None:
    neighbour = Neighbour(detach=True)
    try:
        before = neighbour.make()
        with no_leaks():
            during = neighbour.make()  # removes those, makes three more, while the block runs
        assert not set(before) & _shm() and set(during) <= _shm(), "the other program changed /dev/shm"
        assert neighbour.pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    finally:
        neighbour.close()


async def test_the_soak_counts_no_entry_another_program_makes_or_removes(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncsync import soak

    neighbour = Neighbour(detach=True)
    made: list[str] = []

    @contextmanager
    def beside_a_busy_neighbour(**options: Any) -> Iterator[None]:
        with no_leaks(**options):
            made.extend(neighbour.make())  # after the soak's snapshot, before its check
            yield

    try:
        neighbour.make()
        monkeypatch.setattr(soak, "no_leaks", beside_a_busy_neighbour)
        counters = await soak.soak(minutes=0, workers=1, n_params=1_000, kill_every=3600)
        assert made and counters["leaks"] == 0, counters
    finally:
        neighbour.close()


async def test_the_leak_check_reports_an_asyncsync_segment_and_a_dev_shm_entry_of_this_process_beside_another_program() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=make_model(), num_workers=1)
    worker = loopback_worker(scheme, 0)
    worker.init_on_receiver(worker_idx=0, model=make_model())
    neighbour = Neighbour(detach=True)
    entry = None
    try:
        neighbour.make()
        with pytest.raises(LeakError) as leaked:
            with no_leaks():
                others = neighbour.make()
                await asyncio.gather(scheme.connect(), worker.connect())
                await scheme.send()  # neither closed: their sockets and segments are left
                entry = shared_memory.SharedMemory(create=True, size=4096)  # nor this
        problems = leaked.value.problems
        assert any("/memfd:asyncsync" in p for p in problems), problems
        assert f"/dev/shm/{entry.name} left" in problems, problems
        assert not [p for p in problems if any(name in p for name in others)], problems
    finally:
        neighbour.close()
        await worker.aclose()
        await scheme.aclose()
        if entry is not None:
            entry.close()
            entry.unlink()


def test_the_leak_check_reports_the_entries_a_leftover_child_process_holds() -> None:
    """Also with descriptors=False, which leaves out only what this process itself holds."""
    made: list[str] = []
    child = entry = None
    try:
        with pytest.raises(LeakError) as leaked:
            with no_leaks(descriptors=False):
                child = Neighbour(detach=False)
                made = child.make()
                entry = shared_memory.SharedMemory(create=True, size=4096)  # as a fixture outliving the block may
        mapped, held_open, held_by_nobody = made
        assert sorted(p for p in leaked.value.problems if p.startswith("/dev/shm/")) == sorted([f"/dev/shm/{mapped} left", f"/dev/shm/{held_open} left"])
        assert [p for p in leaked.value.problems if p.startswith(f"child process {child.pid} ")], leaked.value.problems
    finally:
        if child is not None:
            child.close()  # killed by the check: what it made is still there
        for name in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        if entry is not None:
            entry.close()
            entry.unlink()


LEAVING_RELAY = """
import asyncio, torch
from torch import nn
from asyncsync import HostLostError
from asyncsync.testing import open_loopback_hosts

def make_model():
    torch.manual_seed(0)
    return nn.Linear(4, 2)

async def main():
    async with open_loopback_hosts(make_model(), make_model, hosts={1: 1, 2: 1}, timeout=30) as lh:
        await lh.trainer.send()
        await lh.hosts[1].aclose()  # host 1's relay leaves
        await lh.trainer.wait_lost(1, timeout=30)
        try:
            await lh.trainer.send()
        except HostLostError:
            pass
        await lh.trainer.send(worker_ids=[(2, 0)])

asyncio.run(main())
"""


@pytest.mark.timeout(300)
def test_a_multi_host_round_trip_with_a_relay_leaving_prints_only_asyncsyncs_own_log_lines() -> None:
    """Every group, store and connection asyncsync ends on purpose ends without torch's
    C++ side printing about it (a backtrace, a c10d or gloo error line), also after the
    program returned: only the asyncsync logger's own lines reach stderr."""
    done = subprocess.run([sys.executable, "-c", LEAVING_RELAY], capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if line and not line.startswith("asyncsync: ")] == [], done.stderr
