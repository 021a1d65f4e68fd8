"""A trainer (this process) and simulated hosts (spawned relays, each with probe workers)."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

from asyncsync import AsyncQueue, DistributedWeightSyncScheme, spawn_workers
from asyncsync._workers import START_TIMEOUT
from tests._dist_targets import relay_host
from tests._targets import make_model
from tests.conftest import Probe

CTX = mp.get_context("spawn")
TOKEN = "test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Host:
    """One spawned relay process: its control queue, its workers' probes, its group."""

    def __init__(self, idx: int, group: Any, ctrl: AsyncQueue[Any], probes: list[Probe]) -> None:
        self.idx = idx
        self.group = group
        self.ctrl = ctrl
        self.probes = probes
        self.closed = False

    @property
    def running(self) -> bool:
        return not self.closed and self.group.processes[self.idx].exitcode is None

    async def started(self) -> None:
        """Until the relay's worker processes run (bounded like any process start): the
        scheme's timeouts count from there, not from their imports."""
        msg = await self.ctrl.get(timeout=START_TIMEOUT)
        assert msg == ("started",), msg

    async def joined(self) -> None:
        """Until the relay's workers run the first weights."""
        msg = await self.ctrl.get(timeout=30)
        assert msg[0] == "joined", msg

    async def aclose(self) -> None:
        self.closed = True
        await self.group.aclose(grace=10.0)
        await self.ctrl.aclose()
        for p in self.probes:
            await p.q.aclose()


class DistCluster:
    def __init__(self, hosts: dict[int, int], kind: str = "mlp", **scheme_kwargs: Any) -> None:
        self.port = free_port()
        self.layout_hosts = hosts
        self.kind = kind
        self.model = make_model(kind)
        self.scheme = DistributedWeightSyncScheme(
            **{"timeout": 30, "token": TOKEN, "rank": 0, "world_size": 3, "master_addr": "127.0.0.1", "master_port": self.port, "heartbeat": 0.5, **scheme_kwargs}
        )
        self.scheme.init_on_sender(model=self.model, hosts=hosts)
        self.hosts: dict[int, Host] = {}
        # relays take the options that shape the wire (and the workers' behaviour)
        self.relay_opts = {k: v for k, v in scheme_kwargs.items() if k in ("transfer_dtype", "commit", "commit_mode")}

    def spawn_host(self, h: int, token: str = TOKEN, opts: dict[str, Any] | None = None) -> Host:
        ends = [CTX.Pipe() for _ in range(self.layout_hosts[h])]
        ctrl_a, ctrl_b = CTX.Pipe()
        opts = {"kind": self.kind, **self.relay_opts, **(opts or {})}
        group = spawn_workers(relay_host, worker_ids=[h], args=(self.port, token, [b for _, b in ends], ctrl_b, opts))
        group.start()
        for _, b in ends:
            b.close()
        ctrl_b.close()
        host = Host(h, group, AsyncQueue(ctrl_a), [Probe(a) for a, _ in ends])
        self.hosts[h] = host
        return host

    async def start(self, opts: dict[int, dict[str, Any]] | None = None) -> DistCluster:
        for h in self.layout_hosts:
            self.spawn_host(h, opts=(opts or {}).get(h))
        for host in self.hosts.values():
            await host.started()
        await self.scheme.connect(timeout=30)
        for host in self.hosts.values():
            await host.joined()
        return self

    async def state(self, wid: tuple[int, int]) -> tuple[int, dict[str, Any]]:
        return await self.hosts[wid[0]].probes[wid[1]].ask("state")  # type: ignore[no-any-return]

    async def close(self) -> None:
        try:
            live = [p for host in self.hosts.values() if host.running for p in host.probes]
            # (a probe whose worker was killed was removed from host.probes by its test)
            for p in live:
                await p.q.put(("wait_stopped",))
            await self.scheme.aclose()
            for p in live:
                said = await p.q.get(timeout=30)
                assert said == "stopped", said
            for host in self.hosts.values():
                if host.running:
                    msg = await host.ctrl.get(timeout=30)
                    while msg[0] != "stopped":  # after a failed start: ("joined", ...) or ("failed", ...) first
                        msg = await host.ctrl.get(timeout=30)
                    assert msg == ("stopped", "stopped"), msg
        finally:
            for host in self.hosts.values():
                if not host.closed:
                    await host.aclose()
