"""A worker's staging copy cut short: its set and the slot it reads stay its own until the copy ends.

The staging copy of each test blocks on a :class:`threading.Event` the test (on the loop)
sets, so the copy ends exactly when the test says and nothing depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
import torch
from anyio import wait_all_tasks_blocked
from torch import nn

import asyncsync._io._staging as staging_module
from asyncsync import MultiProcessWeightSyncScheme
from asyncsync._core._layout import Layout
from asyncsync._core._ownership import Weights
from asyncsync._io._shm import Segment
from asyncsync._io._staging import THREAD_BYTES
from asyncsync._local._commit import Binding
from asyncsync._local._stage import SlotStaging
from asyncsync._wire._local import Receive
from asyncsync.testing import no_leaks, open_loopback

WAIT_S = 20.0  # a bound for the gated copy's own wait (the test opens the gate well before)
SIDE = 1024  # a 1024 x 1024 float32 layer: 2 MiB in bfloat16, copied in the staging thread


class CopyGate:
    """Holds the next staging copy made in a staging thread until the loop opens the gate."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop = asyncio.get_running_loop()
        self.started = asyncio.Event()
        self.go = threading.Event()
        self.finished = threading.Event()
        self.armed = False
        self.dst: list[torch.Tensor] = []
        copy = staging_module.copy_tensors

        def gated(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], non_blocking: bool = False) -> None:
            if self.armed and threading.current_thread().name.startswith("asyncsync-stage"):
                self.armed = False
                self.dst = list(dst)
                self.loop.call_soon_threadsafe(self.started.set)
                self.go.wait(WAIT_S)
                copy(dst, src, non_blocking)
                self.finished.set()
                return
            copy(dst, src, non_blocking)

        monkeypatch.setattr(staging_module, "copy_tensors", gated)

    def arm(self) -> None:
        self.armed = True

    async def wait_started(self) -> None:
        await asyncio.wait_for(self.started.wait(), WAIT_S)


def fill_(module: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)


async def test_a_worker_closed_mid_staging_keeps_its_weights_and_the_next_version_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker closes while its staging copy runs: the loop goes on (the sender sees it
    gone, a replacement on the same model commits the next versions) while the copy still
    writes; the close ends once the copy has, leaving nothing behind."""
    policy, local = nn.Linear(SIDE, SIDE), nn.Linear(SIDE, SIDE)
    scheme = MultiProcessWeightSyncScheme(timeout=WAIT_S, transfer_dtype=torch.bfloat16)  # a cast: staged, not read from the slot
    scheme.init_on_sender(model=policy, num_workers=1)
    gate = CopyGate(monkeypatch)
    with no_leaks():
        async with open_loopback(scheme, {0: local}) as lb:
            old = {k: t.clone() for k, t in local.state_dict().items()}
            gate.arm()
            fill_(policy, 1.5)  # exact in bfloat16
            v1 = await scheme.send_async()
            await gate.wait_started()
            closing = asyncio.create_task(lb.workers[0].aclose())
            await scheme.sender.wait_dead(0, timeout=WAIT_S)  # the loop runs while the copy is held
            assert scheme.statistics().worker(0).state == "left"
            assert not gate.finished.is_set() and not closing.done()  # the close waits for the copy
            assert all(torch.equal(t, old[k]) for k, t in local.state_dict().items())  # still its old weights
            assert not any(t.data_ptr() == d.data_ptr() for t in local.state_dict().values() for d in gate.dst)

            await lb.restart(0)  # a new worker on the same model, while the old copy still runs
            assert lb.workers[0].version == v1 and all(bool((t == 1.5).all()) for t in local.state_dict().values())
            fill_(policy, 2.5)
            v2 = await scheme.send()
            assert lb.workers[0].version == v2 and all(bool((t == 2.5).all()) for t in local.state_dict().values())
            assert not gate.finished.is_set() and not closing.done()

            gate.go.set()
            await asyncio.wait_for(closing, WAIT_S)  # the copy ended: then the old worker's close did
            assert gate.finished.is_set()
            assert all(bool((t == 2.5).all()) for t in local.state_dict().values())  # the late copy wrote only its own set
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncsync-stage")]


def one_tensor_staging() -> tuple[SlotStaging, torch.Tensor]:
    """A :class:`SlotStaging` bound to one float32 tensor sent as bfloat16, and its slot's view."""
    layout = Layout.from_tensors({"w": torch.zeros(SIDE * SIDE)}, {torch.float32: torch.bfloat16})
    assert layout.nbytes >= THREAD_BYTES
    staging = SlotStaging(0)
    binding = Binding({"w": torch.zeros(SIDE * SIDE)}, torch.device("cpu"), inference=False, reads_slot=False, recyclable=True)
    assert staging.bind(layout, binding, 0) is not None
    staging.slots.add(1, Segment(layout.nbytes), transient=False)
    return staging, staging.slots.views(1, layout)["w"]


async def cancel_mid_copy(staging: SlotStaging, gate: CopyGate) -> None:
    """Stage version 1 from slot 1, and cancel the staging once its copy is held by *gate*."""
    gate.arm()
    task = asyncio.create_task(staging.stage(Receive(1, 1)))
    await gate.wait_started()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancelled_staging_copy_keeps_its_set_until_it_ends_then_the_set_is_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = CopyGate(monkeypatch)
    staging, view = one_tensor_staging()
    roles = staging.roles
    assert roles is not None
    view.fill_(1.5)
    await cancel_mid_copy(staging, gate)
    written = gate.dst[0]
    assert roles.staging is not None and roles.staging.tensors["w"] is written  # not freed: the copy still writes it
    assert staging.waits_for(1)  # a poll leaves it to the receiver task

    view.fill_(2.5)
    second = asyncio.create_task(staging.stage(Receive(2, 1)))
    await wait_all_tasks_blocked()
    assert not second.done()  # the next version waits for the copy, never writes the same set beside it
    gate.go.set()
    staged = await asyncio.wait_for(second, WAIT_S)
    assert gate.finished.is_set()
    assert isinstance(staged, Weights) and staged.version == 2
    assert staged.tensors["w"] is written and bool((written == 2.5).all())  # freed once the copy ended, then reused
    assert roles.staging is None and not staging.waits_for(1)
    staging.close()
    await staging.wait_closed()


async def test_a_close_during_a_cancelled_copy_unmaps_only_once_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = CopyGate(monkeypatch)
    staging, _ = one_tensor_staging()
    await cancel_mid_copy(staging, gate)
    staging.close()
    assert staging.slots.get(1) is not None  # the copy still reads the slot: still mapped
    closed = asyncio.create_task(staging.wait_closed())
    await wait_all_tasks_blocked()
    assert not closed.done()
    gate.go.set()
    await asyncio.wait_for(closed, WAIT_S)
    assert gate.finished.is_set() and staging.slots.get(1) is None
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncsync-stage")]
