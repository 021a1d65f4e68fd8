"""Imported by the forkserver the suite starts (tests/conftest.py): every process it forks
writes its stdout and stderr where the pytest process's point at that moment, as a
spawned worker does (it inherits them). During a test that is pytest's capture, so a
worker's output is shown with the test that started it, if that test fails, and never
mixed into the progress of a passing run.

The forkserver itself was started outside any test, on the terminal's descriptors: what
its children would otherwise inherit.
"""

from __future__ import annotations

import os

_PYTEST = os.getppid()  # the forkserver's parent: the pytest process that started it


def _write_where_pytest_writes() -> None:
    for fd in (1, 2):
        try:
            # appending: pytest reads and truncates its capture file between phases
            target = os.open(f"/proc/{_PYTEST}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # gone, or not ours to open: keep the inherited one
        os.dup2(target, fd)
        os.close(target)


os.register_at_fork(after_in_child=_write_where_pytest_writes)
