"""Workers that asyncsync does not start: they attach to the trainer by address.

    python examples/attach_worker.py                    # trainer; starts 2 worker programs itself
    python examples/attach_worker.py --no-launch        # trainer; prints how to start the workers
    python examples/attach_worker.py worker 0 ADDRESS   # a worker (ADDRESS, or ASYNCSYNC_ADDRESS)

The trainer listens on a Unix socket and prints the address (the socket path, the shared
token and the scheme's options in one line). A worker is any process on the host given
that address and its index: here the trainer launches them with plain ``subprocess`` (as a
container runtime, an env-server launcher or a job script would), handing the address over
in ``ASYNCSYNC_ADDRESS``. The worker function is the one ``spawn_workers`` would run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys

import torch
from torch import nn

from asyncsync import MultiProcessWeightSyncScheme


def make_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))


async def worker(worker_idx: int, scheme: MultiProcessWeightSyncScheme) -> int:
    """The same body as a spawn_workers worker function."""
    policy = make_policy()
    scheme.init_on_receiver(worker_idx=worker_idx, model=policy)
    async with scheme:  # attaches, then receives the newest version
        while not scheme.receiver.stopped:
            with torch.no_grad():
                policy(torch.randn(1, 8))  # act; updates land between two awaits
            await asyncio.sleep(0.01)
    print(f"worker {worker_idx} (pid {os.getpid()}): stopped at version {scheme.version}", flush=True)
    return scheme.version


async def trainer(num_workers: int, steps: int, launch: bool) -> None:
    policy = make_policy()
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    scheme = MultiProcessWeightSyncScheme(timeout=120)
    scheme.init_on_sender(model=policy, num_workers=num_workers)
    address = await scheme.listen()
    print(f"listening; a worker joins with:\n  ASYNCSYNC_ADDRESS='{address}' python {sys.argv[0]} worker K", flush=True)
    procs = []
    if launch:  # a launcher that knows nothing of asyncsync: a command line and an environment
        env = {**os.environ, **address.env()}
        procs = [subprocess.Popen([sys.executable, sys.argv[0], "worker", str(k)], env=env) for k in range(num_workers)]
    try:
        async with scheme:  # waits (within the timeout) for every worker to attach and apply version 0
            for step in range(steps):
                loss = policy(torch.randn(64, 8)).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                version = await scheme.send()
                print(f"step {step}: version {version} applied by {scheme.sender.applied_versions()}", flush=True)
    finally:
        for p in procs:
            p.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="trainer", choices=["trainer", "worker"])
    parser.add_argument("worker_idx", nargs="?", type=int, default=0)
    parser.add_argument("address", nargs="?", default=None, help="the trainer's address (default: ASYNCSYNC_ADDRESS)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-launch", action="store_true", help="only print the address; start the workers yourself")
    args = parser.parse_args()
    if args.role == "worker":
        scheme = MultiProcessWeightSyncScheme.attach(args.address, worker_idx=args.worker_idx)
        asyncio.run(worker(args.worker_idx, scheme))
    else:
        asyncio.run(trainer(args.workers, args.steps, launch=not args.no_launch))


if __name__ == "__main__":
    main()
