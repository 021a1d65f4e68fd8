"""The one helper that runs blocking work off the loop, and its one cancellation rule.

Each job here blocks on a :class:`threading.Event` the test (on the loop) sets: the work
ends exactly when the test says, so nothing depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from asyncsync import SyncTimeoutError
from asyncsync._core._offload import Offload
from asyncsync._io._staging import THREAD_BYTES, Stager

WAIT_S = 30.0  # a bound for the work's own waits (the test sets the event well before)


class Gate:
    """A job that tells the loop it started, then blocks until the loop opens the gate."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.started = asyncio.Event()
        self.go = threading.Event()
        self.finished = threading.Event()
        self.thread: threading.Thread | None = None

    def job(self, result: Any = None, error: BaseException | None = None) -> Callable[[], Any]:
        def run() -> Any:
            self.thread = threading.current_thread()
            self.loop.call_soon_threadsafe(self.started.set)
            opened = self.go.wait(WAIT_S)
            self.finished.set()
            if error is not None:
                raise error
            return result if opened else "the gate never opened"

        return run


class Owner:
    """Records keep/release/discard, and lets the test await the release."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.released = asyncio.Event()
        self.discarded: list[Any] = []

    def keep(self) -> None:
        self.calls.append("keep")

    def release(self) -> None:
        self.calls.append("release")
        self.released.set()

    def discard(self, result: Any) -> None:
        self.calls.append("discard")
        self.discarded.append(result)


async def leave_while_running(gate: Gate, run: Any) -> None:
    """Start *run* (a coroutine awaiting *gate*'s job), and cancel it once the job runs."""
    task = asyncio.create_task(run)
    await asyncio.wait_for(gate.started.wait(), WAIT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.fixture(params=[False, True], ids=["single-thread", "daemon"])
def offload(request: pytest.FixtureRequest) -> Any:
    off = Offload("asyncsync-test", daemon=request.param)
    yield off
    off.close()


async def test_the_caller_gets_the_result_and_owns_nothing_extra(offload: Offload) -> None:
    owner = Owner()
    gate = Gate()
    gate.go.set()
    assert await offload.run(gate.job(result=7), keep=owner.keep, release=owner.release) == 7
    assert owner.calls == []  # a caller that stayed handles its own buffers


async def test_a_cancelled_caller_leaves_at_once_and_the_owner_is_released_only_when_the_work_ends(offload: Offload) -> None:
    owner = Owner()
    gate = Gate()
    await leave_while_running(
        gate, offload.run(gate.job(result="late"), keep=owner.keep, release=owner.release, discard=owner.discard)
    )
    # The caller is gone while the work still blocks: what it owns stays reserved.
    assert not gate.finished.is_set()
    assert owner.calls == ["keep"]
    gate.go.set()
    await asyncio.wait_for(owner.released.wait(), WAIT_S)
    assert gate.finished.is_set()
    assert owner.calls == ["keep", "discard", "release"]  # the result nobody took was handed over first
    assert owner.discarded == ["late"]


async def test_a_timeout_raises_sync_timeout_error_naming_what_was_awaited(offload: Offload) -> None:
    owner = Owner()
    gate = Gate()
    with pytest.raises(SyncTimeoutError, match="the test's store call") as info:
        await offload.run(gate.job(), timeout=0.01, what="the test's store call", keep=owner.keep, release=owner.release)
    assert isinstance(info.value, TimeoutError)
    assert owner.calls == ["keep"]
    gate.go.set()
    await asyncio.wait_for(owner.released.wait(), WAIT_S)
    assert owner.calls == ["keep", "release"]


async def test_an_exception_after_the_caller_left_is_consumed(offload: Offload, caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    try:
        owner = Owner()
        gate = Gate()
        await leave_while_running(
            gate, offload.run(gate.job(error=ValueError("the late failure")), keep=owner.keep, release=owner.release)
        )
        with caplog.at_level(logging.DEBUG, logger="asyncsync"):
            gate.go.set()
            await asyncio.wait_for(owner.released.wait(), WAIT_S)
        gc.collect()  # a future's unretrieved exception is reported (to the handler) as it is collected
        assert unhandled == []
        assert any("the late failure" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    finally:
        loop.set_exception_handler(None)


async def test_the_work_s_own_failure_reaches_the_caller_as_it_is(offload: Offload) -> None:
    gate = Gate()
    gate.go.set()
    with pytest.raises(ValueError, match="refused"):
        await offload.run(gate.job(error=ValueError("refused")))


async def test_the_loop_runs_while_the_work_blocks(offload: Offload) -> None:
    """The work waits for something only the loop does: if the loop were blocked, it never would."""
    gate = Gate()

    async def open_gate() -> None:
        await gate.started.wait()
        gate.go.set()

    opener = asyncio.create_task(open_gate())
    assert await asyncio.wait_for(offload.run(gate.job(result="opened by the loop")), WAIT_S) == "opened by the loop"
    await opener


async def test_a_caller_that_timed_out_can_wait_again_for_the_same_attempt(offload: Offload) -> None:
    gate = Gate()
    job = offload.start(gate.job(result="the store"))
    with pytest.raises(SyncTimeoutError):
        await offload.wait(job, timeout=0.01, what="the first try")
    gate.go.set()
    assert await offload.wait(job, timeout=WAIT_S, what="the retry") == "the store"


async def test_the_next_job_on_the_single_thread_starts_after_one_whose_caller_left() -> None:
    offload = Offload("asyncsync-test")
    try:
        first, owner = Gate(), Owner()
        await leave_while_running(first, offload.run(first.job(), keep=owner.keep, release=owner.release))
        assert offload.busy

        def second() -> bool:
            return first.finished.is_set()  # the abandoned job had ended before this one began

        nxt = asyncio.create_task(offload.run(second))
        first.go.set()
        assert await asyncio.wait_for(nxt, WAIT_S) is True
        await asyncio.wait_for(owner.released.wait(), WAIT_S)
        assert not offload.busy
    finally:
        offload.close()


async def test_a_daemon_job_runs_on_a_daemon_thread_that_nothing_joins() -> None:
    offload = Offload("asyncsync-test", daemon=True)
    gate = Gate()
    with pytest.raises(SyncTimeoutError):
        await offload.run(gate.job(), timeout=0.01, what="a call that never answers")
    offload.close()  # returns although the work still blocks
    await asyncio.wait_for(gate.started.wait(), WAIT_S)
    assert gate.thread is not None and gate.thread.daemon and not gate.finished.is_set()
    gate.go.set()
    gate.thread.join(WAIT_S)


async def test_inline_work_runs_here() -> None:
    offload = Offload("asyncsync-test")
    assert await offload.run(threading.current_thread, inline=True) is threading.current_thread()
    assert not offload.busy


async def test_a_cancelled_staging_copy_returns_at_once_and_close_waits_for_it() -> None:
    """The receiver's staging thread follows the same rule: close() ends the copy before
    anything it reads is unmapped."""
    stager = Stager(torch.device("cpu"))
    gate = Gate()
    await leave_while_running(gate, stager.run(THREAD_BYTES, gate.job()))
    assert not gate.finished.is_set()
    gate.go.set()
    stager.close()
    assert gate.finished.is_set()


async def test_a_result_lives_no_longer_than_its_caller_wants_it(offload: Offload) -> None:
    """A result that holds resources (a process group's sockets) is not kept by the helper."""

    class Resource:
        pass

    gate = Gate()
    gate.go.set()
    ref = weakref.ref(await offload.run(gate.job(result=Resource())))
    gc.collect()
    assert ref() is None


async def test_aclose_waits_for_a_job_whose_caller_left_without_blocking_the_loop() -> None:
    offload = Offload("asyncsync-test")
    gate, owner = Gate(), Owner()
    await leave_while_running(gate, offload.run(gate.job(), keep=owner.keep, release=owner.release))
    closing = asyncio.create_task(offload.aclose())
    asyncio.get_running_loop().call_soon(gate.go.set)  # only a loop that turns opens the gate
    await asyncio.wait_for(closing, WAIT_S)
    assert gate.finished.is_set() and gate.thread is not None
    gate.thread.join(WAIT_S)
    assert not gate.thread.is_alive()  # the thread ended with the job


def test_a_result_whose_loop_ended_is_still_discarded() -> None:
    """A process group built after its loop ended is dropped, not left to the collector."""
    offload = Offload("asyncsync-test", daemon=True)
    discarded: list[Any] = []
    done = threading.Event()
    gates: list[Gate] = []

    def discard(result: Any) -> None:
        discarded.append(result)
        done.set()

    async def leave() -> None:
        gates.append(Gate())
        with pytest.raises(SyncTimeoutError):
            await offload.run(gates[0].job(result="built too late"), timeout=0.01, discard=discard)
        await asyncio.wait_for(gates[0].started.wait(), WAIT_S)

    asyncio.run(leave())  # the loop ends while the work still runs
    gates[0].go.set()
    assert done.wait(WAIT_S) and discarded == ["built too late"]
    offload.close()
