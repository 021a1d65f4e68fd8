from __future__ import annotations

import os

# Executable ownership invariants on in every test (and in every worker it spawns).
os.environ.setdefault("ASYNCSYNC_DEBUG", "1")
# Workers are forked from a forkserver that imported torch, tensordict and asyncsync once
# (a fraction of a second each, instead of seconds for a spawned interpreter). The tests
# that are about spawn pass start_method="spawn"; ASYNCSYNC_START_METHOD=spawn runs all so.
os.environ.setdefault("ASYNCSYNC_START_METHOD", "forkserver")

import asyncio
import faulthandler
import fcntl
import multiprocessing as mp
import re
import stat
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import torch

from asyncsync import AsyncQueue, MultiProcessWeightSyncScheme, spawn_workers
from asyncsync.testing import no_leaks
from tests._targets import make_model, probe_worker

CTX = mp.get_context("spawn")


WORKERS = 2  # pytest-xdist workers for a run of the whole suite


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """A run of the whole suite (no test paths given: the README's command, CI's ``-m``
    steps) goes to two pytest-xdist workers, whole files each (a module's shared workers
    start once), when pytest-xdist is installed: the suite mostly waits on its child
    processes. ``-n N`` chooses, ``-n 0`` runs in this process, and so does a run of named
    files or tests (no workers to start for a few tests)."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return  # an xdist worker itself, or no xdist
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.getoption("usepdb"):
        return
    if config.option.numprocesses is None and config.option.dist == "no" and not config.option.tx:
        config.option.numprocesses = WORKERS
        config.option.dist = "loadfile"


def _distributing(config: pytest.Config) -> bool:
    """This process hands the tests to xdist workers and runs none itself."""
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the forkserver now: it imports torch while the tests are collected (in each
    xdist worker: each has its own)."""
    if os.environ["ASYNCSYNC_START_METHOD"] == "forkserver" and not _distributing(session.config):
        from multiprocessing import forkserver

        from asyncsync._workers import FORKSERVER_PRELOAD

        unset = mp.get_start_method(allow_none=True) is None
        # tests._forkserver_stdio: the workers it forks write where this process does (pytest's capture)
        forkserver.set_forkserver_preload([*FORKSERVER_PRELOAD, "tests._forkserver_stdio"])
        forkserver.ensure_running()
        if unset:
            # ensure_running() fixes the global start method to the platform's default (fork),
            # which torchrl's collectors would then use: leave it unset, as it was.
            mp.set_start_method(None, force=True)  # type: ignore[arg-type]


# What depends on tensordict's version: CI's second pass (tensordict 0.14.3, torchrl's pin)
# runs only these (`-m tensordict`): the weights formats, the strategies, the local state
# machine, the local scheme across processes, and a smoke test of the multi-host scheme.
TENSORDICT_TESTS = (
    "tests/test_weights_formats.py",
    "tests/test_scheme_unit.py",
    "tests/test_regressions_unit.py",
    "tests/test_stateful.py",
    "tests/test_scheme_mp.py",
    "tests/test_staging_mp.py",
    "tests/test_variants_mp.py::test_one_worker_variants",
    "tests/test_dist_loopback.py::test_in_process_round_trip_versions_and_partial",
    "tests/test_torchrl_",  # torchrl 0.14 is installed only with tensordict 0.14.3
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(TENSORDICT_TESTS):
            item.add_marker(pytest.mark.tensordict)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test allowed longer than ``faulthandler_timeout`` (a long state machine) runs past
    it by design: the watchdog would dump every thread's stack while they run, which can
    crash the process (a SIGSEGV inside that dump was seen). Its own timeout guards it."""
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else None
    if isinstance(limit, (int, float)) and limit > float(item.config.getini("faulthandler_timeout") or 0):
        faulthandler.cancel_dump_traceback_later()

# ASYNCSYNC_TEST_LOOP=uvloop: every asyncio test (and fixture) runs on uvloop, and so do the
# workers it spawns (spawn_workers follows the loop it is called from). CI runs a subset so.
TEST_LOOP = os.environ.get("ASYNCSYNC_TEST_LOOP", "asyncio")


class _UvloopFactories:
    @pytest.hookimpl(optionalhook=True)
    def pytest_asyncio_loop_factories(self, config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
        import uvloop

        return {"uvloop": uvloop.new_event_loop}


def selects_slow(markexpr: str) -> bool:
    """The mark expression picks slow tests (``-m slow``, ``-m "slow or ray"``), not only
    leaves them out (``not slow``)."""
    return re.search(r"(?<!not )\bslow\b", markexpr) is not None


def pytest_configure(config: pytest.Config) -> None:
    if config.option.verbose == 0 and selects_slow(config.option.markexpr or ""):
        # Slow tests run for minutes each: name every test as it starts and as it ends
        # (as -v does), so a long run shows where it is. -q keeps it quiet.
        config.option.verbose = 1
    if TEST_LOOP == "asyncio":
        return
    if TEST_LOOP != "uvloop":
        raise pytest.UsageError(f"ASYNCSYNC_TEST_LOOP must be 'asyncio' or 'uvloop', got {TEST_LOOP!r}")
    if not config.pluginmanager.hasplugin("asyncio") or not hasattr(config.hook, "pytest_asyncio_loop_factories"):
        raise pytest.UsageError("ASYNCSYNC_TEST_LOOP=uvloop needs pytest-asyncio >= 1.3 (its loop-factory hook)")
    config.pluginmanager.register(_UvloopFactories(), "asyncsync-uvloop")


@pytest.fixture(autouse=True)
def _appending_capture() -> None:
    """pytest's capture file takes what forkserver workers write (tests/_forkserver_stdio.py)
    at its end: this process writes at its end too, not over theirs."""
    for fd in (1, 2):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)


@pytest.fixture(autouse=True)
def _no_leaked_children() -> Iterator[None]:
    """Every test must leave no child process of ours behind. (Descriptors are checked where
    a test owns its schemes: the plugin's fixtures; module-scoped clusters may rightly add slots.)"""
    with no_leaks(descriptors=False):
        yield


class Probe:
    """Talk to a probe_worker over its control pipe."""

    def __init__(self, conn: Any) -> None:
        self.q: AsyncQueue[Any] = AsyncQueue(conn)

    async def ask(self, *req: Any) -> Any:
        await self.q.put(req)
        return await self.q.get(timeout=30)


class Cluster:
    """A trainer-side scheme, its model and probe workers in spawned processes."""

    def __init__(self, scheme: MultiProcessWeightSyncScheme, model: torch.nn.Module, n: int, kinds: list[str], opts: dict[str, Any] | None = None) -> None:
        self.scheme = scheme
        self.model = model
        self.n = n
        self.kinds = kinds
        self.opts = opts
        self.probes: list[Probe] = []
        self.group: Any = None

    @classmethod
    def of(cls, kinds: list[str], **scheme_kwargs: Any) -> Cluster:
        """A fresh trainer model (of ``kinds[0]``) and scheme, one probe worker per kind."""
        model = make_model(kinds[0])
        scheme = MultiProcessWeightSyncScheme(**{"timeout": 30, **scheme_kwargs})
        scheme.init_on_sender(model=model, num_workers=len(kinds))
        return cls(scheme, model, len(kinds), kinds)

    def spawn(self) -> None:
        """Start the probe workers (one group each, so each gets its own control pipe)."""
        ends = [CTX.Pipe() for _ in range(self.n)]
        self.probes = [Probe(a) for a, _ in ends]
        self.groups = []
        for i, (_, b) in enumerate(ends):
            g = spawn_workers(probe_worker, worker_ids=[i], args=(self.scheme, b, self.kinds[i], self.opts), scheme=self.scheme)
            g.start()
            b.close()
            self.groups.append(g)

    async def wait_started(self) -> None:
        for g in self.groups:
            await g.wait_started()

    async def start(self) -> Cluster:
        self.spawn()
        await self.wait_started()  # connect's timeout counts from here, not from the imports
        await self.scheme.connect()
        return self

    async def start_manual(self) -> Cluster:
        """For commit_mode="manual": connect() needs each worker to commit version 0."""
        self.spawn()
        await self.wait_started()
        connect = asyncio.ensure_future(self.scheme.connect())
        for p in self.probes:
            assert (await p.ask("wait_version", 0)) == -1  # staged, not committed yet
            assert await p.ask("commit") == (True, 0, 0)
        await connect
        return self

    async def kill_close(self) -> None:
        """Close without the stop handshake (some workers may be dead or stuck)."""
        await self.scheme.aclose()
        for p in self.probes:
            await p.q.aclose()  # first: a probe worker ends when its control pipe does
        for g in self.groups:
            await g.aclose(grace=5.0)

    async def state(self, i: int) -> tuple[int, dict[str, torch.Tensor]]:
        return await self.probes[i].ask("state")  # type: ignore[no-any-return]

    async def close(self) -> None:
        try:
            for p in self.probes:
                await p.q.put(("wait_stopped",))
            await self.scheme.aclose()
            for p in self.probes:
                assert await p.q.get(timeout=30) == "stopped"
            for g in self.groups:
                await g.join(timeout=30)
        finally:
            for g in self.groups:
                await g.aclose()
            for p in self.probes:
                await p.q.aclose()


def assert_same(model_or_sd: Any, sd: dict[str, torch.Tensor]) -> None:
    ref = model_or_sd.state_dict() if isinstance(model_or_sd, torch.nn.Module) else model_or_sd
    assert set(ref) == set(sd)
    for k in ref:
        assert torch.equal(ref[k], sd[k]), k


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster2() -> AsyncIterator[Cluster]:
    """Two probe workers shared by the tests of one module (tensordict, shm)."""
    c = Cluster.of(["mlp", "mlp"], strategy="tensordict")
    await c.start()
    yield c
    await c.close()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))
