"""Helpers for testing code that uses asyncsync: loopback workers, real worker processes,
fault injection and a leak check. The pytest plugin (``asyncsync_loopback``,
``asyncsync_workers``, ``asyncsync_no_leaks`` fixtures) is a thin layer over them; see
docs/testing.md.

Example (pytest-asyncio; ``make_policy`` and ``train_step`` are yours)::

    from asyncsync import MultiProcessWeightSyncScheme, WorkerError

    async def test_my_loop_survives_a_rejected_update(asyncsync_loopback):
        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=2)
        async with asyncsync_loopback(scheme, make_policy) as lb:
            async with lb.faults.reject(1, "corrupt"):
                with pytest.raises(WorkerError, match="worker 1 rejected version 1: corrupt"):
                    await scheme.send()
            await scheme.send()          # worker 1 takes the next version again

Nothing here is imported by ``import asyncsync``, and nothing here imports pytest.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import gc
import json
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from multiprocessing import forkserver, resource_sharer, resource_tracker
from types import TracebackType
from typing import Any

import anyio
import torch
from torch import nn
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ._core._signal import Signal
from ._errors import SyncTimeoutError, WorkerDiedError
from ._local._faults import FaultHook, installed, run_with_faults
from ._local._receiver import OnUpdate
from ._schemes._dist import DistributedWeightSyncScheme
from ._schemes._local import MultiProcessWeightSyncScheme, loopback_worker
from ._workers import START_TIMEOUT, WorkerGroup, _Outcome

__all__ = [
    "Faults",
    "LeakError",
    "LoopbackHosts",
    "LoopbackWorkers",
    "ProcessWorkers",
    "no_leaks",
    "open_loopback",
    "open_loopback_hosts",
    "open_workers",
]

_REJECTED = "rejected by asyncsync.testing"


# --------------------------------------------------------------------------- faults


class Faults:
    """Fault injection into one set of workers, to test your own error handling.

    Get it from :attr:`LoopbackWorkers.faults` or :attr:`ProcessWorkers.faults`; it works
    the same on both. Faults act in the worker's receiver, before it stages an update;
    workers without them run exactly the code they run in production.

    Example::

        from asyncsync.testing import open_loopback

        policy = make_policy()
        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=policy, num_workers=2)
        async with open_loopback(scheme, make_policy) as workers:
            async with workers.faults.delay_acks(0):      # worker 0 answers nothing until the block ends
                try:
                    await scheme.send(timeout=0.2)
                except SyncTimeoutError as exc:
                    print(exc.pending)                     # {0: 0}
            async with workers.faults.reject(1, "corrupt"):
                try:
                    await scheme.send()
                except WorkerError as exc:                 # worker 1 keeps its weights
                    print(exc.worker_idx, exc.message)     # 1 corrupt
            await workers.faults.kill(1)
            try:
                await scheme.send()
            except WorkerDiedError as exc:
                print(exc.worker_idx)                      # 1
    """

    timeout: float = 30.0
    """Bound, in seconds, of each fault command (a worker process must first connect)."""

    async def kill(self, worker_idx: int) -> None:
        """End worker *worker_idx* as a crash would (a process: SIGKILL; a loopback worker:
        its channel closes without a goodbye); return once it is gone and the sender (if
        connected) has noticed: from then on a send that targets it still reaches the
        others, and its wait raises :class:`~asyncsync.WorkerDiedError` naming it (with
        ``on_worker_error="raise"``). ``restart(i)`` brings a replacement.

        To kill a worker in the middle of a send, start the send as a task first.
        """
        raise NotImplementedError

    @asynccontextmanager
    async def delay_acks(self, worker_idx: int) -> AsyncIterator[None]:
        """While the block runs, worker *worker_idx* answers no update: one that arrives
        waits, neither applied nor acknowledged, until the block ends (as if the worker's
        loop were busy). Then it applies the newest version, and sends work again."""
        await self._command(worker_idx, {"hold": True})
        try:
            yield
        finally:
            with anyio.move_on_after(self.timeout, shield=True):
                await self._command(worker_idx, {"hold": False}, required=False)

    @asynccontextmanager
    async def reject(self, worker_idx: int, message: str = _REJECTED) -> AsyncIterator[None]:
        """While the block runs, worker *worker_idx* refuses every update with *message*:
        it keeps its weights and the sender raises :class:`~asyncsync.WorkerError` naming
        the worker, the version and *message* (or, with ``on_worker_error="skip"``, records
        it in ``statistics().worker(i).last_error``)."""
        await self._command(worker_idx, {"refusal": message})
        try:
            yield
        finally:
            with anyio.move_on_after(self.timeout, shield=True):
                await self._command(worker_idx, {"refusal": None}, required=False)

    async def _command(self, worker_idx: int, command: dict[str, Any], *, required: bool = True) -> None:
        """Apply *command* in the worker's :class:`FaultHook`; return once it is in force."""
        raise NotImplementedError


class _LoopbackFaults(Faults):
    def __init__(self, owner: LoopbackWorkers) -> None:
        self._owner = owner
        self.hooks: dict[int, FaultHook] = {}

    async def kill(self, worker_idx: int) -> None:
        await self._owner.workers[worker_idx].receiver._kill()
        await self._owner.scheme.sender.wait_dead(worker_idx, timeout=self.timeout)

    async def _command(self, worker_idx: int, command: dict[str, Any], *, required: bool = True) -> None:
        if worker_idx not in self.hooks:
            raise ValueError(f"no loopback worker {worker_idx}; workers: {sorted(self.hooks)}")
        self.hooks[worker_idx].apply(command)


class _ProcessFaults(Faults):
    """Commands to each worker process's :class:`FaultHook` over a Unix socket (an abstract
    address: nothing on disk), one JSON object a line, each answered once applied."""

    def __init__(self, owner: ProcessWorkers) -> None:
        self._owner = owner
        self.address = f"\0asyncsync-faults-{os.getpid()}-{secrets.token_hex(8)}"
        self.token = secrets.token_hex(16)
        self._listener: socket.socket | None = None
        self._server: asyncio.Task[asyncio.Server] | None = None
        self._conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        self._changed = Signal()

    def listen(self) -> None:
        """Listen now (the processes may connect before the loop accepts them)."""
        if self._listener is not None:
            return
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(64)
        self._server = asyncio.get_running_loop().create_task(asyncio.start_unix_server(self._on_client, sock=self._listener))

    async def aclose(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        for _, writer in conns:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        if self._server is not None:
            server = await self._server
            server.close()
            await server.wait_closed()
            self._server = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = json.loads(await reader.readline())
            proc = self._owner.processes.get(hello["worker_idx"])
            # only the current process of that worker (not one killed before its hello came in)
            valid = hello["token"] == self.token and proc is not None and hello["pid"] == proc.pid
        except (ValueError, KeyError, TypeError, ConnectionError):
            valid = False
        if not valid:
            writer.close()
            return
        old = self._conns.pop(hello["worker_idx"], None)  # a replacement's connection supersedes
        if old is not None:
            old[1].close()
        self._conns[hello["worker_idx"]] = (reader, writer)
        self._changed.notify()

    async def kill(self, worker_idx: int) -> None:
        self._owner.kill(worker_idx)
        if not await self._owner._wait_exit(worker_idx, self.timeout):
            raise SyncTimeoutError(f"waiting for worker {worker_idx} to die", {worker_idx: -1}, self.timeout)
        scheme = self._owner.scheme
        if scheme is not None and getattr(scheme, "_sender", None) is not None:
            await scheme.sender.wait_dead(worker_idx, timeout=self.timeout)

    async def _command(self, worker_idx: int, command: dict[str, Any], *, required: bool = True) -> None:
        if worker_idx not in self._owner.processes:
            raise ValueError(f"no worker {worker_idx}; workers: {sorted(self._owner.processes)}")
        if required and not await self._changed.wait_until(lambda: worker_idx in self._conns, self.timeout):
            raise SyncTimeoutError(f"waiting for worker {worker_idx} to take fault commands", {worker_idx: -1}, self.timeout)
        lock = self._locks.setdefault(worker_idx, asyncio.Lock())
        async with lock:
            conn = self._conns.get(worker_idx)
            if conn is None:
                return  # not required: a worker that is gone holds nothing
            reader, writer = conn
            try:
                writer.write(json.dumps(command).encode() + b"\n")
                await writer.drain()
                answered = bool(await reader.readline())
            except ConnectionError:
                answered = False
            if answered:
                return
            if self._conns.get(worker_idx) is conn:
                del self._conns[worker_idx]
                writer.close()
            if required:
                proc = self._owner.processes[worker_idx]
                raise WorkerDiedError(worker_idx, proc.exitcode, proc.pid)


# --------------------------------------------------------------------------- loopback


class LoopbackWorkers:
    """Workers in this event loop, connected to *scheme* (an in-process loopback).

    The same sockets, shared memory and protocol as worker processes, without the
    processes: fast tests of code that calls ``send`` / ``send_async`` / ``wait_async``
    or reacts in ``on_update``. Use it as ``async with``: on entry every worker is
    connected and runs version 0 (committed, with ``commit_mode="manual"``); on exit the
    sender and every worker are closed. Build one with :func:`open_loopback`.

    Attributes:
        scheme: the sender's scheme (as given).
        workers: ``{worker_idx: worker-side scheme}``: ``version``, ``wait_for_version``,
            ``commit``, ``statistics()``...
        models: ``{worker_idx: the worker's model}``.
        faults: :class:`Faults` for these workers.

    Example::

        from asyncsync.testing import open_loopback

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=2)
        async with open_loopback(scheme, make_policy) as lb:   # a LoopbackWorkers
            await lb.faults.kill(1)
            await lb.restart(1)            # a fresh worker 1, on a new channel, gets the latest weights
            await scheme.send()
            print({i: w.version for i, w in lb.workers.items()})   # {0: 1, 1: 1}
    """

    def __init__(
        self,
        scheme: MultiProcessWeightSyncScheme,
        models: Mapping[int, nn.Module] | Callable[[], nn.Module],
        *,
        on_update: OnUpdate | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.scheme = scheme
        self._factory = models if callable(models) else None
        ids = scheme.sender.worker_ids
        self.models: dict[int, nn.Module] = {i: self._factory() for i in ids} if self._factory is not None else dict(models)  # type: ignore[arg-type]
        if sorted(self.models) != sorted(ids):
            raise ValueError(f"models for workers {sorted(self.models)}, the scheme has workers {sorted(ids)}")
        self._on_update = on_update
        self._device = device
        self.workers: dict[int, MultiProcessWeightSyncScheme] = {}
        self.faults = _LoopbackFaults(self)

    def _attach(self, worker_idx: int) -> MultiProcessWeightSyncScheme:
        worker = loopback_worker(self.scheme, worker_idx)
        hook = FaultHook()
        reset = installed.set(hook)
        try:
            worker.init_on_receiver(worker_idx=worker_idx, model=self.models[worker_idx], on_update=self._on_update, device=self._device)
        finally:
            installed.reset(reset)
        self.faults.hooks[worker_idx] = hook
        self.workers[worker_idx] = worker
        return worker

    @staticmethod
    async def _join(worker: MultiProcessWeightSyncScheme) -> None:
        await worker.connect()
        if worker.commit_mode == "manual":
            worker.commit()  # the sender's connect() waits for version 0 to be committed

    async def __aenter__(self) -> LoopbackWorkers:
        joins = [asyncio.ensure_future(self._join(self._attach(i))) for i in self.models]
        try:
            await self.scheme.connect()
            await asyncio.gather(*joins)
        except BaseException:
            for t in joins:
                t.cancel()
            await asyncio.wait(joins)
            await self.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def restart(self, worker_idx: int, *, timeout: float = 10.0) -> None:
        """Replace worker *worker_idx* (killed or not) by a new loopback worker; return once it
        applied the latest weights. Its model is a new one from the factory, else the same
        module (which kept its last weights)."""
        await self.faults.kill(worker_idx)  # a no-op beyond the wait if it is dead already
        if self._factory is not None:
            self.models[worker_idx] = self._factory()
        joining = asyncio.ensure_future(self._join(self._attach(worker_idx)))
        try:
            await self.scheme.sender.wait_joined(worker_idx, timeout=timeout)
        except BaseException:
            joining.cancel()
            await asyncio.wait([joining])
            raise
        await joining

    async def aclose(self) -> None:
        """Close the sender, then every worker (idempotent)."""
        await self.scheme.aclose()
        for worker in self.workers.values():
            await worker.aclose()


def open_loopback(
    scheme: MultiProcessWeightSyncScheme,
    models: Mapping[int, nn.Module] | Callable[[], nn.Module],
    *,
    on_update: OnUpdate | None = None,
    device: torch.device | str | None = None,
) -> LoopbackWorkers:
    """Loopback workers for *scheme* (set up with ``init_on_sender``), to use as ``async with``.

    *models* is ``{worker_idx: model}`` for every worker of the scheme, or a factory called
    once per worker. *on_update* and *device* go to each worker's ``init_on_receiver``.

    Example::

        from asyncsync.testing import open_loopback

        policy = make_policy()
        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=policy, num_workers=2)
        async with open_loopback(scheme, make_policy) as lb:
            with torch.no_grad():
                policy[0].weight.fill_(1.0)
            await scheme.send()
            assert lb.workers[0].version == 1
            assert torch.equal(lb.models[1][0].weight, policy[0].weight)
    """
    return LoopbackWorkers(scheme, models, on_update=on_update, device=device)


class LoopbackHosts:
    """A multi-host setup in this event loop: a trainer, one relay per host and each host's
    loopback workers, on a real gloo group and control plane over 127.0.0.1. Use it as
    ``async with``: on entry everything is connected and every worker runs version 0
    (committed, with ``commit_mode="manual"``); on exit everything is closed. Build one
    with :func:`open_loopback_hosts`.

    Attributes:
        trainer: the trainer's :class:`~asyncsync.DistributedWeightSyncScheme`.
        hosts: ``{host: that host's scheme}`` (after ``init_on_relay``).
        workers: ``{(host, local index): worker-side scheme}``.
        models: ``{(host, local index): the worker's model}``.

    Example::

        from asyncsync.testing import open_loopback_hosts

        async with open_loopback_hosts(make_policy(), make_policy, hosts={1: 2}) as lh:   # a LoopbackHosts
            await lh.trainer.send(worker_ids=[(1, 0)])
            print({wid: w.version for wid, w in lh.workers.items()})   # {(1, 0): 1, (1, 1): 0}
    """

    def __init__(
        self, model: nn.Module, make_model: Callable[[], nn.Module], hosts: Mapping[int, int], options: Mapping[str, Any]
    ) -> None:
        with socket.socket() as s:  # a free port for the rendezvous store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        common: dict[str, Any] = {"timeout": 30, "token": secrets.token_hex(16), **options}
        common.update(world_size=max(hosts) + 1, master_addr="127.0.0.1", master_port=port)
        self.trainer = DistributedWeightSyncScheme(rank=0, **common)
        self.trainer.init_on_sender(model=model, hosts=hosts)
        self.hosts: dict[int, DistributedWeightSyncScheme] = {}
        self.workers: dict[tuple[int, int], MultiProcessWeightSyncScheme] = {}
        self.models: dict[tuple[int, int], nn.Module] = {}
        for h, n in hosts.items():
            host = DistributedWeightSyncScheme(rank=h, **common)
            host.init_on_relay(model=make_model(), num_workers=n)
            self.hosts[h] = host
            for i in range(n):
                worker = loopback_worker(host.local, i)
                self.models[h, i] = make_model()
                worker.init_on_receiver(worker_idx=i, model=self.models[h, i])
                self.workers[h, i] = worker

    async def __aenter__(self) -> LoopbackHosts:
        try:
            joining = [self.trainer.connect(), *(h.connect() for h in self.hosts.values())]
            await asyncio.gather(*joining, *(LoopbackWorkers._join(w) for w in self.workers.values()))
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the trainer (which stops the hosts), then every host and worker. Idempotent."""
        with anyio.CancelScope(shield=True):
            await self.trainer.aclose()
            for host in self.hosts.values():
                await host.aclose()
            for worker in self.workers.values():
                await worker.aclose()


def open_loopback_hosts(
    model: nn.Module, make_model: Callable[[], nn.Module], hosts: Mapping[int, int] | None = None, **options: Any
) -> LoopbackHosts:
    """A trainer sending *model*, and *hosts* ``{host: number of workers}`` (default one
    host with one worker) in this event loop, to use as ``async with``. *make_model* builds
    each relay's and worker's copy; *options* go to every
    :class:`~asyncsync.DistributedWeightSyncScheme` (``timeout`` defaults to 30).

    Example::

        from asyncsync.testing import open_loopback_hosts

        async with open_loopback_hosts(make_policy(), make_policy, timeout=10) as lh:
            await lh.hosts[1].aclose()                  # host 1 leaves (or dies)
            try:
                await lh.trainer.send()
            except HostLostError as exc:
                print(exc.host, exc.worker_idx)         # 1 (1, 0)
    """
    return LoopbackHosts(model, make_model, dict(hosts or {1: 1}), options)


# --------------------------------------------------------------------------- processes


class ProcessWorkers(WorkerGroup):
    """A :class:`~asyncsync.WorkerGroup` (spawned processes) whose workers take faults.

    Each process runs ``await fn(worker_idx, *args, **kwargs)`` as with
    :func:`~asyncsync.spawn_workers`, with :attr:`faults` reaching the receivers it creates.
    A worker killed by :meth:`Faults.kill` (or :meth:`kill`) and not restarted is expected
    to be dead: :meth:`join` (and a normal exit of the block) reports the others and leaves
    it out of ``results``. Build one with :func:`open_workers` (whose example spawns some).

    Example::

        from asyncsync.testing import Faults, ProcessWorkers, open_workers

        async def my_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> None: ...

        scheme = MultiProcessWeightSyncScheme(timeout=30)
        scheme.init_on_sender(model=make_policy(), num_workers=2)
        workers = open_workers(my_worker, 2, args=(scheme,), scheme=scheme)
        print(isinstance(workers, ProcessWorkers), isinstance(workers.faults, Faults))  # True True
        # `async with workers:` starts the processes; nothing runs before
        await scheme.aclose()
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
        start_method: str | None = None,
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError("fn must be an async function taking worker_idx first")
        self.faults = _ProcessFaults(self)
        self._killed: set[int] = set()
        super().__init__(
            run_with_faults,
            num_workers,
            worker_ids=worker_ids,
            args=(self.faults.address, self.faults.token, fn, *args),
            kwargs=kwargs,
            scheme=scheme,
            join_timeout=join_timeout,
            start_method=start_method,
            start_timeout=start_timeout,
        )

    def start(self) -> None:
        self.faults.listen()
        super().start()

    def _start_one(self, idx: int) -> None:
        super()._start_one(idx)
        self._killed.discard(idx)  # a replacement is expected to live

    def kill(self, worker_idx: int) -> None:
        self._process(worker_idx, "kill")  # a bad index or a closed group: nothing recorded
        self._killed.add(worker_idx)
        super().kill(worker_idx)

    def _reported(self) -> dict[int, _Outcome]:
        return {i: outcome for i, outcome in self._outcomes.items() if i not in self._killed}

    async def aclose(self, grace: float = 2.0) -> None:
        try:
            await super().aclose(grace)
        finally:
            with anyio.CancelScope(shield=True):
                await self.faults.aclose()


def open_workers(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    num_workers: int | None = None,
    *,
    worker_ids: Iterable[int] | None = None,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    scheme: Any = None,
    join_timeout: float = 30.0,
    start_method: str | None = None,
    start_timeout: float = START_TIMEOUT,
) -> ProcessWorkers:
    """Worker processes (spawned) running *fn*, with faults, to use as ``async with``.

    Same arguments as :func:`~asyncsync.spawn_workers`; *fn* must be importable (module
    level), as spawn needs.

    Example::

        import asyncio

        import torch
        from torch import nn

        from asyncsync import MultiProcessWeightSyncScheme, WorkerDiedError
        from asyncsync.testing import open_workers


        def make_policy() -> nn.Module:
            return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


        async def my_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
            scheme.init_on_receiver(worker_idx=worker_idx, model=make_policy())
            async with scheme:
                await scheme.wait_stopped()
            return scheme.version


        async def main() -> None:
            scheme = MultiProcessWeightSyncScheme(timeout=30)
            scheme.init_on_sender(model=make_policy(), num_workers=2)
            async with open_workers(my_worker, 2, args=(scheme,), scheme=scheme) as workers:
                async with scheme:
                    await workers.faults.kill(1)
                    try:
                        await scheme.send()
                    except WorkerDiedError as exc:
                        print("worker", exc.worker_idx, "died")   # worker 1 died
                    await workers.restart(1)                     # a replacement gets version 0
                    await scheme.send()
            print(workers.results)                               # {0: 1, 1: 1}


        if __name__ == "__main__":
            asyncio.run(main())
    """
    return ProcessWorkers(
        fn, num_workers, worker_ids=worker_ids, args=args, kwargs=kwargs, scheme=scheme, join_timeout=join_timeout,
        start_method=start_method, start_timeout=start_timeout,
    )  # fmt: skip


# --------------------------------------------------------------------------- leaks


class LeakError(AssertionError):
    """Something outlived the block that created it (see :func:`no_leaks`); ``problems``
    lists each, one sentence apiece.

    Example::

        import os

        from asyncsync.testing import LeakError, no_leaks

        try:
            with no_leaks():
                r, w = os.pipe()          # never closed
        except LeakError as exc:
            print(exc.problems)           # names both descriptors
            os.close(r)
            os.close(w)
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("asyncsync leak check: " + "; ".join(problems))
        self.problems = problems


@contextmanager
def no_leaks(*, descriptors: bool = True, processes: bool = True, threads: bool = False, settle: float = 0.0) -> Iterator[None]:
    """Fail (:class:`LeakError`) if the block leaves a child process, a file descriptor, a
    ``/dev/shm`` entry or (with *threads*) a thread behind.

    Child processes (unless *processes* is False): every descendant of this process started
    in the block and still running at its end (zombies, multiprocessing's resource tracker
    and forkserver, which live as long as the interpreter, are not counted; workers forked
    by the forkserver are); they are killed before the error is raised, so later tests
    start clean. Turn it off where something else keeps a pool of child processes (Ray's
    raylet).
    Descriptors (unless *descriptors* is False): every entry of ``/proc/self/fd`` opened in
    the block and still open after a garbage collection (unclosed schemes, sockets, pipes,
    shared-memory segments, files; not multiprocessing's resource sharer, the
    forkserver's pipe, the pipe torch keeps from its first ``TCPStore`` server on, nor
    the one libuv keeps from a process's first uvloop loop, both made before the
    snapshot: all kept for the interpreter's life). A scheme that
    outlives the block (a module-scoped fixture) may rightly open descriptors in it: a
    slot added under load, a replacement worker's channel; check descriptors where the
    block owns its schemes.
    ``/dev/shm`` entries: every name made there in the block and still there at its end
    (after a garbage collection) that this process tree made: one that this process or a
    running descendant maps or holds open, or one named after such a process (torch's
    ``torch_<pid>_...``); with *descriptors* False, not those of this process itself (a
    fixture that outlives the block may hold them, as it may hold descriptors). ``/dev/shm`` is the machine's: entries other programs make or
    remove meanwhile are never counted, and neither is an entry nothing holds any more
    (it cannot be told from another program's). asyncsync's own segments are not there
    at all (they are memfds: a descriptor or a mapping while in use).
    Threads (with *threads*): every thread started in the block and still running at its
    end (asyncio and anyio keep idle worker threads on purpose: off by default).
    *settle*: seconds that leftover threads and descriptors may take to end on their own
    (what ends only at a timeout of its own); checked again until then.
    Read from ``/proc``: Linux only, as asyncsync is. If the block raises, leftover
    processes are killed and its exception goes on.

    Example::

        from asyncsync.testing import no_leaks, open_loopback

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        with no_leaks():   # raises LeakError on exit if something was left
            async with open_loopback(scheme, make_policy):
                await scheme.send()
    """
    resource_tracker.ensure_running()  # started once per interpreter, and kept: not a leak
    _open_store_pipe()  # likewise
    _open_uvloops_pipe()  # likewise
    children0 = set(_descendants()) if processes else set()
    fds0 = _fds()
    shm0 = _shm_names()
    threads0 = set(threading.enumerate())
    try:
        yield
    except BaseException:
        if processes:
            _kill(set(_descendants()) - children0)
        raise
    children = {pid: cmd for pid, cmd in _descendants().items() if pid not in children0} if processes else {}
    shm = _shm_left(shm0, own=descriptors)  # before the kill: what a leftover process holds counts too
    _kill(set(children))
    deadline = time.monotonic() + settle
    while True:
        fds = _new_fds(fds0) if descriptors else {}
        left = [t for t in threading.enumerate() if t not in threads0 and t.is_alive()] if threads else []
        if fds or shm:
            gc.collect()  # unreachable channels close their descriptors when collected (slow: only then)
            fds = _new_fds(fds0) if descriptors else {}
            shm = [name for name in shm if os.path.exists(f"{_SHM}/{name}")]
        if not (fds or left) or time.monotonic() >= deadline:
            break
        for t in left:
            t.join(max(0.0, deadline - time.monotonic()))
        if not left:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))  # a descriptor: nothing to join
    problems = [f"child process {pid} ({cmd}) still running" for pid, cmd in sorted(children.items())]
    problems += [f"file descriptor {fd} ({target}) left open" for fd, target in sorted(fds.items())]
    problems += [f"/dev/shm/{name} left" for name in shm]
    problems += [f"thread {t.name!r} still running" for t in left]
    if problems:
        raise LeakError(problems)


@functools.cache  # once per process
def _open_store_pipe() -> None:
    """Open what torch keeps for the life of the process once it made a rendezvous store:
    its first ``TCPStore`` server leaves a pipe open after the store is gone (a multi-host
    scheme's trainer hosts one). Once per process: a throwaway store on an ephemeral port
    of 127.0.0.1, so that the pipe exists before the leak check's snapshot."""
    try:
        store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    except Exception:  # no loopback, or a torch without the store: then no test here makes one
        return
    del store


@functools.cache  # once per process
def _open_uvloops_pipe() -> None:
    """Where uvloop is installed, make (and close) one of its loops now: libuv's first loop in
    a process opens a pipe kept for the process's life (its signal lock), which would
    otherwise count as a leak of the block that made the process's first uvloop loop."""
    try:
        import uvloop
    except ImportError:
        return
    uvloop.new_event_loop().close()


def _new_fds(before: Mapping[int, str]) -> dict[int, str]:
    # multiprocessing's resource sharer (started when a Connection is pickled outside a
    # spawn) keeps its listening socket for the interpreter's life
    try:
        kept = {resource_sharer._resource_sharer._listener._listener._socket.fileno()}  # type: ignore[attr-defined]
    except AttributeError:  # not started (its _listener is None), or another Python's layout
        kept = set()
    # ... and so does the forkserver's liveness pipe, once a forkserver was started
    alive = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd", None)
    if alive is not None:
        kept.add(alive)
    return {fd: target for fd, target in _fds().items() if before.get(fd) != target and fd not in kept}


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the descriptor listdir itself used
    return out


def _children() -> dict[int, list[int]]:
    """{pid: its running (not zombie) children} of every process, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    return children


def _descendants() -> dict[int, str]:
    """{pid: command line} of the running (not zombie) descendants of this process."""
    children = _children()
    out = {}
    todo = [(pid, "") for pid in children.get(os.getpid(), [])]
    while todo:
        pid, parent_cmd = todo.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        todo.extend((child, cmd) for child in children.get(pid, []))
        if "multiprocessing.resource_tracker" in cmd:
            continue  # the interpreter's own helper, kept for its lifetime
        if "multiprocessing.forkserver" in cmd and "multiprocessing.forkserver" not in parent_cmd:
            continue  # the forkserver itself (kept too); the workers forked from it count
        out[pid] = cmd[:200]
    return out


def _tree() -> set[int]:
    """This process and all its running descendants (helpers included)."""
    children = _children()
    out: set[int] = set()
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


_SHM = "/dev/shm"


def _shm_entries() -> dict[str, int]:
    """{name: inode} of the entries of ``/dev/shm`` (none where there is none)."""
    try:
        with os.scandir(_SHM) as entries:
            return {e.name: e.inode() for e in entries}
    except OSError:
        return {}


def _shm_names() -> set[str]:
    return set(_shm_entries())


def _shm_left(before: Collection[str], *, own: bool = True) -> list[str]:
    """The ``/dev/shm`` entries made since *before* (the names there then) that this
    process tree made: one it maps or holds open, or one named after one of its processes
    (torch's ``torch_<pid>_...``); with *own* False, those of this process itself do not
    count. Another program's entries, and those it removed, never count."""
    new = {name: inode for name, inode in _shm_entries().items() if name not in before}
    if not new:
        return []
    tree = _tree() - ({os.getpid()} if not own else set())
    held: set[int] = set()
    for pid in tree:
        held |= _shm_inodes(pid)
    return sorted(name for name, inode in new.items() if inode in held or _named_pid(name) in tree)


def _shm_inodes(pid: int) -> set[int]:
    """Inodes of the ``/dev/shm`` entries process *pid* maps or holds open."""
    out: set[int] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                if len(fields) == 6 and fields[5].startswith(_SHM + "/"):
                    out.add(int(fields[4]))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(_SHM + "/"):
                    out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    except OSError:
        pass  # gone meanwhile
    return out


def _named_pid(name: str) -> int | None:
    """The creator's pid in torch's ``torch_<pid>_...`` names (its file_system sharing strategy)."""
    parts = name.split("_")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "torch" and parts[1].isdigit() else None


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
