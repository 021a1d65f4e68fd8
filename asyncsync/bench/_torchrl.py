"""torchrl baseline for the weight-sync benchmark.

Drives torchrl's ``MultiProcessWeightSyncScheme`` ("torchrl-mp") and
``SharedMemWeightSyncScheme`` ("torchrl-shared") standalone, without a
collector, following the order torchrl's own multiprocess collectors use::

    trainer: scheme.init_on_sender(...)      # creates the per-worker mp queues
    trainer: spawn workers(scheme)           # the scheme is pickled into each worker
    trainer: scheme.connect()                # puts the initial weights in the queues
    worker:  scheme.init_on_receiver(...); scheme.connect(worker_idx=i)
             # reads the initial weights, starts torchrl's background receiver thread
    trainer: scheme.send(weights=model)      # sync=True: returns once all workers acked

What one timed ``send`` covers (both kinds use ``sync=True``, so it always ends
with one ack per worker; nothing had to be measured differently):

* torchrl-mp: extract a TensorDict from the trainer model, put it on every
  worker's weight queue (the trainer's parameter storages move into shared
  memory on the first send; later sends pickle file-descriptor handles, one
  per tensor per worker), put a "receive" instruction per worker; each worker
  thread unpickles the handles, copies them into its parameters, acks. (After
  connect() a worker's parameters *are* the initial-weights tensors it got, one
  shared-memory copy common to all workers, so N workers copy into one buffer.)
* torchrl-shared: copy the trainer's parameters into the one shared-memory
  buffer that all workers' parameters alias, put a "receive" instruction per
  worker; each worker thread "applies" the buffer (a no-op copy, its
  parameters are that buffer) and acks.

Run ``python -m asyncsync.bench._torchrl`` for a smoke test. This module imports
nothing from ``asyncsync`` except ``asyncsync.bench._workload`` and
``asyncsync.bench._cpu`` (stdlib only).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import queue
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue as MPQueue
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from asyncsync.bench import _cpu
from asyncsync.bench._workload import make_model, parse_params, perturb_

if TYPE_CHECKING:
    from torchrl.weight_update import SharedMemWeightSyncScheme

__all__ = ["KINDS", "available", "run_torchrl"]

KINDS: tuple[str, ...] = ("torchrl-mp", "torchrl-shared")
MODEL_ID = "policy"
WARMUP_SENDS = 2
#: Limits for the trainer's waits; a wait past one of them fails the run.
READY_TIMEOUT_S = 300.0
SEND_TIMEOUT_S = 300.0
REPLY_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 10.0
_POLL_S = 0.1


def available() -> bool:
    """Return True when ``torchrl.weight_update`` (and tensordict) can be imported."""
    try:
        import tensordict  # noqa: F401
        import torchrl.weight_update  # noqa: F401
    except Exception:
        return False
    return True


# --------------------------------------------------------------------------
# memory helpers
# --------------------------------------------------------------------------


def _reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) on Linux; a no-op where unsupported."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")


def _peak_rss_mb(pid: int) -> float:
    """Peak RSS of ``pid`` in MiB (Linux VmHWM), else its current RSS from psutil."""
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    import psutil

    return float(psutil.Process(pid).memory_info().rss) / 2**20


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------


def _param_sums(model: nn.Module) -> list[float]:
    """Per-parameter float64 sums (to check workers hold the trainer's weights)."""
    with torch.no_grad():
        return [float(p.detach().double().sum()) for p in model.parameters()]


def _worker_main(
    scheme: SharedMemWeightSyncScheme,
    worker_idx: int,
    n_params: int,
    n_tensors: int,
    cmd_q: MPQueue[str],
    out_q: MPQueue[tuple[str, int, Any]],
) -> None:
    """Worker process: connect the torchrl receiver, then serve trainer commands.

    torchrl's background thread receives and applies the weights; the main
    thread only answers "sums"/"stop" on ``cmd_q`` and exits when the trainer
    goes away. SIGINT is ignored so ctrl-C is handled by the trainer alone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    parent = multiprocessing.parent_process()
    try:
        # The worker builds its own copy (different values); torchrl's connect()
        # then swaps in the weights it receives (to_module, not in place).
        model = make_model(n_params, n_tensors, seed=1000 + worker_idx)
        scheme.init_on_receiver(model_id=MODEL_ID, model=model, worker_idx=worker_idx)
        scheme.connect(worker_idx=worker_idx)
        out_q.put(("ready", worker_idx, None))
        while True:
            try:
                cmd = cmd_q.get(timeout=0.25)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    break
                continue
            if cmd == "sums":
                out_q.put(("sums", worker_idx, _param_sums(model)))
            elif cmd == "stop":
                break
    except BaseException:
        with contextlib.suppress(Exception):
            out_q.put(("error", worker_idx, traceback.format_exc()))
    finally:
        # Stop torchrl's receiver thread. Pitfall: a receiver's shutdown() also
        # puts "stop" on every *other* worker's instruction queue (the pickled
        # scheme holds all of them), so it must only run at teardown.
        with contextlib.suppress(Exception):
            scheme.shutdown()


# --------------------------------------------------------------------------
# trainer side
# --------------------------------------------------------------------------


class _AckGuard(threading.Thread):
    """Unblock ``scheme.send`` if a worker dies or a send outlives ``SEND_TIMEOUT_S``.

    torchrl's sync send waits for acks with no timeout, so a dead worker (or a
    receiver thread that hit an error and never acked) would hang the trainer.
    The guard then pushes a fake ack into every ack queue (torchrl only logs a
    warning for it) and records why, and the trainer raises.
    """

    def __init__(
        self, procs: Sequence[BaseProcess], ack_queues: Sequence[MPQueue[str]]
    ) -> None:
        super().__init__(name="torchrl-ack-guard", daemon=True)
        self._procs = list(procs)
        self._ack_queues = list(ack_queues)
        self._deadline: float | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.failure: str | None = None

    def arm(self, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Start watching one send."""
        with self._lock:
            self._deadline = time.monotonic() + timeout_s

    def disarm(self) -> None:
        """Stop the send deadline (worker deaths are still watched)."""
        with self._lock:
            self._deadline = None

    def check(self) -> None:
        """Raise if the guard fired."""
        if self.failure is not None:
            raise RuntimeError(f"torchrl benchmark failed: {self.failure}")

    def stop(self) -> None:
        """End the guard thread."""
        self._done.set()
        if self.is_alive():
            self.join(timeout=2.0)

    def run(self) -> None:
        while not self._done.wait(_POLL_S):
            dead = [i for i, p in enumerate(self._procs) if p.exitcode is not None]
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
            if not dead and not late:
                continue
            self.failure = (
                f"worker(s) {dead} exited (exit codes "
                f"{[self._procs[i].exitcode for i in dead]})"
                if dead
                else f"no ack within {SEND_TIMEOUT_S:.0f}s"
            )
            for q in self._ack_queues:
                with contextlib.suppress(Exception):
                    q.put("aborted-by-benchmark")
            return


def _make_scheme(kind: str) -> SharedMemWeightSyncScheme:
    """Create the torchrl scheme for ``kind`` (sync sends, TensorDict strategy)."""
    from torchrl.weight_update import (
        MultiProcessWeightSyncScheme,
        SharedMemWeightSyncScheme,
    )

    if kind == "torchrl-mp":
        return MultiProcessWeightSyncScheme(strategy="tensordict", sync=True)
    if kind == "torchrl-shared":
        return SharedMemWeightSyncScheme(strategy="tensordict", sync=True)
    raise ValueError(f"unknown torchrl kind {kind!r}; expected one of {KINDS}")


def _collect(
    out_q: MPQueue[tuple[str, int, Any]],
    kind: str,
    workers: int,
    procs: Sequence[BaseProcess],
    timeout_s: float,
) -> dict[int, Any]:
    """Wait for one ``(kind, worker_idx, payload)`` message per worker on ``out_q``."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"timed out after {timeout_s:.0f}s waiting for {kind!r} from workers "
                f"{sorted(set(range(workers)) - set(got))}"
            )
        try:
            tag, idx, payload = out_q.get(timeout=_POLL_S)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode is not None]
            if dead:
                raise RuntimeError(
                    f"worker(s) {dead} exited while waiting for {kind!r}"
                ) from None
            continue
        if tag == "error":
            raise RuntimeError(f"torchrl worker {idx} failed:\n{payload}")
        if tag != kind:
            raise RuntimeError(f"unexpected message {tag!r} from worker {idx}")
        got[idx] = payload
    return got


def _stop_processes(
    procs: Sequence[BaseProcess], cmd_queues: Sequence[MPQueue[str]]
) -> None:
    """Ask workers to stop, join them with a timeout, then terminate/kill stragglers."""
    for q in cmd_queues:
        with contextlib.suppress(Exception):
            q.put("stop")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)


def _release_scheme(scheme: SharedMemWeightSyncScheme) -> None:
    """Shut the sender-side scheme down without risking a hang.

    ``shutdown()`` (also run by the scheme's ``__del__``) puts "stop" on every
    instruction queue and then joins each queue's feeder thread; if a worker
    died with unread weights in its pipe that join would block forever, so the
    feeders are told not to wait first (private torchrl attributes).
    """
    for name in ("_weight_init_queues", "_instruction_queues", "_ack_queues"):
        for q in (getattr(scheme, name, None) or {}).values():
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
    with contextlib.suppress(Exception):
        scheme.shutdown()


def run_torchrl(
    kind: str,
    n_params: int,
    n_tensors: int,
    workers: int,
    repeats: int,
    ctx_method: str = "spawn",
) -> dict[str, Any]:
    """Time ``repeats`` synchronous torchrl sends of fresh weights to ``workers``.

    ``kind`` is "torchrl-mp" or "torchrl-shared". Each timed send is preceded
    (untimed) by ``perturb_`` of the trainer model and lasts until every worker
    acked; ``WARMUP_SENDS`` untimed sends come first. After the timed sends the
    workers' weights are checked against the trainer's. Returns
    ``{"latencies_ms": [...], "peak_rss_sender_mb": float,
    "peak_rss_worker_mb": float}`` (peak RSS = Linux VmHWM, psutil RSS elsewhere;
    the worker figure is the largest over workers), ``trainer_cpu_s``
    (``time.process_time()`` summed over the timed sends: all the trainer's threads,
    torchrl's queue feeder threads included) and ``workers_cpu_s`` (all workers' CPU
    over the timed sends, None where it cannot be read). Worker processes are always
    stopped, including on errors and ctrl-C.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown torchrl kind {kind!r}; expected one of {KINDS}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")

    import torch.multiprocessing as tmp
    from tensordict import TensorDict

    # Any: typeshed's BaseContext lacks .Process; torch.multiprocessing (imported
    # here) registers the tensor reducers used when queues/args are pickled.
    ctx: Any = tmp.get_context(ctx_method)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _reset_peak_rss()

    scheme: SharedMemWeightSyncScheme | None = None
    procs: list[BaseProcess] = []
    cmd_queues: list[MPQueue[str]] = []
    out_q: MPQueue[tuple[str, int, Any]] | None = None
    guard: _AckGuard | None = None
    try:
        model = make_model(n_params, n_tensors, seed=0)
        # Initial weights: a detached copy in shared memory, NOT the trainer's own
        # parameters. Passing model=model instead makes torchrl's buffer alias the
        # trainer's parameters; every worker's parameters then alias them too
        # (connect() applies the received tensors with to_module), so sends would
        # move no data and the trainer's in-place updates would be seen
        # half-written by the workers.
        init_weights = TensorDict.from_module(model).data.clone().share_memory_()
        scheme = _make_scheme(kind)
        scheme.init_on_sender(
            model_id=MODEL_ID,
            weights=init_weights,
            devices=[torch.device("cpu")] * workers,
            ctx=ctx,
        )
        del init_weights

        out_q = ctx.Queue()
        for idx in range(workers):
            cmd_q = ctx.Queue()
            cmd_queues.append(cmd_q)
            proc = ctx.Process(
                target=_worker_main,
                args=(scheme, idx, n_params, n_tensors, cmd_q, out_q),
                name=f"torchrl-bench-worker-{idx}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        # Initial weights go into the per-worker queues only after the workers
        # exist (same order as torchrl's collectors); no ack is sent for them.
        scheme.connect()
        _collect(out_q, "ready", workers, procs, READY_TIMEOUT_S)

        # torchrl's ack queues (private attribute), so the guard can unblock send().
        guard = _AckGuard(procs, list(scheme._ack_queues.values()))
        guard.start()

        latencies_ms: list[float] = []
        pids = [p.pid for p in procs]
        cpu_before: list[_cpu.Sample | None] = []
        trainer_cpu_s = 0.0
        for step in range(WARMUP_SENDS + repeats):
            perturb_(model, step)
            if step == WARMUP_SENDS:
                # Workers' CPU from here to the end of the timed sends (between sends
                # their receiver thread waits; their main thread polls cmd_q every 0.25 s).
                cpu_before = _cpu.sample(pids)
            guard.arm()
            c0 = time.process_time()
            t0 = time.perf_counter_ns()
            scheme.send(weights=model)
            t1 = time.perf_counter_ns()
            c1 = time.process_time()
            guard.disarm()
            guard.check()
            if step >= WARMUP_SENDS:
                trainer_cpu_s += c1 - c0
                latencies_ms.append((t1 - t0) / 1e6)
        workers_cpu_s = _cpu.elapsed_s(cpu_before, _cpu.sample(pids))

        for q in cmd_queues:
            q.put("sums")
        sums = _collect(out_q, "sums", workers, procs, REPLY_TIMEOUT_S)
        expected = _param_sums(model)
        stale = [idx for idx, got in sums.items() if got != expected]
        if stale:
            raise RuntimeError(
                f"workers {stale} do not hold the trainer's last weights"
            )

        return {
            "latencies_ms": latencies_ms,
            "trainer_cpu_s": trainer_cpu_s,
            "workers_cpu_s": workers_cpu_s,
            "peak_rss_sender_mb": _peak_rss_mb(os.getpid()),
            "peak_rss_worker_mb": max(
                _peak_rss_mb(p.pid) for p in procs if p.pid is not None
            ),
        }
    finally:
        if guard is not None:
            guard.stop()
        # Workers stop their own receiver threads (scheme.shutdown() there).
        _stop_processes(procs, cmd_queues)
        if scheme is not None:
            _release_scheme(scheme)
        own_queues: list[MPQueue[Any] | None] = [*cmd_queues, out_q]
        for own_q in own_queues:
            if own_q is not None:
                with contextlib.suppress(Exception):
                    own_q.cancel_join_thread()
                    own_q.close()
        torch.set_num_threads(prev_threads)


# --------------------------------------------------------------------------
# smoke test
# --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Print median send latency for a few sizes, kinds and worker counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["10k", "1M/256"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not available():
        print("torchrl is not importable in this environment", file=sys.stderr)
        return 1
    print(
        f"{'kind':<15} {'size':<9} {'workers':>7} {'median_ms':>10} "
        f"{'p90_ms':>8} {'sender_mb':>10} {'worker_mb':>10}"
    )
    for size in args.sizes:
        n_params, n_tensors = parse_params(size)
        for kind in args.kinds:
            for workers in args.workers:
                res = run_torchrl(kind, n_params, n_tensors, workers, args.repeats)
                lat = sorted(res["latencies_ms"])
                p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
                print(
                    f"{kind:<15} {size:<9} {workers:>7} "
                    f"{statistics.median(lat):>10.3f} {p90:>8.3f} "
                    f"{res['peak_rss_sender_mb']:>10.1f} "
                    f"{res['peak_rss_worker_mb']:>10.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    # Re-enter through the package so spawned workers find _worker_main under
    # its real module name rather than __main__.
    from asyncsync.bench._torchrl import main as _main

    try:
        sys.exit(_main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
