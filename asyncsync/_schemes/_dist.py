"""``DistributedWeightSyncScheme``: the multi-host scheme, with the local scheme's API.

The trainer (launch rank 0 by default) calls :meth:`~DistributedWeightSyncScheme.init_on_sender`
and then uses ``connect`` / ``send`` / ``send_async`` / ``wait_async`` / ``aclose`` exactly
as with :class:`MultiProcessWeightSyncScheme`; worker ids are ``(host, local index)``.
Every other host calls :meth:`~DistributedWeightSyncScheme.init_on_relay` and hands the
scheme to its workers (``spawn_workers(fn, n, args=(scheme,), scheme=scheme.local)``):
pickled, it *is* the host's local scheme, so the worker function is the one used on one
host. A rank that is itself the worker (torchrl's layout) calls
:meth:`~DistributedWeightSyncScheme.init_on_receiver` instead. See docs/multihost.md.

Example (rank 0 trains, the other ranks host workers)::

    scheme = DistributedWeightSyncScheme(token="s3cret")      # RANK, WORLD_SIZE, MASTER_* from the env
    if scheme.rank == 0:
        scheme.init_on_sender(model=policy, workers_per_host=2)
        async with scheme:
            await scheme.send()
    else:
        scheme.init_on_relay(model=make_policy(), num_workers=2)
        async with spawn_workers(worker, 2, args=(scheme,), scheme=scheme.local):
            async with scheme:
                await scheme.wait_stopped()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._core._delivery import Delivery, WorkerIds
from .._core._layout import Layout
from .._core._options import (
    DEFAULT,
    Commit,
    CommitMode,
    OnWorkerError,
    SchemeOptions,
    Strategy,
    Timeout,
    UseDefault,
    check_poll,
    parse_device,
    resolve_timeout,
)
from .._core._sender import Sender
from .._core._source import configured_source
from .._core._weights import resolve_model, to_flat
from .._dist._dataplane import DEFAULT_CHUNK_BYTES
from .._dist._relay import Relay
from .._dist._rendezvous import Rendezvous
from .._dist._transport import RemoteTransport, WorkerId, is_pair
from .._errors import ClosedError
from .._io._loop_thread import LoopThread
from .._local._receiver import OnUpdate
from ._base import SchemeBase
from ._local import MultiProcessWeightSyncScheme, loopback_worker

__all__ = ["DistributedWeightSyncScheme"]

SILENCE_BEATS = 5
"""The default ``silence_timeout`` is at least this many heartbeat periods."""

PAIR = WorkerIds("a (host, local index) pair", is_pair)


class DistributedWeightSyncScheme(SchemeBase[WorkerId]):
    """Weight synchronisation from one trainer to worker processes on several hosts.

    Args (those of :class:`MultiProcessWeightSyncScheme`, plus):
        token: the shared secret of the control plane (default: ``ASYNCSYNC_TOKEN``; if
            neither is set, rank 0 puts a random one in the rendezvous store, which then
            protects only as much as access to the store does).
        rank, world_size, master_addr, master_port: the launch (default: ``RANK``,
            ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` as torchrun sets them).
            Rank 0 is the trainer by default; every other rank is a host.
        store: a ``torch.distributed.Store`` to rendezvous on (default: torchrun's agent
            store when there is one, else a ``TCPStore`` on ``master_addr`` at
            ``master_port + 1``, hosted by rank 0, so the user's own group keeps its port).
        bind: the address the trainer's control plane listens on, and the one relays
            advertise to the data plane (default: ``master_addr``).
        chunk_bytes: the size of one network transfer chunk (default 64 MiB).
        heartbeat: seconds between heartbeats.
        silence_timeout: a peer that sent nothing, heartbeats included, for this long is
            gone (default: ``max(timeout, 5 * heartbeat)``; ``None`` with ``timeout=None``:
            only EOF counts; an explicit value must be longer than ``heartbeat``). A
            killed process is noticed at once anyway (its connection ends); this is for
            partitions and hung hosts. Heartbeats come from a thread of each control
            connection, not from the event loop: a loop blocked by a long synchronous
            step does not look dead.
        backend: ``"gloo"`` (default: CPU memory on the wire) or ``"nccl"`` (CUDA memory on
            the wire: the trainer keeps its snapshots on its GPU and each relay receives
            through two ``chunk_bytes`` buffers on its GPU into the host's shared memory).
        device: with ``backend="nccl"``, this rank's CUDA device (default: the trainer's
            model's device; on a relay ``cuda:LOCAL_RANK``, else the current device).

    Example::

        import socket

        with socket.socket() as s:                      # a free port for the rendezvous store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        common = dict(timeout=10, token="s3cret", world_size=2, master_addr="127.0.0.1", master_port=port)
        trainer = DistributedWeightSyncScheme(rank=0, **common)
        trainer.init_on_sender(model=make_policy(), hosts={1: 1})   # host 1 runs one worker
        host = DistributedWeightSyncScheme(rank=1, **common)         # (another machine, normally)
        host.init_on_relay(model=make_policy(), num_workers=1)
        worker = loopback_worker(host.local, 0)   # (spawn_workers(fn, 1, args=(host,), scheme=host.local), normally)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        await asyncio.gather(trainer.connect(), host.connect(), worker.connect())
        version = await trainer.send()            # every worker of every host applied it
        print(version, trainer.sender.applied_versions())   # 1 {(1, 0): 1}
        print(worker.version)                     # 1: the trainer's version number
        await trainer.aclose()
        await host.aclose()
        await worker.aclose()
    """

    def __init__(
        self,
        strategy: Strategy = "tensordict",
        sync: bool = True,
        timeout: float | None = 60.0,
        *,
        commit: Commit = "swap",
        commit_mode: CommitMode = "auto",
        on_worker_error: OnWorkerError = "raise",
        check_finite: bool = False,
        transfer_dtype: torch.dtype | None = None,
        token: str | bytes | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        store: Any = None,
        bind: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        heartbeat: float = 1.0,
        silence_timeout: float | None | UseDefault = DEFAULT,
        backend: str = "gloo",
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(SchemeOptions(strategy, sync, timeout, commit, commit_mode, on_worker_error, check_finite, transfer_dtype))
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, which this host does not have; use backend='gloo'")
        if device is not None:
            if backend != "nccl":
                raise ValueError(f"device= is the NCCL wire's CUDA device; backend={backend!r} sends from CPU memory")
            if torch.device(device).type != "cuda":
                raise ValueError(f"backend='nccl' needs a CUDA device, got device={device!r}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if heartbeat <= 0:
            raise ValueError(f"heartbeat must be positive, got {heartbeat}")
        self._rendezvous = Rendezvous.of(
            rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, store=store, token=token, timeout=timeout
        )
        self.bind = bind or self.master_addr
        self.chunk_bytes = chunk_bytes
        self.heartbeat = heartbeat
        # the default is derived, so that any valid timeout works: at least SILENCE_BEATS heartbeats
        derived = None if timeout is None else max(timeout, SILENCE_BEATS * heartbeat)
        self.silence_timeout = resolve_timeout(silence_timeout, derived, "silence_timeout")
        if self.silence_timeout is not None and not self.silence_timeout > heartbeat:  # only an explicit one can be
            raise ValueError(
                f"silence_timeout ({self.silence_timeout}) must be longer than heartbeat ({heartbeat}): a peer beats every"
                f" heartbeat seconds; leave silence_timeout unset for max(timeout, {SILENCE_BEATS} x heartbeat)"
            )
        self.backend = backend
        self.device = torch.device(device) if device is not None else None
        self._wire_device: torch.device | None = None  # gloo: host memory (a test may set a CUDA one)
        self._transport: RemoteTransport | None = None
        self._relay: Relay | None = None
        self._local: MultiProcessWeightSyncScheme | None = None
        self._worker: MultiProcessWeightSyncScheme | None = None  # init_on_receiver: the worker in this process

    @property
    def rank(self) -> int:
        return self._rendezvous.rank

    @property
    def world_size(self) -> int:
        return self._rendezvous.world_size

    @property
    def master_addr(self) -> str:
        return self._rendezvous.master_addr

    @property
    def master_port(self) -> int:
        return self._rendezvous.master_port

    def _relay_kwargs(self) -> dict[str, Any]:
        """The constructor's arguments for a relay of this trainer started elsewhere (a Ray
        actor): the same options, this trainer's store given as an explicit address."""
        if self._rendezvous.user_store is not None:
            raise ValueError("relays started for this trainer must reach its rendezvous store: do not pass store=")
        return dict(
            self._options.kwargs(),
            token=self._rendezvous.token,
            master_addr=self.master_addr,
            master_port=self._rendezvous.store_port(),
            heartbeat=self.heartbeat,
            silence_timeout=self.silence_timeout,
            backend=self.backend,
        )

    # ------------------------------------------------------------------ pickling

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (to a worker process), a relay's scheme is its local scheme."""
        if self._local is None:
            raise TypeError("only a relay's scheme (after init_on_relay) can be handed to worker processes")
        return (_same, (self._local,))

    # ------------------------------------------------------------------ trainer

    def init_on_sender(
        self,
        model_id: str | None = None,
        context: Any = None,
        *,
        weights: Any = None,
        model: nn.Module | None = None,
        hosts: Mapping[int, int] | None = None,
        workers_per_host: int | None = None,
        elastic: bool = False,
    ) -> None:
        """Configure the trainer: the weights (*model*, *weights* or *context* + *model_id*)
        and the hosts: *hosts* ``{host: number of local workers}``, or *workers_per_host*
        for every rank of the launch but this one."""
        if self._role is not None:
            raise RuntimeError("this scheme is already initialised")
        source, first = configured_source(model, weights, context, model_id, choices="model= or weights=")
        if hosts is None:
            if workers_per_host is None:
                raise ValueError("pass hosts={host: num_workers} or workers_per_host=")
            hosts = {r: workers_per_host for r in range(self.world_size) if r != self.rank}
        elif workers_per_host is not None:
            raise ValueError("pass either hosts or workers_per_host, not both")
        hosts = dict(hosts)
        if not hosts and not elastic:
            raise ValueError("no hosts: the launch has a single rank (use MultiProcessWeightSyncScheme on one host)")
        for h, n in hosts.items():
            if not (isinstance(h, int) and h >= 0 and isinstance(n, int) and n >= 1):
                raise ValueError(f"hosts maps host ids (ints >= 0) to worker counts (>= 1), got {h!r}: {n!r}")
        source_layout, wire_layout = Layout.pair(first, self.transfer_dtype)
        self._source_layout = source_layout  # what a relay's model must be (before transfer_dtype)
        self.model_id = model_id
        store = self._rendezvous.open_store()
        host_records = RemoteTransport.hosts_of(hosts)
        delivery: Delivery[WorkerId, Any] = Delivery(
            RemoteTransport.records(host_records),
            ids=PAIR,
            options=self._options,
            source_layout=source_layout,
            wire_layout=wire_layout,
            sources={wid: source for h in host_records.values() for wid in ((h.idx, i) for i in h.workers)},
            elastic=elastic,
            source=source,
        )
        self._transport = RemoteTransport(
            delivery,
            host_records,
            store=store,
            token=self._rendezvous.trainer_token(store),
            bind=self.bind,
            chunk_bytes=self.chunk_bytes,
            heartbeat=self.heartbeat,
            silence_timeout=self.silence_timeout,
            backend=self.backend,
            device=self._wire(first),
        )
        self._sender = self._role = Sender(delivery, self._transport)

    async def listen(self) -> tuple[str, int]:
        """Trainer: listen for relays and publish the control address in the store, without
        waiting for them; returns the address. :meth:`connect` does it if it was not done.
        Sends may go out before every host is there: each gets its workers' newest version
        when it joins."""
        return await self._remote().start()

    @property
    def hosts(self) -> list[int]:
        """Trainer: the host ids."""
        return self._remote().hosts

    async def wait_host_joined(self, host: int, timeout: Timeout = DEFAULT) -> None:
        """Trainer: wait until *host* is connected and each of its workers answered its newest version."""
        await self._remote().wait_host_joined(host, resolve_timeout(timeout, self.timeout))

    async def wait_lost(self, host: int, timeout: Timeout = DEFAULT) -> None:
        """Trainer: wait until *host* is declared lost."""
        await self._remote().wait_lost(host, resolve_timeout(timeout, self.timeout))

    def _remote(self) -> RemoteTransport:
        if self._transport is None:
            raise RuntimeError("call init_on_sender() first")
        return self._transport

    # ------------------------------------------------------------------ relay

    def init_on_relay(
        self,
        model_id: str | None = None,
        context: Any = None,
        *,
        model: nn.Module | None = None,
        weights: Any = None,
        num_workers: int,
        host: int | None = None,
    ) -> MultiProcessWeightSyncScheme:
        """Configure this host's relay for *num_workers* local workers; returns the local
        scheme (also :attr:`local`) to start them with. *model* (or *weights*) is the
        same architecture as the trainer's: its layout is checked against the trainer's
        when the relay connects; its values are never sent. *host* defaults to the rank."""
        if self._role is not None:
            raise RuntimeError("this scheme is already initialised")
        if model is None and weights is None:
            model = resolve_model(context, model_id)
            if model is None:
                raise ValueError("the relay needs the model's architecture: pass model= or weights=")
        template = to_flat(model if model is not None else weights)
        frozen = _frozen_copy(template)  # the relay never reads it again
        local = MultiProcessWeightSyncScheme(**self._options.kwargs())
        local.init_on_sender(weights=frozen, num_workers=num_workers)
        self._local = local
        # The store is opened by connect(), off the loop and bounded by its timeout (a store
        # client connecting to a host that does not answer would block here).
        self._relay = self._role = Relay(
            host=self.rank if host is None else host,
            local=local.sender,
            landing=local._local_transport(),
            open_store=self._rendezvous.open_store,
            store_name=self._rendezvous.store_name(),
            token=self._rendezvous.token,
            timeout=self.timeout,
            heartbeat=self.heartbeat,
            silence_timeout=self.silence_timeout,
            backend=self.backend,
            hostname=self.bind if self.bind != self.master_addr else None,
            device=self._wire(None),
        )
        return local

    def _wire(self, flat: Mapping[str, torch.Tensor] | None) -> torch.device | None:
        """The device the weight bytes travel from and to: None (host memory) with gloo;
        with NCCL, ``device=``, else the trainer's model's CUDA device, else this rank's."""
        if self.backend != "nccl":
            return self._wire_device
        if self.device is not None:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return torch.device("cuda", index)
        for t in (flat or {}).values():
            if t.device.type == "cuda":
                return t.device
        local_rank = os.environ.get("LOCAL_RANK")
        return torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())

    # ------------------------------------------------------------------ one worker per rank

    def init_on_receiver(
        self,
        model_id: str | None = None,
        context: Any = None,
        *,
        model: nn.Module | None = None,
        worker_idx: int = 0,
        on_update: OnUpdate | None = None,
        device: torch.device | str | None = None,
        host: int | None = None,
        poll: bool = False,
    ) -> None:
        """Make this rank a host whose only worker is this process (torchrl's layout: one
        worker per rank): the worker's receiver runs in this event loop, its relay in a
        small event-loop thread of its own (a busy worker loop holds up no other host),
        and the trainer names the worker ``(host, 0)``. *model* (or ``context.<model_id>``) receives the
        weights, as with :meth:`MultiProcessWeightSyncScheme.init_on_receiver`; then
        ``connect`` / ``version`` / ``commit`` / ``wait_for_version`` / ``wait_stopped``
        / ``aclose`` work as on a worker. *worker_idx* must be 0 (one worker per rank).
        ``poll=True``: a polled worker, as with the local scheme (docs/polling.md): after
        ``connect()``, versions change only at :meth:`poll_nowait` calls.

        Example (on every rank but the trainer's)::

            scheme = DistributedWeightSyncScheme(token="s3cret")   # RANK, WORLD_SIZE, MASTER_* from the env
            scheme.init_on_receiver(model=policy)
            async with scheme:                   # returns once the first weights are applied
                while True:
                    act(policy)                  # new versions land between two steps
        """
        if worker_idx != 0:
            raise ValueError(f"init_on_receiver runs one worker per rank: worker_idx must be 0, got {worker_idx}")
        if model is None:
            model = resolve_model(context, model_id)
        if model is None:
            raise ValueError("init_on_receiver needs model= (or a context holding the model at context.<model_id>)")
        if device is not None:
            parse_device(device, "init_on_receiver")  # before the relay takes anything
        check_poll(poll, self.commit_mode)  # the local scheme's check, before the relay is built
        local = self.init_on_relay(model=model, num_workers=1, host=host)
        worker = loopback_worker(local, 0)
        worker.init_on_receiver(model_id, context, worker_idx=0, model=model, on_update=on_update, device=device, poll=poll)
        self._worker = worker
        self._receiver = worker.receiver
        self._role = _RankWorker(self.relay, local, worker)

    @property
    def worker(self) -> MultiProcessWeightSyncScheme:
        """After :meth:`init_on_receiver`: this process's worker (its local scheme)."""
        if self._worker is None:
            raise RuntimeError("call init_on_receiver() first")
        return self._worker

    @property
    def local(self) -> MultiProcessWeightSyncScheme:
        """A relay's local scheme: pass it to ``spawn_workers(..., scheme=scheme.local)``."""
        if self._local is None:
            raise RuntimeError("call init_on_relay() first")
        return self._local

    @property
    def relay(self) -> Relay:
        if self._relay is None:
            raise RuntimeError("call init_on_relay() first")
        return self._relay

    # ------------------------------------------------------------------ every role

    async def _close(self, failure: str | None) -> None:
        """Trainer: stop every relay (which stops its workers). Relay: leave. Worker: both.
        Releases the rendezvous store too (the trainer's, when it hosts it, stops serving)."""
        role = self._role
        if isinstance(role, _RankWorker):
            await role.aclose(failure)
        elif role is not None:
            await role.aclose()  # type: ignore[attr-defined]
        self._rendezvous.close()

    async def wait_stopped(self) -> None:
        """Relay (or worker): until the trainer stops this host; :class:`SenderDiedError`
        if it died (the worker keeps its last complete weights)."""
        role = self._role
        if isinstance(role, (Relay, _RankWorker)):
            await role.wait_stopped()
        else:
            raise RuntimeError("wait_stopped() is a relay's or a worker's: call init_on_relay() or init_on_receiver() first")


class _RankWorker:
    """A rank that is its own worker: the worker's receiver runs in this event loop, its
    relay in a small event-loop thread of its own (a busy worker loop holds up no other host)."""

    def __init__(self, relay: Relay, local: MultiProcessWeightSyncScheme, worker: MultiProcessWeightSyncScheme) -> None:
        self.relay = relay
        self.local = local
        self.worker = worker
        self._loop: LoopThread | None = None
        self._closed = False

    @property
    def version(self) -> int:
        return self.worker.version

    def statistics(self) -> Any:
        return self.worker.statistics()

    async def connect(self, timeout: Timeout = DEFAULT) -> int:
        if self._loop is None:
            if self._closed:
                raise ClosedError(f"host {self.relay.host}: the relay is closed")
            self._loop = LoopThread(f"asyncsync-relay-{self.relay.host}")
        both = [
            asyncio.ensure_future(self._loop.call(self.relay.connect(timeout=timeout))),
            asyncio.ensure_future(self.worker.connect(timeout=timeout)),
        ]
        try:
            version, _ = await asyncio.gather(*both)
        except BaseException:
            for t in both:  # neither may outlive the other's failure
                t.cancel()
            await asyncio.gather(*both, return_exceptions=True)
            raise
        return int(version)

    async def aclose(self, failure: str | None = None) -> None:
        if failure is not None and self._loop is not None:
            # The worker's code failed in the block: its goodbye names the error (the local
            # scheme's rule), and its relay passes it on to the trainer before it leaves.
            await self.worker._close(failure)
            with contextlib.suppress(Exception):
                await self._loop.call(self.local.sender.wait_dead(0, timeout=5.0))
        self._closed = True
        loop, self._loop = self._loop, None
        if loop is not None:
            await loop.call(self.relay.aclose())
            loop.close()
        else:
            await self.relay.aclose()
        await self.worker.aclose()

    async def wait_stopped(self) -> None:
        await self.worker.wait_stopped()
        error = self.relay.error
        if error is not None:  # e.g. another relay replaced this rank's: its worker was stopped
            raise error


def _same(scheme: MultiProcessWeightSyncScheme) -> MultiProcessWeightSyncScheme:
    return scheme


def _frozen_copy(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached copy of *flat* that keeps its ties (the layout's aliases: names of one
    tensor stay names of one copy), so the relay's wire layout is the trainer's."""
    aliases = Layout.from_tensors(flat).alias_map
    frozen = {k: t.detach().clone() for k, t in flat.items() if k not in aliases}
    for alias, canonical in aliases.items():
        frozen[alias] = frozen[canonical]
    return {k: frozen[k] for k in flat}  # in the order the weights list them
