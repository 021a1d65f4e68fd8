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

import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn

from .._core._deadline import Deadline
from .._core._source import configured_source
from .._core._strategy import Strategy, as_user_weights, resolve_model, to_flat
from .._errors import ClosedError
from .._io._slots import SlotPool
from .._io._staging import device_problem
from .._options import DEFAULT, OnWorkerError, SchemeOptions, UseDefault, choice, resolve_timeout
from .._stats import ReceiverStatistics, SenderStatistics
from ._attach import Listener, WorkerAddress, adopt_into, dial, placeholder_connection
from ._receiver import Commit, CommitMode, OnUpdate, Receiver
from ._sender import Sender

__all__ = ["MultiProcessWeightSyncScheme"]

Transport = Literal["shm", "queue"]


class MultiProcessWeightSyncScheme:
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
        transport: Transport = "shm",
        num_slots: int | None = None,
        max_slots: int | None = None,
        commit: Commit = "swap",
        commit_mode: CommitMode = "auto",
        on_worker_error: OnWorkerError = "raise",
        check_finite: bool = False,
        transfer_dtype: torch.dtype | None = None,
    ) -> None:
        self._options = SchemeOptions(strategy, sync, timeout, commit, commit_mode, on_worker_error, check_finite, transfer_dtype)
        choice("transport", transport, ("shm", "queue"))
        self.strategy: Strategy = strategy
        self.sync = sync
        self.timeout = timeout
        self.transport: Transport = transport
        self.num_slots = num_slots if num_slots is not None else (3 if commit_mode == "manual" else 2)
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_slots is not None and max_slots < self.num_slots:
            raise ValueError(f"max_slots ({max_slots}) must be >= num_slots ({self.num_slots})")
        self.max_slots = max_slots
        self.commit_kind: Commit = commit
        self.commit_mode: CommitMode = commit_mode
        self.on_worker_error: OnWorkerError = on_worker_error
        self.check_finite = check_finite
        self.transfer_dtype = transfer_dtype
        self.model_id: str | None = None
        self._endpoints: dict[int, Connection] = {}
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        self._listener: Listener | None = None  # trainer: workers attaching by address
        self._attach: tuple[WorkerAddress, int] | None = None  # worker: where to attach, as whom

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_sender", "_receiver", "_listener")}
        ends = self._sender.child_endpoints() if self._sender is not None else dict(self._endpoints)
        uninitialised = self._sender is None and self._receiver is None and self._attach is None and not ends
        if uninitialised and mp.context.get_spawning_popen() is not None:
            raise RuntimeError(_BEFORE_INIT)  # a process being started: say so here, before it runs
        state["_endpoints"] = {i: _Endpoint(c) for i, c in ends.items()}
        state["_before_init"] = uninitialised  # another pickler (Ray...): the worker says so
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_endpoints"] = {i: e.conn if isinstance(e, _Endpoint) else e for i, e in state["_endpoints"].items()}
        self.__dict__.update(state)
        self._sender = None
        self._receiver = None
        self._listener = None

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
        """
        if self._sender is not None or self._receiver is not None:
            raise RuntimeError("this scheme is already initialised")
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

        ids = self._worker_ids(params_map, devices, device_map_fn, num_workers, worker_ids)
        device_of: dict[int, str | None] = {i: None for i in ids}
        if devices is not None:
            seq = devices if isinstance(devices, Mapping) else dict(zip(ids, devices))
            for i in ids:
                device_of[i] = str(_parse_device(seq[i], f"worker {i}"))

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
            for i in ids:  # one worker at a time: never N device copies alive at once
                mapped = to_flat(device_map_fn(i, user_weights))
                device_of[i] = str(next(iter(mapped.values())).device)
                del mapped

        source_layout, wire_layout = self._options.layouts(first)
        pool = SlotPool(
            wire_layout,
            num_slots=self.num_slots,
            max_slots=self.max_slots,
            reuse=self.transport == "shm",
        )
        self.model_id = model_id
        self._sender = Sender(
            worker_ids=ids,
            source_layout=source_layout,
            wire_layout=wire_layout,
            sources=sources,
            devices=device_of,
            pool=pool,
            sync=self.sync,
            timeout=self.timeout,
            on_worker_error=self.on_worker_error,
            check_finite=self.check_finite,
            manual=self.commit_mode == "manual",
            ctx=ctx,
        )

    @staticmethod
    def _worker_ids(
        params_map: Mapping[int, Any] | None,
        devices: Any,
        device_map_fn: Any,
        num_workers: int | None,
        worker_ids: Iterable[int] | None,
    ) -> list[int]:
        candidates: list[list[int]] = []
        if params_map is not None:
            candidates.append(list(params_map))
        if worker_ids is not None:
            candidates.append(list(worker_ids))
        if isinstance(devices, Mapping):
            candidates.append(list(devices))
        if num_workers is not None:
            if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
                raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if not candidates:
            if devices is not None:
                n = len(devices)
                if num_workers is not None and num_workers != n:
                    raise ValueError(f"num_workers={num_workers} but {n} device{' was' if n == 1 else 's were'} given")
                candidates.append(list(range(n)))
            elif num_workers is not None:
                candidates.append(list(range(num_workers)))
            elif device_map_fn is not None:
                raise ValueError("device_map_fn needs num_workers (or worker_ids)")
            else:
                raise ValueError("say how many workers: num_workers=, worker_ids=, devices= or params_map=")
        ids = candidates[0]
        for other in candidates[1:]:
            if sorted(other) != sorted(ids):
                raise ValueError(f"worker ids disagree: {sorted(ids)} vs {sorted(other)}")
        if num_workers is not None and num_workers != len(ids):
            raise ValueError(f"num_workers={num_workers} but {len(ids)} worker ids were given")
        if devices is not None and not isinstance(devices, Mapping) and len(devices) != len(ids):
            raise ValueError(f"{len(devices)} device{'' if len(devices) == 1 else 's'} for {len(ids)} worker{'' if len(ids) == 1 else 's'}")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"worker ids must be non-negative ints, got {i!r}")
        if len(set(ids)) != len(ids) or not ids:
            raise ValueError(f"worker ids must be distinct and non-empty, got {ids}")
        return ids

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
        :class:`ClosedError`). A restarted worker attaches again.

        Example::

            scheme.init_on_sender(model=policy, num_workers=2)
            address = await scheme.listen()
            start_my_workers(env=address.env())   # each: MultiProcessWeightSyncScheme.attach()
            async with scheme:                    # waits for both to attach and ack version 0
                await scheme.send()
        """
        sender = self.sender
        if sender._state in ("closing", "closed"):
            raise ClosedError("listen(): the scheme is closed (aclose() was called); no worker can attach to it")
        if self._listener is not None:
            raise RuntimeError(f"this scheme already listens at {self._listener.address.path}")
        options = {"strategy": self.strategy, "commit": self.commit_kind, "commit_mode": self.commit_mode, "timeout": self.timeout}
        self._listener = await Listener.open(sender, options, path, token)
        return self._listener.address

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
        if self._sender is not None and not self._sender.in_owner_process():
            raise RuntimeError(
                "this scheme reached the worker by fork: asyncsync workers need the 'spawn' (or 'forkserver') "
                "start method, which pickles the scheme with the worker's own channel"
            )
        if self._sender is not None or self._receiver is not None:
            raise RuntimeError("this scheme is already initialised")
        if model is None:
            model = resolve_model(context, model_id)
        if model is None:
            raise ValueError("init_on_receiver needs model= (or a context holding the model at context.<model_id>)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if device is not None:
            device = _parse_device(device, f"worker {worker_idx}")
        if self._attach is not None:
            if worker_idx is not None and worker_idx != self._attach[1]:
                raise ValueError(f"this scheme attaches as worker {self._attach[1]}, not {worker_idx}")
            worker_idx = self._attach[1]
            self._endpoints[worker_idx] = placeholder_connection()  # the socket lands behind it at connect()
        if worker_idx is None:
            raise TypeError("init_on_receiver() needs worker_idx=")
        _check_poll(poll, self.commit_mode)
        conn = self._endpoints.pop(worker_idx, None)
        if conn is None and getattr(self, "_before_init", False):
            raise RuntimeError(_BEFORE_INIT)
        if conn is None:
            raise ValueError(f"no channel for worker {worker_idx}; this scheme carries workers {sorted(self._endpoints)}")
        for other in self._endpoints.values():
            other.close()  # other workers' ends: holding them would hide those workers' deaths
        self._endpoints.clear()
        self.model_id = model_id
        self._receiver = Receiver(
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

    @property
    def sender(self) -> Sender:
        if self._sender is None:
            raise RuntimeError("call init_on_sender() first")
        return self._sender

    @property
    def receiver(self) -> Receiver:
        if self._receiver is None:
            raise RuntimeError("call init_on_receiver() first")
        return self._receiver

    def _side(self) -> Sender | Receiver:
        if self._sender is not None:
            return self._sender
        if self._receiver is not None:
            return self._receiver
        raise RuntimeError("call init_on_sender() or init_on_receiver() first")

    async def connect(self, timeout: float | None | UseDefault = DEFAULT) -> int:
        """Sender: send the initial weights and wait for every worker's ack.
        Worker: start the receiver task and wait for the initial weights. Returns the version."""
        side = self._side()
        if self._attach is not None and isinstance(side, Receiver) and side._state == "new":
            address, idx = self._attach
            deadline = Deadline(resolve_timeout(timeout, self.timeout))  # a bad one is refused before dialling
            adopt_into(await dial(address, idx, deadline.remaining()), side._queue.fileno())
            timeout = deadline.remaining()
        return await side.connect(timeout=timeout)

    async def aclose(self) -> None:
        """Sender: ``stop`` every receiver, wait for them, release every resource.
        Worker: end the receiver task. Idempotent."""
        if self._listener is not None:
            await self._listener.aclose()  # no worker joins a closing trainer
        if self._sender is not None:
            await self._sender.aclose()
        elif self._receiver is not None:
            await self._receiver.aclose()

    async def __aenter__(self) -> MultiProcessWeightSyncScheme:
        try:
            await self.connect()
        except BaseException:
            await self.aclose()  # no reader task, slot or connected worker left behind
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._sender is None and self._receiver is not None and isinstance(exc, Exception):
                # The worker's own code failed inside the block: its goodbye says so, and the
                # sender's WorkerLeftError (a multi-host trainer's too) carries it.
                await self._receiver._close(f"its code raised {_summary(exc)}")
        finally:
            await self.aclose()

    def statistics(self) -> SenderStatistics | ReceiverStatistics:
        """Sender: versions, lags, errors per worker. Worker: its own version and timings."""
        return self._side().statistics()

    @property
    def version(self) -> int:
        """Sender: newest version sent. Worker: version its model runs."""
        return self._side().version

    # sender coroutines -------------------------------------------------------

    async def send(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        partial: bool = False,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> int:
        """Push weights (None: read the configured source) and, if ``sync``, wait for the acks.

        *weights* may be an ``nn.Module``, a TensorDict or a state dict; *worker_ids* an
        int or a list (None: every worker). With *partial*, *weights* may hold a subset
        of the keys (``td.select(...)``); the rest keep their values on each worker.
        Returns the version number of this send. A target that is gone (died, left) keeps
        no other target from the version: with ``sync``, the wait raises its
        :class:`WorkerDiedError` (or :class:`WorkerLeftError`) once every other target
        answered, its ``applied_by`` naming those that applied it.
        """
        return await self.sender.send(weights, worker_ids, partial=partial, timeout=timeout)

    async def send_async(
        self,
        weights: Any = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        partial: bool = False,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> int:
        """Push weights without waiting for acks; returns the version (see :meth:`wait_async`).

        A worker still busy with an earlier version gets this one when it answers (latest
        wins); the call never waits for a worker. *timeout* bounds the wait for another
        send's snapshot and for a free slot (only with a ``max_slots`` cap).
        """
        return await self.sender.send_async(weights, worker_ids, partial=partial, timeout=timeout)

    async def wait_async(
        self,
        version: int | None = None,
        worker_ids: int | Iterable[int] | None = None,
        *,
        quorum: int | None = None,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> None:
        """Wait until the targeted workers applied *version* (default: everything sent)."""
        await self.sender.wait_async(version, worker_ids, quorum=quorum, timeout=timeout)

    def watch_process(self, worker_idx: int, process: Any) -> None:
        """Watch a worker's process (its ``sentinel``) to notice its death at once."""
        self.sender.watch_process(worker_idx, process)

    # worker helpers --------------------------------------------------------------

    def commit(self) -> int | None:
        """Worker, ``commit_mode="manual"``: commit the staged version now."""
        return self.receiver.commit()

    def poll_nowait(self) -> int | None:
        """Worker, ``init_on_receiver(..., poll=True)``: commit the newest version if new."""
        return self.receiver.poll_nowait()

    @property
    def update_pending(self) -> bool:
        """Worker: a staged version waits for :meth:`commit`."""
        return self.receiver.update_pending

    async def wait_for_version(self, version: int, *, timeout: float | None | UseDefault = DEFAULT) -> int:
        """Worker: wait until the model runs *version* or newer."""
        return await self.receiver.wait_for_version(version, timeout=timeout)

    async def wait_stopped(self) -> None:
        """Worker: wait for ``stop``; raises :class:`SenderDiedError` if the trainer died."""
        await self.receiver.wait_stopped()


_BEFORE_INIT = (
    "this scheme was pickled (sent to a worker) before init_on_sender() was called on it, so it carries no "
    "worker channels: call scheme.init_on_sender(...) in the trainer first, then start the workers with the scheme"
)


class _Endpoint:
    """A channel end that pickles by passing its descriptor, whatever the pickler.

    A plain ``pickle`` of a ``Connection`` would copy the descriptor *number*; this goes
    through multiprocessing's reduction: inherited when pickled for a process being
    started, else handed over by multiprocessing's resource sharer, once (:class:`_SharedFd`).
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.connection import rebuild_connection, reduce_connection  # type: ignore[attr-defined]

        if mp.context.get_spawning_popen() is not None:  # pickled for a process being started
            return (_Endpoint._rebuild, (reduce_connection(self.conn),))
        shared = _SharedFd(self.conn.fileno())
        return (_Endpoint._rebuild, ((rebuild_connection, (shared, self.conn.readable, self.conn.writable)),))

    @staticmethod
    def _rebuild(reduced: tuple[Any, tuple[Any, ...]]) -> _Endpoint:
        fn, args = reduced
        try:
            return _Endpoint(fn(*args))
        except (EOFError, OSError, KeyError) as exc:
            raise RuntimeError(
                "a worker's channel end can be unpickled once, by one process: this scheme was already "
                "unpickled elsewhere (pickle the scheme once per worker process)"
            ) from exc


class _SharedFd:
    """multiprocessing's ``resource_sharer.DupFd``, except that asking for it again is refused
    quietly (the peer gets EOF) instead of printing a ``KeyError`` from the sharer's thread.

    The sharer hands each registered descriptor out once and then forgets its key; here the
    key is re-armed with a refusal after every hand-out.
    """

    def __init__(self, fd: int) -> None:
        from multiprocessing import reduction, resource_sharer

        sharer = resource_sharer._resource_sharer  # type: ignore[attr-defined]
        new_fd = os.dup(fd)
        key: list[int] = []

        def refuse(conn: Any, pid: int) -> None:
            pass  # nothing sent: the asking side reads EOF

        def rearm() -> None:  # the sharer calls this right after it popped the key
            sharer._cache[key[0]] = (refuse, rearm)

        def send(conn: Any, pid: int) -> None:
            reduction.send_handle(conn, new_fd, pid)

        def close() -> None:
            os.close(new_fd)
            rearm()

        self._id = sharer.register(send, close)
        key.append(self._id[1])

    def detach(self) -> int:
        """The descriptor (this process's own copy)."""
        from multiprocessing import reduction, resource_sharer

        with resource_sharer._resource_sharer.get_connection(self._id) as conn:  # type: ignore[attr-defined]
            return int(reduction.recv_handle(conn))


def _check_poll(poll: bool, commit_mode: str) -> None:
    """A polled receiver commits at each ``poll_nowait()``: refuse it with manual commits."""
    if poll and commit_mode == "manual":
        raise ValueError("poll=True commits at each poll_nowait(): it needs commit_mode='auto', not 'manual'")


def _summary(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` of *exc*, cut to about *limit* characters (whatever its ``__str__`` does)."""
    try:
        message = str(exc)
    except Exception:
        message = "(its message could not be read)"
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_device(value: Any, who: str) -> torch.device:
    """*value* (a ``torch.device`` or its string) as a device usable here, before anything
    starts: a string torch does not read is a ValueError naming it, another type a TypeError."""
    if isinstance(value, torch.device):
        return _check_device(value, who)
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        if isinstance(value, str):
            raise ValueError(f"{who}: {value!r} is not a device (such as 'cpu', 'cuda' or 'cuda:0'): {exc}") from None
        raise TypeError(f"{who}: a device is a torch.device or a string such as 'cuda:0', got {type(value).__name__} {value!r}") from None
    return _check_device(device, who)


def _check_device(device: torch.device, who: str) -> torch.device:
    """Fail before anything starts if *device* cannot be used on this host."""
    unusable = device_problem(device)
    if unusable is not None:
        raise ValueError(f"{who}: device {device} requested, but {unusable}")
    return device

