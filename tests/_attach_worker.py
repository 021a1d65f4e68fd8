"""A worker program asyncsync does not start: ``python -m tests._attach_worker IDX [ADDRESS]``.

It attaches by address (the argument, else ``ASYNCSYNC_ADDRESS``) and prints one JSON line
per event: ``{"connected": version}``, ``{"version": v, "values": [...]}`` for every version
its model runs (the distinct values of its weights), ``{"stopped": version}`` at the end, or
``{"error": type, "message": ...}`` (exit status 3).
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
from torch import nn

from asyncsync import AsyncSyncError, MultiProcessWeightSyncScheme


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def main(idx: int, address: str | None) -> int:
    model = nn.Linear(4, 4)
    scheme = MultiProcessWeightSyncScheme.attach(address, worker_idx=idx)

    def on_update(weights: object, version: int) -> None:
        values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        say(version=version, values=sorted({float(v) for v in values}))

    scheme.init_on_receiver(model=model, on_update=on_update)
    try:
        async with scheme:
            say(connected=scheme.version)
            await scheme.wait_stopped()
    except (AsyncSyncError, ValueError) as exc:
        say(error=type(exc).__name__, message=str(exc))
        return 3
    say(stopped=scheme.version)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)))
