"""asyncsync inside torchrl: a ``WeightSyncScheme`` that torchrl's collectors accept.

``AsyncSyncScheme`` is a :class:`torchrl.weight_update.WeightSyncScheme` whose bytes move
through asyncsync (one copy per send into shared memory, versioned acks, latest wins, a
dead worker named at once). torchrl's own synchronous calls stay as they are; asyncsync
runs on an event loop of its own, in a thread of each process (trainer and workers), so
it never touches the caller's loop. This module needs torchrl; ``import asyncsync`` does
not import it.

Example (a script: the collector spawns its workers)::

    from tensordict.nn import TensorDictModule
    from torch import nn
    from torchrl.collectors import MultiSyncCollector
    from torchrl.envs import GymEnv

    from asyncsync.torchrl import AsyncSyncScheme

    def make_env():
        return GymEnv("CartPole-v1")

    if __name__ == "__main__":
        policy = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])
        scheme = AsyncSyncScheme(timeout=30)
        collector = MultiSyncCollector([make_env, make_env], policy, frames_per_batch=200,
                                       total_frames=2_000, weight_sync_schemes={"policy": scheme})
        for batch in collector:
            ...                                  # a training step on `batch` changes `policy`
            collector.update_policy_weights_()   # every worker runs the new version
        print(scheme.version, scheme.statistics().workers)
        collector.shutdown()
        scheme.shutdown()

On a worker, a version is committed only where no forward pass of the policy runs: each
call of the policy module holds a gate that commits wait for, so a forward never sees two
versions mixed (:meth:`AsyncSyncScheme.hold` keeps one version over a longer stretch, e.g.
a whole rollout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar

import torch
from torch import nn

try:
    from torchrl.weight_update import WeightSyncScheme
except ImportError as exc:  # pragma: no cover - exercised where torchrl is absent
    raise ImportError(
        "asyncsync.torchrl needs torchrl; the rest of asyncsync does not. Install the version it is tested with: "
        "pip install torch==2.13.0 torchrl==0.14.1 tensordict==0.14.3 (torchrl 0.14.1 requires tensordict<0.15: "
        "pip replaces a newer tensordict with 0.14.3)"
    ) from exc

from ._core._offload import retrieve
from ._core._options import DEFAULT, UseDefault, resolve_timeout
from ._core._weights import resolve_model, to_flat
from ._errors import SyncTimeoutError
from ._io._loop_thread import SHUTDOWN_TIMEOUT_S, LoopThread
from ._schemes._local import MultiProcessWeightSyncScheme
from ._stats import ReceiverStatistics, SenderStatistics

__all__ = ["AsyncSyncScheme"]

logger = logging.getLogger("asyncsync")

T = TypeVar("T")
#: How long shutdown() waits for asyncsync to close before it gives up (it never raises).


class AsyncSyncScheme(WeightSyncScheme):  # type: ignore[misc]
    """A torchrl weight-sync scheme backed by asyncsync's :class:`MultiProcessWeightSyncScheme`.

    Pass it to a collector as ``weight_sync_schemes={"policy": AsyncSyncScheme()}``
    (``MultiSyncCollector``, ``MultiAsyncCollector``, ``Collector(num_collectors=N)``);
    ``collector.update_policy_weights_()`` then calls :meth:`send`.

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"`` (torchrl's names).
        sync: if True, :meth:`send` returns once every targeted worker runs the new
            version; if False, once the snapshot is taken (a slow worker then gets
            only the newest version: latest wins).
        timeout: default bound, in seconds, of every wait (``None``: no bound).
        on_worker_error: ``"raise"`` (a send that targets a dead worker still reaches
            the others, then fails with :class:`~asyncsync.WorkerDiedError` naming it) or
            ``"skip"``.
        transfer_dtype: send floating-point tensors in this dtype (e.g. ``torch.bfloat16``).
        check_finite: reject weights holding NaN or inf before sending.
        per_worker_weights: each worker keeps weights of its own: ``send({worker_idx:
            weights, ...})`` (``collector.update_policy_weights_({0: w0, 1: w1})``) gives
            each listed worker its entry, in one version. On by itself when the
            collector's ``policy_factory`` is a list of distinct factories.
        loop_factory: makes the event loop of asyncsync's thread in each process
            (e.g. ``uvloop.new_event_loop``; it must pickle). Default: asyncio's.

    Example::

        scheme = AsyncSyncScheme(sync=True, timeout=30)
        collector = MultiSyncCollector(env_makers, policy, frames_per_batch=200, total_frames=-1,
                                       weight_sync_schemes={"policy": scheme})
        for batch in collector:
            train(batch)
            collector.update_policy_weights_()   # -> scheme.send(): version 1, 2, ...
        print(scheme.statistics().workers)       # each worker's applied version, lag, errors
    """

    def __init__(
        self,
        strategy: Literal["tensordict", "state_dict"] = "tensordict",
        sync: bool = True,
        timeout: float | None = 60.0,
        *,
        on_worker_error: Literal["raise", "skip"] = "raise",
        transfer_dtype: torch.dtype | None = None,
        check_finite: bool = False,
        per_worker_weights: bool = False,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:
        super().__init__(strategy=strategy)
        # Manual commits: the worker's receiver stages off the caller's threads, and the
        # commit waits for the gate (no forward pass running).
        self._inner = MultiProcessWeightSyncScheme(
            strategy=strategy,
            sync=sync,
            timeout=timeout,
            commit_mode="manual",
            on_worker_error=on_worker_error,
            transfer_dtype=transfer_dtype,
            check_finite=check_finite,
        )
        self.sync = sync
        self.timeout = timeout
        self.per_worker_weights = per_worker_weights
        self.loop_factory = loop_factory
        self._worker_devices: dict[int, str] = {}
        self._per_worker_mode = False  # read by the workers too: they stage on their policy's device
        self._runtime_init()

    def _runtime_init(self) -> None:
        """State that lives in one process only (never pickled)."""
        self._loop: LoopThread | None = None
        self._connecting: asyncio.Task[int] | None = None
        self._gate: _Gate | None = None
        self._hooks: list[Any] = []
        self._hooked: nn.Module | None = None
        self._bound: nn.Module | None = None  # the module the inner receiver commits into
        self._committer: asyncio.Task[None] | None = None
        self._commit_lock: asyncio.Lock | None = None
        self._closed = False
        self._origin: _Origin | None = None  # trainer: what send(None) and version 0 read

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_loop", "_connecting", "_gate", "_hooks", "_hooked", "_bound", "_committer", "_commit_lock", "_closed", "_origin"):
            state.pop(key, None)
        return state  # type: ignore[no-any-return]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._runtime_init()

    def create_transport(self, **kwargs: Any) -> Any:
        """Not used: asyncsync moves the bytes itself."""
        raise NotImplementedError("AsyncSyncScheme has no torchrl transport: asyncsync moves the weights")

    # ------------------------------------------------------------------ trainer side

    def _init_on_sender_impl(
        self,
        model_id: str | None = None,
        context: Any = None,
        *,
        ctx: Any = None,
        weights: Any = None,
        model: nn.Module | None = None,
        params_map: dict[int, Any] | None = None,
        devices: Any = None,
        device_map_fn: Callable[[int, Any], Any] | None = None,
        num_workers: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"AsyncSyncScheme.init_on_sender got unexpected arguments {sorted(kwargs)}")
        self.model_id = model_id
        self.context = context
        if model is not None:
            self.model = model
        if num_workers is None and params_map is None and devices is None and context is not None:
            num_workers = getattr(context, "num_workers", None)
        if devices is None and params_map is None and device_map_fn is None and context is not None:
            found = _policy_devices(context, num_workers)
            if found is not None:
                devices = found
        built = None
        if model is None and weights is None and params_map is None and resolve_model(context, model_id) is None:
            built = _factory_policies(context, model_id)  # the collector has a policy_factory and no policy
        self._per_worker_mode = self.per_worker_weights or (built is not None and len(built) > 1)
        if self._per_worker_mode:
            if device_map_fn is not None:
                raise ValueError("per-worker weights: each worker's device comes from devices= (or the collector's policy devices), not device_map_fn")
            origin = _Origin.per_worker(model_id, context, model, weights, params_map, built, _worker_ids(params_map, devices, num_workers))
            self._inner.init_on_sender(model_id=model_id, params_map=origin.sources, ctx=ctx)
        else:
            origin = _Origin(refuse_none=built is not None)
            self._inner.init_on_sender(
                model_id=model_id,
                context=context,
                weights=weights,
                model=built[0] if built is not None else model,  # version 0: what the workers' factory builds
                params_map=params_map,
                devices=devices,
                device_map_fn=device_map_fn,
                num_workers=num_workers,
                ctx=ctx,
            )
        self._origin = origin
        if devices is not None:  # read after init_on_sender checked them (a bad one is named there)
            listed = devices.items() if isinstance(devices, dict) else enumerate(devices)
            self._worker_devices = {int(i): str(torch.device(d)) for i, d in listed}

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None, weights: Any | None = None) -> None:
        """Publish version 0 and return at once: the workers wait for it while they start."""
        if weights is not None:
            raise TypeError("AsyncSyncScheme.connect() sends the configured weights; call send(weights) after it")
        assert self._origin is not None
        first = self._origin.first()
        loop = self._start_loop("asyncsync-torchrl-trainer")
        processes = list(getattr(self.context, "procs", None) or [])

        async def start() -> asyncio.Task[int]:
            for idx, proc in zip(self._inner.sender.worker_ids, processes):
                self._inner.watch_process(idx, proc)  # a death is seen at once, not at the next read
            # Unbounded here: the workers start (import torch, build envs) before they answer, and
            # each send bounds its own wait for this; a worker that dies meanwhile is named at once.
            connect = self._inner.connect(timeout=None) if first is None else self._inner.sender.connect(timeout=None, weights=first)
            task = asyncio.get_running_loop().create_task(connect, name="asyncsync-torchrl-connect")
            task.add_done_callback(retrieve)
            return task

        self._connecting = loop.run(start(), None)

    async def _connected(self, timeout: float | None) -> None:
        assert self._connecting is not None
        if not self._connecting.done():
            done, _ = await asyncio.wait([self._connecting], timeout=timeout)
            if not done:
                raise SyncTimeoutError("the workers' initial weights", {}, timeout)
        self._connecting.result()  # the connect error (a dead or rejecting worker), at every call

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None, *, timeout: float | None | UseDefault = DEFAULT) -> int:
        """Push weights (None: ``context.<model_id>``) to the workers; return the version.

        Synchronous, from any thread (never the scheme's own). With ``sync=True`` it
        returns once every targeted worker runs this version; with ``sync=False`` once
        the snapshot is taken. Raises :class:`~asyncsync.WorkerDiedError` naming a dead
        worker (with ``sync=True``, once the living targets applied it), :class:`~asyncsync.WorkerError` for a rejected payload (that worker keeps
        its weights), :class:`~asyncsync.SyncTimeoutError` past *timeout*.
        """
        return self._trainer_loop().run(self._send(weights, worker_ids, timeout), self._outer_bound(timeout))

    async def asend(self, weights: Any = None, worker_ids: int | list[int] | None = None, *, timeout: float | None | UseDefault = DEFAULT) -> int:
        """:meth:`send` for an asyncio trainer: awaits the scheme's thread, never blocks the caller's loop.

        Example::

            version = await scheme.asend()   # inside `async def train()`
        """
        return await asyncio.wrap_future(self._trainer_loop().submit(self._send(weights, worker_ids, timeout)))

    async def _send(self, weights: Any, worker_ids: Any, timeout: float | None) -> int:
        origin = self._origin
        assert origin is not None
        if _per_worker(weights):
            targets = origin.per_worker_targets(weights, worker_ids)  # refused before any wait
            await self._connected(self.timeout if timeout is DEFAULT else timeout)
            async with origin.holding(weights, targets):
                return await self._inner.send(None, targets, timeout=timeout)
        if weights is None:
            weights = origin.default()  # None: the inner scheme reads its configured source
        await self._connected(self.timeout if timeout is DEFAULT else timeout)
        if weights is None and origin.sources is not None:
            async with origin.holding({}, []):  # params_map: no per-worker send is swapped in meanwhile
                return await self._inner.send(None, worker_ids, timeout=timeout)
        return await self._inner.send(weights, worker_ids, timeout=timeout)

    def wait_async(self, version: int | None = None, worker_ids: int | Iterable[int] | None = None, *, quorum: int | None = None, timeout: float | None | UseDefault = DEFAULT) -> None:
        """Trainer: block until the targeted workers run *version* (default: the newest sent)."""

        async def wait() -> None:
            await self._connected(self.timeout if timeout is DEFAULT else timeout)
            await self._inner.wait_async(version, worker_ids, quorum=quorum, timeout=timeout)

        self._trainer_loop().run(wait(), self._outer_bound(timeout))

    def _trainer_loop(self) -> LoopThread:
        if not self.initialized_on_sender:
            raise RuntimeError("Must be initialized on sender before sending weights")
        if self._loop is None or self._connecting is None:
            raise RuntimeError("Must be synchronized on sender before sending weights (call connect())")
        return self._loop

    def _outer_bound(self, timeout: float | None) -> float | None:
        limit = self.timeout if timeout is DEFAULT else timeout
        return None if limit is None else 2 * limit + 5.0  # asyncsync's own timeout fires first

    # ------------------------------------------------------------------ both sides

    @property
    def version(self) -> int:
        """Trainer: newest version sent. Worker: the version its policy runs (-1 before connect)."""
        if self._loop is None:
            return -1
        return self._loop.run(_value(lambda: self._inner.version), self.timeout)

    def statistics(self) -> SenderStatistics | ReceiverStatistics:
        """Trainer: per-worker applied versions, lag and errors. Worker: its version and timings."""
        if self._loop is None:
            raise RuntimeError("call connect() first")
        return self._loop.run(_value(self._inner.statistics), self.timeout)

    def shutdown(self) -> None:
        """Close this side (idempotent; starts nothing; safe from ``__del__``).

        Trainer: stop every worker's receiver and release the shared memory. Worker: end
        this worker's receiver only; its policy keeps the version it runs.
        """
        loop = getattr(self, "_loop", None)
        if loop is None or getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if loop.alive and threading.get_ident() != loop.ident:
                loop.run(self._aclose(), SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # shutdown never raises (it runs from __del__ too)
            logger.warning("asyncsync: closing %s: %r", type(self).__name__, exc)
        finally:
            self._unhook()
            loop.close()
            self._loop = None

    async def _aclose(self) -> None:
        if self._committer is not None:
            self._committer.cancel()
            await asyncio.wait([self._committer])
        if self._gate is not None and self._commit_lock is not None:
            # The receiver copies its weights out of shared memory as it closes: not mid-forward.
            async with self._commit_lock, self._gate.exclusive():
                await self._inner.aclose()
                self._follow()
        else:
            await self._inner.aclose()

    def _start_loop(self, name: str) -> LoopThread:
        if self._loop is not None:
            raise RuntimeError("this scheme is already connected")
        self._closed = False
        self._loop = LoopThread(name, self.loop_factory, owner="AsyncSyncScheme")
        return self._loop

    # ------------------------------------------------------------------ worker side

    def _init_on_receiver_impl(self, model_id: str, context: Any = None, **kwargs: Any) -> None:
        model = kwargs.pop("model", None)
        worker_idx = kwargs.pop("worker_idx", None)
        if kwargs:
            raise TypeError(f"AsyncSyncScheme.init_on_receiver got unexpected arguments {sorted(kwargs)}")
        self.model_id = model_id
        self.context = context
        self._worker_idx = worker_idx
        if model is not None:
            self.model = model

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        """Wait (bounded by ``timeout``) until this worker's policy runs version 0."""
        idx = self._worker_idx if worker_idx is None else worker_idx
        if idx is None:
            raise ValueError("AsyncSyncScheme: the worker index is unknown; pass worker_idx to init_on_receiver or connect")
        self._worker_idx = idx
        model = self.model
        if not isinstance(model, nn.Module):
            raise TypeError(f"worker {idx}: the policy to update must be an nn.Module, got {type(model).__name__}")
        _materialize(model, torch.device(self._worker_devices.get(idx, "cpu")))
        loop = self._start_loop(f"asyncsync-torchrl-worker-{idx}")
        self._gate = _Gate()
        try:
            loop.run(self._receiver_connect(idx, model), self._outer_bound(DEFAULT))
        except BaseException:
            self.shutdown()
            raise

    async def _receiver_connect(self, idx: int, model: nn.Module) -> None:
        self._commit_lock = asyncio.Lock()
        device = self._worker_devices.get(idx)
        if device is None and self._per_worker_mode:
            device = _device_of(model)  # per-worker weights carry the trainer's device: stage on the policy's own
        self._inner.init_on_receiver(worker_idx=idx, model=model, device=device)
        await self._inner.connect()
        if self._inner.commit() is None:  # nothing staged: version 0 was refused
            error = self._inner.receiver.last_error or "no initial weights"
            raise ValueError(f"worker {idx}: cannot use the trainer's weights: {error}")
        self._bound = model
        self._hook(model)
        self._committer = asyncio.get_running_loop().create_task(self._commit_forever(), name=f"asyncsync-torchrl-commit-{idx}")

    async def _commit_forever(self) -> None:
        """Commit every staged version as soon as no forward pass runs."""
        while not self._inner.receiver.stopped:  # (it stops when the worker left at a commit)
            try:
                await self._inner.wait_for_version(self._inner.version + 1, timeout=None)
            except Exception as exc:  # the receiver ended (the trainer stopped it, or died)
                logger.info("asyncsync: worker %s stops committing: %s", self._worker_idx, exc)
                return
            await self._commit_pending()

    async def _commit_pending(self) -> int | None:
        assert self._gate is not None and self._commit_lock is not None
        async with self._commit_lock:
            if not self._inner.update_pending:
                return None
            async with self._gate.exclusive():
                assert self._bound is not None and self._hooked is not None
                try:
                    copies = _copies(self._bound, self._hooked)
                except ValueError as exc:  # the policy it runs can no longer take the weights: never ack them
                    await self._leave(str(exc))
                    return None
                version = self._inner.commit()
                _copy(copies)
                bump = getattr(self.context, "increment_version", None)
                if version is not None and callable(bump):
                    bump()  # torchrl's PolicyVersion tracking, as its own receive() cascade does
            return version

    async def _leave(self, reason: str) -> None:
        """End this worker's receiver, saying *reason* in its goodbye: the trainer's send
        raises ``WorkerLeftError`` naming the worker and the reason."""
        logger.error("asyncsync: worker %s leaves: %s", self._worker_idx, reason)
        error = ValueError(reason)
        await self._inner.__aexit__(ValueError, error, None)  # as a worker whose code raised in its block

    def _follow(self) -> None:
        """As the receiver closes: the policy the worker calls keeps the version it ran."""
        if self._bound is not None and self._hooked is not None:
            with contextlib.suppress(ValueError):  # it cannot hold them: the worker left at the commit that found it
                _copy(_copies(self._bound, self._hooked))

    def receive(self, timeout: float | None | UseDefault = DEFAULT) -> Any:
        """Commit the newest staged version now, if one waits; return its weights, else None.

        *timeout* bounds the wait for the commit (the scheme's by default, ``None``: no
        bound, ``0``: do not wait), as every asyncsync wait.

        Commits also happen by themselves (between forward passes); this is for a loop
        that wants the newest weights at a point of its choosing. Called from inside a
        forward pass (or :meth:`hold`) it commits nothing and returns None.
        """
        if not self.initialized_on_receiver:
            raise RuntimeError("Must be initialized on receiver before receiving weights")
        if self._loop is None or self._gate is None:
            raise RuntimeError("Must be synchronized on receiver before receiving weights")
        if self._gate.held_here():
            return None
        version = self._loop.run(self._commit_pending(), resolve_timeout(timeout, self.timeout))
        if version is None:
            return None
        from tensordict import TensorDict

        return TensorDict.from_module(self._hooked) if self._hooked is not None else None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Worker: keep the policy's version fixed inside this block (commits wait for its end).

        Example::

            with scheme.hold():          # one version for the whole rollout
                rollout = env.rollout(200, policy)
        """
        if self._gate is None:
            raise RuntimeError("hold() is for a connected worker")
        self._gate.enter()
        try:
            yield
        finally:
            self._gate.exit()

    @property  # type: ignore[override]
    def model(self) -> Any:
        return WeightSyncScheme.model.fget(self)

    @model.setter
    def model(self, model: Any) -> None:
        WeightSyncScheme.model.fset(self, model)
        if getattr(self, "_loop", None) is not None and self._bound is not None and model is not None and model is not self._hooked:
            self._retarget(model)

    def _retarget(self, model: nn.Module) -> None:
        """Point the worker at the policy it really calls (torchrl's runner does, after moving it).

        Later versions reach *model*: it reads the received tensors, or each commit copies
        them into its own (a copy of the policy, on another device). Commits and forward
        passes wait meanwhile; a policy whose tensors cannot hold the weights is refused.
        """
        assert self._bound is not None and self._loop is not None and self._gate is not None
        if not isinstance(model, nn.Module):
            raise TypeError(f"worker {self._worker_idx}: the policy to update must be an nn.Module, got {type(model).__name__}")
        if self._gate.held_here():
            raise RuntimeError(f"worker {self._worker_idx}: set scheme.model outside the policy's forward pass and hold()")
        _copies(self._bound, model)  # refused here, before anything changes

        async def swap() -> None:
            assert self._gate is not None and self._commit_lock is not None and self._bound is not None
            async with self._commit_lock, self._gate.exclusive():  # no forward straddles the change
                _copy(_copies(self._bound, model))
                self._unhook()
                self._hook(model)

        self._loop.run(swap(), self.timeout)

    def _hook(self, model: nn.Module) -> None:
        gate = self._gate
        assert gate is not None
        self._hooks = [
            model.register_forward_pre_hook(lambda _m, _a: gate.enter()),
            model.register_forward_hook(lambda _m, _a, _o: gate.exit(), always_call=True),
        ]
        self._hooked = model

    def _unhook(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks = []
        self._hooked = None


# ---------------------------------------------------------------------- the trainer's sources


_NO_POLICY = (
    "send() has no weights to read: the collector builds its policies with policy_factory and holds no policy of "
    "its own. Pass the weights: collector.update_policy_weights_(weights)"
)


class _Origin:
    """Trainer: what version 0 and ``send(None)`` carry, where the inner scheme cannot say it alone.

    *sources* (per-worker weights): one flat dict per worker, the inner scheme's
    ``params_map``; a per-worker send swaps its entries in for the send and puts the
    *initial* ones back. *default* gives what ``send(None)`` sends (None: the inner
    scheme's own source); *refuse_none*: nothing to read (a policy_factory only).
    *first* gives version 0 for every worker (None: each worker's source).
    """

    def __init__(
        self,
        *,
        refuse_none: bool = False,
        default: Callable[[], Any] | None = None,
        sources: dict[int, dict[str, torch.Tensor]] | None = None,
        first: Callable[[], Any] | None = None,
    ) -> None:
        self.refuse_none = refuse_none
        self._default = default
        self._first = first
        self.sources = sources
        self._initial = {i: dict(flat) for i, flat in sources.items()} if sources is not None else {}
        self._lock = asyncio.Lock()

    @classmethod
    def per_worker(
        cls,
        model_id: str | None,
        context: Any,
        model: nn.Module | None,
        weights: Any,
        params_map: Mapping[int, Any] | None,
        built: list[nn.Module] | None,
        ids: list[int],
    ) -> _Origin:
        """Per-worker sources from ``init_on_sender``'s arguments (or the factories' policies)."""
        if params_map is not None:  # each worker's entry, read at every send(None)
            return cls(sources={i: to_flat(params_map[i]) for i in ids})
        if built is not None and len(built) > 1:
            if len(built) != len(ids):
                raise ValueError(f"{len(built)} policy factories for {len(ids)} workers")
            return cls(refuse_none=True, sources={i: to_flat(m) for i, m in zip(ids, built)})
        if built is not None:
            one = built[0]
            return cls(refuse_none=True, sources={i: to_flat(one) for i in ids}, first=lambda: one)
        read = _reader(model_id, context, model, weights)
        now = read()
        return cls(default=read, first=read, sources={i: to_flat(now) for i in ids})

    def first(self) -> Any:
        """Version 0 for every worker, or None (each worker's own source)."""
        return self._first() if self._first is not None else None

    def default(self) -> Any:
        """What ``send(None)`` sends; None: the inner scheme's configured source."""
        if self.refuse_none:
            raise ValueError(_NO_POLICY + (" or {worker_idx: weights}." if self.sources is not None else "."))
        return self._default() if self._default is not None else None

    def per_worker_targets(self, weights: Mapping[int, Any], worker_ids: int | list[int] | None) -> list[int]:
        """The workers a ``{worker_idx: weights}`` send updates (its keys, or *worker_ids*)."""
        if self.sources is None:
            raise ValueError(
                "per-worker weights ({worker_idx: weights}) need AsyncSyncScheme(per_worker_weights=True), "
                "or a collector whose policy_factory lists a distinct factory per worker"
            )
        unknown = sorted(set(weights) - set(self.sources))
        if unknown:
            raise ValueError(f"per-worker weights for unknown worker(s) {unknown}; this scheme's workers are {sorted(self.sources)}")
        targets = sorted(weights) if worker_ids is None else [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        missing = [i for i in targets if i not in weights]
        if missing:
            raise ValueError(f"worker_ids {missing} have no entry in the per-worker weights {sorted(weights)}")
        return targets

    @contextlib.asynccontextmanager
    async def holding(self, weights: Mapping[int, Any], targets: list[int]) -> AsyncIterator[None]:
        """Within the block, each target's source holds its entry of *weights* (one at a time)."""
        assert self.sources is not None
        async with self._lock:
            try:
                for i in targets:
                    self.sources[i].clear()
                    self.sources[i].update(to_flat(weights[i]))
                yield
            finally:
                for i in targets:
                    self.sources[i].clear()
                    self.sources[i].update(self._initial[i])


def _reader(model_id: str | None, context: Any, model: nn.Module | None, weights: Any) -> Callable[[], Any]:
    """What ``send(None)`` reads: *model*, *weights* or ``context.<model_id>`` (looked up each time)."""
    if model is not None or weights is not None:
        fixed = model if model is not None else weights
        return lambda: fixed
    ref = weakref.ref(context) if context is not None else None

    def lookup() -> nn.Module:
        found = resolve_model(ref() if ref is not None else None, model_id)
        if found is None:
            raise ValueError(f"nothing to send: pass model=, weights= or params_map=, or a context with the model at context.{model_id}")
        return found

    return lookup


def _per_worker(weights: Any) -> bool:
    """``{worker_idx: weights}``: a plain dict whose keys are all ints (a state dict's are names)."""
    return isinstance(weights, dict) and bool(weights) and all(isinstance(k, int) and not isinstance(k, bool) for k in weights)


def _worker_ids(params_map: Mapping[int, Any] | None, devices: Any, num_workers: int | None) -> list[int]:
    if params_map is not None:
        return list(params_map)
    if isinstance(devices, Mapping):
        return list(devices)
    if devices is not None:
        return list(range(len(devices)))
    if num_workers is not None:
        return list(range(num_workers))
    raise ValueError("per-worker weights: say how many workers (num_workers=, devices= or params_map=)")


def _factory_policies(context: Any, model_id: str | None) -> list[nn.Module] | None:
    """The policies a collector's ``policy_factory`` builds, when it has no policy: one, or
    one per worker where the factories differ (None: no factory)."""
    factories = getattr(context, "policy_factory", None) if model_id == "policy" else None
    if not isinstance(factories, (list, tuple)) or not factories or any(f is None for f in factories):
        return None
    chosen = factories[:1] if all(f is factories[0] for f in factories) else factories
    built = [f() for f in chosen]
    for f, policy in zip(chosen, built):
        if not isinstance(policy, nn.Module):
            raise TypeError(f"policy_factory {f!r} built a {type(policy).__name__}, not an nn.Module: it has no weights to synchronise")
    return built


# ---------------------------------------------------------------------- the gate


class _Gate:
    """Forward passes (any threads) against commits (the scheme's loop thread).

    A forward ``enter()``s and ``exit()``s; a commit runs inside ``exclusive()``, which
    stops new forwards from starting, waits (without blocking its loop) until the running
    ones end, and lets them go again on exit. A thread already inside may re-enter.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._want = False
        self._wake: Callable[[], None] | None = None
        self._local = threading.local()

    def held_here(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def enter(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cond:
                while self._want:
                    self._cond.wait(1.0)
                self._busy += 1
        self._local.depth = depth + 1

    def exit(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            return  # a pre-hook before ours raised: ours never entered
        self._local.depth = depth - 1
        if depth == 1:
            with self._cond:
                self._busy -= 1
                if self._busy == 0 and self._wake is not None:
                    self._wake()
                    self._wake = None

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        idle: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(lambda: idle.done() or idle.set_result(None))

        with self._cond:
            self._want = True
            if self._busy:
                self._wake = wake
            else:
                idle.set_result(None)
        try:
            await idle
            yield
        finally:
            with self._cond:
                self._want = False
                self._wake = None
                self._cond.notify_all()


# ---------------------------------------------------------------------- the loop thread


async def _value(fn: Callable[[], T]) -> T:
    return fn()


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _copies(received: nn.Module, running: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) pairs that give *running* the weights committed into *received*,
    as the two hold them now: none where *running* reads the received tensors themselves.
    Raises ValueError when *running*'s tensors cannot hold them."""
    mine = _tensors(received)
    theirs = _tensors(running)
    held = {id(t) for t in theirs.values()}
    if all(id(t) in held for t in mine.values()):
        return []
    prefix = _prefix(mine, theirs)  # a wrapper's names: "module." + the received module's
    if prefix is None or any(theirs[prefix + k].shape != t.shape for k, t in mine.items()):
        mine_named = {prefix + k: t for k, t in mine.items()} if prefix is not None else mine
        raise ValueError(
            f"the policy the worker calls has tensors {_names(theirs, mine_named)}, which cannot hold the weights it "
            f"receives {_names(mine_named, theirs)}"
        )
    return [(t, theirs[prefix + k]) for k, t in mine.items() if theirs[prefix + k] is not t]


def _prefix(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> str | None:
    """The prefix (``""``, ``"module."``...) that names each of *mine* in *theirs*, if one does."""
    if len(mine) != len(theirs) or not mine:
        return None
    first = next(iter(mine))
    for name in theirs:
        prefix = name[: len(name) - len(first)]
        if name.endswith(first) and (prefix == "" or prefix.endswith(".")) and all(prefix + k in theirs for k in mine):
            return prefix
    return None


def _names(these: dict[str, torch.Tensor], others: dict[str, torch.Tensor]) -> str:
    """The names (with shapes) in *these* that *others* lacks or shapes otherwise, at most 8."""
    odd = [f"{k}{list(t.shape)}" for k, t in these.items() if k not in others or others[k].shape != t.shape]
    return ", ".join(odd[:8]) + (f" (+{len(odd) - 8})" if len(odd) > 8 else "")


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for src, dst in pairs:
            dst.copy_(src)


def _device_of(model: nn.Module) -> str | None:
    first = next(iter(_tensors(model).values()), None)
    return str(first.device) if first is not None else None


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give storage to tensors on the meta device (torchrl ships a stateless policy)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:  # a new Parameter: meta cannot become real in place
                module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)


def _policy_devices(context: Any, num_workers: int | None) -> list[str] | None:
    """The collector's per-worker policy devices, when it names them all."""
    devices = getattr(context, "policy_device", None)
    if not isinstance(devices, (list, tuple)) or not devices or any(d is None for d in devices):
        return None
    if num_workers is not None and len(devices) != num_workers:
        return None
    return [str(torch.device(d)) for d in devices]
