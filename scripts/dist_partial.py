"""Multi-host partial updates: bytes on the wire and send time, whole versus changed ranges.

A trainer, one relay (host 1) and one loopback worker in this process (gloo and the
control plane over 127.0.0.1, as in tests/test_dist_loopback.py); a model of a large
"base" weight and a small "adapter" (LoRA-like). Times ``await send()`` until the worker
applied it, for full sends and for partial sends of the adapter alone. Prints JSON.

Run: python scripts/dist_partial.py [--base-params 100000000] [--adapter-params 262144] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time

import torch
from torch import nn

from asyncsync import DistributedWeightSyncScheme, loopback_worker


class Model(nn.Module):
    def __init__(self, base: int, adapter: int) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.zeros(base))
        self.adapter = nn.Parameter(torch.zeros(adapter))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main(base: int, adapter: int, repeats: int) -> dict[str, object]:
    common = dict(timeout=120, token="bench", world_size=2, master_addr="127.0.0.1", master_port=free_port())
    model = Model(base, adapter)
    trainer = DistributedWeightSyncScheme(rank=0, **common)  # type: ignore[arg-type]
    trainer.init_on_sender(model=model, hosts={1: 1})
    relay = DistributedWeightSyncScheme(rank=1, **common)  # type: ignore[arg-type]
    relay.init_on_relay(model=Model(base, adapter), num_workers=1)
    worker = loopback_worker(relay.local, 0)
    local = Model(base, adapter)
    worker.init_on_receiver(worker_idx=0, model=local)
    out: dict[str, object] = {"base_params": base, "adapter_params": adapter}
    try:
        await asyncio.gather(trainer.connect(), relay.connect(), worker.connect())
        for mode in ("full", "partial"):
            times, sent = [], []
            for k in range(repeats):
                with torch.no_grad():
                    model.adapter.fill_(float(k))
                t0 = time.perf_counter()
                if mode == "full":
                    await trainer.send()
                else:
                    await trainer.send(weights={"adapter": model.adapter.detach()}, partial=True)
                times.append((time.perf_counter() - t0) * 1e3)
                sent.append(trainer.statistics().last_send_bytes)  # type: ignore[union-attr]
                assert bool((local.adapter == float(k)).all())
            out[mode] = {"send_median_ms": statistics.median(times), "bytes_on_the_wire": sent[-1]}
    finally:
        await trainer.aclose()
        await relay.aclose()
        await worker.aclose()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-params", type=int, default=100_000_000)
    p.add_argument("--adapter-params", type=int, default=262_144)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    print(json.dumps(asyncio.run(main(a.base_params, a.adapter_params, a.repeats)), indent=2))
