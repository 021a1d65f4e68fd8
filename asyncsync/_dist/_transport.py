"""The multi-host transport: a relay per remote host, reached over TCP and a network group.

Each remote host has one relay, connected over an authenticated TCP control stream
(:mod:`._hosts`) and a member of the current weight-sync group, rank 0 being the trainer
(:mod:`._transfer`). A send copies the weights once into a flat wire snapshot and hands
it to the transfer pump, which moves it to every targeted host; each relay lands the
bytes in a local shared-memory slot and fans them out to its workers; their acks come
back over the control stream, so versions, ``worker_ids``, quorum waits and statistics
name global workers ``(host, local index)``.

Latest wins per worker, as locally: a worker that has not received version v when v+1
is sent for it only ever gets v+1. A host whose control connection ends (EOF, no
heartbeat, a malformed frame) is declared lost at once, with every one of its workers;
the group is re-formed from the survivors (a new store prefix, a new generation) and the
next transfer goes to the living. A host that connects again joins a new generation and
gets each of its workers' newest version before anything else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._core._deadline import Deadline
from .._core._delivery import Delivery
from .._core._options import checked_timeout
from .._core._ownership import Snapshot, SnapshotLedger
from .._core._transport import Group, Silence
from .._errors import SyncTimeoutError, WeightsError
from .._stats import DistributedStatistics, HostStatistics
from .._wire._control import Stop
from ._dataplane import DEFAULT_CHUNK_BYTES, SyncGroup
from ._hosts import Host, HostTable, RemoteWorker, WorkerId
from ._transfer import Transfers

__all__ = ["RemoteTransport", "WorkerId"]


class RemoteTransport:
    """The hosts, their relays and the transfers to them (see the module docstring)."""

    def __init__(
        self,
        delivery: Delivery[WorkerId, RemoteWorker],
        hosts: Mapping[int, Host],
        *,
        store: Any,
        token: bytes,
        bind: str,
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        heartbeat: float = 1.0,
        silence_timeout: float | None = None,
        backend: str = "gloo",
        device: torch.device | None = None,
    ) -> None:
        self._delivery = delivery
        self._hosts = dict(hosts)
        self._workers = delivery.records
        self._store = store
        self._bind = bind
        self._port = port
        layout = delivery.layout

        def snapshot() -> Snapshot:
            tensor = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
            return Snapshot(tensor, layout.views(tensor))

        self._snapshots = SnapshotLedger(snapshot)
        self._table = HostTable(
            self._hosts, delivery=delivery, snapshots=self._snapshots, layout=layout, token=token, heartbeat=heartbeat, silence_timeout=silence_timeout
        )
        self._xfer = Transfers(
            self._table,
            layout=layout,
            copier=delivery.copier,
            store=store,
            chunk_bytes=chunk_bytes,
            backend=backend,
            hostname=bind,
            device=device,
            timeout=delivery.timeout,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.address: tuple[str, int] | None = None

    @staticmethod
    def hosts_of(hosts: Mapping[int, int]) -> dict[int, Host]:
        """One record per host, for ``{host: number of workers}``."""
        return HostTable.make(dict(hosts))

    @staticmethod
    def records(hosts: Mapping[int, Host]) -> dict[WorkerId, RemoteWorker]:
        """The per-worker records a :class:`Delivery` of this transport is built with."""
        return {w.wid: w for h in hosts.values() for w in h.workers.values()}

    # ----------------------------------------------------------------- the Transport protocol

    async def start(self) -> tuple[str, int]:
        """Start the delivery and :meth:`open` (once); the control address."""
        if self._delivery.start():
            await self.open()
        assert self.address is not None
        return self.address

    async def open(self) -> None:
        """Listen for relays (on ``bind``) and publish the address in the store."""
        port = await self._table.listen(self._bind, self._port)
        self.address = (self._bind, port)
        self._store.set("control", f"{self._bind}:{port}")  # rank 0 hosts the store: a local call
        self._tasks.append(asyncio.get_running_loop().create_task(self._xfer.pump(), name="asyncsync-dist-pump"))

    async def publish(self, groups: Sequence[Group[WorkerId]], version: int, deadline: Deadline) -> None:
        d = self._delivery
        (flat, targets), = groups  # (one source on the trainer)
        by_base: dict[int, tuple[Snapshot | None, list[WorkerId]]] = {}
        full = d.reader.is_whole(flat)  # type: ignore[arg-type]
        for wid in targets:
            base = None if full else self._snapshots.latest.get(wid)
            if not full and base is None:
                raise WeightsError(f"a partial update needs full weights first; worker {wid} has none")
            by_base.setdefault(id(base), (base, []))[1].append(wid)
        if not by_base:  # no member yet (elastic): a snapshot for those that join
            base = None if full else self._snapshots.newest
            if not full and base is None:
                raise WeightsError("a partial update needs full weights first: none was sent yet")
            by_base[id(base)] = (base, [])
        written = await self._xfer.snapshot(flat, version, list(by_base.values()))
        d.published(version, ())
        if d.elastic and set(d.members()) <= set(targets):
            self._snapshots.hold_newest(written[0][0])  # (every snapshot of a version holds all of it)
        self._xfer.assign(written)  # (each worker's newest version, reported as it is assigned)
        d.changed.notify()

    def retire(self, wid: WorkerId) -> None:
        self._delivery.acks.retire(wid)
        self._snapshots.forget(wid)

    def silence(self, wids: Sequence[WorkerId]) -> Silence:
        return Silence()

    def statistics(self) -> DistributedStatistics:
        d = self._delivery
        xfer = self._xfer
        hosts = tuple(
            HostStatistics(
                host=h.idx,
                state=h.state,
                pid=h.pid,
                peer=h.peer,
                connections=h.connections,
                delivered_version=h.delivered,
                pending_versions=tuple(sorted({v for v, _ in self._snapshots.pending.get(h.idx, {})})),
                reason=h.reason,
            )
            for h in self._hosts.values()
        )
        return DistributedStatistics(
            version=d.version,
            sends=d.sends,
            bytes_sent=xfer.bytes_sent,
            last_send_bytes=xfer.last_send_bytes,
            buffers=len(self._snapshots.bufs),
            buffer_bytes=d.layout.nbytes,
            last_copy_ms=xfer.last_copy_s * 1e3,
            generation=xfer.generation,
            members=tuple(xfer.members),
            hosts=hosts,
            workers=d.acks.rows(d.version, lambda w: {"pid": None, "generation": self._hosts[w.wid[0]].connections}),
        )

    async def aclose(self, timeout: float) -> None:
        """``Stop`` every relay (they stop their workers), wait (bounded), release everything."""
        d = self._delivery
        if d.life.phase == "closed":
            return
        if d.closing():
            for stream in self._table.connected_streams():
                try:
                    stream.send(Stop())
                except Exception:  # best effort: its loss is noticed by its reader
                    pass
            await d.changed.wait_until(lambda: not self._table.connected_streams(), timeout)
        d.closed()
        self._table.stop_listening()
        tasks = self._tasks + self._table.tasks()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        await self._table.aclose()
        await self._xfer.aclose()
        self._store = None

    # ----------------------------------------------------------------- hosts

    @property
    def hosts(self) -> list[int]:
        return list(self._hosts)

    @property
    def group(self) -> SyncGroup | None:
        """The current weight-sync group (for tests)."""
        return self._xfer.group

    def host(self, host: int) -> Host:
        return self._table.host(host)

    async def wait_host_joined(self, host: int, timeout: float | None) -> None:
        """Wait until *host* is connected and each of its workers answered its newest version."""
        h = self.host(host)
        await self._delivery.acks.wait_joined([w.wid for w in h.workers.values()], timeout, f"waiting for host {host} to join")

    async def wait_lost(self, host: int, timeout: float | None) -> None:
        """Wait until the trainer has declared *host* lost."""
        h = self.host(host)
        timeout = checked_timeout(timeout)
        life = self._delivery.life
        if not await self._delivery.changed.wait_until(lambda: h.state in ("dead", "left", "stopped") or life.phase != "running", timeout):
            raise SyncTimeoutError(f"waiting for host {host} to be declared lost", {}, timeout)


def is_pair(wid: object) -> bool:
    """A multi-host worker id: ``(host, local index)``."""
    return isinstance(wid, tuple) and len(wid) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in wid)
