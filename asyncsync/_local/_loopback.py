"""An in-process loopback: receivers in the trainer's own event loop, no processes.

Each worker end is the same socket and shared memory a spawned worker would get, so a
loopback exercises the real protocol; only the process boundary is missing. Handy for
fast unit tests of code that calls ``send`` / ``send_async`` / ``wait_async`` or reacts
in ``on_update``.

Example::

    scheme = MultiProcessWeightSyncScheme()
    scheme.init_on_sender(model=policy, num_workers=2)
    workers = [loopback_worker(scheme, i) for i in range(2)]
    for i, w in enumerate(workers):
        w.init_on_receiver(worker_idx=i, model=make_policy())
    connecting = [asyncio.ensure_future(w.connect()) for w in workers]
    await scheme.connect()
    await asyncio.gather(*connecting)
"""

from __future__ import annotations

import copy
import os
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._scheme import MultiProcessWeightSyncScheme

__all__ = ["loopback_worker"]


def loopback_worker(scheme: MultiProcessWeightSyncScheme, worker_idx: int) -> MultiProcessWeightSyncScheme:
    """A worker-side copy of *scheme* (set up with ``init_on_sender``) for *worker_idx*, in this process.

    Call ``init_on_receiver(worker_idx=worker_idx, ...)`` on it, as a worker process would.
    After a worker left or died, call it again for a replacement on the new channel.

    Example::

        policy = make_policy()
        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=policy, num_workers=1)
        local = make_policy()
        worker = loopback_worker(scheme, 0)    # worker 0's side, in this event loop
        worker.init_on_receiver(worker_idx=0, model=local, on_update=lambda weights, version: print("applied", version))
        await asyncio.gather(scheme.connect(), worker.connect())   # applied 0
        with torch.no_grad():
            policy[0].bias.fill_(1.0)          # a training step
        await scheme.send()                    # applied 1
        print(local[0].bias.tolist())          # [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        await scheme.aclose()
        await worker.aclose()
    """
    ends = scheme.sender.child_endpoints()
    if worker_idx not in ends:
        raise ValueError(f"worker {worker_idx} has no channel to hand out (it is connected); workers waiting: {sorted(ends)}")
    worker = copy.copy(scheme)
    worker.__dict__.update(_sender=None, _receiver=None, _endpoints={worker_idx: Connection(os.dup(ends[worker_idx].fileno()))})
    return worker
