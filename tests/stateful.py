"""A hypothesis state machine that drives one sender and several receivers through random
interleavings and checks the guarantees after every step.

The receivers run in the test's own event loop (:func:`asyncsync.loopback_worker`): same
sockets and shared memory as across processes, and the checks run between two awaits of
every worker. ``tests/test_stateful.py`` runs it in the suite; ``python -m asyncsync.soak
--stateful`` runs it for longer.

What is checked after each step, for every worker still receiving:
- the model holds exactly the weights of the version it reports, and that version was
  sent to this worker (so no mix of two versions, no change without a commit);
- a staged version (manual commit) holds exactly its own weights;
- versions only go up;
- a worker that left keeps its weights forever after;
- the sender's slot ledger holds its invariants (``ASYNCSYNC_DEBUG`` checks on every
  transition) and the slot count stays within the ownership bound;
- no call outlives its timeout by more than a hang margin;
and at the end of each example every living worker converges to the newest version;
after the run, descriptors and threads are back to where they started.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from asyncsync import (
    CapacityError,
    MultiProcessWeightSyncScheme,
    SyncTimeoutError,
    WorkerDiedError,
    WorkerGoneError,
    WorkerLeftError,
    loopback_worker,
)
from asyncsync._core._ownership import set_debug, slot_bound
from asyncsync._stateful import KEYS, SHORT, check_version, content, fill, gate_receive, make_model, run_without_leaks

HANG = 10.0  # a call that outlives its own timeout by this much is a hang
GONE_ERRORS: dict[str, type[WorkerGoneError]] = {"dead": WorkerDiedError, "left": WorkerLeftError}


class _Worker:
    def __init__(self, idx: int, scheme: MultiProcessWeightSyncScheme, model: nn.Module) -> None:
        self.idx = idx
        self.scheme = scheme
        self.model = model
        self.state = "running"  # running | left | dead | stopped
        self.busy: asyncio.Event | None = None
        self.last_version = -1
        self.frozen: dict[str, float | None] | None = None


class SyncMachine(RuleBasedStateMachine):
    """One trainer, 2-3 loopback workers, random options and operations."""

    steps = 0  # checked steps, over every example of a run

    def __init__(self) -> None:
        super().__init__()
        set_debug(True)
        self.loop = asyncio.new_event_loop()
        self.scheme: MultiProcessWeightSyncScheme | None = None
        self.workers: dict[int, _Worker] = {}
        self.expected: dict[int, dict[int, dict[str, float]]] = {}
        self.value = 0.0
        self.closed = False

    # ----------------------------------------------------------------- helpers

    def run(self, coro: Any, timeout: float | None) -> Any:
        limit = HANG + (timeout or 0.0)
        return self.loop.run_until_complete(asyncio.wait_for(coro, limit))

    def advance(self, n: int) -> None:
        async def spin() -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())

    def next_values(self) -> float:
        self.value += 1.0  # small integers and halves: exact in bfloat16
        return self.value

    def fill_sources(self) -> dict[int, dict[str, float]]:
        """New values in every source; what each worker would get from send()."""
        per_source: dict[int, dict[str, float]] = {}
        for s, sd in enumerate(self.sources):
            v = self.next_values() + 0.5 * s
            values = dict.fromkeys(KEYS, v)
            fill(sd, values)
            per_source[id(sd)] = values
        return {w: per_source[id(self.params_map[w])] for w in self.params_map}

    def living(self) -> list[_Worker]:
        return [w for w in self.workers.values() if w.state == "running"]

    def record(self, before: int, planned: dict[int, dict[str, float]]) -> None:
        """Register what a send published (if it published: the sender's version moved)."""
        assert self.scheme is not None
        after = self.scheme.version
        assert after in (before, before + 1), (before, after)
        if after == before + 1:
            for w, values in planned.items():
                self.expected[w][after] = values
                self.latest_sent[w] = after

    async def start_worker(self, idx: int) -> None:
        assert self.scheme is not None
        ws = loopback_worker(self.scheme, idx)
        model = make_model()
        ws.init_on_receiver(worker_idx=idx, model=model)
        w = _Worker(idx, ws, model)
        self.workers[idx] = w
        connecting = asyncio.ensure_future(ws.connect(timeout=HANG))
        if self.manual:
            await ws.wait_for_version(0, timeout=HANG)  # staged; committed below
            if ws.update_pending:
                ws.commit()
        await connecting

    def sender_ok_errors(self, targets: list[int]) -> tuple[type[BaseException], ...]:
        """A timeout, or the departure of a target that is gone, named for how it went: a
        killed worker died (:class:`WorkerDiedError`), one that closed its receiver left
        (:class:`WorkerLeftError`)."""
        errors: list[type[BaseException]] = [SyncTimeoutError]
        for i in targets:
            gone = GONE_ERRORS.get(self.workers[i].state)
            if gone is not None and gone not in errors:
                errors.append(gone)
        return tuple(errors)

    # ----------------------------------------------------------------- set-up

    @initialize(
        n=st.integers(2, 3),
        commit=st.sampled_from(["swap", "copy"]),
        manual=st.booleans(),
        cast=st.booleans(),
        shared_source=st.booleans(),
        transport=st.sampled_from(["shm", "shm", "queue"]),
        skip=st.booleans(),
    )
    def setup(self, n: int, commit: str, manual: bool, cast: bool, shared_source: bool, transport: str, skip: bool) -> None:
        self.manual = manual
        self.sources = [make_model().state_dict()]
        if not shared_source:
            self.sources.append(make_model().state_dict())
        self.params_map = {i: self.sources[i % len(self.sources)] for i in range(n)}
        scheme = MultiProcessWeightSyncScheme(
            timeout=HANG,
            commit=commit,  # type: ignore[arg-type]
            commit_mode="manual" if manual else "auto",
            transfer_dtype=torch.bfloat16 if cast else None,
            transport=transport,  # type: ignore[arg-type]
            on_worker_error="skip" if skip else "raise",
        )
        scheme.init_on_sender(params_map=self.params_map)
        self.scheme = scheme
        self.expected = {i: {-1: dict.fromkeys(KEYS, -1.0)} for i in range(n)}
        self.latest_sent = dict.fromkeys(range(n), -1)
        planned = self.fill_sources()

        async def start() -> None:
            tasks = [asyncio.ensure_future(self.start_worker(i)) for i in range(n)]
            await scheme.connect()
            await asyncio.gather(*tasks)

        self.run(start(), HANG)
        self.record(-1, planned)

    # ----------------------------------------------------------------- rules

    @precondition(lambda self: not self.closed)
    @rule(
        kind=st.sampled_from(["send", "send_async"]),
        subset=st.one_of(st.none(), st.lists(st.integers(0, 2), min_size=1, max_size=2, unique=True)),
        partial=st.one_of(st.none(), st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)),
    )
    def send(self, kind: str, subset: list[int] | None, partial: list[str] | None) -> None:
        assert self.scheme is not None
        targets = [i for i in (subset or range(len(self.params_map))) if i in self.params_map]
        if not targets:
            return
        if partial is not None and any(self.latest_sent[i] < 0 for i in targets):
            return
        if partial is None:
            planned_all = self.fill_sources()
            planned = {i: planned_all[i] for i in targets}
            weights = None
        else:
            v = self.next_values()
            weights = {k: torch.full_like(self.sources[0][k], v) for k in partial}
            planned = {i: {**self.expected[i][self.latest_sent[i]], **dict.fromkeys(partial, v)} for i in targets}
        before = self.scheme.version
        call = self.scheme.send if kind == "send" else self.scheme.send_async
        try:
            self.run(call(weights, targets, partial=partial is not None, timeout=SHORT), SHORT)
        except self.sender_ok_errors(targets):
            pass
        self.record(before, planned)

    @precondition(lambda self: not self.closed)
    @rule(kind=st.sampled_from(["send", "send_async", "wait_async"]), steps=st.integers(0, 8))
    def cancelled(self, kind: str, steps: int) -> None:
        """Cancel a call at a random await; the next calls must work."""
        assert self.scheme is not None
        before = self.scheme.version
        planned = self.fill_sources() if kind != "wait_async" else {}
        coro: Any = getattr(self.scheme, kind)(timeout=SHORT)
        task = self.loop.create_task(coro)
        self.advance(steps)
        task.cancel()

        ok: tuple[type[BaseException], ...] = (asyncio.CancelledError, *self.sender_ok_errors(list(self.params_map)))

        async def settle() -> None:
            try:
                await task
            except ok:
                pass

        self.run(settle(), SHORT)
        self.record(before, planned)

    @precondition(lambda self: not self.closed)
    @rule(quorum=st.one_of(st.none(), st.integers(1, 2)))
    def wait(self, quorum: int | None) -> None:
        assert self.scheme is not None
        try:
            self.run(self.scheme.wait_async(quorum=quorum, timeout=SHORT), SHORT)
        except self.sender_ok_errors(list(self.params_map)):
            pass
        except ValueError as exc:  # a quorum above the workers that were sent the version
            assert "quorum" in str(exc)

    @precondition(lambda self: self.manual)
    @rule(idx=st.integers(0, 2))
    def commit(self, idx: int) -> None:
        """Commit at a safe point; after the receiver ended, a staged version may still be
        committed (the worker's own commit), and nothing else changes the model."""
        w = self.workers.get(idx)
        if w is None or w.state == "dead":
            return
        pending = w.scheme.receiver._roles.pending if w.scheme.receiver._roles is not None else None
        committed = w.scheme.commit()
        assert committed == (pending.version if pending is not None else None)
        if committed is not None and w.frozen is not None:
            w.frozen = dict(self.expected[idx][committed])

    @rule(idx=st.integers(0, 2))
    def make_busy(self, idx: int) -> None:
        """The worker's loop stops reading its channel (a long synchronous step)."""
        w = self.workers.get(idx)
        if w is None or w.state != "running" or w.busy is not None:
            return
        w.busy = gate_receive(w.scheme)

    @rule(idx=st.integers(0, 2))
    def make_idle(self, idx: int) -> None:
        w = self.workers.get(idx)
        if w is not None and w.busy is not None:
            w.busy.set()
            w.busy = None

    @rule(steps=st.integers(1, 30))
    def run_loop(self, steps: int) -> None:
        self.advance(steps)

    @precondition(lambda self: not self.closed)
    @rule(idx=st.integers(0, 2))
    def leave(self, idx: int) -> None:
        """The worker closes its receiver and goes on using its model."""
        w = self.workers.get(idx)
        if w is None or w.state != "running":
            return
        self.make_idle(idx)
        self.run(w.scheme.aclose(), None)
        w.state = "left"
        w.frozen = content(w.model.state_dict())
        self.run(self.scheme.sender.wait_dead(idx, timeout=HANG), HANG)  # type: ignore[union-attr]

    @precondition(lambda self: not self.closed)
    @rule(idx=st.integers(0, 2))
    def kill(self, idx: int) -> None:
        """The worker's process dies: its channel closes with no goodbye."""
        w = self.workers.get(idx)
        if w is None or w.state != "running":
            return
        self.make_idle(idx)
        # What asyncsync.testing's faults.kill does to a loopback worker: its channel closes
        # with no goodbye (the model keeps its weights, as a dead process's would be gone).
        self.run(w.scheme.receiver._kill(), HANG)
        w.state = "dead"
        self.run(self.scheme.sender.wait_dead(idx, timeout=HANG), HANG)  # type: ignore[union-attr]

    @precondition(lambda self: not self.closed)
    @rule(idx=st.integers(0, 2))
    def restart(self, idx: int) -> None:
        """A replacement worker joins and gets the newest version sent to this id."""
        w = self.workers.get(idx)
        if w is None or w.state not in ("left", "dead"):
            return
        self.run(self.start_worker(idx), HANG)
        self.expected[idx][-1] = dict.fromkeys(KEYS, -1.0)

    @precondition(lambda self: not self.closed)
    @rule()
    def close_trainer(self) -> None:
        assert self.scheme is not None
        for w in self.workers.values():
            if w.busy is not None:
                self.make_idle(w.idx)
        self.run(self.scheme.aclose(), HANG)
        self.closed = True
        for w in self.living():
            self.run(w.scheme.wait_stopped(), HANG)
            w.state = "stopped"
            w.frozen = content(w.model.state_dict())

    # ----------------------------------------------------------------- checks

    @invariant()
    def models_hold_one_sent_version(self) -> None:
        if self.scheme is None:
            return
        SyncMachine.steps += 1
        for w in self.workers.values():
            if w.state == "dead":
                continue
            now = content(w.model.state_dict())
            if w.frozen is not None:
                assert now == w.frozen, f"worker {w.idx} changed after it stopped receiving: {w.frozen} -> {now}"
                continue
            rx = w.scheme.receiver
            pending = rx._roles.pending if rx._roles is not None else None
            staged = None if pending is None else (pending.version, content(pending.tensors))
            w.last_version = check_version(w.idx, rx.version, now, staged, self.expected[w.idx], w.last_version)

    @invariant()
    def slots_within_bound(self) -> None:
        if self.scheme is None or self.closed:
            return
        assert self.scheme._transport is not None
        ledger = self.scheme._transport.ledger  # slot ownership, checked on purpose
        ledger.check()
        latest = len({r.slot for r in ledger.latest.values()})
        if self.scheme.max_slots is None:
            n = len(self.params_map)
            slots = self.scheme.statistics().slots  # allocated now
            if self.scheme.transport == "queue":  # freed once released: the bound of the owners now
                assert slots <= slot_bound(n, self.manual, latest, 1)
            else:  # kept for reuse: each was allocated within the bound of its time (checked then)
                assert slots <= max(self.scheme.num_slots, slot_bound(n, self.manual, n, n))

    def teardown(self) -> None:
        try:
            if self.scheme is not None:
                for w in list(self.workers.values()):
                    self.make_idle(w.idx)
                if not self.closed:
                    self.converge()
                    self.close_trainer()
                for w in self.workers.values():
                    if w.state != "dead":
                        self.run(w.scheme.aclose(), HANG)
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            set_debug(os.environ.get("ASYNCSYNC_DEBUG", "") not in ("", "0"))
        self.workers.clear()
        self.scheme = None

    def converge(self) -> None:
        """Idle workers, commit everything: the living reach the newest version sent to them."""
        assert self.scheme is not None
        living = [w.idx for w in self.living()]
        if not living:
            return
        before = self.scheme.version
        planned = self.fill_sources()
        task = self.loop.create_task(self.scheme.send(worker_ids=living, timeout=HANG))
        if self.manual:

            async def commit_all() -> None:
                while not task.done():
                    for i in living:
                        self.workers[i].scheme.commit()
                    await asyncio.sleep(0.001)

            self.run(commit_all(), HANG)
        try:
            self.run(task, HANG)
        except CapacityError:  # pragma: no cover - only with a max_slots cap
            raise
        self.record(before, {i: planned[i] for i in living})
        for i in living:
            assert self.workers[i].scheme.version == self.latest_sent[i]



def run_machine(settings: Any) -> int:
    """Run the machine; afterwards no descriptor or thread is left from any example.

    Returns the number of steps checked.
    """
    SyncMachine.steps = 0
    run_without_leaks(SyncMachine, settings)
    return SyncMachine.steps


# ------------------------------------------------------------------ across processes


class ProcessMachine(RuleBasedStateMachine):
    """The same guarantees with the workers in spawned processes (slow: each example
    spawns two). Workers answer probes (tests/_targets.py ``probe_worker``); a busy worker
    blocks its loop on a pipe until released; a killed worker is SIGKILLed."""

    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.cluster: Any = None
        self.expected: dict[int, dict[int, dict[str, float]]] = {}
        self.state: dict[int, str] = {}
        self.last_version: dict[int, int] = {}
        self.value = 0.0

    def run(self, coro: Any, timeout: float | None) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, HANG + (timeout or 0.0)))

    def fill_model(self, keys: list[str] | None = None) -> dict[str, float]:
        self.value += 1.0
        values = dict.fromkeys(keys or self.keys, self.value)
        fill(self.cluster.model.state_dict(), values)
        return values

    def record(self, before: int, targets: list[int], values: dict[str, float]) -> None:
        after = self.cluster.scheme.version
        assert after in (before, before + 1)
        if after == before + 1:
            for i in targets:
                base = self.expected[i][self.latest[i]]
                self.expected[i][after] = {**base, **values}
                self.latest[i] = after

    @initialize(manual=st.booleans(), cast=st.booleans(), commit=st.sampled_from(["swap", "copy"]), transport=st.sampled_from(["shm", "queue"]))
    def setup(self, manual: bool, cast: bool, commit: str, transport: str) -> None:
        from tests.conftest import Cluster

        self.manual = manual
        self.cluster = Cluster.of(
            ["mlp", "mlp"],
            commit_mode="manual" if manual else "auto",
            transfer_dtype=torch.bfloat16 if cast else None,
            commit=commit,
            transport=transport,
            on_worker_error="skip",
        )
        self.keys = list(self.cluster.model.state_dict())
        values = self.fill_model()
        self.run(self.cluster.start_manual() if manual else self.cluster.start(), HANG)
        self.expected = {i: {0: dict(values)} for i in range(2)}
        self.latest = dict.fromkeys(range(2), 0)
        self.state = dict.fromkeys(range(2), "running")
        self.last_version = dict.fromkeys(range(2), 0)

    @rule(kind=st.sampled_from(["send", "send_async"]), subset=st.sampled_from([None, [0], [1]]), partial=st.booleans())
    def send(self, kind: str, subset: list[int] | None, partial: bool) -> None:
        scheme = self.cluster.scheme
        targets = subset or [0, 1]
        keys = self.keys[:1] if partial else None
        values = self.fill_model(keys)
        weights = {k: self.cluster.model.state_dict()[k] for k in keys} if keys else None
        before = scheme.version
        call = scheme.send if kind == "send" else scheme.send_async
        try:
            self.run(call(weights, targets, partial=partial, timeout=0.3), 0.3)
        except (SyncTimeoutError, WorkerDiedError):
            pass
        self.record(before, targets, values)

    @rule(kind=st.sampled_from(["send", "send_async", "wait_async"]), steps=st.integers(0, 6))
    def cancelled(self, kind: str, steps: int) -> None:
        scheme = self.cluster.scheme
        before = scheme.version
        values = self.fill_model() if kind != "wait_async" else {}
        task = self.loop.create_task(getattr(scheme, kind)(timeout=0.3))

        async def cancel() -> None:
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, SyncTimeoutError, WorkerDiedError):
                pass

        self.run(cancel(), 0.3)
        self.record(before, [0, 1], values)

    @precondition(lambda self: self.manual)
    @rule(idx=st.integers(0, 1))
    def commit(self, idx: int) -> None:
        if self.state[idx] == "running":
            self.run(self.cluster.probes[idx].ask("commit"), None)

    @rule(idx=st.integers(0, 1))
    def block(self, idx: int) -> None:
        if self.state[idx] == "running":
            assert self.run(self.cluster.probes[idx].ask("block"), None) == "blocked"
            self.state[idx] = "blocked"

    @rule(idx=st.integers(0, 1))
    def release(self, idx: int) -> None:
        if self.state[idx] == "blocked":
            self.run(self.cluster.probes[idx].ask("release"), None)
            self.state[idx] = "running"

    @rule(idx=st.integers(0, 1))
    def kill(self, idx: int) -> None:
        if self.state[idx] in ("running", "blocked"):
            self.cluster.groups[idx].kill(idx)
            self.run(self.cluster.scheme.sender.wait_dead(idx, timeout=HANG), HANG)
            self.state[idx] = "dead"

    @invariant()
    def workers_hold_one_sent_version(self) -> None:
        if self.cluster is None:
            return
        ProcessMachine.steps += 1
        self.cluster.scheme._transport.ledger.check()  # type: ignore[union-attr]
        for i, state in self.state.items():
            if state != "running":
                continue
            version, sd = self.run(self.cluster.state(i), None)
            assert version >= self.last_version[i], (i, self.last_version[i], version)
            self.last_version[i] = version
            assert content(sd) == self.expected[i][version], (i, version, content(sd), self.expected[i][version])

    def teardown(self) -> None:
        try:
            if self.cluster is not None:
                for i in range(2):
                    self.release(i)
                self.run(self.cluster.kill_close(), HANG)
        finally:
            self.loop.close()
