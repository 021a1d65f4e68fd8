"""What the multi-host scheme opened is closed when it is done, even while its objects or errors are kept.

A log record keeps the exception it was given (``logger.warning("... %r", exc)``), and so
may a caller: the exception's frames must not keep the store connection and the gloo device
(a listening socket, an epoll and a pipe) of a group that never formed. A closed scheme
the program still holds holds no connection either.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch.distributed as dist
from anyio import wait_all_tasks_blocked
from torch import nn

from asyncsync import SyncTimeoutError
from asyncsync._dist._dataplane import SyncGroup
from asyncsync.testing import no_leaks, open_loopback_hosts

WAIT_S = 20.0  # a bound for the blocked rendezvous's own wait (the test opens it well before)


class UnansweredStore(dist.Store):  # type: ignore[misc]
    """A rendezvous store nobody else ever writes to: every read blocks until *gate* opens,
    then fails (as a member that never came does, at the group's timeout)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def clone(self) -> UnansweredStore:
        return self

    def set(self, key: str, value: bytes) -> None:
        pass

    def get(self, key: str) -> bytes:
        self.gate.wait(WAIT_S)
        raise RuntimeError(f"no member published {key!r}")

    def wait(self, keys: list[str], timeout: object = None) -> None:
        self.gate.wait(WAIT_S)
        raise RuntimeError(f"no member published {keys!r}")

    def add(self, key: str, value: int) -> int:
        return value

    def check(self, keys: list[str]) -> bool:
        return False


async def test_a_group_refused_by_the_backend_keeps_nothing_open_while_its_error_is_kept() -> None:
    kept: list[BaseException] = []
    with no_leaks():
        with pytest.raises(RuntimeError, match="rank < size") as info:
            await SyncGroup.create(dist.HashStore(), 1, 2, 2, timeout=WAIT_S)  # rank 2 of 2: gloo refuses it
        kept.append(info.value)
    assert kept


async def test_a_rendezvous_given_up_on_keeps_nothing_open_once_it_ends_while_the_error_is_kept() -> None:
    gate = threading.Event()
    before = set(threading.enumerate())
    kept: list[BaseException] = []
    with no_leaks():
        with pytest.raises(SyncTimeoutError, match="forming weight-sync group generation 1") as info:
            await SyncGroup.create(UnansweredStore(gate), 1, 0, 2, timeout=0.2)
        kept.append(info.value)
        gate.set()  # the rendezvous, still running on its own thread, fails now
        for t in set(threading.enumerate()) - before:
            if t.name.startswith("asyncsync-group"):
                await asyncio.to_thread(t.join, WAIT_S)
        for _ in range(2):  # its outcome reaches the loop in one callback, whose own callbacks run next
            await wait_all_tasks_blocked()
    assert kept


async def test_a_rendezvous_given_up_on_closes_its_device_as_it_ends_before_the_loop_hears_of_it() -> None:
    # The work's outcome waits in a callback the loop has not run yet (a program that checks
    # its ports right after joining the thread): the frame in that exception holds no device.
    gate = threading.Event()
    before = set(threading.enumerate())
    with no_leaks():
        with pytest.raises(SyncTimeoutError, match="forming weight-sync group generation 1"):
            await SyncGroup.create(UnansweredStore(gate), 1, 0, 2, timeout=0.2)
        gate.set()
        for t in set(threading.enumerate()) - before:
            if t.name.startswith("asyncsync-group"):
                t.join(WAIT_S)  # blocking: the loop runs nothing meanwhile


async def test_closed_schemes_still_referenced_hold_no_descriptor() -> None:
    async with open_loopback_hosts(nn.Linear(4, 2), lambda: nn.Linear(4, 2), timeout=WAIT_S):
        pass  # the first cluster in a process leaves the backend's process-wide state behind
    with no_leaks():
        async with open_loopback_hosts(nn.Linear(4, 2), lambda: nn.Linear(4, 2), timeout=WAIT_S) as lh:
            await lh.trainer.send()
    assert lh.hosts[1].relay is not None  # closed, and still held: its store connection is closed all the same


def test_a_group_closed_while_busy_goes_when_its_operation_ends_after_its_loop_closed() -> None:
    """A member closes its group while a receive still runs in it, and its program's loop
    ends; the receive ends later (its peer goes), off any loop. The group must go then,
    with its connections, as it does while the loop runs."""
    import time

    import torch

    groups: list[SyncGroup] = []

    async def main() -> None:
        store = dist.HashStore()
        groups.extend(await asyncio.gather(SyncGroup.create(store, 1, 0, 2, timeout=WAIT_S), SyncGroup.create(store, 1, 1, 2, timeout=WAIT_S)))
        receiving = asyncio.ensure_future(groups[1].recv(torch.empty(16, dtype=torch.uint8), 0, tag=0))  # rank 0 never sends
        await wait_all_tasks_blocked()
        receiving.cancel()
        await asyncio.wait([receiving])
        groups[1].close()  # busy: kept until the receive ends
        assert groups[1].busy

    with no_leaks():
        asyncio.run(main())  # the loop is closed from here on
        sender, receiver = groups
        sender.close()  # its peer gone, the receive ends (on the backend's thread)
        deadline = time.monotonic() + WAIT_S
        while receiver.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not receiver.busy, "the receive never ended"
        for t in [t for t in threading.enumerate() if t.name == "asyncsync-group-close"]:
            t.join(WAIT_S)
        assert receiver.pg is None
        groups.clear()
