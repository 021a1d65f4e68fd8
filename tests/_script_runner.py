"""Run example scripts one after another in this one interpreter, each as ``python
script.py`` would: as ``__main__`` from its own file (``runpy.run_path``), so the workers it
spawns import their function from that file. torch and the forkserver start once for all
of them instead of once per script (most of a script's time).

``python -m tests._script_runner --timeout S FD SCRIPT...``: after each script, one JSON
line ``{"path", "ok", "error", "stdout"}`` on the inherited descriptor *FD* (what the
script printed is in ``stdout``; what its workers print goes to the runner's own output).
A script fails if it raises (``SystemExit`` with a non-zero code included) or leaves a
child process running when it returns (``asyncsync.testing.no_leaks``). A script running
past *S* seconds ends the runner, leaving the rest unrun: its line says so, with every
thread's stack.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import os
import runpy
import sys
import tempfile
import threading
import traceback
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results", type=int)
    p.add_argument("scripts", nargs="+")
    p.add_argument("--timeout", type=float, required=True)
    args = p.parse_args()
    from asyncsync.testing import no_leaks

    with open(args.results, "a", buffering=1) as results:

        def report(path: str, ok: bool, error: str, stdout: str) -> None:
            results.write(json.dumps({"path": path, "ok": ok, "error": error, "stdout": stdout}) + "\n")

        for path in args.scripts:
            done = threading.Event()
            watchdog = threading.Thread(target=_watch, args=(done, path, args.timeout, report), daemon=True)
            watchdog.start()
            out = io.StringIO()
            error = ""
            try:
                with no_leaks(descriptors=False), contextlib.redirect_stdout(out):
                    runpy.run_path(path, run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    error = f"exited with {exc.code!r}"
            except BaseException:
                error = traceback.format_exc()
            done.set()
            watchdog.join()
            report(path, not error, error, out.getvalue())


def _watch(done: threading.Event, path: str, timeout: float, report: object) -> None:
    if done.wait(timeout):
        return
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f)
        f.seek(0)
        stacks = f.read()
    report(path, False, f"ran past {timeout} s; every thread's stack:\n{stacks}", "")  # type: ignore[operator]
    os._exit(1)  # its workers are killed with the runner's session


def run_here(script: str | Path, *args: str) -> None:
    """Run *script* in this process as ``python script args...`` would: as ``__main__`` from
    its own file, with that command line in ``sys.argv`` (the workers it starts import their
    function from that file). Raises if it exits with a non-zero code."""
    argv = sys.argv[:]
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise AssertionError(f"{script} exited with {exc.code!r}") from exc
    finally:
        sys.argv = argv


if __name__ == "__main__":
    main()
