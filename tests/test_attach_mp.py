"""Workers that attach by address: processes asyncsync did not start join as worker k.

The workers here are never given the scheme object, only its address (on the command line
or in ``ASYNCSYNC_ADDRESS``): a plain program (``python -m tests._attach_worker``) started
with ``asyncio.create_subprocess_exec`` in the first test, the same program's ``main`` in
processes forked from the suite's forkserver (no torch import to wait for) everywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from asyncsync import (
    ClosedError,
    MultiProcessWeightSyncScheme,
    SenderDiedError,
    SyncTimeoutError,
    WorkerAddress,
    WorkerDiedError,
)
from tests import _attach_worker
from tests.test_hygiene_mp import shm_left, snapshot

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)  # each worker program imports torch on a busy machine


def fill_(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


class Program:
    """One worker program and the JSON events it prints."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def event(self, timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert line, f"the worker program ended (status {await self.proc.wait()}) without saying more"
        return json.loads(line)

    async def events_until(self, key: str) -> list[dict[str, Any]]:
        out = []
        while True:
            out.append(await self.event())
            if key in out[-1] or "error" in out[-1]:
                return out


class _ForkedOutput:
    """``readline()`` over the forked program's event pipe (``b""`` at its end)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def readline(self) -> bytes:
        await anyio.wait_readable(self._conn.fileno())  # (a whole event per message)
        try:
            return bytes(self._conn.recv_bytes())
        except (EOFError, OSError):
            return b""


class _ForkedProcess:
    """The part of ``asyncio.subprocess.Process`` the tests use, for a forked program."""

    def __init__(self, process: Any, events: Any) -> None:
        self._process = process
        self.stdout = _ForkedOutput(events)
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    async def wait(self) -> int:
        await anyio.wait_readable(self._process.sentinel)  # readable once it has ended
        self._process.join()
        return self._process.exitcode

    def close(self) -> None:
        """Its descriptors (the event pipe, the process sentinel), once it has ended."""
        self.stdout._conn.close()
        self._process.close()


@contextlib.asynccontextmanager
async def programs(fresh_interpreter: bool = False) -> AsyncIterator[Any]:
    """``start(idx, address, via_env=False)``; every program is waited for (killed if still
    running) on exit. A program is ``python -m tests._attach_worker`` with
    *fresh_interpreter*, else the same ``main`` in a process forked from the suite's
    forkserver (no torch import to wait for); either way it gets only the address."""
    started: list[Program] = []
    ctx = multiprocessing.get_context(os.environ.get("ASYNCSYNC_START_METHOD", "forkserver"))

    async def start(idx: int, address: WorkerAddress | str, via_env: bool = False) -> Program:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.pop("ASYNCSYNC_ADDRESS", None)
        target = None if via_env else str(address)
        if via_env:
            assert isinstance(address, WorkerAddress)
            env.update(address.env())
        if fresh_interpreter:
            args = [sys.executable, "-m", "tests._attach_worker", str(idx)] + ([] if target is None else [target])
            proc: Any = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT))
        else:
            events, sink = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_attach_worker.run_forked, args=(idx, target, env, sink), name=f"attached-{idx}")
            process.start()
            sink.close()
            proc = _ForkedProcess(process, events)
        started.append(Program(proc))
        return started[-1]

    try:
        yield start
    finally:
        for p in started:
            if p.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.kill()
            await p.proc.wait()
            if isinstance(p.proc, _ForkedProcess):
                p.proc.close()


async def test_programs_attach_by_address_and_receive_every_version() -> None:
    model = nn.Linear(4, 4)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=model, num_workers=2)
    fill_(model, 0.0)
    address = await scheme.listen()
    # worker 0 a plain program, as a launcher starts it (the example's test starts one given
    # the address in the environment); worker 1 forked, given it in the environment
    async with programs(fresh_interpreter=True) as start, programs() as start_forked:
        workers = [await start(0, address), await start_forked(1, address, via_env=True)]
        async with scheme:  # waits for both programs to attach and apply version 0
            for v in (1, 2, 3):
                fill_(model, float(v))
                assert await scheme.send() == v
            assert scheme.sender.applied_versions() == {0: 3, 1: 3}
        for w in workers:
            events = await w.events_until("stopped")
            assert events[-1] == {"stopped": 3}
            seen = [(e["version"], e["values"]) for e in events if "version" in e]
            assert seen == [(v, [float(v)]) for v in range(4)], "each version's weights, exactly as sent"
            assert await w.proc.wait() == 0
    assert_nobody_listens(address)


async def test_a_late_worker_gets_the_newest_version_first() -> None:
    model = nn.Linear(4, 4)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=model, num_workers=1)
    address = await scheme.listen()  # the trainer's side runs from here: sends go out before anyone attaches
    try:
        for v in range(4):  # versions 0..3 while nobody is attached
            fill_(model, float(v))
            assert await scheme.send_async() == v
        async with programs() as start:
            late = await start(0, address)
            await scheme.sender.wait_joined(0, timeout=60)
            first = await late.event()
            assert first == {"version": 3, "values": [3.0]}, "the newest version, not version 0"
            fill_(model, 4.0)
            assert await scheme.send() == 4
            await scheme.aclose()
            assert [e for e in await late.events_until("stopped") if "version" in e] == [{"version": 4, "values": [4.0]}]
    finally:
        await scheme.aclose()


async def test_a_wrong_token_is_refused_and_counted() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    address = await scheme.listen(token="the-real-one")
    try:
        import dataclasses

        wrong = dataclasses.replace(address, token="a-guess")
        async with programs() as start:
            intruder = await start(0, wrong)
            event = await intruder.event()
            assert event["error"] == "AuthenticationError"
            assert "refused" in event["message"] and "token" in event["message"] and address.path in event["message"]
            assert await intruder.proc.wait() == 3
        assert scheme.listener is not None and scheme.listener.refused == 1
        # the index stays free: the right token still gets in (in this process this time)
        worker = MultiProcessWeightSyncScheme.attach(str(address), worker_idx=0)
        worker.init_on_receiver(model=nn.Linear(4, 4))
        await asyncio.gather(scheme.connect(), worker.connect())
        await worker.aclose()
    finally:
        await scheme.aclose()


async def test_an_unknown_or_taken_index_is_refused_naming_it() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=2)
    address = await scheme.listen()
    first = MultiProcessWeightSyncScheme.attach(address, worker_idx=1)
    first.init_on_receiver(model=nn.Linear(4, 4))
    try:
        await scheme.send_async()  # listen() started the trainer's side
        await first.connect()
        second = MultiProcessWeightSyncScheme.attach(address, worker_idx=1)
        second.init_on_receiver(model=nn.Linear(4, 4))
        with pytest.raises(ValueError, match=rf"worker 1 is already connected \(pid {os.getpid()}\)"):
            await second.connect()
        await second.aclose()
        stranger = MultiProcessWeightSyncScheme.attach(address, worker_idx=7)
        stranger.init_on_receiver(model=nn.Linear(4, 4))
        with pytest.raises(ValueError, match=r"worker 7 is not one of the trainer's workers \[0, 1\]"):
            await stranger.connect()
        await stranger.aclose()
        assert scheme.listener is not None and scheme.listener.refused == 2
        assert first.version == 0  # the connected worker was not disturbed
    finally:
        await first.aclose()
        await scheme.aclose()


class _StartingChild:
    """A child the trainer started (``watch_process``) that has not said hello yet."""

    pid = 4242
    exitcode = None

    def __init__(self, sentinel: int) -> None:
        self.sentinel = sentinel


async def test_a_started_child_that_has_not_said_hello_keeps_its_index() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=2)
    address = await scheme.listen()
    r, w = os.pipe()
    try:
        await scheme.send_async()  # version 0 (listen() started the trainer's side)
        scheme.watch_process(0, _StartingChild(r))
        intruder = MultiProcessWeightSyncScheme.attach(address, worker_idx=0)
        intruder.init_on_receiver(model=nn.Linear(4, 4))
        with pytest.raises(ValueError, match=r"worker 0 is a process the trainer started \(pid 4242\)"):
            await intruder.connect()
        await intruder.aclose()
        free = MultiProcessWeightSyncScheme.attach(address, worker_idx=1)  # an index nobody was started for
        free.init_on_receiver(model=nn.Linear(4, 4))
        await free.connect()
        assert free.version == 0
        await free.aclose()
    finally:
        await scheme.aclose()
        os.close(r)
        os.close(w)


async def test_attaching_where_nobody_listens_times_out_naming_the_address(tmp_path: Path) -> None:
    path = str(tmp_path / "nobody.sock")
    worker = MultiProcessWeightSyncScheme.attach(WorkerAddress(path, token="t"), worker_idx=0, timeout=0.3)
    worker.init_on_receiver(model=nn.Linear(4, 4))
    with pytest.raises(SyncTimeoutError, match=f"worker 0 attaching to the trainer at {path}"):
        await worker.connect()
    await worker.aclose()


async def test_a_killed_program_is_named_dead_and_its_restart_reattaches() -> None:
    model = nn.Linear(4, 4)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=model, num_workers=1)
    address = await scheme.listen()
    async with programs() as start:
        worker = await start(0, address)
        async with scheme:
            assert (await worker.event())["version"] == 0
            worker.proc.kill()
            # no process is watched for an attached worker: its socket's end tells
            await scheme.sender.wait_dead(0, timeout=30)
            with pytest.raises(WorkerDiedError, match="worker 0") as info:
                await scheme.send()
            assert info.value.worker_idx == 0 and info.value.applied_by == ()
            restarted = await start(0, address)
            await scheme.sender.wait_joined(0, timeout=60)
            # the newest sent to worker 0: the send that raised, which its replacement gets first
            assert (await restarted.event())["version"] == scheme.version == 1
            fill_(model, 6.0)
            version = await scheme.send()
        events = await restarted.events_until("stopped")
        assert events[-1] == {"stopped": version}
        assert {"version": version, "values": [6.0]} in events


async def test_an_attached_worker_sees_the_trainer_die() -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    address = await scheme.listen(path="@asyncsync-test-" + os.urandom(6).hex())  # a Linux abstract socket
    worker = MultiProcessWeightSyncScheme.attach(str(address), worker_idx=0)
    worker.init_on_receiver(model=nn.Linear(4, 4))
    try:
        await asyncio.gather(scheme.connect(), worker.connect())
        await scheme._transport.aclose(10, stop=False)  # the channel ends without a Stop: as if the trainer died
        with pytest.raises(SenderDiedError):
            await asyncio.wait_for(worker.wait_stopped(), 30)
    finally:
        await worker.aclose()
        await scheme.aclose()


async def test_nothing_left_after_aclose_and_a_crash() -> None:
    # The loop's own first-use descriptors come first (uvloop keeps one on /dev/null for
    # the stdio of the children it starts).
    warm = await asyncio.create_subprocess_exec(sys.executable, "-c", "", stdout=asyncio.subprocess.PIPE)
    await warm.communicate()
    fds0, shm0, threads0 = snapshot()
    model = nn.Linear(4, 4)
    scheme = MultiProcessWeightSyncScheme(timeout=60, on_worker_error="skip")
    scheme.init_on_sender(model=model, num_workers=2)
    address = await scheme.listen()
    async with programs() as start:
        workers = [await start(i, address) for i in range(2)]
        async with scheme:
            await scheme.send()
            workers[1].proc.kill()  # a crash mid-life
            await scheme.sender.wait_dead(1, timeout=30)
            await scheme.send()
        assert (await workers[0].events_until("stopped"))[-1] == {"stopped": 2}
    assert_nobody_listens(address)
    fds1, _, threads1 = snapshot()
    assert fds1 == fds0, f"descriptors left: {[(fd, _link(fd)) for fd in sorted(fds1 - fds0)]}"
    assert not shm_left(shm0), f"/dev/shm entries left: {shm_left(shm0)}"
    assert threads1 == threads0


async def test_listen_after_aclose_raises_closed_error_and_opens_nothing(tmp_path: Path) -> None:
    for listened_before in (False, True):
        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
        if listened_before:
            await scheme.listen()
        await scheme.aclose()
        fds0, _, _ = snapshot()
        path = str(tmp_path / f"after-close-{listened_before}.sock")
        with pytest.raises(ClosedError, match="listen"):
            await scheme.listen(path)
        assert not os.path.exists(path) and snapshot()[0] == fds0  # no socket was opened


def test_the_address_round_trips_through_its_string_form() -> None:
    address = WorkerAddress("/tmp/a b/trainer.sock", token="s3cr&t=x", commit_mode="manual", timeout=None)
    assert WorkerAddress.from_string(str(address)) == address
    assert WorkerAddress.from_env(address.env()) == address
    assert "s3cr" not in repr(address)
    with pytest.raises(ValueError, match="not a worker address"):
        WorkerAddress.from_string("tcp://host:1")
    with pytest.raises(ValueError, match="ASYNCSYNC_ADDRESS is not set"):
        WorkerAddress.from_env({})


def test_the_example_runs(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``python examples/attach_worker.py --workers 1 --steps 2``, its trainer in this process;
    it launches its worker program with plain ``subprocess``, as it would."""
    from tests._script_runner import run_here

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run_here(ROOT / "examples" / "attach_worker.py", "--workers", "1", "--steps", "2")
    text = capfd.readouterr().out
    assert "step 1: version 2 applied by {0: 2}" in text and "worker 0" in text and "stopped at version 2" in text, text


async def test_queue_transport_passes_a_segment_per_message_over_the_socket() -> None:
    model = nn.Linear(4, 4)
    scheme = MultiProcessWeightSyncScheme(timeout=30, transport="queue")
    scheme.init_on_sender(model=model, num_workers=1)
    address = await scheme.listen()
    local = nn.Linear(4, 4)
    worker = MultiProcessWeightSyncScheme.attach(address, worker_idx=0)
    worker.init_on_receiver(model=local)
    try:
        await asyncio.gather(scheme.connect(), worker.connect())
        for v in (1, 2):
            fill_(model, float(v))
            assert await scheme.send() == v
            assert worker.version == v
            assert all(bool((p == float(v)).all()) for p in local.parameters())
    finally:
        await worker.aclose()
        await scheme.aclose()


async def test_a_socket_file_left_by_a_dead_trainer_is_replaced_and_a_live_one_refused(tmp_path: Path) -> None:
    import socket

    path = str(tmp_path / "trainer.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # bound, never listening, closed without unlinking: a killed trainer's leftover
    stale.close()
    first = MultiProcessWeightSyncScheme(timeout=30)
    first.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    second = MultiProcessWeightSyncScheme(timeout=30)
    second.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    try:
        address = await first.listen(path=path)
        assert address.path == path
        with pytest.raises(FileExistsError, match=f"another trainer listens at {path}"):
            await second.listen(path=path)
    finally:
        await first.aclose()
        await second.aclose()
    assert not os.path.exists(path)


async def test_a_sigkilled_trainer_leaves_nothing_behind(tmp_path: Path) -> None:
    """A trainer process listens on the default address, a worker in this process attaches
    by its string, the trainer is SIGKILLed: the worker sees it die, and nothing of the
    trainer's socket remains (no file or directory in its temporary directory, the name
    free again)."""
    ctx = multiprocessing.get_context(os.environ.get("ASYNCSYNC_START_METHOD", "forkserver"))
    events, sink = ctx.Pipe(duplex=False)
    trainer = ctx.Process(target=_attach_worker.run_trainer, args=(str(tmp_path), sink), name="killed-trainer")
    trainer.start()
    sink.close()
    address = WorkerAddress.from_string(await _next_event(events))
    worker = MultiProcessWeightSyncScheme.attach(address, worker_idx=0)
    model = nn.Linear(4, 4)
    worker.init_on_receiver(model=model)
    try:
        await worker.connect()
        assert await _next_event(events) == "connected" and worker.version == 0
        trainer.kill()
        await anyio.wait_readable(trainer.sentinel)
        with pytest.raises(SenderDiedError):
            await asyncio.wait_for(worker.wait_stopped(), 30)
    finally:
        await worker.aclose()
        trainer.kill()
        trainer.join(30)
        events.close()
        trainer.close()
    assert os.listdir(tmp_path) == [], "the killed trainer left files behind"
    assert_nobody_listens(address)


async def test_a_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    address = await scheme.listen(path="rel.sock")
    assert address.path == str(tmp_path / "rel.sock")
    monkeypatch.chdir(ROOT)  # the worker runs elsewhere: the address still finds the socket
    async with programs() as start:
        worker = await start(0, address)
        async with scheme:
            assert (await worker.event())["version"] == 0
        assert (await worker.events_until("stopped"))[-1] == {"stopped": 0}
    assert not os.path.exists(tmp_path / "rel.sock")


async def test_a_socket_path_too_long_is_refused_naming_it(tmp_path: Path) -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    path = str(tmp_path / ("x" * 120))
    try:
        with pytest.raises(ValueError, match=f"the socket path '{path}' is .* bytes, a Unix socket's address holds at most 107"):
            await scheme.listen(path)
        assert scheme.listener is None
    finally:
        await scheme.aclose()


async def _next_event(conn: Any) -> str:
    with anyio.fail_after(60):
        await anyio.wait_readable(conn.fileno())
    return bytes(conn.recv_bytes()).decode()


def assert_nobody_listens(address: WorkerAddress) -> None:
    """Nothing is bound at *address* any more: no socket file, and a connection is refused."""
    import socket

    if not address.path.startswith("@"):
        assert not os.path.exists(address.path), f"{address.path} is left"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
            probe.connect(address.sockaddr())
    finally:
        probe.close()


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"
