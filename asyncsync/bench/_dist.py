"""``--transports dist-gloo``: the multi-host scheme on loopback, against a raw broadcast.

One trainer (this process) and ``hosts`` relay processes, each with ``workers`` worker
processes (the benchmark's ``bench_worker``), all on 127.0.0.1. A row times
``await scheme.send()`` until every worker on every host applied the version, then, in the
same run and between the same processes, a raw ``broadcast`` of the same number of bytes
on a gloo group built the same way (plus a one-element ``allreduce`` so the root knows
every host has the bytes: the raw counterpart of the acks). It also reports the bytes that
left the trainer per send (``DistributedStatistics.last_send_bytes``), and the CPU each send
cost: the trainer's (``time.process_time()``, all its threads) and the hosts' (every relay
and worker process, read from ``/proc``; Linux only), over the timed sends.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import secrets
import signal
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from asyncsync import DistributedWeightSyncScheme, spawn_workers
from asyncsync.bench import _cpu
from asyncsync.bench._run import WARMUP_SENDS
from asyncsync.bench._worker import bench_worker
from asyncsync.bench._workload import make_model, parse_params, perturb_

__all__ = ["dist_markdown", "run_dist_rows"]

TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _store(port: int, master: bool) -> Any:
    return TCPStore("127.0.0.1", port, None, master, datetime.timedelta(seconds=TIMEOUT_S), wait_for_workers=False)


def _descendants() -> list[int]:
    """The pids of this process's descendants (the relays and their workers); Linux only."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _raw_broadcasts(store: Any, rank: int, size: int, nbytes: int, repeats: int) -> list[float]:
    """Blocking: *repeats* broadcasts of *nbytes* from rank 0 (+ an allreduce as the ack)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg: Any = dist.ProcessGroupGloo(PrefixStore("bench-raw/", store), rank, size, opts)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    one = torch.ones(1)
    out = []
    for _ in range(WARMUP_SENDS + repeats):
        bo = dist.BroadcastOptions()
        bo.rootRank = 0
        t0 = time.perf_counter()
        pg.broadcast([buf], bo).wait()
        pg.allreduce([one]).wait()
        out.append((time.perf_counter() - t0) * 1e3)
    del pg
    return out[WARMUP_SENDS:]


async def dist_host(host: int, port: int, token: str, size: int, workers: int, n_params: int, n_tensors: int, repeats: int) -> None:
    """A bench host: a relay and *workers* bench workers, then its part of the raw broadcasts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    store = _store(port, master=False)
    scheme = DistributedWeightSyncScheme(timeout=TIMEOUT_S, token=token, rank=host, world_size=size, master_addr="127.0.0.1", store=store)
    scheme.init_on_relay(model=make_model(n_params, n_tensors), num_workers=workers)
    async with spawn_workers(bench_worker, workers, args=(scheme, n_params, n_tensors), scheme=scheme.local) as group:
        async with scheme:
            await scheme.wait_stopped()
        await group.join(timeout=60)
    nbytes = scheme.local.sender.layout.nbytes
    del scheme
    await asyncio.to_thread(_raw_broadcasts, store, host, size, nbytes, repeats)


async def _row(spec: str, hosts: int, workers: int, repeats: int) -> dict[str, Any]:
    n_params, n_tensors = parse_params(spec)
    port = _free_port()
    token = secrets.token_hex(16)
    store = _store(port, master=True)
    torch.set_num_threads(1)
    model = make_model(n_params, n_tensors)
    scheme = DistributedWeightSyncScheme(timeout=TIMEOUT_S, token=token, rank=0, world_size=hosts + 1, master_addr="127.0.0.1", store=store)
    scheme.init_on_sender(model=model, workers_per_host=workers)
    group = spawn_workers(dist_host, worker_ids=range(1, hosts + 1), args=(port, token, hosts + 1, workers, n_params, n_tensors, repeats))
    group.start()
    lat: list[float] = []
    trainer_cpu_s = 0.0
    hosts_cpu_s: float | None = None
    try:
        try:
            await scheme.connect()
            pids: list[int] = []
            before: list[_cpu.Sample | None] = []
            for step in range(WARMUP_SENDS + repeats):
                perturb_(model, step)
                if step == WARMUP_SENDS:
                    pids = _descendants()
                    before = _cpu.sample(pids)
                c0 = time.process_time()
                t0 = time.perf_counter()
                await scheme.send()
                lat.append((time.perf_counter() - t0) * 1e3)
                if step >= WARMUP_SENDS:
                    trainer_cpu_s += time.process_time() - c0
            if pids:
                hosts_cpu_s = _cpu.elapsed_s(before, _cpu.sample(pids))
            stats = scheme.sender.statistics()
        finally:
            await scheme.aclose()
        nbytes = stats.buffer_bytes
        raw = await asyncio.to_thread(_raw_broadcasts, store, 0, hosts + 1, nbytes, repeats)
        await group.join(timeout=120)
    finally:
        await group.aclose()
    lat = lat[WARMUP_SENDS:]
    send_ms = statistics.median(lat)
    raw_ms = statistics.median(raw)
    return {
        "transport": "dist-gloo",
        "params": spec,
        "hosts": hosts,
        "workers_per_host": workers,
        "bytes": nbytes,
        "send_median_ms": send_ms,
        "send_p90_ms": sorted(lat)[int(0.9 * (len(lat) - 1))],
        "raw_broadcast_median_ms": raw_ms,
        "x_raw": send_ms / raw_ms if raw_ms > 0 else None,
        "trainer_cpu_ms_per_send": trainer_cpu_s / repeats * 1e3,
        "hosts_cpu_ms_per_send": None if hosts_cpu_s is None else hosts_cpu_s / repeats * 1e3,
        "bytes_leaving_trainer_per_send": stats.last_send_bytes,
        "pid": os.getpid(),
    }


def run_dist_rows(params: Sequence[str], hosts: int, workers: Sequence[int], repeats: int, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per (model size, workers per host)."""
    rows = []
    for spec in params:
        for w in workers:
            if progress is not None:
                progress(f"dist-gloo {spec}: {hosts} host{'' if hosts == 1 else 's'} x {w} worker{'' if w == 1 else 's'} ...")
            row = asyncio.run(_row(spec, hosts, w, repeats))
            if progress is not None:
                progress(
                    f"  send {row['send_median_ms']:.2f} ms, raw broadcast {row['raw_broadcast_median_ms']:.2f} ms "
                    f"({row['x_raw']:.2f}x), {row['bytes_leaving_trainer_per_send']} bytes left the trainer per send; "
                    f"CPU per send: trainer {row['trainer_cpu_ms_per_send']:.2f} ms, hosts {_ms(row['hosts_cpu_ms_per_send'])} ms"
                )
            rows.append(row)
    return rows


def dist_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| transport | params | hosts x workers | send median ms | send p90 ms | raw broadcast + ack ms | x raw "
        "| trainer CPU ms/send | hosts CPU ms/send | bytes leaving the trainer per send |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['transport']} | {r['params']} | {r['hosts']} x {r['workers_per_host']} | {r['send_median_ms']:.2f} | {r['send_p90_ms']:.2f} "
            f"| {r['raw_broadcast_median_ms']:.2f} | {r['x_raw']:.2f} | {r['trainer_cpu_ms_per_send']:.2f} | {_ms(r['hosts_cpu_ms_per_send'])} "
            f"| {r['bytes_leaving_trainer_per_send']:,} |"
        )
    return "\n".join(lines) + "\n"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
