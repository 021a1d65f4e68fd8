"""Start async worker functions in spawned child processes (on aiomultiprocess).

Example::

    async def worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
        scheme.init_on_receiver(worker_idx=worker_idx, model=make_model())
        async with scheme:
            await scheme.wait_stopped()
        return scheme.version

    async with spawn_workers(worker, 2, args=(scheme,), scheme=scheme) as workers:
        async with scheme:
            await scheme.send()
    print(workers.results)        # {0: 1, 1: 1}

A worker's exception is raised in the parent as :class:`WorkerProcessError` (with the
original exception as ``__cause__`` when it pickles); on exit every child is joined
with a deadline, then terminated, then killed: no child survives the block, and no
child outlives a parent that was killed (see ``orphan_grace``). No manager process is
started (aiomultiprocess's ``Process`` starts one; ours passes results over a pipe).

Start methods: ``spawn`` (the default: each worker is a fresh interpreter, which imports
torch itself: seconds) or ``forkserver`` (``start_method="forkserver"``, or the
``ASYNCSYNC_START_METHOD`` environment variable): one server process imports torch,
tensordict and asyncsync once, and each worker is forked from it, ready in a fraction of
a second. Neither copies the trainer's state into a worker. Progress is logged on the
``asyncsync`` logger at INFO (``logging.basicConfig(level=logging.INFO)`` shows it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Coroutine, Iterable, Mapping
from types import TracebackType
from typing import Any

import aiomultiprocess
import anyio
from aiomultiprocess.types import Unit

from ._errors import BrokenChannelError, ClosedError, SyncTimeoutError, WorkerDiedError, WorkerProcessError, WouldBlock
from ._io._queues import AsyncQueue
from ._schemes._local import MultiProcessWeightSyncScheme

__all__ = ["WorkerGroup", "spawn_workers"]

logger = logging.getLogger("asyncsync")

START_METHODS = ("spawn", "forkserver")
# What a forkserver imports once, so that the workers forked from it need not.
FORKSERVER_PRELOAD = ("torch", "tensordict", "asyncsync")
# How long a worker may take to start (import its modules, unpickle its arguments).
START_TIMEOUT = 600.0
_PROGRESS_EVERY = 2.0  # seconds between progress lines while worker processes start


def _context(ctx: mp.context.BaseContext | None, start_method: str | None) -> mp.context.BaseContext:
    """The multiprocessing context for workers: *ctx*, else *start_method*, else
    ``$ASYNCSYNC_START_METHOD``, else spawn."""
    if ctx is not None:
        if start_method is not None:
            raise ValueError("pass ctx or start_method, not both")
        if ctx.get_start_method() not in START_METHODS:
            raise ValueError(f"asyncsync workers need the 'spawn' or 'forkserver' start method, not {ctx.get_start_method()!r}")
        return ctx
    env = os.environ.get("ASYNCSYNC_START_METHOD") if start_method is None else None
    method = start_method or env or "spawn"
    if method not in START_METHODS:
        origin = " (from $ASYNCSYNC_START_METHOD)" if env else ""
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', not {method!r}{origin}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # in force when the server starts
    return ctx


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text (its ``__cause__``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\"\"\"\n" + self.tb.rstrip() + "\n\"\"\""


class _Process(aiomultiprocess.Process):  # type: ignore[misc]
    """aiomultiprocess's Process without its manager server process.

    ``aiomultiprocess.Process.__init__`` starts a ``multiprocessing`` manager (one more
    process, which outlives a killed parent) only to hold a result namespace; results and
    errors travel over our own pipe instead. The child side is :func:`_run_child`.
    """

    def __init__(
        self,
        ctx: mp.context.BaseContext,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        name: str,
        daemon: bool,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:
        self.unit = Unit(target=target, args=args, kwargs={}, namespace=None, loop_initializer=loop_factory)
        self.aio_process = ctx.Process(target=_run_child, args=(self.unit,), name=name, daemon=daemon)  # type: ignore[attr-defined]


def _run_child(unit: Unit) -> None:
    """A worker process's target: a fresh event loop (``unit.loop_initializer``'s, or
    asyncio's) running :func:`_child_entry`.

    A function that raised exits with code 1 and no traceback of ours on stderr: the
    parent gets the function's own exception and traceback over the result pipe.
    """
    loop = unit.loop_initializer() if unit.loop_initializer is not None else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    if loop.run_until_complete(unit.target(*unit.args, **unit.kwargs)):
        sys.exit(1)


async def _child_entry(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    worker_idx: int,
    conn: Any,
    lifeline: Any,
    orphan_grace: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bool:
    """Run the worker function; report its start, then its result or error. True: it failed."""
    # The function and its arguments are unpickled (their modules imported): say so.
    _send(conn, ("started", os.getpid()))
    main = asyncio.ensure_future(fn(worker_idx, *args, **kwargs))
    parent_gone = asyncio.ensure_future(_wait_eof(lifeline))
    await asyncio.wait({main, parent_gone}, return_when=asyncio.FIRST_COMPLETED)
    if not main.done():
        # The parent died: let the function end by itself (a scheme's receiver raises
        # SenderDiedError), then cancel it; no orphan outlives its parent for long.
        await asyncio.wait({main}, timeout=orphan_grace)
        main.cancel()
        await asyncio.wait({main})
    parent_gone.cancel()
    await asyncio.wait({parent_gone})
    lifeline.close()
    try:
        exc = main.exception()
    except asyncio.CancelledError as cancelled:
        exc = cancelled
    if exc is not None:  # report over our own channel, then exit non-zero
        _send(conn, _error_report(exc))
        conn.close()
        return True
    result = main.result()
    if not _send(conn, ("ok", result)):
        _send(conn, ("error", None, "", "", f"the result of worker {worker_idx} cannot be pickled"))
    conn.close()
    return False


def _error_report(exc: BaseException) -> tuple[str, bytes | None, str, str, str]:
    """``("error", pickled exception or None, formatted traceback, type name, message)``."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload: bytes | None = pickle.dumps(exc)
        pickle.loads(payload)  # an exception whose __init__ takes other arguments does not load
    except Exception:
        payload = None
    return ("error", payload, tb, type(exc).__qualname__, str(exc))


async def _wait_eof(conn: Any) -> None:
    try:
        await AsyncQueue(conn).get()
    except BrokenChannelError:
        pass


def _send(conn: Any, message: tuple[Any, ...]) -> bool:
    """Send *message* to the parent; False if it does not pickle (the parent being gone is fine).

    By value, with the plain pickler: ``Connection.send`` pickles with multiprocessing's
    ``ForkingPickler``, for which torch shares a tensor's storage by descriptor or shared
    memory, served by this process: gone once it exits, which a result outlives (the
    parent would fail to unpickle ``return model.state_dict()``).
    """
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return False
    try:
        conn.send_bytes(data)
    except OSError:
        pass  # the parent is gone
    return True


class WorkerGroup:
    """N spawned processes each running ``await fn(worker_idx, *args, **kwargs)``.

    Example (a script; replacing a worker that was killed)::

        import asyncio

        import torch
        from torch import nn

        from asyncsync import MultiProcessWeightSyncScheme, spawn_workers


        async def worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
            scheme.init_on_receiver(worker_idx=worker_idx, model=nn.Linear(4, 2))
            async with scheme:                 # the receiver task runs in this loop
                await scheme.wait_stopped()    # until the trainer closes the scheme
            return scheme.version


        async def main() -> None:
            policy = nn.Linear(4, 2)
            scheme = MultiProcessWeightSyncScheme(timeout=30, on_worker_error="skip")
            scheme.init_on_sender(model=policy, num_workers=2)
            async with spawn_workers(worker, 2, args=(scheme,), scheme=scheme) as group:
                async with scheme:
                    group.kill(1)              # SIGKILL, e.g. a fault-injection test
                    await scheme.send()        # "skip": worker 0 gets version 1
                    await group.restart(1)     # a new process; it applied version 1
                    await scheme.send()        # both get version 2
                results = await group.join()
            print(results)                     # {0: 2, 1: 2}


        if __name__ == "__main__":
            asyncio.run(main())
    """

    def __init__(
        self,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        num_workers: int | None = None,
        *,
        worker_ids: Iterable[int] | None = None,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        scheme: Any = None,
        join_timeout: float = 30.0,
        daemon: bool = False,
        orphan_grace: float = 5.0,
        ctx: mp.context.BaseContext | None = None,
        start_method: str | None = None,
        start_timeout: float = START_TIMEOUT,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError("fn must be an async function taking worker_idx first")
        _check_importable(fn)
        if worker_ids is None:
            if num_workers is None:
                raise ValueError("pass num_workers or worker_ids")
            worker_ids = range(num_workers)
        self.fn = fn
        self.worker_ids = list(worker_ids)
        _check_scheme_has(scheme, self.worker_ids)
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.scheme = scheme
        self.join_timeout = join_timeout
        self.daemon = daemon  # daemonic workers cannot start processes of their own
        self.orphan_grace = orphan_grace
        self.start_timeout = start_timeout
        self.ctx = _context(ctx, start_method)
        self.loop_factory = loop_factory if loop_factory is not None else _caller_loop_factory()
        self.processes: dict[int, aiomultiprocess.Process] = {}
        self.results: dict[int, Any] = {}
        self._outcomes: dict[int, _Outcome] = {}
        self._started: set[int] = set()
        self._results: dict[int, AsyncQueue[Any]] = {}
        self._lifelines: dict[int, Any] = {}
        self._closed = False
        self._restarting: dict[int, asyncio.Lock] = {}  # one restart of a worker at a time
        self._restarted: dict[int, int] = {}  # restarts of each worker that succeeded

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start every worker (``async with`` does this, then waits for :meth:`wait_started`)."""
        n = len(self.worker_ids)
        logger.info("asyncsync: starting %d worker%s (%s)...", n, "" if n == 1 else "s", self.ctx.get_start_method())
        self._t_start = time.monotonic()
        for i in self.worker_ids:
            self._start_one(i)

    def _start_one(self, idx: int) -> None:
        results_r, results_w = self.ctx.Pipe(duplex=False)
        # The child waits for EOF on this pipe: it means the parent is gone.
        lifeline_r, lifeline_w = self.ctx.Pipe(duplex=False)
        proc = _Process(
            self.ctx,
            _child_entry,
            (self.fn, idx, results_w, lifeline_r, self.orphan_grace, self.args, self.kwargs),
            name=f"asyncsync-worker-{idx}",
            daemon=self.daemon,
            loop_factory=self.loop_factory,
        )
        try:
            proc.start()
        except BaseException:
            results_r.close()  # (it never started: nothing of it is kept)
            lifeline_w.close()
            raise
        finally:
            results_w.close()
            lifeline_r.close()
        self.processes[idx] = proc
        self._results[idx] = AsyncQueue(results_r)
        old = self._lifelines.pop(idx, None)
        if old is not None:
            old.close()
        self._lifelines[idx] = lifeline_w
        self._outcomes.pop(idx, None)
        self._started.discard(idx)
        if self.scheme is not None and getattr(self.scheme, "_sender", None) is not None:
            self.scheme.watch_process(idx, proc.aio_process)

    async def wait_started(self, timeout: float | None = START_TIMEOUT) -> None:
        """Wait until every worker process runs its function (its imports done).

        ``async with`` calls it (with ``start_timeout``), so that a scheme's ``connect``
        timeout counts from there: starting a process is mostly importing torch, seconds,
        more on a busy machine. Raises :class:`WorkerProcessError` if a process exits
        before it started, :class:`SyncTimeoutError` after *timeout* seconds.
        """
        t0 = time.monotonic()
        since = getattr(self, "_t_start", t0)
        n = len(self.processes)
        waits = [asyncio.ensure_future(self._wait_started_one(idx)) for idx in self.processes]
        deadline = None if timeout is None else t0 + timeout
        try:
            while True:
                # A line every few seconds while processes import torch: a long start is no hang.
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                step = _PROGRESS_EVERY if left is None else min(_PROGRESS_EVERY, left)
                done, pending = await asyncio.wait(waits, timeout=step, return_when=asyncio.FIRST_EXCEPTION)
                if not pending or any(w.exception() is not None for w in done) or (left is not None and left <= step):
                    break
                logger.info("asyncsync: %d/%d worker%s started, %.0f s...", n - len(pending), n, "" if n == 1 else "s", time.monotonic() - since)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.wait(waits)
        for w in done:
            if w.exception() is not None:
                raise w.exception()  # type: ignore[misc]
        if len(done) < len(waits):
            waiting = {i: -1 for i in self.processes if i not in self._started}
            raise SyncTimeoutError("waiting for worker processes to start", waiting, timeout)
        logger.info("asyncsync: %d/%d worker%s started in %.1f s", n, n, "" if n == 1 else "s", time.monotonic() - since)

    async def _wait_started_one(self, idx: int) -> None:
        while idx not in self._started:
            if idx in self._outcomes:  # it ended before it started
                raise self._error(idx, self._outcomes[idx])
            await self._receive(idx)

    async def _receive(self, idx: int) -> None:
        """Take the next message from worker *idx* (blocking); record its start or its outcome."""
        try:
            message = await self._results[idx].get()
        except BrokenChannelError:
            await self._wait_exit(idx, 5.0)
            code = self.processes[idx].exitcode
            when = "without a result" if idx in self._started else "before it started (see its stderr)"
            self._outcomes[idx] = _Outcome(None, f"the process exited with code {code} {when}")
            return
        self._take(idx, message)

    def _take(self, idx: int, message: tuple[Any, ...]) -> None:
        if message[0] == "started":
            self._started.add(idx)
        elif message[0] == "ok":
            self._started.add(idx)
            self._outcomes[idx] = _Outcome(message[1])
        else:
            _, payload, tb, type_name, text = message
            exc = None
            if payload is not None:
                try:
                    exc = pickle.loads(payload)
                except Exception:  # a class the parent cannot import
                    exc = None
            label = f"{type_name}: {text}" if type_name else text
            self._started.add(idx)
            self._outcomes[idx] = _Outcome(None, label, tb, exc)

    def _drain(self) -> None:
        """Take, without waiting, whatever each worker already reported."""
        for idx, queue in self._results.items():
            while idx not in self._outcomes:
                try:
                    self._take(idx, queue.get_nowait())
                except (WouldBlock, BrokenChannelError):
                    break
                except Exception:  # a result that does not unpickle here
                    break

    async def __aenter__(self) -> WorkerGroup:
        try:
            self.start()  # (a worker whose arguments do not pickle fails here: the others go too)
            await self.wait_started(self.start_timeout)
        except BaseException:
            await self.aclose(grace=0.0)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not await exit_group(self, exc_type) or exc is None:
            return
        failures = self._failures()
        if not failures:
            return
        cut_off = type(exc) is WorkerDiedError and exc.reason is not None  # by the trainer: its reason is the news
        if isinstance(exc, BrokenChannelError) and not isinstance(exc, WorkerProcessError) and not cut_off:
            # The block failed because a worker's channel broke (it died, so a send failed):
            # that worker's own error is what the user needs to see. Only the worker the
            # trainer's error names: another's failed only because the block ended, and any
            # other error of the trainer (its own mistake, a timeout) is the trainer's to see.
            named = getattr(exc, "worker_idx", None)
            err = next((f for f in failures if f.worker_idx == named), None)
            if err is not None:
                if hasattr(err, "add_note"):
                    err.add_note(f"(the trainer saw: {type(exc).__name__}: {exc})")
                raise err
        if hasattr(exc, "add_note"):  # Python 3.11+
            for err in failures:
                exc.add_note(f"meanwhile, in a worker process: {err}")

    def _failures(self) -> list[WorkerProcessError]:
        """A :class:`WorkerProcessError` for each worker that reported an error (in worker order),
        its ``__cause__`` set."""
        out = []
        for idx, outcome in sorted(self._reported().items()):
            if not outcome.ok:
                out.append(self._error(idx, outcome))
        return out

    def _error(self, idx: int, outcome: _Outcome) -> WorkerProcessError:
        err = WorkerProcessError(idx, outcome.label, outcome.tb)
        cause: BaseException | None = outcome.exc
        if outcome.tb:
            remote = _RemoteTraceback(outcome.tb)
            if cause is None:
                cause = remote
            else:
                cause.__cause__ = remote
        err.__cause__ = cause
        return err

    # -------------------------------------------------------------- control

    def _process(self, worker_idx: int, what: str) -> aiomultiprocess.Process:
        """The process of *worker_idx*, for *what* (a method's name): a ValueError names an
        index that is not one of the group's, a ClosedError a group already closed."""
        if worker_idx not in self.worker_ids:
            raise ValueError(f"{what}: no worker {worker_idx!r} in this group; its workers: {', '.join(map(str, self.worker_ids))}")
        if self._closed:
            raise ClosedError(f"{what}({worker_idx!r}): the worker group is closed")
        if worker_idx not in self.processes:
            raise RuntimeError(f"{what}({worker_idx!r}): the worker group has not started (use async with, or start())")
        return self.processes[worker_idx]

    def kill(self, worker_idx: int) -> None:
        """SIGKILL one worker (for fault-injection tests and soak runs)."""
        self._process(worker_idx, "kill").kill()

    async def restart(self, worker_idx: int, *, timeout: float = 10.0) -> None:
        """Replace a dead worker: wait until the scheme noticed, then spawn a new one.

        The new process receives the scheme with a fresh channel for ``worker_idx``
        and gets the latest weights when it connects; the other workers are untouched.
        With a scheme, returns once the replacement has applied those weights (*timeout*
        bounds each wait after the process started; starting is bounded by ``start_timeout``):
        :class:`SyncTimeoutError` naming the worker when the replacement does not connect in
        time. Raises ``ValueError`` for an index that is not one of the group's,
        :class:`ClosedError` once the group is closed.

        A restart of a worker that another task is restarting waits for that one and
        returns with it, replacing nothing more (two tasks that each saw the worker die
        get one replacement); if that one failed, this one restarts the worker itself.
        """
        self._process(worker_idx, "restart")
        lock = self._restarting.setdefault(worker_idx, asyncio.Lock())
        before = self._restarted.get(worker_idx, 0)
        async with lock:
            if self._restarted.get(worker_idx, 0) != before:
                return  # replaced by the restart this one waited for
            await self._replace(worker_idx, timeout)
            self._restarted[worker_idx] = before + 1

    async def _replace(self, worker_idx: int, timeout: float) -> None:
        old = self._process(worker_idx, "restart")
        if old.is_alive():
            old.kill()
        await self._wait_exit(worker_idx, timeout)
        if self.scheme is not None and getattr(self.scheme, "_sender", None) is not None:
            await self.scheme.sender.wait_dead(worker_idx, timeout=timeout)
        await self._results[worker_idx].aclose()
        old.close()
        self._start_one(worker_idx)
        try:
            with anyio.fail_after(self.start_timeout):
                await self._wait_started_one(worker_idx)
        except TimeoutError:
            raise SyncTimeoutError(f"waiting for worker {worker_idx}'s new process to start", {worker_idx: -1}, self.start_timeout) from None
        if self.scheme is not None and getattr(self.scheme, "_sender", None) is not None:
            await self.scheme.sender.wait_joined(worker_idx, timeout=timeout)

    async def _wait_exit(self, idx: int, timeout: float | None) -> bool:
        proc = self.processes[idx]
        with anyio.move_on_after(math.inf if timeout is None else timeout):
            while proc.exitcode is None:
                await _readable(proc.aio_process.sentinel)
                proc.aio_process.join(0)
            return True
        return False

    async def join(self, timeout: float | None = None) -> dict[int, Any]:
        """Wait for every worker to finish; return ``{worker_idx: result}``.

        Raises :class:`WorkerProcessError` for the first worker that raised or crashed:
        its message names the worker's exception type and message, its ``__cause__`` is that
        exception (when it pickles), whose own cause holds the worker's traceback.
        """
        try:
            with anyio.fail_after(math.inf if timeout is None else timeout):
                async with anyio.create_task_group() as tg:
                    for idx in list(self.processes):
                        tg.start_soon(self._collect, idx)
        except TimeoutError:
            running = {i: -1 for i, p in self.processes.items() if p.exitcode is None}
            raise SyncTimeoutError("joining workers", running, timeout) from None
        failures = self._failures()
        if failures:
            raise failures[0]
        self.results = {i: o.value for i, o in sorted(self._reported().items())}
        return self.results

    def _reported(self) -> dict[int, _Outcome]:
        """The outcomes :meth:`join` reports: all (``asyncsync.testing`` leaves out the workers it killed)."""
        return self._outcomes

    async def _collect(self, idx: int) -> None:
        while idx not in self._outcomes:
            await self._receive(idx)
        await self._wait_exit(idx, 5.0)

    async def aclose(self, grace: float = 2.0) -> None:
        """Join every child for *grace* seconds, then terminate, then kill. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for idx in list(self.processes):
                if not await self._wait_exit(idx, grace):
                    self.processes[idx].terminate()
                    if not await self._wait_exit(idx, 2.0):
                        self.processes[idx].kill()
                        await self._wait_exit(idx, 5.0)
            self._drain()  # what they reported before they ended: __aexit__ raises it
            for q in self._results.values():
                await q.aclose()
            for lifeline in self._lifelines.values():
                lifeline.close()
            for p in self.processes.values():
                try:
                    p.close()
                except ValueError:
                    pass


def _check_importable(fn: Callable[..., Any]) -> None:
    """A worker process imports *fn* by name (spawn and forkserver pickle it by reference):
    refuse one defined inside another function, naming it, before any process starts."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname:
        raise TypeError(
            f"the worker function {qualname!r} is defined inside another function: worker processes import it "
            f"by name, so define it at the top level of a module (here {getattr(fn, '__module__', '?')!r})"
        )


async def _readable(fd: int) -> None:
    """Until *fd* is readable, waiting on a duplicate of it: anyio takes one waiter per
    descriptor, and a restart, ``join`` and ``aclose`` may wait for one process together."""
    own = os.dup(fd)
    try:
        await anyio.wait_readable(own)
    finally:
        os.close(own)


def _check_scheme_has(scheme: Any, worker_ids: list[int]) -> None:
    """Before any process starts: every worker to start must be one of *scheme*'s (a scheme
    has one channel per worker id it was given at ``init_on_sender``)."""
    if not isinstance(scheme, MultiProcessWeightSyncScheme) or scheme._sender is None:
        return
    known = scheme._sender.worker_ids
    extra = [i for i in worker_ids if i not in known]
    if extra:
        listed = ", ".join(map(str, sorted(known)))
        raise ValueError(
            f"worker{'s' if len(extra) > 1 else ''} {', '.join(map(str, extra))} to start, but the scheme has workers {listed} "
            f"(init_on_sender gave it {len(known)}): start at most those, or give init_on_sender more"
        )


class _Outcome:
    """How one worker process ended: ``ok`` with *value*, or an error (*label*, *tb*, *exc*)."""

    def __init__(self, value: Any, label: str | None = None, tb: str = "", exc: BaseException | None = None) -> None:
        self.ok = label is None
        self.value = value
        self.label = label or ""
        self.tb = tb
        self.exc = exc


async def exit_group(group: Any, exc_type: type[BaseException] | None) -> bool:
    """The common start of a worker group's ``__aexit__``: after a clean block, join the
    workers, then close; otherwise close (at once if interrupted). True if the block raised
    an error the group may add its workers' failures to (not an interruption)."""
    if exc_type is None and not group._closed:
        try:
            await group.join(timeout=group.join_timeout)
        finally:
            await group.aclose()
        return False
    interrupted = exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, asyncio.CancelledError))
    await group.aclose(grace=0.0 if interrupted else 2.0)
    return exc_type is not None and not interrupted


def _caller_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory if the calling code runs on uvloop, else None (asyncio's)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    if type(loop).__module__.split(".")[0] == "uvloop":
        import uvloop

        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return None


def spawn_workers(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    num_workers: int | None = None,
    *,
    worker_ids: Iterable[int] | None = None,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    scheme: Any = None,
    join_timeout: float = 30.0,
    daemon: bool = False,
    orphan_grace: float = 5.0,
    start_method: str | None = None,
    start_timeout: float = START_TIMEOUT,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> WorkerGroup:
    """A :class:`WorkerGroup` to use as ``async with``; see the module docstring.

    With *scheme* (initialised on the sender), each process is registered with it so a
    worker's death is noticed at once through its process sentinel. If the parent dies,
    each worker's function gets *orphan_grace* seconds to end (a scheme's receiver raises
    :class:`SenderDiedError` at once), then it is cancelled and the process exits.
    *start_method* is ``"spawn"`` (default; or ``$ASYNCSYNC_START_METHOD``) or ``"forkserver"``
    (workers forked from a server that imported torch, tensordict and asyncsync once: much
    faster to start). ``async with`` returns once every process runs *fn*, within
    *start_timeout* seconds; a worker that raises is reported as :class:`WorkerProcessError`
    with its exception's type, message and traceback, also when the block fails because
    that worker died; when the block fails for any other reason, its own error leaves the
    block, each worker's failure added to it as a note (Python 3.11+).
    Each worker runs *fn* on a fresh event loop made by *loop_factory* (it must pickle,
    e.g. ``uvloop.new_event_loop``); by default, the kind of loop ``spawn_workers`` is
    called from: uvloop's under uvloop, else asyncio's.

    Example (a script: spawned workers import their function from it)::

        import asyncio, torch
        from asyncsync import MultiProcessWeightSyncScheme, spawn_workers

        async def worker(worker_idx, scheme):
            scheme.init_on_receiver(worker_idx=worker_idx, model=torch.nn.Linear(4, 2))
            async with scheme:                 # a receiver task in this process's event loop
                await scheme.wait_stopped()    # ...or serve requests: updates land between awaits
            return scheme.version

        async def main():
            policy = torch.nn.Linear(4, 2)
            scheme = MultiProcessWeightSyncScheme(strategy="tensordict", sync=True)
            scheme.init_on_sender(model=policy, num_workers=2)
            async with spawn_workers(worker, 2, args=(scheme,), scheme=scheme) as workers:
                async with scheme:             # initial weights to every worker
                    for step in range(10):
                        policy.weight.data.add_(0.01)  # stands in for a training step
                        await scheme.send()    # returns once both workers applied this version
            print(workers.results)             # {0: 10, 1: 10}

        if __name__ == "__main__":
            asyncio.run(main())
    """
    return WorkerGroup(
        fn, num_workers, worker_ids=worker_ids, args=args, kwargs=kwargs, scheme=scheme, join_timeout=join_timeout,
        daemon=daemon, orphan_grace=orphan_grace, start_method=start_method, start_timeout=start_timeout,
        loop_factory=loop_factory,
    )  # fmt: skip

