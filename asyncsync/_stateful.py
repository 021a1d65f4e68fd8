"""One hypothesis state machine for every transport: the guarantees are checked once, each
transport is a small *cluster* adapter.

- :class:`LocalCluster`: a :class:`MultiProcessWeightSyncScheme` and its loopback workers
  (shared memory, in this event loop);
- :class:`HostsCluster`: a :class:`DistributedWeightSyncScheme` trainer and two relays
  (hosts 1 and 2, on a real gloo group and control plane over 127.0.0.1), each relay with
  its loopback workers, all in this event loop.

:class:`ClusterMachine` drives random sends (all, subsets, partial), async sends, waits,
manual commits, busy workers and hosts, blocked trainer loops (a synchronous sleep
shorter than the silence timeout), crashes and rejoins; after every step it checks, for
every worker:

- its model holds exactly the values of the version it reports, that version was sent to
  it (no mix of two versions, no change without a commit), and a staged version (manual
  commit) holds exactly its own values;
- versions only go up;
- a worker that lost its sender keeps its weights forever after;
- the slot ledgers hold their invariants and the slot counts stay within the bound;
- no call outlives its timeout by more than a hang margin;

and at the end of each example every living worker converges to the newest version sent
to it. :func:`run_machine` checks that no descriptor or thread is left afterwards.

Used by ``tests/test_stateful.py`` and ``python -m asyncsync.soak --stateful`` (this
module needs ``hypothesis``, which is in the ``test`` extra).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test
from torch import nn

from ._core._ownership import set_debug, slot_bound
from ._errors import HostLostError, SenderDiedError, SyncTimeoutError, WorkerGoneError
from ._schemes._dist import DistributedWeightSyncScheme
from ._schemes._local import MultiProcessWeightSyncScheme, loopback_worker
from .testing import no_leaks

KEYS = ("0.weight", "0.bias", "1.weight", "1.bias")
HANG = 10.0  # a call that outlives its own timeout by this much is a hang
SHORT = 0.005  # timeout of calls that may well time out (a busy or uncommitted worker)
SETTLE = 60.0  # timeout of calls that must succeed (set-up, rejoin, the final convergence)
SILENCE = 30.0  # the multi-host silence timeout: a blocked trainer loop stays far below it
Wid = Hashable


def make_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fill(model.state_dict(), dict.fromkeys(KEYS, -1.0))
    return model


def fill(sd: dict[str, torch.Tensor], values: dict[str, float]) -> None:
    with torch.no_grad():
        for k, v in values.items():
            sd[k].fill_(v)


def content(tensors: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """Each key's value (the tensors are constant-filled), None where a tensor is mixed."""
    out: dict[str, float | None] = {}
    for k in KEYS if set(KEYS) <= set(tensors) else list(tensors):
        t = tensors[k].detach().float()
        lo, hi = float(t.min()), float(t.max())
        out[k] = lo if lo == hi else None
    return out


def check_version(
    wid: Wid, version: int, now: dict[str, float | None], pending: tuple[int, dict[str, float | None]] | None, expected: dict[int, dict[str, float]], last: int
) -> int:
    """Worker *wid* runs *version*, holding *now* (and *pending* staged, with a manual commit):
    it went no lower than *last*, that version was sent to it (*expected*: version ->
    values), the model holds exactly its values and a staged version exactly its own.
    Returns *version*."""
    assert version >= last, f"worker {wid} went back from version {last} to {version}"
    assert version in expected, f"worker {wid} runs version {version}, never sent to it"
    assert now == expected[version], f"worker {wid} at version {version} holds {now}, expected {expected[version]}"
    if pending is not None:
        pv, staged = pending
        assert pv in expected and staged == expected[pv], f"worker {wid} staged version {pv} holds {staged}"
    return version


def gate_receive(worker: MultiProcessWeightSyncScheme) -> asyncio.Event:
    """Worker *worker*'s receiver stops reading its channel until the returned event is set."""
    gate = asyncio.Event()
    queue = worker.receiver._queue
    real_get = type(queue).get_bytes  # what the receiver task awaits

    async def gated_get(*args: Any, **kwargs: Any) -> Any:
        await gate.wait()
        return await real_get(queue, *args, **kwargs)

    queue.get_bytes = gated_get  # type: ignore[method-assign]
    return gate


def _recorder(seen: dict[Wid, list[int]], wid: Wid) -> Any:
    """An ``on_update`` that lists the versions worker *wid* applies in ``seen[wid]``."""
    versions = seen[wid] = []

    def on_update(_worker: Any, version: int) -> None:
        versions.append(version)

    return on_update


class _Worker:
    """One worker as the machine sees it: its scheme, model and receive gate."""

    def __init__(self, wid: Wid, scheme: MultiProcessWeightSyncScheme, model: nn.Module, polled: bool = False) -> None:
        self.wid = wid
        self.scheme = scheme
        self.model = model
        self.polled = polled  # its versions change only at poll_nowait()
        self.busy: asyncio.Event | None = None

    def pending(self) -> tuple[int, dict[str, float | None]] | None:
        roles = self.scheme.receiver._roles
        pending = roles.pending if roles is not None else None
        return None if pending is None else (pending.version, content(pending.tensors))

    def make_busy(self) -> None:
        """Its loop stops reading its channel (a long synchronous step)."""
        if self.busy is None:
            self.busy = gate_receive(self.scheme)

    def make_idle(self) -> None:
        if self.busy is not None:
            self.busy.set()
            self.busy = None


async def _start_worker(sender: MultiProcessWeightSyncScheme, idx: int, manual: bool, on_update: Any = None, poll: bool = False) -> _Worker:
    """A loopback worker of *sender*; returns once it runs the first version (committed).
    *poll*: a polled receiver (later versions are committed by ``poll_nowait()``)."""
    scheme = loopback_worker(sender, idx)
    model = make_model()
    scheme.init_on_receiver(worker_idx=idx, model=model, on_update=on_update, poll=poll)
    connecting = asyncio.ensure_future(scheme.connect(timeout=SETTLE))
    try:
        if manual:
            await scheme.wait_for_version(0, timeout=SETTLE)  # staged: the sender waits for its commit
            scheme.commit()
        await connecting
    except BaseException:
        connecting.cancel()
        await asyncio.wait([connecting])
        await scheme.aclose()
        raise
    return _Worker(idx, scheme, model, poll)


def _check_slots(scheme: MultiProcessWeightSyncScheme, manual: bool, polled: int) -> None:
    """The ledger's invariants; slots kept for reuse were each allocated within the bound
    (*polled*: how many of the scheme's workers poll, each may hold one slot more)."""
    assert scheme._transport is not None
    scheme._transport.ledger.check()
    if scheme.max_slots is None and scheme.transport == "shm":
        n = len(scheme.sender.worker_ids)
        slots = scheme.statistics().slots
        assert slots <= max(scheme.num_slots, slot_bound(n, manual, n, n, polled=polled)), slots


# ---------------------------------------------------------------------------- clusters


class LocalCluster:
    """One host: a :class:`MultiProcessWeightSyncScheme` and *n* loopback workers.

    A crash unit is a worker (its process dies: no goodbye, its mappings gone)."""

    name = "local"

    def __init__(self, n: int, manual: bool, options: dict[str, Any]) -> None:
        self.manual = manual
        options = dict(options)
        # options["poll"]: worker 0 polls (``poll=True``), the others are event-driven.
        self.polled: set[Wid] = {0} if options.pop("poll", False) and not manual else set()
        self.source = make_model()
        self.scheme = MultiProcessWeightSyncScheme(timeout=SETTLE, commit_mode="manual" if manual else "auto", **options)
        self.scheme.init_on_sender(model=self.source, num_workers=n)
        self.ids: list[Wid] = list(range(n))
        self.units: list[Hashable] = list(self.ids)
        self.workers: dict[Wid, _Worker] = {}
        self.frozen: dict[Wid, _Worker] = {}  # lost their sender; must never change again
        self.seen: dict[Wid, list[int]] = {}  # versions each worker applied (on_update)

    async def start(self) -> None:
        joins = [asyncio.ensure_future(_start_worker(self.scheme, i, self.manual, _recorder(self.seen, i), i in self.polled)) for i in self.ids]
        await self.scheme.connect(timeout=SETTLE)
        for w in await asyncio.gather(*joins):
            self.workers[w.wid] = w

    @property
    def version(self) -> int:
        return self.scheme.version

    def unit_of(self, wid: Wid) -> Hashable:
        return wid

    def members(self, unit: Hashable) -> list[Wid]:
        return [unit]

    async def send(self, weights: Any, worker_ids: list[Wid], *, partial: bool, timeout: float, sync: bool) -> None:
        call = self.scheme.send if sync else self.scheme.send_async
        await call(weights, worker_ids, partial=partial, timeout=timeout)  # type: ignore[arg-type]

    async def wait(self, worker_ids: list[Wid] | None, quorum: int | None, timeout: float) -> None:
        await self.scheme.wait_async(worker_ids=worker_ids, quorum=quorum, timeout=timeout)  # type: ignore[arg-type]

    def make_busy_unit(self, unit: Hashable) -> bool:
        return False  # a local unit is a worker: make_busy covers it

    def make_idle_unit(self, unit: Hashable) -> None:
        pass

    async def crash(self, unit: Hashable, graceful: bool) -> None:
        """Worker *unit* dies (killed: no goodbye) or leaves (closes its receiver and goes
        on using its model, which must never change again)."""
        w = self.workers.pop(unit)
        w.make_idle()
        if graceful:
            await w.scheme.aclose()
            self.frozen[unit] = w
        else:
            await w.scheme.receiver._kill()
            await w.scheme.aclose()
        await self.scheme.sender.wait_dead(unit, timeout=SETTLE)

    async def rejoin(self, unit: Hashable) -> None:
        self.frozen.pop(unit, None)
        self.workers[unit] = await _start_worker(self.scheme, unit, self.manual, _recorder(self.seen, unit), unit in self.polled)  # type: ignore[arg-type]

    def check(self) -> None:
        _check_slots(self.scheme, self.manual, len(self.polled))

    async def stop_trainer(self) -> None:
        await self.scheme.aclose()
        for w in self.workers.values():
            await w.scheme.wait_stopped()

    async def aclose(self) -> None:
        await self.scheme.aclose()
        for w in [*self.workers.values(), *self.frozen.values()]:
            await w.scheme.aclose()


class HostsCluster:
    """Hosts 1 and 2 (*n* loopback workers each) behind relays, and a trainer, on gloo and
    a control plane over 127.0.0.1, in this event loop. Worker ids are ``(host, index)``.

    A crash unit is a host: its relay dies (the control connection ends without ``Bye``,
    its workers lose their sender and keep their weights). A busy host's relay stops
    landing transfers."""

    name = "hosts"
    HOSTS = (1, 2)

    def __init__(self, n: int, manual: bool, options: dict[str, Any]) -> None:
        self.manual = manual
        self.n = n
        options = dict(options)
        # options["poll"]: each host's worker 0 polls (``poll=True``), the others are event-driven.
        self.polled_index = 0 if options.pop("poll", False) and not manual else None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.common: dict[str, Any] = dict(
            timeout=SETTLE,
            silence_timeout=SILENCE,
            heartbeat=1.0,
            token="stateful",
            world_size=len(self.HOSTS) + 1,
            master_addr="127.0.0.1",
            master_port=port,
            commit_mode="manual" if manual else "auto",
            **options,
        )
        self.source = make_model()
        self.trainer = DistributedWeightSyncScheme(rank=0, **self.common)
        self.trainer.init_on_sender(model=self.source, hosts=dict.fromkeys(self.HOSTS, n))
        self.ids = [(h, i) for h in self.HOSTS for i in range(n)]
        self.units: list[Hashable] = list(self.HOSTS)
        self.relays: dict[int, DistributedWeightSyncScheme] = {}
        self.workers: dict[Wid, _Worker] = {}
        self.frozen: dict[Wid, _Worker] = {}
        self.gates: dict[int, asyncio.Event] = {}  # stalled hosts: their relay resumes when set
        self.held: dict[int, asyncio.Event] = {}  # set once a stalled relay holds an operation
        self.seen: dict[Wid, list[int]] = {}  # versions each worker applied (on_update)

    async def start(self) -> None:
        await asyncio.gather(self.trainer.connect(timeout=SETTLE), *(self.rejoin(h) for h in self.HOSTS))

    async def rejoin(self, unit: Hashable) -> None:
        """Host *unit* joins (again), with a new relay and new workers; returns once they run
        their newest version.

        Every host takes part in the new weight-sync group the trainer forms for it (gloo
        needs every member), so a stalled host holds the rejoin up until it resumes: each
        other host's stall ends once it holds an operation (that group, or one from before)."""
        h: int = unit  # type: ignore[assignment]
        self.make_idle_unit(h)
        old = self.relays.pop(h, None)
        if old is not None:
            await old.aclose()
        relay = DistributedWeightSyncScheme(rank=h, **self.common)
        relay.init_on_relay(model=make_model(), num_workers=self.n)
        self.relays[h] = relay
        joins = [
            asyncio.ensure_future(_start_worker(relay.local, i, self.manual, _recorder(self.seen, (h, i)), i == self.polled_index))
            for i in range(self.n)
        ]
        connecting = asyncio.ensure_future(relay.connect(timeout=SETTLE))
        holding = asyncio.ensure_future(asyncio.gather(*(self.held[o].wait() for o in self.gates)))
        try:
            if self.gates:
                await asyncio.wait([connecting, holding], return_when=asyncio.FIRST_COMPLETED)
            for other in list(self.gates):
                self.make_idle_unit(other)
            await connecting
        finally:
            for t in (connecting, holding):
                t.cancel()
            await asyncio.wait([connecting, holding])
            done = await asyncio.gather(*joins, return_exceptions=True)
        for w in done:
            if isinstance(w, BaseException):
                raise w
            w.wid = (h, w.wid)
            self.workers[w.wid] = w

    @property
    def version(self) -> int:
        return self.trainer.version

    def unit_of(self, wid: Wid) -> Hashable:
        return wid[0]  # type: ignore[index]

    def members(self, unit: Hashable) -> list[Wid]:
        return [(unit, i) for i in range(self.n)]

    async def send(self, weights: Any, worker_ids: list[Wid], *, partial: bool, timeout: float, sync: bool) -> None:
        call = self.trainer.send if sync else self.trainer.send_async
        await call(weights, worker_ids, partial=partial, timeout=timeout)  # type: ignore[arg-type]

    async def wait(self, worker_ids: list[Wid] | None, quorum: int | None, timeout: float) -> None:
        await self.trainer.wait_async(worker_ids=worker_ids, quorum=quorum, timeout=timeout)  # type: ignore[arg-type]

    def make_busy_unit(self, unit: Hashable) -> bool:
        """Host *unit*'s relay stops carrying out the trainer's operations (a stalled host):
        the next one it takes (a group to form, a transfer to land) waits for the gate.
        Only a host that is up can stall."""
        h: int = unit  # type: ignore[assignment]
        if h in self.gates or not all(m in self.workers for m in self.members(h)):
            return False
        gate = self.gates[h] = asyncio.Event()
        held = self.held[h] = asyncio.Event()
        relay = self.relays[h].relay
        # Gated where the ops task calls them, not at its queue: that task may be parked
        # inside the queue's get() already, and would let the next operation through.
        for name in ("_form", "_land"):
            real = getattr(type(relay), name)

            async def gated(op: Any, real: Any = real) -> None:
                held.set()
                await gate.wait()
                await real(relay, op)

            setattr(relay, name, gated)
        return True

    def make_idle_unit(self, unit: Hashable) -> None:
        self.held.pop(unit, None)  # type: ignore[arg-type]
        gate = self.gates.pop(unit, None)  # type: ignore[arg-type]
        if gate is not None:
            gate.set()

    async def crash(self, unit: Hashable, graceful: bool) -> None:
        """Host *unit*'s relay dies (the process would be killed) or leaves (``aclose``);
        its workers keep their weights. A wait on them then raises :class:`HostLostError`
        naming the host."""
        h: int = unit  # type: ignore[assignment]
        self.make_idle_unit(h)
        if graceful:
            await self.relays[h].aclose()
        else:
            await self.relays[h].relay._crash()
        await self.trainer.wait_lost(h, timeout=SETTLE)
        self._freeze(h)
        try:
            await self.trainer.wait_async(worker_ids=[(h, 0)], timeout=SETTLE)
        except HostLostError as exc:
            assert exc.host == h, exc
        else:
            raise AssertionError(f"a wait on lost host {h} did not raise")

    def _freeze(self, h: int) -> None:
        for wid in self.members(h):
            w = self.workers.pop(wid)
            w.make_idle()
            self.frozen[wid] = w

    def check(self) -> None:
        for relay in self.relays.values():
            if relay.relay._state == "running":
                _check_slots(relay.local, self.manual, 0 if self.polled_index is None else 1)

    async def stop_trainer(self) -> None:
        before = {h: self.trainer.statistics().host(h) for h in self.relays}
        await self.trainer.aclose()
        for h, relay in self.relays.items():
            try:
                await relay.wait_stopped()
            except SenderDiedError as exc:
                seen = before[h]
                raise AssertionError(
                    f"host {h}'s relay lost its trainer instead of being stopped ({exc}); before the trainer "
                    f"closed it saw host {h} {seen.state} ({seen.reason}), connections {seen.connections}"
                ) from exc
        for w in self.workers.values():
            await w.scheme.wait_stopped()

    async def aclose(self) -> None:
        for h in list(self.gates):
            self.make_idle_unit(h)
        await self.trainer.aclose()
        for relay in self.relays.values():
            await relay.aclose()
        for w in [*self.workers.values(), *self.frozen.values()]:
            await w.scheme.aclose()


CLUSTERS: dict[str, Callable[[int, bool, dict[str, Any]], Any]] = {"local": LocalCluster, "hosts": HostsCluster}


# ----------------------------------------------------------------------------- machine


class _Errors(logging.Handler):
    """Collects what asyncsync logs at ERROR and above."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


class ClusterMachine(RuleBasedStateMachine):
    """One trainer, its workers behind the transport :attr:`transports` names (each example
    picks one), random options and operations; the guarantees checked after every step."""

    transports: tuple[str, ...] = ("local", "hosts")
    strict_logs = False  # also fail on anything asyncsync logs at ERROR (see nothing_went_wrong_unseen)
    always_poll = False  # every local example has a polled worker (else drawn)
    steps = 0  # checked steps, over every example of a run

    def __init__(self) -> None:
        super().__init__()
        set_debug(True)
        self.loop = asyncio.new_event_loop()
        self.cluster: Any = None
        self.expected: dict[Wid, dict[int, dict[str, float]]] = {}
        self.latest_sent: dict[Wid, int] = {}
        self.last_version: dict[Wid, int] = {}
        self.frozen: dict[Wid, dict[str, float | None]] = {}
        self.busy_units: set[Hashable] = set()
        self.value = 0.0
        self.closed = False
        self.errors = _Errors()
        logging.getLogger("asyncsync").addHandler(self.errors)

    # ----------------------------------------------------------------- helpers

    def run(self, coro: Any, timeout: float | None) -> Any:
        """Run *coro*, expected to end within its own *timeout* (plus a hang margin)."""
        return self.loop.run_until_complete(asyncio.wait_for(coro, HANG + (timeout or 0.0)))

    def advance(self, n: int) -> None:
        async def spin() -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())

    def ok_errors(self, targets: list[Wid]) -> tuple[type[BaseException], ...]:
        errors: list[type[BaseException]] = [SyncTimeoutError]
        if any(t not in self.cluster.workers for t in targets):
            errors.append(WorkerGoneError)  # died, left or host lost
        return tuple(errors)

    def record(self, before: int, planned: dict[Wid, dict[str, float]]) -> None:
        """Register what a send published (if it published: the trainer's version moved)."""
        after = self.cluster.version
        assert after in (before, before + 1), (before, after)
        if after == before + 1:
            for w, values in planned.items():
                self.expected[w][after] = values
                self.latest_sent[w] = after

    def targets_of(self, subset: list[int] | None) -> list[Wid]:
        ids = self.cluster.ids
        return list(ids) if subset is None else [ids[i % len(ids)] for i in dict.fromkeys(subset)]

    # ----------------------------------------------------------------- set-up

    @initialize(
        transport=st.sampled_from(["local", "hosts"]),
        manual=st.booleans(),
        cast=st.booleans(),
        commit=st.sampled_from(["swap", "copy"]),
        n=st.integers(1, 2),
        poll=st.booleans(),
    )
    def setup(self, transport: str, manual: bool, cast: bool, commit: str, n: int, poll: bool) -> None:
        if transport not in self.transports:
            transport = self.transports[0]
        self.manual = manual
        options: dict[str, Any] = dict(commit=commit, transfer_dtype=torch.bfloat16 if cast else None)
        if poll or self.always_poll:
            options["poll"] = True  # a polled worker among the local ones, or on each host (see the poll rule)
        # local: 2-3 workers; hosts: 1-2 workers on each of the two hosts
        cluster = CLUSTERS[transport](n + 1 if transport == "local" else n, manual, options)
        self.cluster = cluster
        self.expected = {w: {-1: dict.fromkeys(KEYS, -1.0)} for w in cluster.ids}
        self.latest_sent = dict.fromkeys(cluster.ids, -1)
        self.last_version = dict.fromkeys(cluster.ids, -1)
        values = self.next_values()
        fill(cluster.source.state_dict(), values)
        self.run(cluster.start(), SETTLE)
        self.record(-1, dict.fromkeys(cluster.ids, values))

    def next_values(self, keys: tuple[str, ...] | list[str] = KEYS) -> dict[str, float]:
        self.value += 1.0  # small integers: exact in bfloat16
        return dict.fromkeys(keys, self.value)

    # ----------------------------------------------------------------- rules

    @precondition(lambda self: not self.closed)
    @rule(
        sync=st.booleans(),
        subset=st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=1, max_size=3)),
        partial=st.one_of(st.none(), st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)),
        timeout=st.sampled_from([SHORT, 1.0]),
    )
    def send(self, sync: bool, subset: list[int] | None, partial: list[str] | None, timeout: float) -> None:
        targets = self.targets_of(subset)
        values = self.next_values(partial or KEYS)
        planned = {w: {**self.expected[w][self.latest_sent[w]], **values} for w in targets}
        if partial is None:
            fill(self.cluster.source.state_dict(), values)
            weights = None
        else:
            sd = self.cluster.source.state_dict()
            weights = {k: torch.full_like(sd[k], v) for k, v in values.items()}
        before = self.cluster.version
        try:
            self.run(self.cluster.send(weights, targets, partial=partial is not None, timeout=timeout, sync=sync), timeout)
        except self.ok_errors(targets):
            pass
        self.record(before, planned)

    @precondition(lambda self: not self.closed)
    @rule(subset=st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=1, max_size=2)), quorum=st.one_of(st.none(), st.integers(1, 2)))
    def wait(self, subset: list[int] | None, quorum: int | None) -> None:
        targets = self.targets_of(subset) if subset is not None else None
        try:
            self.run(self.cluster.wait(targets, quorum, SHORT), SHORT)
        except self.ok_errors(targets or self.cluster.ids):
            pass
        except ValueError as exc:  # a quorum above the workers that were sent the version
            assert "quorum" in str(exc), exc

    @precondition(lambda self: self.manual)
    @rule(i=st.integers(0, 3))
    def commit(self, i: int) -> None:
        """A worker commits at a safe point (also after its sender ended: its own commit)."""
        wid = self.cluster.ids[i % len(self.cluster.ids)]
        w = self.cluster.workers.get(wid) or self.cluster.frozen.get(wid)
        if w is None:
            return
        pending = w.pending()
        committed = w.scheme.commit()
        assert committed == (pending[0] if pending is not None else None), (wid, committed, pending)
        if committed is not None and wid in self.frozen:
            self.frozen[wid] = dict(self.expected[wid][committed])  # type: ignore[arg-type]

    @rule(i=st.integers(0, 3))
    def poll(self, i: int) -> None:
        """A polled worker polls between two steps: it commits the version in its mailbox,
        if new (also after its sender ended: then nothing is new)."""
        wid = self.cluster.ids[i % len(self.cluster.ids)]
        w = self.cluster.workers.get(wid) or self.cluster.frozen.get(wid)
        if w is None or not getattr(w, "polled", False):
            return
        before = w.scheme.version
        got = w.scheme.poll_nowait()
        assert got is None or (got > before and w.scheme.version == got), (wid, before, got)
        assert got is None or wid not in self.frozen, f"worker {wid} committed version {got} after it stopped receiving"
        if got is not None:
            # its ack comes through the mailbox and the wake of its sender: the trainer's, or its host's relay
            sender = self.cluster.scheme.sender if isinstance(self.cluster, LocalCluster) else self.cluster.relays[wid[0]].local.sender  # type: ignore[index]
            idx = wid if isinstance(self.cluster, LocalCluster) else wid[1]  # type: ignore[index]

            async def acked() -> None:
                while sender.applied_versions()[idx] < got:
                    await asyncio.sleep(0)

            self.run(acked(), SETTLE)

    @rule(i=st.integers(0, 3), busy=st.booleans())
    def make_busy(self, i: int, busy: bool) -> None:
        """A worker's loop stops (or resumes) reading its channel."""
        w = self.cluster.workers.get(self.cluster.ids[i % len(self.cluster.ids)])
        if w is not None:
            w.make_busy() if busy else w.make_idle()

    @rule(i=st.integers(0, 1), busy=st.booleans())
    def make_host_busy(self, i: int, busy: bool) -> None:
        """A host's relay stalls (or resumes); no-op on one host."""
        unit = self.cluster.units[i % len(self.cluster.units)]
        if busy:
            self.cluster.make_busy_unit(unit)
        else:
            self.cluster.make_idle_unit(unit)

    @rule(steps=st.integers(1, 30))
    def run_loop(self, steps: int) -> None:
        self.advance(steps)

    @precondition(lambda self: not self.closed)
    @rule(seconds=st.sampled_from([0.05, 0.3]))
    def block_trainer_loop(self, seconds: float) -> None:
        """A synchronous training step in the trainer's loop, under the silence timeout:
        nobody is declared lost, and the next calls work."""
        before = self.cluster.version

        async def step() -> None:
            sending = asyncio.ensure_future(self.cluster.send(None, list(self.cluster.workers), partial=False, timeout=SHORT, sync=False))
            await asyncio.sleep(0)
            time.sleep(seconds)
            try:
                await sending
            except self.ok_errors(list(self.cluster.ids)):
                pass

        values = self.next_values()
        fill(self.cluster.source.state_dict(), values)
        self.run(step(), SHORT)
        self.record(before, dict.fromkeys(self.cluster.workers, values))

    @precondition(lambda self: not self.closed)
    @rule(i=st.integers(0, 3), graceful=st.booleans())
    def crash(self, i: int, graceful: bool) -> None:
        """A worker (local) or a host's relay (multi-host) dies or leaves; what it leaves
        behind keeps its last complete version, and never changes again."""
        unit = self.cluster.units[i % len(self.cluster.units)]
        members = self.cluster.members(unit)
        if any(m not in self.cluster.workers for m in members) or len(self.cluster.workers) <= len(members):
            return  # already down, or the last one standing
        self.every_worker_runs_exactly_a_version_sent_to_it()
        self.run(self.cluster.crash(unit, graceful), SETTLE)
        for m in members:
            if m in self.cluster.frozen:
                self.frozen[m] = content(self.cluster.frozen[m].model.state_dict())

    @precondition(lambda self: not self.closed)
    @rule(i=st.integers(0, 3))
    def rejoin(self, i: int) -> None:
        """A replacement joins and gets the newest version sent to its workers, first."""
        unit = self.cluster.units[i % len(self.cluster.units)]
        members = self.cluster.members(unit)
        if any(m in self.cluster.workers for m in members):
            return
        for m in members:
            old = self.cluster.frozen.pop(m, None)
            self.frozen.pop(m, None)
            if old is not None:
                self.run(old.scheme.aclose(), SETTLE)
            self.expected[m][-1] = dict.fromkeys(KEYS, -1.0)
            self.last_version[m] = -1
        self.run(self.cluster.rejoin(unit), SETTLE)
        for m in members:
            seen = self.cluster.seen[m]
            assert seen and seen[0] == self.latest_sent[m], f"worker {m} rejoined with versions {seen}, the newest sent to it is {self.latest_sent[m]}"

    @precondition(lambda self: not self.closed)
    @rule()
    def stop_trainer(self) -> None:
        for w in self.cluster.workers.values():
            w.make_idle()
        for u in self.cluster.units:
            self.cluster.make_idle_unit(u)
        self.run(self.cluster.stop_trainer(), SETTLE)
        self.closed = True
        for wid, w in self.cluster.workers.items():
            self.frozen[wid] = content(w.model.state_dict())

    # ----------------------------------------------------------------- checks

    def check_worker(self, wid: Wid, w: _Worker) -> None:
        now = content(w.model.state_dict())
        if wid in self.frozen:
            assert now == self.frozen[wid], f"worker {wid} changed after it stopped receiving: {self.frozen[wid]} -> {now}"
            return
        self.last_version[wid] = check_version(wid, w.scheme.version, now, w.pending(), self.expected[wid], self.last_version[wid])

    @invariant()
    def every_worker_runs_exactly_a_version_sent_to_it(self) -> None:
        if self.cluster is None:
            return
        ClusterMachine.steps += 1
        for wid, w in [*self.cluster.workers.items(), *self.cluster.frozen.items()]:
            self.check_worker(wid, w)

    @invariant()
    def nothing_went_wrong_unseen(self) -> None:
        """With :attr:`strict_logs`, no error was logged (a version a host could not
        complete, a transfer lost...): the soak's stricter check."""
        assert not (self.strict_logs and self.errors.records), f"asyncsync logged errors: {self.errors.records}"

    @invariant()
    def slots_within_bound(self) -> None:
        if self.cluster is not None and not self.closed:
            self.cluster.check()

    def converge(self) -> None:
        """Idle everything, commit everything: the living reach the newest version."""
        living = list(self.cluster.workers)
        before = self.cluster.version
        values = self.next_values()
        fill(self.cluster.source.state_dict(), values)
        task = self.loop.create_task(self.cluster.send(None, living, partial=False, timeout=SETTLE, sync=True))
        if self.manual or any(getattr(w, "polled", False) for w in self.cluster.workers.values()):

            async def commit_all() -> None:
                while not task.done():
                    for w in self.cluster.workers.values():
                        w.scheme.poll_nowait() if getattr(w, "polled", False) else w.scheme.commit()
                    await asyncio.sleep(0.001)

            self.run(commit_all(), SETTLE)
        self.run(task, SETTLE)
        self.record(before, dict.fromkeys(living, values))
        for wid in living:
            self.check_worker(wid, self.cluster.workers[wid])
            assert self.cluster.workers[wid].scheme.version == self.latest_sent[wid], (wid, self.latest_sent[wid])

    def teardown(self) -> None:
        try:
            if self.cluster is not None:
                for w in self.cluster.workers.values():
                    w.make_idle()
                for u in self.cluster.units:
                    self.cluster.make_idle_unit(u)
                if not self.closed:
                    self.converge()
                self.run(self.cluster.aclose(), SETTLE)
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            logging.getLogger("asyncsync").removeHandler(self.errors)
            set_debug(os.environ.get("ASYNCSYNC_DEBUG", "") not in ("", "0"))
            self.cluster = None


def run_machine(settings: Any, transports: tuple[str, ...] = ("local", "hosts"), *, strict_logs: bool = False) -> int:
    """Run :class:`ClusterMachine` over *transports*; afterwards no descriptor or thread is
    left from any example. Returns the number of steps checked."""
    machine = type("Machine", (ClusterMachine,), {"transports": transports, "strict_logs": strict_logs})
    ClusterMachine.steps = 0
    if "hosts" in transports:
        _warm_up()
    run_without_leaks(machine, settings)
    return ClusterMachine.steps


def run_without_leaks(machine: type[RuleBasedStateMachine], settings: Any) -> None:
    """Run *machine* as a test; afterwards no descriptor, thread or ``/dev/shm`` entry is
    left from any example (:func:`asyncsync.testing.no_leaks`)."""
    # What the library leaves to end on its own must end within its timeouts: a
    # weight-sync group's rendezvous left waiting for a member that went away cannot be
    # interrupted (it ends when its store closes, at the latest at its timeout), and a
    # group closed while the backend still runs an operation in it (a receive from a
    # trainer that gave up) is kept until that operation ends, at the group's timeout.
    # Neither has anything to wait on from here: the check waits for them until then.
    gc.collect()
    with no_leaks(threads=True, settle=SETTLE + HANG):
        run_state_machine_as_test(machine, settings=settings)


_warm = False


def _warm_up() -> None:
    """Build and close one multi-host cluster: the first in a process leaves the backend's
    process-wide state behind (a pipe), which is not a leak of any example."""
    global _warm
    if _warm:
        return
    loop = asyncio.new_event_loop()
    try:
        cluster = HostsCluster(1, False, {})
        try:
            loop.run_until_complete(asyncio.wait_for(cluster.start(), SETTLE))
        finally:
            loop.run_until_complete(cluster.aclose())
    finally:
        loop.close()
    _warm = True
