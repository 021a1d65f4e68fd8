"""A worker program asyncsync does not start: ``python -m tests._attach_worker IDX [ADDRESS]``.

It attaches by address (the argument, else ``ASYNCSYNC_ADDRESS``) and prints one JSON line
per event: ``{"connected": version}``, ``{"version": v, "values": [...]}`` for every version
its model runs (the distinct values of its weights), ``{"stopped": version}`` at the end, or
``{"error": type, "message": ...}`` (exit status 3).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import torch
from torch import nn

from asyncsync import AsyncSyncError, MultiProcessWeightSyncScheme

_sink: Any = None  # a multiprocessing Connection when started by run_forked, else stdout


def say(**event: object) -> None:
    line = json.dumps(event)
    if _sink is not None:
        _sink.send_bytes(line.encode() + b"\n")
    else:
        print(line, flush=True)


def run_forked(idx: int, address: str | None, env: dict[str, str], sink: Any) -> None:
    """The same program in a process a test forked from its forkserver (not given the
    scheme, only the address): events go to *sink*, the exit status is the program's."""
    global _sink
    _sink = sink
    os.environ.clear()
    os.environ.update(env)
    sys.exit(asyncio.run(main(idx, address)))


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


def run_trainer(tmpdir: str, sink: Any) -> None:
    """A trainer that listens on the default address (temporary files under *tmpdir*),
    sends it to *sink*, waits for worker 0, says ``connected`` and runs until killed."""
    import tempfile

    tempfile.tempdir = tmpdir
    asyncio.run(_trainer(sink))


async def _trainer(sink: Any) -> None:
    scheme = MultiProcessWeightSyncScheme(timeout=60)
    scheme.init_on_sender(model=nn.Linear(4, 4), num_workers=1)
    address = await scheme.listen()
    sink.send_bytes(str(address).encode())
    async with scheme:
        sink.send_bytes(b"connected")
        await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    sys.exit(asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)))
