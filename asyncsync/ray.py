"""Ray actors as asyncsync workers: Ray places and runs them, asyncsync moves the weights.

:func:`start_workers` starts N Ray async actors on the trainer's node; each runs your async
worker function, the one ``spawn_workers`` takes (``fn(worker_idx, scheme, *args)``),
unchanged, in the actor's event loop. The actor's ``scheme`` is attached to the trainer by
address (:meth:`MultiProcessWeightSyncScheme.attach`): weights travel through asyncsync's
shared memory, never through Ray's object store. Ray does placement and lifecycle only. A
dead actor is named like any dead worker (:class:`WorkerDiedError` for worker *k*), and
:meth:`RayWorkerGroup.join` raises :class:`WorkerProcessError` for an actor that raised or
died.

Given a :class:`DistributedWeightSyncScheme` instead, :func:`start_workers` places workers on
other nodes too: per host of the scheme, one relay actor pinned to that host's Ray node
receives each version once over the network and hands it to that node's worker actors
through their shared memory (a :class:`RayHostGroup`; see docs/ray.md).

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

Workers on other nodes (one host per node; the trainer's address must be one they reach)::

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    scheme = DistributedWeightSyncScheme(timeout=60, master_addr=ray.util.get_node_ip_address())
    scheme.init_on_sender(model=policy, hosts={h: 2 for h in range(1, len(nodes) + 1)})
    async with start_workers(worker, scheme, nodes=nodes) as group:   # host h on nodes[h - 1]
        async with scheme:
            await scheme.send()
    print(group.results)                            # {(1, 0): 1, (1, 1): 1, (2, 0): 1, ...}
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import os
from collections.abc import Callable, Coroutine, Hashable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, overload

import anyio
import torch

from ._core._layout import Layout
from ._core._offload import retrieve
from ._errors import AsyncSyncError, HostLostError, SyncTimeoutError, WorkerProcessError
from ._schemes._dist import DistributedWeightSyncScheme
from ._schemes._local import MultiProcessWeightSyncScheme
from ._workers import exit_group

__all__ = ["RayHostGroup", "RayWorkerGroup", "start_workers"]

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


def _where() -> tuple[int, str, str]:
    """This actor's process id, Ray node id and node address."""
    ray = _ray()
    return os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class _WorkerActor:
    """The actor's body (made a Ray actor class on first use, so that this module imports without Ray)."""

    async def ready(self) -> tuple[int, str, str]:
        return _where()

    async def run(self, fn: Callable[..., Coroutine[Any, Any, Any]], worker_idx: int, address: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        scheme = MultiProcessWeightSyncScheme.attach(address, worker_idx=worker_idx)
        return await fn(worker_idx, scheme, *args, **kwargs)


class _RelayActor:
    """One host's relay, on the host's Ray node: it joins the trainer and is the local
    sender its node's worker actors attach to."""

    def __init__(self) -> None:
        self.scheme: DistributedWeightSyncScheme | None = None

    async def setup(self, settings: dict[str, Any], host: int, num_workers: int, layout: Layout) -> tuple[tuple[int, str, str], str]:
        """Build the relay (the trainer's options, its store's address) and listen for the
        workers; returns where it runs and the address they attach to."""
        where = _where()
        # bind: the address this relay gives the data plane, the one Ray knows this node by
        scheme = DistributedWeightSyncScheme(rank=host, bind=where[2], **settings)
        scheme.init_on_relay(weights=relay_template(layout), num_workers=num_workers, host=host)
        address = await scheme.local.listen()
        self.scheme = scheme
        return where, str(address)

    async def run(self) -> int:
        """Join the trainer, serve until it stops this host; the newest version landed."""
        assert self.scheme is not None, "setup() first"
        async with self.scheme:
            await self.scheme.wait_stopped()
        return self.scheme.version


_actor_classes: dict[type, Any] = {}


def _actor(ray: Any, cls: type = _WorkerActor) -> Any:
    if cls not in _actor_classes:
        _actor_classes[cls] = ray.remote(cls)
    return _actor_classes[cls]


def relay_template(layout: Layout) -> dict[str, torch.Tensor]:
    """Weights with *layout*'s keys, shapes and dtypes: what a relay needs of the model (its
    architecture; the relay never reads values). Meta tensors, with no memory; with tied
    weights (aliases), uninitialised CPU tensors, each alias the very tensor it names, as a
    meta tensor cannot show that two names are one."""
    device = "cpu" if layout.aliases else "meta"
    out = {s.key: torch.empty(s.shape, dtype=s.dtype, device=device) for s in layout.specs}
    for alias, canonical in layout.aliases:
        out[alias] = out[canonical]
    return out


_G = TypeVar("_G", bound="_ActorGroup")


class _ActorGroup:
    """What both groups share: worker actors, their runs, join, kill and close."""

    def __init__(
        self,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        actor_options: Mapping[str, Any],
        join_timeout: float,
        start_timeout: float,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = dict(kwargs)
        self.actor_options = dict(actor_options)
        self.join_timeout = join_timeout
        self.start_timeout = start_timeout
        self.scheme: Any = None
        self.actors: dict[Any, Any] = {}
        self.pids: dict[Any, int] = {}
        self.node_ids: dict[Any, str] = {}  # each worker's Ray node
        self.results: dict[Any, Any] = {}
        self._runs: dict[Any, asyncio.Future[Any]] = {}
        self._local_pids: dict[Hashable, int] = {}  # actors on this machine: their exit can be awaited
        self._killed: set[Any] = set()  # by kill(): named by the scheme, not reported by join()
        self._closed = False

    def _start_worker(self, ray: Any, wid: Any, worker_idx: int, address: str, node: str) -> None:
        options = dict(self.actor_options)
        if "scheduling_strategy" not in options:
            # The shared memory and the socket are local to *node*: the worker goes there.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        actor = _actor(ray).options(**options).remote()
        self.actors[wid] = actor
        self._runs[wid] = _run(actor.run.remote(self.fn, worker_idx, address, self.args, self.kwargs))

    async def _wait_ready(self, refs: Mapping[Any, Any], what: str) -> dict[Any, Any]:
        """The answers of *refs* ``{key: ref}`` (each actor's start), within ``start_timeout``:
        ``{key: answer or the exception it raised}``."""
        keys = list(refs)
        try:
            answers = await asyncio.wait_for(asyncio.gather(*(_awaited(refs[k]) for k in keys), return_exceptions=True), self.start_timeout)
        except asyncio.TimeoutError:
            raise SyncTimeoutError(f"waiting for the Ray {what} to start", {k: -1 for k in keys}, self.start_timeout) from None
        return dict(zip(keys, answers))

    def _started(self, key: Hashable, where: tuple[int, str, str]) -> int:
        pid, _node, ip = where
        if ip == _ray().util.get_node_ip_address():
            self._local_pids[key] = pid
        return pid

    async def _wait_started(self, ids: Iterable[Any]) -> None:
        ready = await self._wait_ready({i: self.actors[i].ready.remote() for i in ids}, "actors")
        for i, where in ready.items():
            if isinstance(where, BaseException):
                raise WorkerProcessError(i, f"its Ray actor failed to start: {_describe(where)}") from where
            self.pids[i] = self._started(i, where)
            self.node_ids[i] = where[1]

    async def start(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: _G) -> _G:
        try:
            await self.start()
        except BaseException:
            await self.aclose(grace=0.0)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if await exit_group(self, exc_type) and isinstance(exc, AsyncSyncError) and not isinstance(exc, WorkerProcessError):
            self._annotate(exc)

    def _annotate(self, exc: BaseException) -> None:
        failures = self._failures()
        if failures and hasattr(exc, "add_note"):
            for err in failures:
                exc.add_note(f"meanwhile, in a Ray actor: {err}")

    def kill(self, worker_id: Any) -> None:
        """Kill one worker's actor process (``ray.kill``; for fault-injection tests). The
        scheme names the worker dead; :meth:`join` does not report it."""
        if worker_id not in self.actors:
            raise ValueError(f"no worker {worker_id!r} in this group (workers {sorted(self.actors)})")
        self._killed.add(worker_id)
        _ray().kill(self.actors[worker_id], no_restart=True)

    async def restart(self, worker_id: Any, *, timeout: float = 30.0) -> None:
        """Replace one worker's actor: kill it, wait until the trainer noticed, start a new
        one in its place, and return once it has applied the newest version it was sent."""
        ray = _ray()
        self.kill(worker_id)
        sender = self.scheme.sender
        await sender.wait_dead(worker_id, timeout)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(self._runs[worker_id]), timeout)
        self._killed.discard(worker_id)
        self._respawn(ray, worker_id)
        await self._wait_started([worker_id])
        await sender.wait_joined(worker_id, timeout)

    def _respawn(self, ray: Any, worker_id: Any) -> None:
        raise NotImplementedError

    async def join(self, timeout: float | None = None) -> dict[Any, Any]:
        """Wait for every actor's function to return; ``{worker id: result}``.

        Raises :class:`WorkerProcessError` for the first worker whose function raised or
        whose actor died (in a :class:`RayHostGroup`, :class:`HostLostError` first for a
        relay that failed), :class:`SyncTimeoutError` after *timeout* seconds.
        """
        runs = self._all_runs()
        done, pending = await asyncio.wait(runs, timeout=math.inf if timeout is None else timeout) if runs else (set(), set())
        if pending:
            running = {i: -1 for i, f in self._runs.items() if not f.done()}
            raise SyncTimeoutError("joining the Ray workers", running, timeout)
        failures = self._failures()
        if failures:
            raise failures[0]
        self.results = {i: f.result() for i, f in sorted(self._runs.items()) if i not in self._killed}
        return self.results

    def _all_runs(self) -> list[asyncio.Future[Any]]:
        return list(self._runs.values())

    def _failures(self) -> list[AsyncSyncError]:
        out: list[AsyncSyncError] = []
        for idx, fut in sorted(self._runs.items()):
            if idx not in self._killed and _failed(fut):
                err = WorkerProcessError(idx, _label(fut))
                err.__cause__ = fut.exception()
                out.append(err)
        return out

    def _all_actors(self) -> list[Any]:
        return list(self.actors.values())

    async def aclose(self, grace: float = 2.0) -> None:
        """Give the functions *grace* seconds to return, then kill every actor and wait
        (bounded) for the processes on this machine to exit. Idempotent."""
        if self._closed:
            return
        self._closed = True
        runs = [f for f in self._all_runs() if not f.done()]
        if runs and grace > 0:
            await asyncio.wait(runs, timeout=grace)
        try:
            ray = _ray()
        except (ImportError, RuntimeError):
            return
        for actor in self._all_actors():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with anyio.CancelScope(shield=True):
            await _wait_exited(list(self._local_pids.values()), 10.0)  # ray.kill only asks
        for f in self._all_runs():
            if not f.done():
                f.cancel()


class RayWorkerGroup(_ActorGroup):
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
        super().__init__(fn, args, kwargs, actor_options, join_timeout, start_timeout)
        self.scheme = scheme
        self.worker_ids = worker_ids

    async def start(self) -> None:
        """Listen (if the scheme does not yet), start every actor, wait until each runs."""
        ray = _ray()
        if self.scheme.listener is None:
            await self.scheme.listen()
        for idx in self.worker_ids:
            self._respawn(ray, idx)
        await self._wait_started(self.worker_ids)

    def _respawn(self, ray: Any, worker_id: Any) -> None:
        listener = self.scheme.listener
        assert listener is not None
        # by default on the trainer's node, where the shared memory is
        self._start_worker(ray, worker_id, worker_id, str(listener.address), ray.get_runtime_context().get_node_id())


class RayHostGroup(_ActorGroup):
    """Ray actors on several nodes for a trainer's :class:`DistributedWeightSyncScheme`.

    Made by :func:`start_workers`; use it as ``async with``. Per host of the scheme, one
    relay actor pinned to that host's Ray node (``nodes[host]``) and the host's worker
    actors on the same node, attached to the relay. Worker ids are ``(host, local index)``:
    ``actors``, ``pids`` and ``results`` are keyed by them; ``relays`` and ``relay_pids``
    by host. A relay that died or failed is a lost host (:class:`HostLostError`).

    Example (host 1 on another node, host 2 on the trainer's)::

        async with start_workers(worker, scheme, nodes={1: other_node, 2: this_node}) as group:
            async with scheme:
                await scheme.send()
                group.kill_host(1)                      # a fault test: host 1's relay dies
                await scheme.wait_lost(1, timeout=30)
                await scheme.send(worker_ids=[(2, 0)])  # host 2 goes on
        print(group.results)                            # {(2, 0): ...}: host 1's are not reported
    """

    def __init__(
        self,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        scheme: DistributedWeightSyncScheme,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        nodes: dict[int, str],
        actor_options: Mapping[str, Any],
        relay_options: Mapping[str, Any],
        join_timeout: float,
        start_timeout: float,
    ) -> None:
        super().__init__(fn, args, kwargs, actor_options, join_timeout, start_timeout)
        self.scheme = scheme
        self.nodes = nodes
        self.relay_options = dict(relay_options)
        self.worker_ids: list[tuple[int, int]] = list(scheme.sender.worker_ids)
        self.relays: dict[int, Any] = {}
        self.relay_pids: dict[int, int] = {}
        self.node_addresses: dict[int, str] = {}
        self._addresses: dict[int, str] = {}  # each relay's, for its workers to attach to
        self._relay_runs: dict[int, asyncio.Future[Any]] = {}
        self._lost: set[int] = set()  # by kill_host()

    async def start(self) -> None:
        """Publish the trainer's address, start each host's relay on its node, then the
        host's workers next to it; return once every actor runs (the relays then join the
        trainer, which ``async with scheme`` waits for)."""
        ray = _ray()
        await self.scheme.listen()  # and publish the control address in the store
        settings = self.scheme._relay_kwargs()
        layout = self.scheme._source_layout
        counts: dict[int, int] = {}
        for h, _ in self.worker_ids:
            counts[h] = counts.get(h, 0) + 1
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        setups = {}
        for h, node in self.nodes.items():
            options = {"num_cpus": 0, **self.relay_options, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
            relay = _actor(ray, _RelayActor).options(**options).remote()
            self.relays[h] = relay
            setups[h] = relay.setup.remote(settings, h, counts[h], layout)
        ready = await self._wait_ready(setups, "relays")
        for h, answer in ready.items():
            if isinstance(answer, BaseException):
                raise HostLostError(h, (h, 0), f"its Ray relay actor on node {self.nodes[h]} failed to start: {_describe(answer)}") from answer
        for h, (where, address) in ready.items():
            self.relay_pids[h] = self._started(("relay", h), where)
            self.node_addresses[h] = where[2]
            self._addresses[h] = address
            self._relay_runs[h] = _run(self.relays[h].run.remote())
            for wid in (w for w in self.worker_ids if w[0] == h):
                self._respawn(ray, wid)
        await self._wait_started(self.worker_ids)

    def _respawn(self, ray: Any, worker_id: Any) -> None:
        host, idx = worker_id
        self._start_worker(ray, worker_id, idx, self._addresses[host], self.nodes[host])

    def kill_host(self, host: int) -> None:
        """Kill one host's relay actor (``ray.kill``; for fault-injection tests): the trainer
        loses the host (:class:`HostLostError`), its workers end with
        :class:`SenderDiedError` (not reported by :meth:`join`)."""
        if host not in self.relays:
            raise ValueError(f"no host {host!r} in this group (hosts {sorted(self.relays)})")
        self._lost.add(host)
        self._killed.update(w for w in self.worker_ids if w[0] == host)
        _ray().kill(self.relays[host], no_restart=True)

    def _all_runs(self) -> list[asyncio.Future[Any]]:
        return list(self._runs.values()) + list(self._relay_runs.values())

    def _all_actors(self) -> list[Any]:
        return list(self.actors.values()) + list(self.relays.values())  # workers first: no SenderDiedError noise

    def _failures(self) -> list[AsyncSyncError]:
        relays: list[AsyncSyncError] = []
        for h, fut in sorted(self._relay_runs.items()):
            if h not in self._lost and _failed(fut):
                err = HostLostError(h, (h, 0), f"its Ray relay actor on node {self.nodes[h]} failed: {_label(fut)}", self.relay_pids.get(h))
                err.__cause__ = fut.exception()
                relays.append(err)
        return relays + super()._failures()

    def _annotate(self, exc: BaseException) -> None:
        if isinstance(exc, HostLostError) and exc.host in self.nodes and hasattr(exc, "add_note"):
            exc.add_note(f"host {exc.host} ran on Ray node {self.nodes[exc.host]} ({self.node_addresses.get(exc.host, '?')})")
        super()._annotate(exc)


@overload
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
) -> RayWorkerGroup: ...


@overload
def start_workers(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    scheme: DistributedWeightSyncScheme,
    *args: Any,
    nodes: Mapping[int, str] | Sequence[str] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    actor_options: Mapping[str, Any] | None = None,
    relay_options: Mapping[str, Any] | None = None,
    join_timeout: float = 30.0,
    start_timeout: float = START_TIMEOUT,
) -> RayHostGroup: ...


def start_workers(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    scheme: MultiProcessWeightSyncScheme | DistributedWeightSyncScheme,
    *args: Any,
    num_workers: int | None = None,
    worker_ids: Iterable[int] | None = None,
    nodes: Mapping[int, str] | Sequence[str] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    actor_options: Mapping[str, Any] | None = None,
    relay_options: Mapping[str, Any] | None = None,
    join_timeout: float = 30.0,
    start_timeout: float = START_TIMEOUT,
) -> RayWorkerGroup | RayHostGroup:
    """A group of Ray actors to use as ``async with``: one actor per worker, each running
    ``fn(worker_idx, attached_scheme, *args, **kwargs)`` in its event loop.

    *scheme* is the trainer's, after ``init_on_sender``:

    - a :class:`MultiProcessWeightSyncScheme`: a :class:`RayWorkerGroup` on the trainer's
      node. The scheme listens (``scheme.listen()``) if it does not yet. The workers are
      *worker_ids* (default: all of the scheme's), or the first *num_workers* of them.
    - a :class:`DistributedWeightSyncScheme`: a :class:`RayHostGroup`, every host of the
      scheme on a Ray node: *nodes* ``{host: node id}``, or node ids in the order of the
      sorted hosts (default: the living nodes other than the trainer's, in ``ray.nodes()``
      order). The trainer's own node may take a host too. Each host runs the number of
      workers ``init_on_sender(hosts=...)`` gave it; ``worker_idx`` is the local index.
      *relay_options* go to the relay actors' ``.options()`` (default ``num_cpus=0``).

    *actor_options* go to the worker actors' ``.options()`` (``num_cpus``, ``num_gpus``,
    ``runtime_env``, ...); by default each is pinned to the node of its shared memory. See
    the module docstring for examples.
    """
    if isinstance(scheme, DistributedWeightSyncScheme):
        if num_workers is not None or worker_ids is not None:
            raise ValueError("with a DistributedWeightSyncScheme, init_on_sender(hosts=...) says how many workers each host runs")
        placement = _placement(scheme, nodes)
        return RayHostGroup(fn, scheme, args, kwargs or {}, placement, actor_options or {}, relay_options or {}, join_timeout, start_timeout)
    if not isinstance(scheme, MultiProcessWeightSyncScheme):
        raise TypeError(f"scheme must be the trainer's MultiProcessWeightSyncScheme or DistributedWeightSyncScheme, got {type(scheme).__name__}")
    if nodes is not None or relay_options is not None:
        raise ValueError("nodes= and relay_options= place workers on other nodes: pass a DistributedWeightSyncScheme")
    ids = list(scheme.sender.worker_ids) if worker_ids is None else list(worker_ids)
    if num_workers is not None:
        if num_workers < 1 or num_workers > len(ids):
            raise ValueError(f"num_workers={num_workers}, but the scheme has workers {ids}")
        ids = ids[:num_workers]
    unknown = sorted(set(ids) - set(scheme.sender.worker_ids))
    if unknown:
        raise ValueError(f"workers {unknown} are not the scheme's workers {list(scheme.sender.worker_ids)}")
    return RayWorkerGroup(fn, scheme, args, kwargs or {}, ids, actor_options or {}, join_timeout, start_timeout)


def _placement(scheme: DistributedWeightSyncScheme, nodes: Mapping[int, str] | Sequence[str] | None) -> dict[int, str]:
    """``{host: node id}`` for every host of *scheme*, checked against the cluster before
    anything starts: living nodes, and a trainer address they can reach."""
    ray = _ray()
    hosts = sorted(scheme.hosts)
    alive = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    here = ray.get_runtime_context().get_node_id()
    if nodes is None:
        others = [n for n in alive if n != here]
        if len(others) < len(hosts):
            raise ValueError(
                f"the scheme has {len(hosts)} hosts {hosts}, but the Ray cluster has {len(others)} other living nodes: "
                "pass nodes={host: node id} (the trainer's own node may take a host)"
            )
        placement = dict(zip(hosts, others))
    elif isinstance(nodes, Mapping):
        placement = {int(h): str(n) for h, n in nodes.items()}
        if sorted(placement) != hosts:
            raise ValueError(f"nodes= names hosts {sorted(placement)}, but the scheme's hosts are {hosts}")
    else:
        listed = [str(n) for n in nodes]
        if len(listed) != len(hosts):
            raise ValueError(f"nodes= lists {len(listed)} nodes for the scheme's {len(hosts)} hosts {hosts}")
        placement = dict(zip(hosts, listed))
    for h, node in placement.items():
        if node not in alive:
            raise ValueError(f"host {h}: {node!r} is not a living node of the Ray cluster")
        if _loopback(scheme.bind) and alive[node] != alive.get(here):
            raise ValueError(
                f"host {h}'s node {node} ({alive[node]}) cannot reach the trainer at {scheme.bind}: build the scheme with "
                "master_addr=ray.util.get_node_ip_address() (or bind= an address the nodes reach)"
            )
    return placement


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


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


def _run(ref: Any) -> asyncio.Future[Any]:
    """An actor method's call as a future whose failure is retrieved (joins report it)."""
    fut = asyncio.ensure_future(_awaited(ref))
    fut.add_done_callback(retrieve)
    return fut


async def _awaited(ref: Any) -> Any:
    return await ref


def _failed(fut: asyncio.Future[Any]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is not None


def _describe(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the function's own exception
    return f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else f"{type(exc).__name__}: {exc}"


def _label(fut: asyncio.Future[Any]) -> str:
    exc = fut.exception()
    assert exc is not None
    return _describe(exc)
