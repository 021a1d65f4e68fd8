"""asyncsync's pytest plugin (entry point ``asyncsync``): fixtures for tests of code that uses it.

Installed with asyncsync and loaded by pytest in every project of that environment, so it
stays out of the way: importing it loads nothing but pytest, and no fixture is autouse.
asyncsync (and torch) load when a test first asks for one of its fixtures. The helpers
themselves live in :mod:`asyncsync.testing`; see docs/testing.md.

Example (pytest-asyncio)::

    async def test_my_loop(asyncsync_loopback):
        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=policy, num_workers=2)
        async with asyncsync_loopback(scheme, make_policy) as lb:
            await my_training_loop(scheme, steps=3)
            assert all(w.version == 3 for w in lb.workers.values())

Disable it with ``-p no:asyncsync``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from asyncsync.testing import LoopbackWorkers, ProcessWorkers

_failed = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)  # old style: works with every pluggy a user may have
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        item.stash[_failed] = True


@pytest.fixture
def asyncsync_no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test (an error at teardown) if it leaves a child process, a file descriptor or a /dev/shm entry.

    See :func:`asyncsync.testing.no_leaks`. ``asyncsync_workers`` and ``asyncsync_loopback``
    use it; add it to other tests with ``@pytest.mark.usefixtures("asyncsync_no_leaks")``.
    Leftover processes are killed whatever happens; after a test that failed, no leak is
    reported on top (its traceback, kept by pytest, may hold what would be reported).
    """
    from asyncsync.testing import LeakError, no_leaks

    try:
        with no_leaks():
            yield
    except LeakError:
        if not request.node.stash.get(_failed, False):
            raise


@pytest.fixture
def asyncsync_loopback(asyncsync_no_leaks: None) -> Callable[..., LoopbackWorkers]:
    """:func:`asyncsync.testing.open_loopback`: ``asyncsync_loopback(scheme, models) as lb``,
    workers in the test's event loop, with ``lb.faults``; and the leak check."""
    from asyncsync.testing import open_loopback

    return open_loopback


@pytest.fixture
def asyncsync_workers(asyncsync_no_leaks: None) -> Callable[..., ProcessWorkers]:
    """:func:`asyncsync.testing.open_workers`: ``asyncsync_workers(fn, n, args=..., scheme=...) as
    workers``, spawned processes with ``workers.faults``; and the leak check."""
    from asyncsync.testing import open_workers

    return open_workers
