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
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import pickle
import sys
import traceback
from collections.abc import Callable, Coroutine, Iterable, Mapping
from types import TracebackType
from typing import Any

import aiomultiprocess
import anyio
from aiomultiprocess.types import Unit

from ._errors import BrokenChannelError, SyncTimeoutError, WorkerProcessError
from ._queues import AsyncQueue

__all__ = ["WorkerGroup", "spawn_workers"]


class _Process(aiomultiprocess.Process):  # type: ignore[misc]
    """aiomultiprocess's Process without its manager server process.

    ``aiomultiprocess.Process.__init__`` starts a ``multiprocessing`` manager (one more
    process, which outlives a killed parent) only to hold a result namespace; results and
    errors travel over our own pipe instead. The child side is aiomultiprocess's own
    ``run_async`` (a fresh event loop running the coroutine).
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
        self.aio_process = ctx.Process(target=aiomultiprocess.Process.run_async, args=(self.unit,), name=name, daemon=daemon)  # type: ignore[attr-defined]


async def _child_entry(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    worker_idx: int,
    conn: Any,
    lifeline: Any,
    orphan_grace: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
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
        result = main.result()
    except BaseException as exc:  # report over our own channel, then exit non-zero
        tb = traceback.format_exc()
        _report(conn, ("error", exc, tb), ("error", None, tb))
        sys.stderr.flush()
        raise SystemExit(1) from None
    _report(conn, ("ok", result, ""), ("error", None, f"result of worker {worker_idx} cannot be pickled"))


async def _wait_eof(conn: Any) -> None:
    try:
        await AsyncQueue(conn).get()
    except BrokenChannelError:
        pass


def _report(conn: Any, message: tuple[Any, ...], fallback: tuple[Any, ...]) -> None:
    try:
        try:
            conn.send(message)
        except (pickle.PicklingError, TypeError, AttributeError):
            conn.send(fallback)
    except OSError:
        pass  # the parent is gone
    conn.close()


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
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError("fn must be an async function taking worker_idx first")
        if worker_ids is None:
            if num_workers is None:
                raise ValueError("pass num_workers or worker_ids")
            worker_ids = range(num_workers)
        self.fn = fn
        self.worker_ids = list(worker_ids)
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.scheme = scheme
        self.join_timeout = join_timeout
        self.daemon = daemon  # daemonic workers cannot start processes of their own
        self.orphan_grace = orphan_grace
        self.loop_factory = loop_factory if loop_factory is not None else _caller_loop_factory()
        self.ctx = ctx if ctx is not None else mp.get_context("spawn")
        if self.ctx.get_start_method() != "spawn":
            raise ValueError("asyncsync workers need the 'spawn' start method")
        self.processes: dict[int, aiomultiprocess.Process] = {}
        self.results: dict[int, Any] = {}
        self._outcomes: dict[int, tuple[str, Any, str]] = {}
        self._results: dict[int, AsyncQueue[Any]] = {}
        self._lifelines: dict[int, Any] = {}
        self._closed = False

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Spawn every worker (``async with`` does this)."""
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
        if self.scheme is not None and getattr(self.scheme, "_sender", None) is not None:
            self.scheme.watch_process(idx, proc.aio_process)

    async def __aenter__(self) -> WorkerGroup:
        self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None and not self._closed:
            try:
                await self.join(timeout=self.join_timeout)
            finally:
                await self.aclose()
        else:
            await self.aclose(grace=0.0 if exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, asyncio.CancelledError)) else 2.0)

    # -------------------------------------------------------------- control

    def kill(self, worker_idx: int) -> None:
        """SIGKILL one worker (for fault-injection tests and soak runs)."""
        self.processes[worker_idx].kill()

    async def restart(self, worker_idx: int, *, timeout: float = 10.0) -> None:
        """Replace a dead worker: wait until the scheme noticed, then spawn a new one.

        The new process receives the scheme with a fresh channel for ``worker_idx``
        and gets the latest weights when it connects; the other workers are untouched.
        With a scheme, returns once the replacement has applied those weights.
        """
        old = self.processes[worker_idx]
        if old.is_alive():
            old.kill()
        await self._wait_exit(worker_idx, timeout)
        if self.scheme is not None and getattr(self.scheme, "_sender", None) is not None:
            await self.scheme.sender.wait_dead(worker_idx, timeout=timeout)
        await self._results[worker_idx].aclose()
        old.close()
        self._start_one(worker_idx)
        if self.scheme is not None and getattr(self.scheme, "_sender", None) is not None:
            await self.scheme.sender.wait_joined(worker_idx, timeout=timeout + 30.0)

    async def _wait_exit(self, idx: int, timeout: float | None) -> bool:
        proc = self.processes[idx]
        with anyio.move_on_after(math.inf if timeout is None else timeout):
            while proc.exitcode is None:
                await anyio.wait_readable(proc.aio_process.sentinel)
                proc.aio_process.join(0)
            return True
        return False

    async def join(self, timeout: float | None = None) -> dict[int, Any]:
        """Wait for every worker to finish; return ``{worker_idx: result}``.

        Raises :class:`WorkerProcessError` for the first worker that raised or crashed.
        """
        try:
            with anyio.fail_after(math.inf if timeout is None else timeout):
                async with anyio.create_task_group() as tg:
                    for idx in list(self.processes):
                        tg.start_soon(self._collect, idx)
        except TimeoutError:
            running = {i: -1 for i, p in self.processes.items() if p.exitcode is None}
            raise SyncTimeoutError("joining workers", running, timeout) from None
        outcomes = self._reported()
        for idx in sorted(outcomes):
            status, value, tb = outcomes[idx]
            if status != "ok":
                err = WorkerProcessError(idx, str(value) if value is not None else tb.strip().splitlines()[-1] if tb else "failed", tb)
                if isinstance(value, BaseException):
                    raise err from value
                raise err
        self.results = {i: outcomes[i][1] for i in sorted(outcomes)}
        return self.results

    def _reported(self) -> dict[int, tuple[str, Any, str]]:
        """The outcomes :meth:`join` reports: all (``asyncsync.testing`` leaves out the workers it killed)."""
        return self._outcomes

    async def _collect(self, idx: int) -> None:
        if idx in self._outcomes:
            return
        queue = self._results[idx]
        try:
            self._outcomes[idx] = await queue.get()
        except BrokenChannelError:
            await self._wait_exit(idx, 5.0)
            code = self.processes[idx].exitcode
            self._outcomes[idx] = ("error", None, f"process exited with code {code} without a result")
            return
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
            for q in self._results.values():
                await q.aclose()
            for lifeline in self._lifelines.values():
                lifeline.close()
            for p in self.processes.values():
                try:
                    p.close()
                except ValueError:
                    pass


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
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> WorkerGroup:
    """A :class:`WorkerGroup` to use as ``async with``; see the module docstring.

    With *scheme* (initialised on the sender), each process is registered with it so a
    worker's death is noticed at once through its process sentinel. If the parent dies,
    each worker's function gets *orphan_grace* seconds to end (a scheme's receiver raises
    :class:`SenderDiedError` at once), then it is cancelled and the process exits.
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
        fn,
        num_workers,
        worker_ids=worker_ids,
        args=args,
        kwargs=kwargs,
        scheme=scheme,
        join_timeout=join_timeout,
        daemon=daemon,
        orphan_grace=orphan_grace,
        loop_factory=loop_factory,
    )

