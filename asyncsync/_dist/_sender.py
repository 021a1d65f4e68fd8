"""The trainer side of the multi-host scheme: its API, above the hosts and the transfers.

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
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from .._core._front import SenderCore
from .._core._layout import Layout
from .._errors import ClosedError, SyncTimeoutError, WeightsError
from .._options import DEFAULT, Timeout, checked_timeout
from .._stats import DistributedStatistics, HostStatistics
from .._wire._control import Stop
from ._dataplane import DEFAULT_CHUNK_BYTES, SyncGroup
from ._hosts import Host, HostTable, RemoteWorker, WorkerId
from ._transfer import Snapshot, Transfers

__all__ = ["DistSender", "WorkerId"]


class DistSender(SenderCore[WorkerId, RemoteWorker]):
    """Pushes weights to workers on remote hosts; created by ``init_on_sender``."""

    def __init__(
        self,
        *,
        hosts: Mapping[int, int],
        source_layout: Layout,
        wire_layout: Layout,
        source: Any,
        store: Any,
        token: bytes,
        bind: str,
        port: int,
        sync: bool,
        timeout: float | None,
        on_worker_error: str,
        check_finite: bool,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        heartbeat: float = 1.0,
        silence_timeout: float | None = None,
        backend: str = "gloo",
        device: torch.device | None = None,
    ) -> None:
        self._source = source
        self._store = store
        self._bind = bind
        self._port = port
        self._hosts = HostTable.make(dict(hosts))
        self._workers: dict[WorkerId, RemoteWorker] = {w.wid: w for h in self._hosts.values() for w in h.workers.values()}
        super().__init__(
            self._workers, source_layout=source_layout, wire_layout=wire_layout, sync=sync, timeout=timeout, on_worker_error=on_worker_error, check_finite=check_finite
        )
        self._table = HostTable(
            self._hosts, acks=self._acks, changed=self._changed, phase=self._phase, layout=wire_layout, token=token, heartbeat=heartbeat, silence_timeout=silence_timeout
        )
        self._xfer = Transfers(
            self._table,
            layout=wire_layout,
            copier=self._copier,
            store=store,
            chunk_bytes=chunk_bytes,
            backend=backend,
            hostname=bind,
            device=device,
            timeout=timeout,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.address: tuple[str, int] | None = None

    def _phase(self) -> str:
        return self._state

    # ----------------------------------------------------------------- public API

    @property
    def hosts(self) -> list[int]:
        return list(self._hosts)

    async def _open(self) -> None:
        await self.start()

    async def start(self) -> None:
        """Listen for relays (on ``bind``) and publish the address in the store."""
        if self._state != "new":
            if self._state != "running":
                raise ClosedError("the sender is closed")
            return
        self._state = "running"
        self._send_lock = asyncio.Lock()
        port = await self._table.listen(self._bind, self._port)
        self.address = (self._bind, port)
        self._store.set("control", f"{self._bind}:{port}")  # rank 0 hosts the store: a local call
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._xfer.pump(), name="asyncsync-dist-pump"))

    async def connect(self, timeout: Timeout = DEFAULT, weights: Any = None) -> int:
        """Start, send version 0 to every worker of every host, wait for every ack."""
        return await self._connect(timeout, weights)

    async def send(self, weights: Any = None, worker_ids: Any = None, *, partial: bool = False, timeout: Timeout = DEFAULT) -> int:
        """Snapshot *weights*; with ``sync`` wait until every targeted worker applied them
        (*timeout* bounds the whole call). A target that is gone (left, died, its host
        lost) keeps no other target from the version: the wait raises its error
        (:class:`HostLostError` for a lost host) once every other target answered;
        ``applied_by`` names those that applied it."""
        return await self._send(weights, worker_ids, partial, timeout)

    async def send_async(self, weights: Any = None, worker_ids: Any = None, *, partial: bool = False, timeout: Timeout = DEFAULT) -> int:
        """Snapshot *weights* into a wire buffer and hand it to the transfer task.

        Never waits for a host; *timeout* bounds the wait for another send's snapshot. A
        target that is gone is sent the version too (a host that connects again gets it
        first): the call does not raise for it; :meth:`wait_async` does.
        """
        targets = self._targets(worker_ids)
        self._check_running()
        flat = self._flat(weights, partial)
        async with self._sending(timeout):
            self._check_running()
            by_base: dict[int, tuple[Snapshot | None, list[WorkerId]]] = {}
            full = self._reader.is_whole(flat)
            for wid in targets:
                base = None if full else self._workers[wid].latest
                if not full and base is None:
                    raise WeightsError(f"a partial update needs full weights first; worker {wid} has none")
                by_base.setdefault(id(base), (base, []))[1].append(wid)
            version = self._version + 1
            written = await self._xfer.snapshot(flat, version, list(by_base.values()))
            self._version = version
            self._sends += 1
            self._xfer.assign(written)
            self._changed.notify()
        return version

    async def wait_async(
        self,
        version: int | None = None,
        worker_ids: Any = None,
        *,
        quorum: int | None = None,
        timeout: Timeout = DEFAULT,
        what: str | None = None,
    ) -> None:
        """Wait until the targeted workers applied *version* (see the local scheme)."""
        await self._wait(version, worker_ids, quorum, timeout, what)

    async def wait_joined(self, host: int, timeout: float | None = None) -> None:
        """Wait until *host* is connected and each of its workers answered its newest version."""
        h = self._host(host)
        await self._acks.wait_joined([w.wid for w in h.workers.values()], timeout, f"waiting for host {host} to join")

    async def wait_lost(self, host: int, timeout: float | None = None) -> None:
        """Wait until the trainer has declared *host* lost."""
        h = self._host(host)
        timeout = checked_timeout(timeout)
        if not await self._changed.wait_until(lambda: h.state in ("dead", "left", "stopped") or self._state != "running", timeout):
            raise SyncTimeoutError(f"waiting for host {host} to be declared lost", {}, timeout)

    def statistics(self) -> DistributedStatistics:
        workers = self._acks.rows(self._version, lambda w: {"pid": None, "generation": self._hosts[w.wid[0]].connections})
        xfer = self._xfer
        hosts = tuple(
            HostStatistics(
                host=h.idx,
                state=h.state,
                pid=h.pid,
                peer=h.peer,
                connections=h.connections,
                delivered_version=h.delivered,
                pending_versions=tuple(sorted({v for v, _ in h.pending})),
                reason=h.reason,
            )
            for h in self._hosts.values()
        )
        return DistributedStatistics(
            version=self._version,
            sends=self._sends,
            bytes_sent=xfer.bytes_sent,
            last_send_bytes=xfer.last_send_bytes,
            buffers=len(xfer.bufs),
            buffer_bytes=self._layout.nbytes,
            last_copy_ms=xfer.last_copy_s * 1e3,
            generation=xfer.generation,
            members=tuple(xfer.members),
            hosts=hosts,
            workers=workers,
        )

    async def aclose(self, timeout: float = 10.0) -> None:
        """``Stop`` every relay (they stop their workers), wait (bounded), release everything."""
        if self._state == "closed":
            return
        with anyio.CancelScope(shield=True):
            await self._stop_peers(
                timeout,
                True,
                self._table.connected_streams,
                lambda stream: stream.send(Stop()),
            )
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

    # ----------------------------------------------------------------- sends

    def _host(self, host: int) -> Host:
        return self._table.host(host)

    @property
    def _group(self) -> SyncGroup | None:
        """The current weight-sync group (for tests)."""
        return self._xfer.group

    def _targets(self, worker_ids: Any) -> list[WorkerId]:
        """``None`` (all), a ``(host, local)`` pair, or a list of them."""
        return self._parse_targets(worker_ids, _is_pair, "a (host, local index) pair")

    def _flat(self, weights: Any, partial: bool) -> dict[str, torch.Tensor]:
        if weights is None:
            return self._reader.source(self._reader.resolve(self._source), self.check_finite)
        return self._reader.weights(weights, partial, self.check_finite)


def _is_pair(wid: object) -> bool:
    return isinstance(wid, tuple) and len(wid) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in wid)
