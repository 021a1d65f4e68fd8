"""GPU check for the CUDA staging paths (needs one CUDA device; runs in under 3 minutes).

Checks, on cuda:0, for commit="swap" and commit="copy":
  * staging and commit are correct (every parameter equals what was sent, on the GPU);
  * the worker's event loop keeps ticking while a 100M-parameter update lands (max lag);
  * send-until-acked latency;
and measures host-to-device GB/s (pinned and pageable) against the device's own copy
bandwidth.

With ``--dist`` it checks the multi-host path's device side (``backend="nccl"``). NCCL
needs one GPU per rank: with three GPUs or more it runs a trainer and two relays (each
feeding a worker on its GPU) on NCCL. On fewer it tries a two-rank NCCL group (reporting
NCCL's refusal) and checks the device steps in one process, with a stand-in for NCCL that
writes on a stream of its own, as NCCL does: the trainer's snapshot on its GPU, a send
from device memory, and a relay's receive through two device chunks into pageable host
memory (the order of the stream hand-offs is what can go wrong there).

Prints one JSON document; exits non-zero if a check fails.

Run: python scripts/gpu_check.py [--params 100000000] [--dist [--nccl]]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch
from torch import nn

from asyncsync import DistributedWeightSyncScheme, MultiProcessWeightSyncScheme, spawn_workers


def make_model(n_params: int) -> nn.Module:
    m = nn.Module()
    per = n_params // 4
    for i in range(4):
        m.register_parameter(f"p{i}", nn.Parameter(torch.zeros(per)))
    return m


async def gpu_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, n_params: int, device: str) -> dict[str, object]:
    torch.set_num_threads(1)
    model = make_model(n_params).to(device)
    ptrs0 = [p.data_ptr() for p in model.parameters()]
    lags: list[float] = []
    wrong: list[int] = []
    stop = asyncio.Event()
    first = [0]  # ticks before version 0 was applied: set-up (CUDA context, first allocations)

    def applied(idx: int, version: int) -> None:
        if version == 0:
            first[0] = len(lags)

    scheme.init_on_receiver(worker_idx=worker_idx, model=model, on_update=applied)

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            lags.append(max(0.0, (now - last - 0.001) * 1e3))
            last = now

    def check() -> None:  # after the run: checking on the loop while ticking would add lag
        expect = float(scheme.version)
        for p in model.parameters():
            if p.device != torch.device(device) or not bool((p == expect).all()):
                wrong.append(scheme.version)
                break

    async with scheme:
        tick = asyncio.ensure_future(ticker())
        await scheme.wait_stopped()
        stop.set()
        await tick
        check()
    stable = ptrs0 == [p.data_ptr() for p in model.parameters()]
    stats = scheme.statistics()
    steady = lags[first[0] :]
    from asyncsync._io._staging import cudart

    return {
        "pinning_via": cudart()[2] if device != "cpu" else None,
        "max_loop_lag_ms": max(lags) if lags else None,
        "max_loop_lag_after_first_update_ms": max(steady) if steady else None,
        "p99_loop_lag_ms": sorted(lags)[int(0.99 * len(lags))] if lags else None,
        "wrong_versions": wrong,
        "addresses_stable": stable,
        "last_stage_ms": stats.last_stage_ms,  # type: ignore[union-attr]
        "last_commit_ms": stats.last_commit_ms,  # type: ignore[union-attr]
    }


async def run_mode(commit: str, n_params: int, sends: int, device: str) -> dict[str, object]:
    model = make_model(n_params)
    scheme = MultiProcessWeightSyncScheme(commit=commit, timeout=120)  # type: ignore[arg-type]
    scheme.init_on_sender(model=model, devices=[device])
    latencies = []
    async with spawn_workers(gpu_worker, 1, args=(scheme, n_params, device), scheme=scheme) as group:
        async with scheme:
            for k in range(1, sends + 1):
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(float(k))
                t0 = time.perf_counter()
                await scheme.send()
                latencies.append((time.perf_counter() - t0) * 1e3)
        result = (await group.join(timeout=120))[0]
    result["commit"] = commit
    result["send_median_ms"] = statistics.median(latencies)
    result["gbps"] = n_params * 4 / (statistics.median(latencies) / 1e3) / 1e9
    return result


def bandwidth(n_bytes: int) -> dict[str, float]:
    dev = torch.device("cuda:0")
    pinned = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n_bytes, dtype=torch.uint8)
    a = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    b = torch.empty(n_bytes, dtype=torch.uint8, device=dev)

    def timed(fn: object) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        start.record()
        for _ in range(5):
            fn()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        return n_bytes * 5 / (start.elapsed_time(end) / 1e3) / 1e9

    return {
        "h2d_pinned_gbps": timed(lambda: a.copy_(pinned, non_blocking=True)),
        "h2d_pageable_gbps": timed(lambda: a.copy_(pageable)),
        "d2d_gbps": timed(lambda: b.copy_(a)),
    }


# ---------------------------------------------------------------- the multi-host device path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _dev(rank: int, cpu: bool) -> torch.device:
    """Rank r's device: cuda:r (modulo the GPU count); the CPU for a dry run."""
    return torch.device("cpu") if cpu else torch.device("cuda", rank % torch.cuda.device_count())


def _dist_scheme(rank: int, port: int, nccl: bool, chunk_bytes: int, cpu: bool) -> DistributedWeightSyncScheme:
    dev = _dev(rank, cpu)
    kw: dict[str, Any] = dict(timeout=120, token="gpu-check", rank=rank, world_size=3, master_addr="127.0.0.1", master_port=port)
    if nccl:
        return DistributedWeightSyncScheme(backend="nccl", device=dev, chunk_bytes=chunk_bytes, **kw)
    scheme = DistributedWeightSyncScheme(backend="gloo", chunk_bytes=chunk_bytes, **kw)
    scheme._wire_device = dev  # NCCL's steps (device memory, the group's thread) on gloo: a CPU dry run only
    return scheme


async def dist_worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme, n_params: int, device: str) -> dict[str, object]:
    torch.set_num_threads(1)
    model = make_model(n_params).to(device)
    wrong: list[int] = []
    applied: list[int] = []

    def check(idx: int, version: int) -> None:  # p0 carries the version in every send, partial ones too
        applied.append(version)
        if not bool((model.p0 == float(version)).all()):
            wrong.append(version)

    scheme.init_on_receiver(worker_idx=worker_idx, model=model)
    scheme.receiver.on_update = check
    async with scheme:
        await scheme.wait_stopped()
    last = applied[-1] if applied else -1
    rest_ok = all(bool((p == float(last)).all()) for name, p in model.named_parameters() if name != "p0")
    return {"applied": applied, "wrong": wrong, "device": str(model.p0.device), "others_at_last": rest_ok}


async def _relay(rank: int, port: int, nccl: bool, chunk_bytes: int, n_params: int, cpu: bool) -> dict[str, object]:
    scheme = _dist_scheme(rank, port, nccl, chunk_bytes, cpu)
    device = str(_dev(rank, cpu))
    scheme.init_on_relay(model=make_model(n_params), num_workers=1)
    async with spawn_workers(dist_worker, 1, args=(scheme, n_params, device), scheme=scheme.local) as workers:
        async with scheme:
            await scheme.wait_stopped()
        results = await workers.join(timeout=120)
    return {"host": rank, "relay_version": scheme.version, "worker": results[0]}


async def _trainer(port: int, nccl: bool, chunk_bytes: int, n_params: int, sends: int, cpu: bool) -> dict[str, object]:
    scheme = _dist_scheme(0, port, nccl, chunk_bytes, cpu)
    model = make_model(n_params).to(_dev(0, cpu))
    scheme.init_on_sender(model=model, hosts={1: 1, 2: 1})
    times = []
    async with scheme:
        snapshot_on = str(scheme._transport._snapshots.bufs[0].tensor.device)
        for k in range(1, sends + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(k))
            t0 = time.perf_counter()
            assert await scheme.send() == k
            times.append((time.perf_counter() - t0) * 1e3)
        # a partial update (p0 only), then latest wins under a burst of send_async
        v = await scheme.send(weights={"p0": torch.full_like(model.p0, float(sends + 1))}, partial=True)
        for k in range(v + 1, v + 6):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(k))
            await scheme.send_async()
        await scheme.wait_async()
        stats = scheme.statistics()
    return {
        "snapshots_on": snapshot_on,
        "send_median_ms": statistics.median(times),
        "gbps": n_params * 4 / (statistics.median(times) / 1e3) / 1e9,
        "version": scheme.version,
        "bytes_per_send": stats.last_send_bytes,  # type: ignore[union-attr]
    }


def _role(rank: int, port: int, nccl: bool, chunk_bytes: int, n_params: int, sends: int, cpu: bool, out: Any) -> None:
    try:
        if rank == 0:
            res = asyncio.run(_trainer(port, nccl, chunk_bytes, n_params, sends, cpu))
        else:
            res = asyncio.run(_relay(rank, port, nccl, chunk_bytes, n_params, cpu))
        out.put((rank, res))
    except BaseException:
        out.put((rank, {"error": traceback.format_exc()[-3000:]}))


def _run_ranks(target: Any, ranks: int, args: tuple[Any, ...], timeout: float) -> dict[int, object]:
    """``target(rank, *args, out)`` in *ranks* spawned processes; ``{rank: what it put}``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in procs:
            rank, res = out.get(timeout=timeout)
            results[rank] = res
    except Exception as exc:
        results[-1] = {"error": f"no result: {exc!r}"}
    for p in procs:
        p.join(30)
        if p.exitcode is None:
            p.kill()
            p.join()
    return results


def run_dist(n_params: int, sends: int, nccl: bool, chunk_bytes: int, cpu: bool = False) -> dict[str, object]:
    results = _run_ranks(_role, 3, (_free_port(), nccl, chunk_bytes, n_params, sends, cpu), 240)
    return {"backend": "nccl" if nccl else "gloo (device steps on CPU)", "chunk_bytes": chunk_bytes, "results": results}


def _nccl_probe(rank: int, port: int, out: Any) -> None:
    """Form a two-rank NCCL weight-sync group on cuda:rank%count and broadcast through it."""
    import torch.distributed as dist

    from asyncsync._dist._dataplane import SyncGroup

    async def go() -> dict[str, object]:
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=30))
        group = await SyncGroup.create(store, 1, rank, 2, timeout=20, backend="nccl", device=dev)
        try:
            if rank == 0:
                buf = torch.arange(3 << 20, dtype=torch.int32, device=dev).view(torch.uint8)
                await group.broadcast(buf, 0)
                return {"sent": True}
            host = torch.zeros(12 << 20, dtype=torch.uint8)
            await group.broadcast(host, 0)
            ok = torch.equal(host.view(torch.int32), torch.arange(3 << 20, dtype=torch.int32))
            return {"received_correctly": ok}
        finally:
            group.close()

    try:
        res = asyncio.run(go())
    except BaseException as exc:
        res = {"error": repr(exc)[:600]}
    nccl = getattr(__import__("torch.distributed", fromlist=["x"]), "ProcessGroupNCCL", None)
    res["has_abort"] = hasattr(nccl, "abort")
    res["has_shutdown"] = hasattr(nccl, "shutdown")
    out.put((rank, res))


def run_nccl_probe() -> dict[str, object]:
    return {"gpus": torch.cuda.device_count(), "results": _run_ranks(_nccl_probe, 2, (_free_port(),), 90)}


class _StandInWork:
    """What NCCL's work does on ``wait()`` (blocking wait off): the current stream waits."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)  # type: ignore[no-untyped-call]


async def device_steps(n_bytes: int, chunk_bytes: int) -> dict[str, object]:
    """The device side of ``backend="nccl"`` on one GPU, NCCL replaced by slow copies on a
    stream of its own that first waits for the issuing stream (what ProcessGroupNCCL does)."""
    from asyncsync._dist._dataplane import SyncGroup

    dev = torch.device("cuda", 0)
    comm = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
    source = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, device=dev)
    out: dict[str, object] = {}

    def on_comm(write: Any) -> _StandInWork:
        comm.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(comm):
            torch.cuda._sleep(1_000_000)  # a slow network: a late write shows up as wrong bytes
            write()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(comm)
        return _StandInWork(event)

    # A relay: receive into pageable host memory through two device chunks.
    group = SyncGroup(None, 1, 1, 2, chunk_bytes=chunk_bytes, timeout=60.0, device=dev)
    host = torch.zeros(n_bytes, dtype=torch.uint8)

    def recv(landing: torch.Tensor, i: int) -> _StandInWork:
        return on_comm(lambda: landing.copy_(source[i * chunk_bytes : i * chunk_bytes + landing.numel()]))

    t0 = time.perf_counter()
    await group._on_device(host, recv, receive=True, release=None)
    ring_s = time.perf_counter() - t0
    out["relay_receive_correct"] = torch.equal(host, source.cpu())
    out["relay_receive_gbps"] = n_bytes / ring_s / 1e9
    t0 = time.perf_counter()
    host.copy_(source)
    out["plain_d2h_pageable_gbps"] = n_bytes / (time.perf_counter() - t0) / 1e9

    # The trainer: send from device memory written just before on the default stream.
    sent = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    buf = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    torch.cuda._sleep(5_000_000)
    buf.copy_(source)  # queued behind the sleep: the send must wait for it

    def send(chunk: torch.Tensor, i: int) -> _StandInWork:
        return on_comm(lambda: sent[i * chunk_bytes : i * chunk_bytes + chunk.numel()].copy_(chunk))

    group0 = SyncGroup(None, 1, 0, 2, chunk_bytes=chunk_bytes, timeout=60.0, device=dev)
    await group0._on_device(buf, send, receive=False, release=None)
    out["trainer_send_correct"] = torch.equal(sent, source)  # the send returned once the device was done
    group.close()
    group0.close()

    # The trainer's snapshot: on its GPU, complete when send_async would return; a large
    # one (copied in a thread) and a small one (copied on the loop, awaited by an event),
    # with device="cuda" (no index) as a user may write it.
    for label, n_params in (("snapshot", n_bytes // 16), ("small_snapshot", 100_000)):
        port = _free_port()
        scheme = DistributedWeightSyncScheme(
            backend="nccl", device="cuda", timeout=10, token="t", rank=0, world_size=2, master_addr="127.0.0.1", master_port=port
        )
        model = make_model(n_params).to(dev)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(3.0)
        scheme.init_on_sender(model=model, hosts={1: 1})
        sender = scheme.sender
        snap = scheme._transport._snapshots.reserve()
        torch.cuda._sleep(5_000_000)  # queued work ahead of the copy: the snapshot must wait for it
        await scheme._transport._xfer._write(snap, scheme._transport._delivery.read(None, scheme.sender.worker_ids, False)[0][0], None)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(4.0)
        out[f"{label}_device"] = str(snap.tensor.device)
        out[f"{label}_correct"] = all(bool((v == 3.0).all()) for v in snap.views.values())
        await scheme.aclose()
    return out


def dist_failures(report: dict[str, Any], sends: int) -> list[str]:
    failures = []
    results = report["results"]
    trainer = results.get(0, {})
    if "error" in trainer or -1 in results:
        failures.append("the trainer failed")
    for h in (1, 2):
        r = results.get(h, {})
        w = r.get("worker", {}) if isinstance(r, dict) else {}
        if "error" in r or not w or w["wrong"] or not w["others_at_last"] or w["applied"][-1] != trainer.get("version"):
            failures.append(f"host {h}")
    return failures


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--sends", type=int, default=5)
    parser.add_argument("--device", default="cuda:0", help="cpu runs the same checks as a dry run")
    parser.add_argument("--dist", action="store_true", help="check the multi-host device path instead")
    parser.add_argument("--no-probe", action="store_true", help="with --dist on one GPU: skip trying NCCL")
    parser.add_argument("--chunk-bytes", type=int, default=16 << 20)
    args = parser.parse_args()
    if args.dist and args.device == "cpu":  # a dry run of the device steps, on CPU memory
        report = {"dist": run_dist(args.params, args.sends, False, args.chunk_bytes, cpu=True)}
        report["failures"] = dist_failures(report["dist"], args.sends)
        print(json.dumps(report, indent=2, default=str))
        return 1 if report["failures"] else 0
    if args.dist:
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to check", file=sys.stderr)
            return 2
        report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "params": args.params, "torch": torch.__version__}
        if torch.cuda.device_count() >= 3:
            report["dist"] = run_dist(args.params, args.sends, True, args.chunk_bytes)
            failures = dist_failures(report["dist"], args.sends)
        else:
            if not args.no_probe:
                report["nccl_probe"] = run_nccl_probe()
            steps = await device_steps(args.params * 4, args.chunk_bytes)
            report["device_steps"] = steps
            failures = [k for k, v in steps.items() if k.endswith("_correct") and v is not True]
        report["failures"] = failures
        print(json.dumps(report, indent=2, default=str))
        return 1 if failures else 0
    if args.device == "cpu":
        modes = [await run_mode(mode, args.params, args.sends, "cpu") for mode in ("swap", "copy")]
        print(json.dumps({"device": "cpu", "modes": modes}, indent=2))
        return 1 if any(m["wrong_versions"] for m in modes) else 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    out: dict[str, object] = {"device": torch.cuda.get_device_name(0), "params": args.params, "torch": torch.__version__}
    out["bandwidth"] = bandwidth(args.params * 4)
    out["modes"] = [await run_mode(mode, args.params, args.sends, args.device) for mode in ("swap", "copy")]
    print(json.dumps(out, indent=2))
    failed = [m for m in out["modes"] if m["wrong_versions"]]  # type: ignore[union-attr]
    failed += [m for m in out["modes"] if m["commit"] == "copy" and not m["addresses_stable"]]  # type: ignore[union-attr]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
