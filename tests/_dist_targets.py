"""Relay hosts for the multi-host tests (module level: spawn pickles them by name)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncsync import AsyncQueue, DistributedWeightSyncScheme, spawn_workers
from tests._targets import fill_, make_model, probe_worker


async def relay_host(host: int, port: int, token: str, probe_conns: list[Any], ctrl: Any, opts: dict[str, Any] | None = None) -> str:
    """One simulated host: a relay and one probe worker per connection in *probe_conns*.

    Answers on *ctrl*: ``("started",)`` once its worker processes run (then it connects),
    ``("joined", version, n)`` once its workers run the first weights, then
    ``("stopped", how)`` when the trainer stops it or dies (``("failed", why)`` first if
    it could not start or join).
    """
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"[host {host} %(relativeCreated)d ms] %(message)s")
    opts = dict(opts or {})
    kind = opts.pop("kind", "mlp")
    die_at = opts.pop("die_in_broadcast_of", None)
    if die_at is not None:
        _die_in_broadcast_of(die_at)
    scheme = DistributedWeightSyncScheme(
        timeout=30, token=token, rank=host, world_size=3, master_addr="127.0.0.1", master_port=port, heartbeat=0.5, **opts
    )
    scheme.init_on_relay(model=make_model(kind), num_workers=len(probe_conns))
    q: AsyncQueue[Any] = AsyncQueue(ctrl)
    n = len(probe_conns)
    groups = []
    for i, conn in enumerate(probe_conns):  # one group each: each probe gets its own control pipe
        # spawn: each worker is then a child of this relay, which tests find (and kill) by pid;
        # a forkserver would be one more process here, paid again by every relay anyway
        g = spawn_workers(probe_worker, worker_ids=[i], args=(scheme, conn, kind, None), scheme=scheme.local, join_timeout=30, start_method="spawn")
        g.start()
        groups.append(g)
    outcome = "?"
    try:
        try:
            for g in groups:  # importing torch is what takes long on a busy machine: the timeouts start after it
                await g.wait_started()
            await q.put(("started",))
            async with scheme:
                await q.put(("joined", scheme.version, n))
                try:
                    await scheme.wait_stopped()
                    outcome = "stopped"
                except Exception as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            await q.put(("failed", outcome))
        await q.put(("stopped", outcome))
        for g in groups:  # the probes end when the test tells them to (or were killed)
            try:
                await g.join(timeout=60)
            except Exception as exc:
                print(f"host {host}: a worker ended badly: {exc}")
    finally:
        for g in groups:
            await g.aclose(grace=0.0)
    await q.aclose()
    return outcome


async def dist_trainer(idx: int, port: int, token: str, report: Any) -> None:
    """A trainer in its own process (a test SIGKILLs it): host 1 with one worker."""
    import asyncio

    torch.set_num_threads(1)
    model = make_model()
    fill_(model, 5.0)
    scheme = DistributedWeightSyncScheme(timeout=30, token=token, rank=0, world_size=2, master_addr="127.0.0.1", master_port=port, heartbeat=0.5)
    scheme.init_on_sender(model=model, hosts={1: 1})
    await scheme.connect()
    fill_(model, 6.0)
    await scheme.send()
    report.send(("trainer-ready", scheme.version))
    await asyncio.Event().wait()  # until killed


def _die_in_broadcast_of(version: int) -> None:
    """Make this relay SIGKILL itself in the middle of the broadcast of *version*: once its
    first chunk has arrived, with the others still in flight."""
    import os
    import signal

    import torch.distributed as dist

    from asyncsync._dist._relay import Relay

    land = Relay._land

    async def dying(self: Relay, op: Any) -> None:
        if op.version == version and not op.p2p and self._group is not None:
            group = self._group
            first = torch.empty(min(group.chunk_bytes, self.local.layout.nbytes), dtype=torch.uint8)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            group.pg.broadcast([first], opts).wait()  # the broadcast is under way...
            os.kill(os.getpid(), signal.SIGKILL)  # ...and this host dies in the middle of it
        await land(self, op)

    Relay._land = dying  # type: ignore[method-assign]


async def state_dict_host(host: int, port: int, token: str, own_worker: bool) -> Any:
    """A host whose workers return their state dicts: a relay with one spawned worker
    (returns ``{0: state dict}``), or with *own_worker* a rank that is its own worker
    (returns its model's state dict)."""
    from tests._targets import state_dict_worker

    torch.set_num_threads(1)
    scheme = DistributedWeightSyncScheme(timeout=30, token=token, rank=host, world_size=3, master_addr="127.0.0.1", master_port=port, heartbeat=0.5)
    if own_worker:
        model = make_model()
        scheme.init_on_receiver(model=model)
        async with scheme:
            await scheme.wait_stopped()
        return model.state_dict()
    scheme.init_on_relay(model=make_model(), num_workers=1)
    async with spawn_workers(state_dict_worker, 1, args=(scheme,), scheme=scheme.local, start_method="spawn") as workers:
        async with scheme:
            await scheme.wait_stopped()
        return await workers.join(timeout=60)
