"""``MultiProcessWeightSyncScheme``: the user-facing object, in torchrl's vocabulary.

The same object is configured in the trainer (``init_on_sender``), pickled to each worker
process (it carries only the workers' channel ends), and configured there
(``init_on_receiver``). ``connect()``, ``send()``, ``aclose()`` and ``async with`` then act
for whichever side this process is.

Example::

    scheme = MultiProcessWeightSyncScheme(strategy="tensordict")
    scheme.init_on_sender(model=policy, num_workers=2)
    # start workers with `scheme` as an argument, then:
    async with scheme:                      # connect(): initial weights to everyone
        for step in range(100):
            train_step(policy)
            await scheme.send()             # returns once every worker applied it

    # in each worker process:
    scheme.init_on_receiver(worker_idx=i, model=local_policy)
    async with scheme:
        await scheme.wait_stopped()         # or serve requests; updates land in between
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

from .._core._deadline import Deadline
from .._core._delivery import Delivery, WorkerIds
from .._core._layout import Layout
from .._core._options import (
    DEFAULT,
    Commit,
    CommitMode,
    LocalOptions,
    OnWorkerError,
    SchemeOptions,
    Strategy,
    TransportKind,
    UseDefault,
    check_poll,
    parse_device,
    parse_worker_ids,
    resolve_timeout,
)
from .._core._sender import Sender
from .._core._source import configured_source
from .._core._weights import as_user_weights, resolve_model, to_flat
from .._errors import ClosedError
from .._io._fdpass import Endpoint
from .._io._slots import SlotPool
from .._local._attach import Listener, WorkerAddress, adopt_into, dial, placeholder_connection
from .._local._receiver import OnUpdate, Receiver
from .._local._transport import LocalTransport
from ._base import SchemeBase

__all__ = ["MultiProcessWeightSyncScheme", "loopback_worker"]

INDEX = WorkerIds("an int", lambda i: isinstance(i, int) and not isinstance(i, bool))


class MultiProcessWeightSyncScheme(SchemeBase[int]):
    """Asyncio weight synchronisation from one trainer to many worker processes.

    Args:
        strategy: ``"tensordict"`` (weights as TensorDict) or ``"state_dict"`` (plain dict).
        sync: if True, :meth:`send` waits until every targeted worker applied the weights.
        timeout: default bound, in seconds, of every wait (``None``: no bound): what a
            method's ``timeout=DEFAULT`` stands for.
        transport: ``"shm"`` (default: shared-memory slots allocated once and reused, one
            copy per send whatever the number of workers) or ``"queue"`` (a fresh
            shared-memory segment travels with every message, as with torch pickling).
        num_slots: slots allocated at connect (``"shm"``) and kept. Default 2, or 3 with
            ``commit_mode="manual"`` (one live, one staged, one being written).
            When lagging workers or subset sends hold them all, a slot is added (within
            the ownership bound) and kept for reuse.
        max_slots: cap on slots allocated at once. Default None: only the ownership
            bound ``k·W + L + G + 1`` applies (see docs/overview.md), and a send never
            waits for a worker. With a cap, a send may wait (within its timeout) for a
            lagging worker to release a slot, and raises :class:`CapacityError` when no
            answer outstanding could free one.
        commit: on the worker, ``"swap"`` points the parameters at the new weights (no
            second copy; on CPU they view the shared slot) or ``"copy"`` copies in place so
            parameter addresses stay stable (CUDA graphs, compiled modules).
        commit_mode: ``"auto"`` commits as soon as staged; ``"manual"`` waits for the
            worker to call :meth:`commit` at a safe point.
        on_worker_error: ``"raise"`` (a dead worker fails sends that target it) or
            ``"skip"`` (sends go on to the living workers).
        check_finite: reject weights holding NaN or inf before sending.
        transfer_dtype: send floating-point tensors in this dtype (e.g. ``torch.bfloat16``
            halves the bytes); workers cast back to their model's dtype while staging.

    Example::

        policy = make_policy()
        scheme = MultiProcessWeightSyncScheme(strategy="tensordict", timeout=10)
        scheme.init_on_sender(model=policy, num_workers=2)
        # Each worker process does this with the scheme it was given (here: loopbacks).
        workers = [loopback_worker(scheme, i) for i in range(2)]
        for i, worker in enumerate(workers):
            worker.init_on_receiver(worker_idx=i, model=make_policy())
        joining = [asyncio.ensure_future(w.connect()) for w in workers]
        async with scheme:                     # connect(): version 0 to both workers
            await asyncio.gather(*joining)
            with torch.no_grad():
                policy[0].weight.add_(0.1)     # a training step
            print(await scheme.send())         # 1: both workers applied it
            version = await scheme.send_async()  # returns once the snapshot is taken
            await scheme.wait_async(version)   # ... and now both applied it
            print(scheme.version, [w.version for w in workers])  # 2 [2, 2]
        for worker in workers:
            await worker.aclose()
    """

    def __init__(
        self,
        strategy: Strategy = "tensordict",
        sync: bool = True,
        timeout: float | None = 60.0,
        *,
        transport: TransportKind = "shm",
        num_slots: int | None = None,
        max_slots: int | None = None,
        commit: Commit = "swap",
        commit_mode: CommitMode = "auto",
        on_worker_error: OnWorkerError = "raise",
        check_finite: bool = False,
        transfer_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(SchemeOptions(strategy, sync, timeout, commit, commit_mode, on_worker_error, check_finite, transfer_dtype))
        self._slot_options = LocalOptions(transport, num_slots if num_slots is not None else (3 if commit_mode == "manual" else 2), max_slots)
        self._endpoints: dict[int, Connection] = {}
        self._transport: LocalTransport | None = None
        self._listener: Listener | None = None  # trainer: workers attaching by address
        self._attach: tuple[WorkerAddress, int] | None = None  # worker: where to attach, as whom
        self._placeholder: Connection | None = None  # worker attaching: its channel, until connect() dials
        self._device_of: Callable[[int], str] | None = None  # elastic: a new worker's device, from device_map_fn

    @property
    def transport(self) -> TransportKind:
        """``"shm"`` (slots reused) or ``"queue"`` (a fresh segment per message)."""
        return self._slot_options.transport

    @property
    def num_slots(self) -> int:
        return self._slot_options.num_slots

    @property
    def max_slots(self) -> int | None:
        return self._slot_options.max_slots

    def _local_transport(self) -> LocalTransport:
        if self._transport is None:
            raise RuntimeError("call init_on_sender() first")
        return self._transport

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_sender", "_receiver", "_role", "_transport", "_listener", "_device_of")}
        ends = self._transport.child_endpoints() if self._transport is not None else dict(self._endpoints)
        uninitialised = self._role is None and self._attach is None and not ends
        if uninitialised and mp.context.get_spawning_popen() is not None:
            raise RuntimeError(_BEFORE_INIT)  # a process being started: say so here, before it runs
        state["_endpoints"] = {i: Endpoint(c) for i, c in ends.items()}
        state["_before_init"] = uninitialised  # another pickler (Ray...): the worker says so
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_endpoints"] = {i: e.conn if isinstance(e, Endpoint) else e for i, e in state["_endpoints"].items()}
        self.__dict__.update(state)
        self._sender = self._receiver = self._role = None
        self._transport = None
        self._listener = None
        self._device_of = None

    # ------------------------------------------------------------------ sender side

    def init_on_sender(
        self,
        model_id: str | None = None,
        context: Any = None,
        *,
        weights: Any = None,
        model: nn.Module | None = None,
        params_map: Mapping[int, Any] | None = None,
        devices: Sequence[torch.device | str] | Mapping[int, torch.device | str] | None = None,
        device_map_fn: Callable[[int, Any], Any] | None = None,
        num_workers: int | None = None,
        worker_ids: Iterable[int] | None = None,
        ctx: mp.context.BaseContext | None = None,
        elastic: bool = False,
    ) -> None:
        """Configure the trainer side.

        Where the weights come from (one of): *model* (read at every send), *weights*
        (a TensorDict/state dict read at every send), *params_map* (``{worker_id:
        weights}``, its keys are the worker ids and its tensors' device each worker's
        device), or *context* + *model_id* (the model is ``context.<model_id>``).

        Which workers: *num_workers* (ids ``0..n-1``), *worker_ids*, *devices* (one per
        worker: where that worker stages its weights) or *params_map*.
        *device_map_fn(worker_idx, weights)* gives a worker's weights on its device; it
        is called one worker at a time to learn the device, the result is not kept.

        *elastic*: the workers named are the first members, and others may join at any
        time (:meth:`add_worker`, or attaching by address with a new index; ``num_workers=0``
        starts with none); a member that is gone stops being a target of sends to all.
        See docs/elastic.md.
        """
        if self._role is not None:
            raise RuntimeError("this scheme is already initialised")
        if elastic and params_map is not None:
            raise ValueError("elastic=True needs one source for every worker (model=, weights= or context): params_map names each worker's own")
        if params_map is not None and (weights is not None or model is not None):
            raise ValueError("params_map gives each worker's weights; do not pass weights or model with it")
        if params_map is not None and (devices is not None or device_map_fn is not None):
            raise ValueError("params_map already fixes each worker's device; do not pass devices or device_map_fn with it")
        if devices is not None and device_map_fn is not None:
            raise ValueError("pass either devices or device_map_fn, not both")
        if ctx is None:
            ctx = mp.get_context("spawn")
        elif not isinstance(ctx, mp.context.BaseContext):
            raise TypeError(f"ctx must be a multiprocessing context, got {type(ctx).__name__}")
        elif ctx.get_start_method() == "fork":
            raise ValueError("asyncsync workers need the 'spawn' (or 'forkserver') start method, not 'fork'")
        if params_map is None:
            source, first = configured_source(model, weights, context, model_id, choices="model=, weights= or params_map=")

        ids = [] if elastic and num_workers == 0 and worker_ids is None and devices is None else parse_worker_ids(params_map, devices, device_map_fn, num_workers, worker_ids)
        device_of: dict[int, str | None] = {i: None for i in ids}
        if devices is not None:
            seq = devices if isinstance(devices, Mapping) else dict(zip(ids, devices))
            for i in ids:
                device_of[i] = str(parse_device(seq[i], f"worker {i}"))

        if params_map is not None:
            flat_map = {i: to_flat(params_map[i]) for i in ids}
            for i, flat in flat_map.items():
                device_of[i] = str(next(iter(flat.values())).device) if flat else None
            first = flat_map[ids[0]]
            sources = dict(params_map)
            if not first:
                raise ValueError("the weights hold no tensors")
        else:
            sources = {i: source for i in ids}
        if device_map_fn is not None:
            user_weights = as_user_weights(first, self.strategy)
            self._device_of = lambda i: _mapped_device(device_map_fn, i, user_weights)
            for i in ids:  # one worker at a time: never N device copies alive at once
                device_of[i] = self._device_of(i)

        source_layout, wire_layout = Layout.pair(first, self.transfer_dtype)
        pool = SlotPool(wire_layout, num_slots=self.num_slots, max_slots=self.max_slots, reuse=self.transport == "shm")
        self.model_id = model_id
        delivery: Delivery[int, Any] = Delivery(
            LocalTransport.records(ids, device_of),
            ids=INDEX,
            options=self._options,
            source_layout=source_layout,
            wire_layout=wire_layout,
            sources=sources,
            elastic=elastic,
            source=None if params_map is not None else source,
        )
        self._transport = LocalTransport(delivery, pool=pool, manual=self.commit_mode == "manual", ctx=ctx)
        self._sender = self._role = Sender(delivery, self._transport)

    async def listen(self, path: str | None = None, token: str | bytes | None = None) -> WorkerAddress:
        """Trainer: accept workers that attach by address (processes asyncsync did not start).

        Listens on the Unix socket *path*, made absolute (``"@name"``: a Linux abstract
        socket; None: a fresh abstract socket on Linux, which leaves nothing behind even
        after a crash, elsewhere a socket file in a fresh private directory). *token* is the
        shared secret (None: ``ASYNCSYNC_TOKEN``, else a random one). Returns the
        :class:`WorkerAddress` to hand to the workers (``str(address)`` or
        ``address.env()``); each calls :meth:`attach` with it. Call it before ``connect()``
        (which waits for every worker) or later; it accepts until :meth:`aclose`, which
        removes a socket file and its private directory (after it, ``listen()`` raises
        :class:`ClosedError`). A restarted worker attaches again. From then on the trainer's
        side runs: sends may go out before every worker is there (each gets its newest
        version when it attaches), and ``connect()`` waits for every worker.

        Example::

            scheme.init_on_sender(model=policy, num_workers=2)
            address = await scheme.listen()
            start_my_workers(env=address.env())   # each: MultiProcessWeightSyncScheme.attach()
            async with scheme:                    # waits for both to attach and ack version 0
                await scheme.send()
        """
        transport = self._local_transport()
        if transport.closed:
            raise ClosedError("listen(): the scheme is closed (aclose() was called); no worker can attach to it")
        if self._listener is not None:
            raise RuntimeError(f"this scheme already listens at {self._listener.address.path}")
        options = {"strategy": self.strategy, "commit": self.commit_kind, "commit_mode": self.commit_mode, "timeout": self.timeout}
        self._listener = await Listener.open(transport, options, path, token)
        transport.start()
        return self._listener.address

    def add_worker(self, worker_idx: int, device: torch.device | str | None = None) -> None:
        """Trainer, elastic membership: worker *worker_idx* (a new id) may join now. Start its
        process with this scheme (``spawn_workers``, a worker group's ``add``), as for the
        first workers; it gets the members' newest version when it connects, and from then
        on every send to all. *device*: where it stages its weights (default: from
        ``device_map_fn``, else its model's own). A worker attaching by address with a new
        index needs no call: it joins when it attaches.

        Example::

            scheme.init_on_sender(model=policy, num_workers=1, elastic=True)
            async with scheme:
                scheme.add_worker(1)                  # then start its process with `scheme`
        """
        if device is not None:
            where = str(parse_device(device, f"worker {worker_idx}"))
        else:
            where = self._device_of(worker_idx) if self._device_of is not None else None
        self._local_transport().add_worker(worker_idx, where)

    @property
    def listener(self) -> Listener | None:
        """Trainer: the socket workers attach to, after :meth:`listen` (``refused`` counts refusals)."""
        return self._listener

    @classmethod
    def attach(
        cls,
        address: WorkerAddress | str | None = None,
        *,
        worker_idx: int,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> MultiProcessWeightSyncScheme:
        """Worker: a scheme that joins the trainer at *address* as worker *worker_idx*.

        *address* is what the trainer's :meth:`listen` returned, or its string form (None:
        ``ASYNCSYNC_ADDRESS``); it carries the token and the trainer's options. Then, as in
        a worker started by ``spawn_workers``: ``init_on_receiver(model=...)`` and ``async
        with scheme`` (``connect()`` attaches, retrying while nothing listens yet, within
        *timeout*, by default the trainer's). Joining late, or again after a crash, the
        worker gets the newest version first.

        Example::

            scheme = MultiProcessWeightSyncScheme.attach(sys.argv[1], worker_idx=0)
            scheme.init_on_receiver(model=make_policy())
            async with scheme:
                await scheme.wait_stopped()
        """
        if isinstance(address, str):
            address = WorkerAddress.from_string(address)
        elif address is None:
            address = WorkerAddress.from_env()
        elif not isinstance(address, WorkerAddress):
            raise TypeError(f"address must be a WorkerAddress or its string form, got {type(address).__name__}")
        if not isinstance(worker_idx, int) or isinstance(worker_idx, bool) or worker_idx < 0:
            raise ValueError(f"worker_idx must be a non-negative int, got {worker_idx!r}")
        scheme = cls(
            strategy=address.strategy,  # type: ignore[arg-type]
            timeout=address.timeout if isinstance(timeout, UseDefault) else timeout,
            commit=address.commit,  # type: ignore[arg-type]
            commit_mode=address.commit_mode,  # type: ignore[arg-type]
        )
        scheme._attach = (address, worker_idx)
        return scheme

    # ------------------------------------------------------------------ receiver side

    def init_on_receiver(
        self,
        model_id: str | None = None,
        context: Any = None,
        *,
        worker_idx: int | None = None,
        model: nn.Module | None = None,
        on_update: OnUpdate | None = None,
        device: torch.device | str | None = None,
        poll: bool = False,
    ) -> None:
        """Configure the worker side (in the worker process, on the pickled scheme).

        *model* (or ``context.<model_id>``) receives the weights; if *context* has
        ``update_policy_weights_`` it is called with every new version's weights, and
        so is ``on_update(weights, version)`` (sync or async). *device* overrides the
        device chosen on the sender (``devices`` / ``params_map`` / ``device_map_fn``);
        by default the model's own device. A device this process cannot use (CUDA where
        there is none) raises :class:`ValueError` here. *worker_idx* is required, except
        on a scheme made by :meth:`attach` (which names it already). ``poll=True``: after
        ``connect()``, versions change only at :meth:`poll_nowait` calls (see docs/polling.md).
        """
        if self._transport is not None and not self._transport.in_owner_process():
            raise RuntimeError(
                "this scheme reached the worker by fork: asyncsync workers need the 'spawn' (or 'forkserver') "
                "start method, which pickles the scheme with the worker's own channel"
            )
        if self._role is not None:
            raise RuntimeError("this scheme is already initialised")
        if model is None:
            model = resolve_model(context, model_id)
        if model is None:
            raise ValueError("init_on_receiver needs model= (or a context holding the model at context.<model_id>)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if device is not None:
            device = parse_device(device, f"worker {worker_idx}")
        if self._attach is not None:
            if worker_idx is not None and worker_idx != self._attach[1]:
                raise ValueError(f"this scheme attaches as worker {self._attach[1]}, not {worker_idx}")
            worker_idx = self._attach[1]
            self._placeholder = self._endpoints[worker_idx] = placeholder_connection()  # the socket lands behind it at connect()
        if worker_idx is None:
            raise TypeError("init_on_receiver() needs worker_idx=")
        check_poll(poll, self.commit_mode)
        conn = self._endpoints.pop(worker_idx, None)
        if conn is None and getattr(self, "_before_init", False):
            raise RuntimeError(_BEFORE_INIT)
        if conn is None:
            raise ValueError(f"no channel for worker {worker_idx}; this scheme carries workers {sorted(self._endpoints)}")
        for other in self._endpoints.values():
            other.close()  # other workers' ends: holding them would hide those workers' deaths
        self._endpoints.clear()
        self.model_id = model_id
        self._receiver = self._role = Receiver(
            conn,
            worker_idx=worker_idx,
            model=model,
            strategy=self.strategy,
            context=context,
            on_update=on_update,
            commit=self.commit_kind,
            commit_mode=self.commit_mode,
            timeout=self.timeout,
            device=device,
            poll=poll,
        )

    # ------------------------------------------------------------------ both sides

    async def connect(self, timeout: float | None | UseDefault = DEFAULT) -> int:
        """Sender: send the initial weights and wait for every worker's ack.
        Worker: start the receiver task and wait for the initial weights. Returns the version."""
        if self._attach is not None and self._placeholder is not None:
            address, idx = self._attach
            deadline = Deadline(resolve_timeout(timeout, self.timeout))  # a bad one is refused before dialling
            adopt_into(await dial(address, idx, deadline.remaining()), self._placeholder.fileno())
            self._placeholder = None  # (a connect() after a timeout waits on the same socket)
            timeout = deadline.remaining()
        return await super().connect(timeout)

    async def _close(self, failure: str | None) -> None:
        if self._listener is not None:
            await self._listener.aclose()  # no worker joins a closing trainer
        if self._sender is not None:
            await self._sender.aclose()
        elif self._receiver is not None:
            await self._receiver.aclose(reason=failure or "the worker closed its receiver")

    def watch_process(self, worker_idx: int, process: Any) -> None:
        """Watch a worker's process (its ``sentinel``) to notice its death at once."""
        self._local_transport().watch_process(worker_idx, process)

    async def wait_stopped(self) -> None:
        """Worker: wait for ``stop``; raises :class:`SenderDiedError` if the trainer died."""
        await self.receiver.wait_stopped()


def _mapped_device(device_map_fn: Callable[[int, Any], Any], worker_idx: int, weights: Any) -> str:
    mapped = to_flat(device_map_fn(worker_idx, weights))
    return str(next(iter(mapped.values())).device)


_BEFORE_INIT = (
    "this scheme was pickled (sent to a worker) before init_on_sender() was called on it, so it carries no "
    "worker channels: call scheme.init_on_sender(...) in the trainer first, then start the workers with the scheme"
)


def loopback_worker(scheme: MultiProcessWeightSyncScheme, worker_idx: int) -> MultiProcessWeightSyncScheme:
    """A worker-side copy of *scheme* (set up with ``init_on_sender``) for *worker_idx*, in this process.

    Call ``init_on_receiver(worker_idx=worker_idx, ...)`` on it, as a worker process would.
    After a worker left or died, call it again for a replacement on the new channel.

    Example::

        policy = make_policy()
        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=policy, num_workers=1)
        local = make_policy()
        worker = loopback_worker(scheme, 0)    # worker 0's side, in this event loop
        worker.init_on_receiver(worker_idx=0, model=local, on_update=lambda weights, version: print("applied", version))
        await asyncio.gather(scheme.connect(), worker.connect())   # applied 0
        with torch.no_grad():
            policy[0].bias.fill_(1.0)          # a training step
        await scheme.send()                    # applied 1
        print(local[0].bias.tolist())          # [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        await scheme.aclose()
        await worker.aclose()
    """
    ends = scheme._local_transport().child_endpoints()
    if worker_idx not in ends:
        raise ValueError(f"worker {worker_idx} has no channel to hand out (it is connected); workers waiting: {sorted(ends)}")
    worker = copy.copy(scheme)
    worker.__dict__.update(_sender=None, _receiver=None, _role=None, _transport=None, _listener=None, _endpoints={worker_idx: Connection(os.dup(ends[worker_idx].fileno()))})
    return worker
