"""Ray actors as asyncsync workers: Ray places and runs them, asyncsync moves the weights.

:func:`start_workers` starts N Ray async actors on the trainer's node; each runs your async
worker function, the one ``spawn_workers`` takes (``fn(worker_idx, scheme, *args)``),
unchanged, in the actor's event loop. The actor's ``scheme`` is attached to the trainer by
address (:meth:`MultiProcessWeightSyncScheme.attach`): weights travel through asyncsync's
shared memory, never through Ray's object store. Ray does placement and lifecycle only. A
dead actor is named like any dead worker (:class:`WorkerDiedError` for worker *k*), and
:meth:`RayWorkerGroup.join` raises :class:`WorkerProcessError` for an actor that raised or
died. Workers on other nodes use :class:`DistributedWeightSyncScheme` (docs/ray.md).

This module imports without Ray; starting workers needs ``pip install 'asyncsync[ray]'``.

Example::

    import ray
    from asyncsync.ray import start_workers

    async def worker(worker_idx, scheme):          # the quickstart's worker, as is
        scheme.init_on_receiver(worker_idx=worker_idx, model=make_policy())
        async with scheme:
            await scheme.wait_stopped()
        return scheme.version

    ray.init(num_cpus=2)
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=policy, num_workers=2)
    async with start_workers(worker, scheme, num_workers=2) as group:
        async with scheme:                          # waits for both actors to attach
            await scheme.send()
    print(group.results)                            # {0: 1, 1: 1}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Callable, Coroutine, Iterable, Mapping
from types import TracebackType
from typing import Any

import anyio

from ._errors import AsyncSyncError, SyncTimeoutError, WorkerProcessError
from ._local._scheme import MultiProcessWeightSyncScheme
from ._local._workers import exit_group

__all__ = ["RayWorkerGroup", "start_workers"]

logger = logging.getLogger("asyncsync")

START_TIMEOUT = 300.0  # an actor's process may have to start and import torch


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("asyncsync.ray needs Ray: pip install 'asyncsync[ray]' (or pip install 'ray[default]')") from exc
    if not ray.is_initialized():
        raise RuntimeError("call ray.init() (or connect to a cluster) before starting workers")
    return ray


class _WorkerActor:
    """The actor's body (made a Ray actor class on first use, so that this module imports without Ray)."""

    async def ready(self) -> tuple[int, str]:
        import os

        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    async def run(self, fn: Callable[..., Coroutine[Any, Any, Any]], worker_idx: int, address: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        scheme = MultiProcessWeightSyncScheme.attach(address, worker_idx=worker_idx)
        return await fn(worker_idx, scheme, *args, **kwargs)


_actor_class: Any = None


def _actor(ray: Any) -> Any:
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(_WorkerActor)
    return _actor_class


class RayWorkerGroup:
    """Ray actors running one worker function each, attached to a trainer's scheme.

    Made by :func:`start_workers`; use it as ``async with``. ``actors`` maps each worker
    index to its actor handle, ``pids`` to its process id, ``results`` is filled by
    :meth:`join` (the ``async with`` block joins on a clean exit).
    """

    def __init__(
        self,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        scheme: MultiProcessWeightSyncScheme,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        worker_ids: list[int],
        actor_options: Mapping[str, Any],
        join_timeout: float,
        start_timeout: float,
    ) -> None:
        self.fn = fn
        self.scheme = scheme
        self.args = args
        self.kwargs = dict(kwargs)
        self.worker_ids = worker_ids
        self.actor_options = dict(actor_options)
        self.join_timeout = join_timeout
        self.start_timeout = start_timeout
        self.actors: dict[int, Any] = {}
        self.pids: dict[int, int] = {}
        self.results: dict[int, Any] = {}
        self._runs: dict[int, asyncio.Future[Any]] = {}
        self._local_pids: dict[int, int] = {}  # actors on this node: their exit can be awaited
        self._killed: set[int] = set()  # by kill(): named by the scheme, not reported by join()
        self._closed = False

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Listen (if the scheme does not yet), start every actor, wait until each runs."""
        ray = _ray()
        if self.scheme.listener is None:
            await self.scheme.listen()
        for idx in self.worker_ids:
            self._start_one(ray, idx)
        await self._wait_started(self.worker_ids)

    def _options(self, ray: Any) -> dict[str, Any]:
        options = dict(self.actor_options)
        if "scheduling_strategy" not in options:
            # Shared memory and the socket are local: on the trainer's node, not elsewhere.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return options

    def _start_one(self, ray: Any, idx: int) -> None:
        listener = self.scheme.listener
        assert listener is not None
        actor = _actor(ray).options(**self._options(ray)).remote()
        self.actors[idx] = actor
        ref = actor.run.remote(self.fn, idx, str(listener.address), self.args, self.kwargs)
        self._runs[idx] = asyncio.ensure_future(_awaited(ref))
        self._runs[idx].add_done_callback(_retrieve)

    async def _wait_started(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        try:
            pids = await asyncio.wait_for(asyncio.gather(*(_awaited(self.actors[i].ready.remote()) for i in ids)), self.start_timeout)
        except asyncio.TimeoutError:
            raise SyncTimeoutError("waiting for the Ray actors to start", {i: -1 for i in ids}, self.start_timeout) from None
        except Exception as exc:
            raise WorkerProcessError(ids[0], f"a Ray actor failed to start: {type(exc).__name__}: {exc}") from exc
        here = ray_node_id()
        for i, (pid, node) in zip(ids, pids):
            self.pids[i] = pid
            if node == here:
                self._local_pids[i] = pid

    async def __aenter__(self) -> RayWorkerGroup:
        try:
            await self.start()
        except BaseException:
            await self.aclose(grace=0.0)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if await exit_group(self, exc_type) and isinstance(exc, AsyncSyncError) and not isinstance(exc, WorkerProcessError):
            failures = self._failures()
            if failures and hasattr(exc, "add_note"):
                for err in failures:
                    exc.add_note(f"meanwhile, in a Ray actor: {err}")

    # -------------------------------------------------------------- control

    def kill(self, worker_idx: int) -> None:
        """Kill one actor's process (``ray.kill``; for fault-injection tests). The scheme names
        the worker dead; :meth:`join` does not report it."""
        self._killed.add(worker_idx)
        _ray().kill(self.actors[worker_idx], no_restart=True)

    async def restart(self, worker_idx: int, *, timeout: float = 30.0) -> None:
        """Replace worker *worker_idx*'s actor: kill it, wait until the scheme noticed, start a
        new one, and return once it has applied the newest version."""
        ray = _ray()
        self.kill(worker_idx)
        sender = self.scheme.sender
        await sender.wait_dead(worker_idx, timeout=timeout)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(self._runs[worker_idx]), timeout)
        self._killed.discard(worker_idx)
        self._start_one(ray, worker_idx)
        await self._wait_started([worker_idx])
        await sender.wait_joined(worker_idx, timeout=timeout)

    async def join(self, timeout: float | None = None) -> dict[int, Any]:
        """Wait for every actor's function to return; ``{worker_idx: result}``.

        Raises :class:`WorkerProcessError` for the first worker whose function raised or
        whose actor died, :class:`SyncTimeoutError` after *timeout* seconds.
        """
        runs = list(self._runs.values())
        done, pending = await asyncio.wait(runs, timeout=math.inf if timeout is None else timeout) if runs else (set(), set())
        if pending:
            running = {i: -1 for i, f in self._runs.items() if not f.done()}
            raise SyncTimeoutError("joining the Ray workers", running, timeout)
        failures = self._failures()
        if failures:
            raise failures[0]
        self.results = {i: f.result() for i, f in sorted(self._runs.items()) if i not in self._killed}
        return self.results

    def _failures(self) -> list[WorkerProcessError]:
        out = []
        for idx, fut in sorted(self._runs.items()):
            if idx not in self._killed and fut.done() and not fut.cancelled() and fut.exception() is not None:
                exc = fut.exception()
                cause = getattr(exc, "cause", None)  # a RayTaskError carries the function's own exception
                label = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else f"{type(exc).__name__}: {exc}"
                err = WorkerProcessError(idx, label)
                err.__cause__ = exc
                out.append(err)
        return out

    async def aclose(self, grace: float = 2.0) -> None:
        """Give the functions *grace* seconds to return, then kill every actor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        runs = [f for f in self._runs.values() if not f.done()]
        if runs and grace > 0:
            await asyncio.wait(runs, timeout=grace)
        try:
            ray = _ray()
        except (ImportError, RuntimeError):
            return
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with anyio.CancelScope(shield=True):
            await _wait_exited(list(self._local_pids.values()), 10.0)  # ray.kill only asks
        for f in self._runs.values():
            if not f.done():
                f.cancel()


def start_workers(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    scheme: MultiProcessWeightSyncScheme,
    *args: Any,
    num_workers: int | None = None,
    worker_ids: Iterable[int] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    actor_options: Mapping[str, Any] | None = None,
    join_timeout: float = 30.0,
    start_timeout: float = START_TIMEOUT,
) -> RayWorkerGroup:
    """A :class:`RayWorkerGroup` to use as ``async with``: one Ray actor per worker, each
    running ``fn(worker_idx, attached_scheme, *args, **kwargs)`` in its event loop.

    *scheme* is the trainer's, after ``init_on_sender``; it listens (``scheme.listen()``)
    if it does not yet. The workers are *worker_ids* (default: all of the scheme's), or the
    first *num_workers* of them. *actor_options* go to Ray's ``.options()`` (``num_cpus``,
    ``num_gpus``, ``runtime_env``, ...); by default each actor is pinned to the trainer's
    node, where the shared memory is. See the module docstring for an example.
    """
    if not isinstance(scheme, MultiProcessWeightSyncScheme):
        raise TypeError(f"scheme must be the trainer's MultiProcessWeightSyncScheme, got {type(scheme).__name__}")
    ids = list(scheme.sender.worker_ids) if worker_ids is None else list(worker_ids)
    if num_workers is not None:
        if num_workers < 1 or num_workers > len(ids):
            raise ValueError(f"num_workers={num_workers}, but the scheme has workers {ids}")
        ids = ids[:num_workers]
    unknown = sorted(set(ids) - set(scheme.sender.worker_ids))
    if unknown:
        raise ValueError(f"workers {unknown} are not the scheme's workers {list(scheme.sender.worker_ids)}")
    return RayWorkerGroup(fn, scheme, args, kwargs or {}, ids, actor_options or {}, join_timeout, start_timeout)


def ray_node_id() -> str:
    return str(_ray().get_runtime_context().get_node_id())


async def _wait_exited(pids: list[int], timeout: float) -> None:
    """Until each process of *pids* (on this host) has exited, for at most *timeout* seconds."""
    with anyio.move_on_after(timeout):
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except (ProcessLookupError, OSError):
                continue  # gone already
            try:
                await anyio.wait_readable(fd)
            finally:
                os.close(fd)


async def _awaited(ref: Any) -> Any:
    return await ref


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
