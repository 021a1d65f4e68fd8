"""asyncsync.testing and its pytest plugin: the fault helpers on loopback workers and on real
processes, and the plugin as a user meets it (through pytester: a user's test file, a
leaked process, a leaked descriptor)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import asyncsync.testing
from asyncsync import MultiProcessWeightSyncScheme, SyncTimeoutError, WorkerDiedError, WorkerError
from asyncsync.testing import LoopbackWorkers, ProcessWorkers, no_leaks, open_loopback, open_workers
from tests._targets import fill_, make_model, simple_worker

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


def sender(model: nn.Module, num_workers: int = 2) -> MultiProcessWeightSyncScheme:
    scheme = MultiProcessWeightSyncScheme(timeout=30)
    scheme.init_on_sender(model=model, num_workers=num_workers)
    return scheme


def values(model: nn.Module) -> set[float]:
    return {float(v) for t in model.state_dict().values() for v in t.unique()}


# ------------------------------------------------------------------ faults, loopback


async def test_a_killed_loopback_worker_is_named_and_can_be_restarted(asyncsync_loopback: Callable[..., LoopbackWorkers]) -> None:
    model = make_model()
    scheme = sender(model)
    async with asyncsync_loopback(scheme, make_model) as lb:
        await lb.faults.kill(1)
        fill_(model, 1.0)
        with pytest.raises(WorkerDiedError) as info:
            await scheme.send()
        assert info.value.worker_idx == 1 and "worker 1" in str(info.value)
        assert scheme.version == 1 and info.value.applied_by == (0,)  # the living worker got it
        assert scheme.statistics().worker(1).state == "dead"
        await lb.restart(1)
        v = await scheme.send()
        assert scheme.sender.applied_versions() == {0: v, 1: v}
        assert values(lb.models[0]) == values(lb.models[1]) == {1.0}


async def test_delayed_loopback_acks_time_out_naming_the_worker_then_sends_work(asyncsync_loopback: Callable[..., LoopbackWorkers]) -> None:
    model = make_model()
    scheme = sender(model)
    async with asyncsync_loopback(scheme, make_model) as lb:
        async with lb.faults.delay_acks(1):
            fill_(model, 1.0)
            with pytest.raises(SyncTimeoutError) as info:
                await scheme.send(timeout=0.2)
            assert info.value.pending == {1: 0}
            assert "worker 1 (at version 0)" in str(info.value)
            await scheme.wait_async(worker_ids=[0])
            assert (lb.workers[0].version, lb.workers[1].version) == (1, 0)  # held: not applied
        fill_(model, 2.0)
        v = await scheme.send()
        assert scheme.sender.applied_versions() == {0: v, 1: v}
        assert values(lb.models[1]) == {2.0}


async def test_a_rejected_loopback_payload_raises_and_the_worker_keeps_its_weights(asyncsync_loopback: Callable[..., LoopbackWorkers]) -> None:
    model = make_model()
    scheme = sender(model)
    async with asyncsync_loopback(scheme, make_model) as lb:
        initial = {k: t.clone() for k, t in lb.models[1].state_dict().items()}
        async with lb.faults.reject(1, "corrupt payload"):
            fill_(model, 1.0)
            with pytest.raises(WorkerError) as info:
                await scheme.send()
            assert (info.value.worker_idx, info.value.version, info.value.message) == (1, 1, "corrupt payload")
            await scheme.wait_async(version=1, worker_ids=[0])  # the error may come before worker 0's ack
            assert values(lb.models[0]) == {1.0}
            assert all(torch.equal(t, initial[k]) for k, t in lb.models[1].state_dict().items())
            assert lb.workers[1].statistics().rejected == 1
        fill_(model, 2.0)
        await scheme.send()
        assert values(lb.models[0]) == values(lb.models[1]) == {2.0}


async def test_open_loopback_refuses_models_for_other_workers() -> None:
    scheme = sender(make_model())
    with pytest.raises(ValueError, match=r"models for workers \[0\], the scheme has workers \[0, 1\]"):
        open_loopback(scheme, {0: make_model()})
    await scheme.aclose()


# ------------------------------------------------------------------ faults, processes


async def _process_faults_round(open_: Callable[..., ProcessWorkers]) -> None:
    """reject, delay_acks and kill on worker processes, and a replacement that takes them too."""
    model = make_model()
    scheme = sender(model)
    async with open_(simple_worker, 2, args=(scheme,), scheme=scheme) as workers:
        async with scheme:
            async with workers.faults.reject(1, "corrupt payload"):
                fill_(model, 1.0)
                with pytest.raises(WorkerError) as info:
                    await scheme.send()
                assert (info.value.worker_idx, info.value.version, info.value.message) == (1, 1, "corrupt payload")
                await scheme.wait_async(version=1, worker_ids=[0])  # the error may come before worker 0's ack
                assert scheme.sender.applied_versions() == {0: 1, 1: 0}  # worker 1 kept version 0
            async with workers.faults.delay_acks(0):
                with pytest.raises(SyncTimeoutError) as timed_out:
                    await scheme.send(timeout=0.2)
                assert timed_out.value.pending == {0: 1}
            v = await scheme.send()
            assert scheme.sender.applied_versions() == {0: v, 1: v}
            await workers.faults.kill(1)
            with pytest.raises(WorkerDiedError) as died:
                await scheme.send()
            assert died.value.worker_idx == 1 and died.value.exitcode == -signal.SIGKILL
            await workers.restart(1)
            async with workers.faults.reject(1, "again"):  # the replacement takes faults too
                with pytest.raises(WorkerError, match=r"worker 1 rejected version \d+: again"):
                    await scheme.send()
            v = await scheme.send()
    assert workers.results == {0: v, 1: v}


async def test_process_faults_reject_delay_kill_and_a_replacement_takes_them_too(asyncsync_workers: Callable[..., ProcessWorkers]) -> None:
    await _process_faults_round(asyncsync_workers)


def test_process_faults_work_when_the_loop_is_uvloop() -> None:
    # The trainer and (following it) the workers on uvloop, in any pass of the suite.
    uvloop = pytest.importorskip("uvloop")
    with no_leaks():
        uvloop.run(_process_faults_round(open_workers))


def test_the_leak_check_does_not_count_uvloops_process_wide_pipe() -> None:
    # libuv opens a pipe for the life of the process with the first loop it makes: a test
    # whose uvloop loop is the process's first is no leak (a fresh interpreter: the first).
    pytest.importorskip("uvloop")
    probe = (
        "import asyncio, uvloop\n"
        "from asyncsync.testing import no_leaks\n"
        "with no_leaks():\n"
        "    uvloop.run(asyncio.sleep(0))\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "clean"), out.stderr[-2000:]


async def test_open_workers_wants_an_async_function() -> None:
    with pytest.raises(TypeError, match="async function"):
        open_workers(print, 1)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the plugin, as users meet it


def test_the_plugin_is_an_entry_point_that_imports_neither_asyncsync_nor_torch() -> None:
    assert [ep.value for ep in entry_points(group="pytest11") if ep.name == "asyncsync"] == ["_asyncsync_pytestplugin"]
    probe = "import sys, _asyncsync_pytestplugin; print(sorted(m for m in ('asyncsync', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.strip() == "[]"


def test_asyncsync_testing_is_imported_explicitly_and_never_imports_pytest() -> None:
    probe = (
        "import sys, asyncsync; before = 'asyncsync.testing' in sys.modules; import asyncsync.testing; "
        "print(before, 'pytest' in sys.modules, sorted(asyncsync.testing.__all__) == asyncsync.testing.__all__)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False", "True"]
    for name in asyncsync.testing.__all__:
        assert getattr(asyncsync.testing, name).__module__ == "asyncsync.testing"


def test_the_first_rendezvous_store_of_a_process_is_no_leak() -> None:
    """torch keeps a pipe for the life of the process from its first TCPStore server on:
    the leak check opens it before its snapshot, so a multi-host test that makes the
    process's first store passes it (a fresh interpreter: this one has made stores already)."""
    probe = (
        "import asyncio, torch\n"
        "from asyncsync.testing import no_leaks, open_loopback_hosts\n"
        "def make(): return torch.nn.Linear(4, 2)\n"
        "async def main():\n"
        "    async with open_loopback_hosts(make(), make, timeout=30) as lh:\n"
        "        await lh.trainer.send()\n"
        "with no_leaks():\n"
        "    asyncio.run(main())\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["clean"], out.stderr[-3000:]


INI = "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"


def test_the_example_user_tests_pass(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(test_my_loop=(ROOT / "examples" / "test_my_loop.py").read_text())
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


def test_a_worker_functions_error_is_what_the_asyncsync_workers_test_reports(pytester: pytest.Pytester) -> None:
    # A worker that never connects its receiver raises; the trainer's send fails because that
    # worker died: the test's failure shows the worker's exception and its traceback.
    pytester.makeini(INI)
    pytester.makepyfile(
        test_user="""
        from torch import nn

        from asyncsync import MultiProcessWeightSyncScheme


        async def forgetful_worker(worker_idx, scheme):
            scheme.init_on_receiver(worker_idx=worker_idx, model=nn.Linear(4, 2))
            await scheme.wait_stopped()  # no `async with scheme`: the receiver never connected


        async def test_training(asyncsync_workers):
            scheme = MultiProcessWeightSyncScheme(timeout=30)
            scheme.init_on_sender(model=nn.Linear(4, 2), num_workers=1)
            async with asyncsync_workers(forgetful_worker, 1, args=(scheme,), scheme=scheme):
                async with scheme:
                    await scheme.send()
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*in forgetful_worker*",
            "*await scheme.wait_stopped()*",
            "RuntimeError: the receiver was not connected",
            "E*WorkerProcessError: worker 0: RuntimeError: the receiver was not connected",
        ]
    )


class Leftovers:
    """A plugin for the inner run: what its tests leak, for the outer test to clean up
    (this suite's own leak check would fail it otherwise)."""

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self.fds: list[int] = []

    @pytest.fixture
    def leftovers(self) -> Leftovers:
        return self

    def clean(self) -> None:
        for p in self.processes:
            p.join(timeout=30)  # killed by the leak check
            assert p.exitcode == -signal.SIGKILL
            p.close()
        for fd in self.fds:
            os.close(fd)


def test_a_leaked_process_or_descriptor_fails_the_test(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(
        test_leaks="""
        import multiprocessing, os, time

        def test_leaks_a_process(asyncsync_no_leaks, leftovers):
            p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
            p.start()
            leftovers.processes.append(p)

        def test_leaks_a_descriptor(asyncsync_no_leaks, leftovers):
            leftovers.fds.extend(os.pipe())

        def test_clean(asyncsync_no_leaks):
            os.close(os.dup(0))
        """
    )
    leftovers = Leftovers()
    try:
        result = pytester.runpytest("-p", "no:cacheprovider", plugins=[leftovers])
    finally:
        leftovers.clean()
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.re_match_lines([r".*LeakError: asyncsync leak check: child process \d+ \(.*\) still running.*"])
    result.stdout.re_match_lines([r".*LeakError: asyncsync leak check: file descriptor \d+ \(pipe:\[\d+\]\) left open.*"])
    assert (len(leftovers.processes), len(leftovers.fds)) == (1, 2)


def test_a_failed_test_gets_no_leak_report_on_top_but_its_processes_are_killed(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(
        test_fails="""
        import multiprocessing, time

        def test_fails_and_leaks(asyncsync_no_leaks, leftovers):
            p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
            p.start()
            leftovers.processes.append(p)
            assert False, "the test's own failure"
        """
    )
    leftovers = Leftovers()
    try:
        result = pytester.runpytest("-p", "no:cacheprovider", plugins=[leftovers])
    finally:
        leftovers.clean()  # asserts the process was killed
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the test's own failure*"])
    assert "LeakError" not in result.stdout.str()


async def test_open_loopback_hosts_connects_every_host_and_closes_everything() -> None:
    from asyncsync import HostLostError
    from asyncsync.testing import open_loopback_hosts

    policy = make_model()
    async with open_loopback_hosts(policy, make_model, hosts={1: 2, 2: 1}, timeout=10) as lh:
        assert sorted(lh.workers) == [(1, 0), (1, 1), (2, 0)] and all(w.version == 0 for w in lh.workers.values())
        fill_(policy, 4.0)
        v = await lh.trainer.send(worker_ids=[(1, 1), (2, 0)])
        assert {wid: w.version for wid, w in lh.workers.items()} == {(1, 0): 0, (1, 1): v, (2, 0): v}
        assert all(bool((p == 4.0).all()) for p in lh.models[2, 0].parameters())
        await lh.hosts[2].aclose()
        with pytest.raises(HostLostError):
            await lh.trainer.send()
    assert lh.trainer.statistics().host(1).state == "stopped"
