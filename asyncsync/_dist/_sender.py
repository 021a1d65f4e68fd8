"""The trainer side of the multi-host scheme: hosts, network transfers, acks from afar.

Each remote host has one relay, connected over an authenticated TCP control stream and a
member of the current weight-sync group (:class:`~._dataplane.SyncGroup`, rank 0 is the
trainer). A send copies the weights once into a flat wire buffer (the snapshot), then
the *pump* task moves it: one network transfer per host, a ``broadcast`` when the version
goes to every member of the group, point-to-point sends otherwise. Each relay lands the
bytes in a local shared-memory slot and fans them out to its workers; their acks come
back over the control stream, so versions, ``worker_ids``, quorum waits and statistics
name global workers ``(host, local index)``.

Latest wins per worker, as locally: a worker that has not received version v when v+1
is sent for it only ever gets v+1. Buffers are held only by the workers whose newest
version they carry and by a transfer in progress, so at most ``W + 1`` exist (one, two
in the usual case where every send goes to everybody).
A host whose control connection ends (EOF, no heartbeat, a malformed frame) is declared
lost at once, with every one of its workers; the group is re-formed from the survivors
(a new store prefix, a new generation) and the next transfer goes to the living. A host
that connects again joins a new generation and gets each of its workers' newest version
before anything else.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from .._core._acks import WorkerRecord
from .._core._deadline import unless
from .._core._front import SenderCore
from .._core._layout import Layout
from .._core._offload import THREAD_COPY_BYTES
from .._errors import (
    AuthenticationError,
    BrokenChannelError,
    ClosedError,
    HostLostError,
    ProtocolError,
    SyncTimeoutError,
    WeightsError,
    WorkerDiedError,
    WorkerLeftError,
)
from .._io._staging import copy_tensors, stream_done
from .._options import DEFAULT, Timeout
from .._stats import DistributedStatistics, HostStatistics
from .._wire._protocol import Ack, Auth, Beat, Bye, Challenge, Group, Lost, Setup, Stop, Transfer, Welcome
from ._control import FRAME_LIMIT, ControlStream, auth_mac, new_nonce, welcome_mac
from ._dataplane import DEFAULT_CHUNK_BYTES, SyncGroup

__all__ = ["DistSender", "WorkerId", "unless"]

logger = logging.getLogger("asyncsync")

WorkerId = tuple[int, int]


class _Buf:
    """One flat wire buffer: the snapshot of one version."""

    def __init__(self, layout: Layout, device: torch.device | None) -> None:
        self.tensor = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        self.views = layout.views(self.tensor)
        self.version = -1
        self.serial = -1  # which write this is (a buffer is reused)
        self.owners = 0  # workers whose newest version this is
        self.transfers = 0  # network transfers still reading it
        # A partial update: the version it completed and the byte ranges it changed; a
        # host whose targets applied that version gets only these ranges.
        self.base_version = -1
        self.ranges: tuple[tuple[int, int], ...] = ()


class _RemoteWorker(WorkerRecord):
    """One remote worker: its delivery state (kept by the :class:`AckTracker`) and the
    buffer holding its newest version."""

    def __init__(self, wid: WorkerId) -> None:
        super().__init__(wid)
        self.wid: WorkerId = wid
        self.latest: _Buf | None = None


class _Host:
    def __init__(self, idx: int, num_workers: int) -> None:
        self.idx = idx
        self.num_workers = num_workers
        self.state = "waiting"  # waiting | connected | dead | left | stopped
        self.stream: ControlStream | None = None
        self.pid: int | None = None
        self.peer: str | None = None
        self.connections = 0
        self.reason: str | None = None
        self.workers = {i: _RemoteWorker((idx, i)) for i in range(num_workers)}
        # (version, buffer serial) -> (buffer, local targets). One version may need several
        # buffers on one host: a partial update completed from different bases per worker.
        self.pending: dict[tuple[int, int], tuple[_Buf, set[int]]] = {}
        self.delivered = -1
        self.tasks: list[asyncio.Task[None]] = []
        self.busy = False  # a transfer to this host is in flight


class DistSender(SenderCore[WorkerId, _RemoteWorker]):
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
        self._token = token
        self._bind = bind
        self._port = port
        self.chunk_bytes = chunk_bytes
        self.heartbeat = heartbeat
        self.silence_timeout = silence_timeout
        self.backend = backend
        self.device = device  # where the snapshots live and travel from (None: host memory)
        self._hosts = {h: _Host(h, n) for h, n in sorted(hosts.items())}
        self._workers: dict[WorkerId, _RemoteWorker] = {w.wid: w for h in self._hosts.values() for w in h.workers.values()}
        super().__init__(
            self._workers, source_layout=source_layout, wire_layout=wire_layout, sync=sync, timeout=timeout, on_worker_error=on_worker_error, check_finite=check_finite
        )
        self._bufs: list[_Buf] = []
        self._serial = 0
        self._bytes_sent = 0
        self._last_send_bytes = 0
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._group: SyncGroup | None = None
        self._members: list[int] = []
        self._generation = 0
        self._regroup = True
        self._tag = 0
        self._transfers: set[asyncio.Task[None]] = set()  # in flight, at most one per host
        self._last_send_version = -1
        self._last_send_parts: dict[tuple[int, ...], int] = {}
        self._streams: set[ControlStream] = set()  # every control connection not yet closed
        self.address: tuple[str, int] | None = None

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
        self._server = await asyncio.start_server(self._accept, self._bind, self._port)
        sock = self._server.sockets[0].getsockname()
        self.address = (self._bind, int(sock[1]))
        self._store.set("control", f"{self._bind}:{sock[1]}")  # rank 0 hosts the store: a local call
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._pump(), name="asyncsync-dist-pump"))

    async def connect(self, timeout: Timeout = DEFAULT, weights: Any = None) -> int:
        """Start, send version 0 to every worker of every host, wait for every ack."""
        return await self._connect(timeout, weights)

    async def send(self, weights: Any = None, worker_ids: Any = None, *, partial: bool = False, timeout: Timeout = DEFAULT) -> int:
        """Snapshot *weights*; with ``sync`` wait until every targeted worker applied them
        (*timeout* bounds the whole call)."""
        return await self._send(weights, worker_ids, partial, timeout)

    async def send_async(self, weights: Any = None, worker_ids: Any = None, *, partial: bool = False, timeout: Timeout = DEFAULT) -> int:
        """Snapshot *weights* into a wire buffer and hand it to the transfer task.

        Never waits for a host; *timeout* bounds the wait for another send's snapshot.
        """
        targets = self._targets(worker_ids)
        self._before_send(targets)
        flat = self._flat(weights, partial)
        async with self._sending(timeout):
            self._check_running()
            by_base: dict[int, tuple[_Buf | None, list[WorkerId]]] = {}
            full = self._reader.is_whole(flat)
            for wid in targets:
                base = None if full else self._workers[wid].latest
                if not full and base is None:
                    raise WeightsError(f"a partial update needs full weights first; worker {wid} has none")
                by_base.setdefault(id(base), (base, []))[1].append(wid)
            version = self._version + 1
            written: list[tuple[_Buf, list[WorkerId]]] = []
            try:
                for base, members in by_base.values():
                    buf = self._free_buf()
                    buf.transfers += 1  # reserved until assigned: the next group must not take it
                    written.append((buf, members))
                    await self._write(buf, flat, base)
                    buf.version = version
                    self._serial += 1
                    buf.serial = self._serial
                    if base is None:
                        buf.base_version = -1
                        buf.ranges = ()
                    else:
                        buf.base_version = base.version
                        buf.ranges = _changed_ranges(self._layout, flat, self.chunk_bytes)
            except BaseException:
                for buf, _ in written:
                    buf.transfers -= 1
                raise
            self._version = version
            self._sends += 1
            for buf, members in written:
                for wid in members:
                    self._assign(self._workers[wid], buf)
                buf.transfers -= 1
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
        if not await self._changed.wait_until(lambda: h.state in ("dead", "left", "stopped") or self._state != "running", timeout):
            raise SyncTimeoutError(f"waiting for host {host} to be declared lost", {}, timeout)

    def statistics(self) -> DistributedStatistics:
        workers = self._acks.rows(self._version, lambda w: {"pid": None, "generation": self._hosts[w.wid[0]].connections})
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
            bytes_sent=self._bytes_sent,
            last_send_bytes=self._last_send_bytes,
            buffers=len(self._bufs),
            buffer_bytes=self._layout.nbytes,
            last_copy_ms=self._last_copy_s * 1e3,
            generation=self._generation,
            members=tuple(self._members),
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
                lambda: [h.stream for h in self._hosts.values() if h.state == "connected" and h.stream is not None],
                lambda stream: stream.send(Stop()),
            )
            if self._server is not None:
                self._server.close()
            tasks = self._tasks + [t for h in self._hosts.values() for t in h.tasks]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks = []
            for h in self._hosts.values():
                h.tasks = []
                h.stream = None
            streams, self._streams = list(self._streams), set()
            for stream in streams:  # (those of lost hosts are closed already: their threads end)
                await stream.aclose()
            if self._server is not None:
                await self._server.wait_closed()
                self._server = None
            if self._group is not None:
                self._group.close()
                self._group = None
            await self._copier.aclose()
            self._bufs = []
            self._store = None
            for w in self._workers.values():
                w.latest = None
            for h in self._hosts.values():
                h.pending.clear()

    # ----------------------------------------------------------------- sends

    def _host(self, host: int) -> _Host:
        try:
            return self._hosts[host]
        except KeyError:
            raise ValueError(f"unknown host {host!r}; hosts are {sorted(self._hosts)}") from None

    def _targets(self, worker_ids: Any) -> list[WorkerId]:
        """``None`` (all), a ``(host, local)`` pair, or a list of them."""
        return self._parse_targets(worker_ids, _is_pair, "a (host, local index) pair")

    def _flat(self, weights: Any, partial: bool) -> dict[str, torch.Tensor]:
        if weights is None:
            return self._reader.source(self._reader.resolve(self._source), self.check_finite)
        return self._reader.weights(weights, partial, self.check_finite)

    def _free_buf(self) -> _Buf:
        for buf in self._bufs:
            if buf.owners == 0 and buf.transfers == 0:
                return buf
        buf = _Buf(self._layout, self.device)
        self._bufs.append(buf)
        return buf

    async def _write(self, buf: _Buf, flat: Any, base: _Buf | None) -> None:
        keys = self._layout.keys
        dst = [buf.views[k] for k in keys]
        src = [flat[k] if k in flat else base.views[k] for k in keys]  # type: ignore[union-attr]
        t0 = time.perf_counter()
        if self._layout.nbytes < THREAD_COPY_BYTES:
            copy_tensors(dst, src)
            if self.device is not None and self.device.type == "cuda":
                await stream_done(torch.cuda.current_stream(self.device))  # polled: the loop never synchronizes
        else:

            def keep() -> None:  # the copy thread still writes it: reserved until it is done
                buf.transfers += 1

            def release() -> None:
                buf.transfers -= 1
                self._changed.notify()

            await self._copier.run(_copy_snapshot, dst, src, self.device, keep=keep, release=release)
        self._last_copy_s = time.perf_counter() - t0

    def _assign(self, w: _RemoteWorker, buf: _Buf) -> None:
        """*buf* is *w*'s newest version: it replaces whatever older one was waiting."""
        old = w.latest
        if old is not None:
            old.owners -= 1
        w.latest = buf
        buf.owners += 1
        self._acks.sent(w.wid, buf.version)
        h = self._hosts[w.wid[0]]
        local = w.wid[1]
        for key in list(h.pending):
            targets = h.pending[key][1]
            targets.discard(local)
            if not targets:
                del h.pending[key]
        h.pending.setdefault((buf.version, buf.serial), (buf, set()))[1].add(local)

    # ----------------------------------------------------------------- the pump

    async def _pump(self) -> None:
        """Form the group when membership changed; else start a transfer for every idle
        host with something pending. One transfer is in flight per host at most: a busy
        host (still landing, or its relay not answering) is left out, and gets its
        workers' newest version once it is done (latest wins), never holding up the others."""
        try:
            while self._state == "running":
                await self._changed.wait_until(lambda: self._state != "running" or self._work_to_do(), None)
                if self._state != "running":
                    return
                if self._regroup:
                    await self._end_transfers()
                    await self._form_group()
                    continue
                self._start_transfers()
        finally:
            await self._end_transfers()

    def _connected(self) -> list[int]:
        return [h.idx for h in self._hosts.values() if h.state == "connected"]

    def _idle(self) -> list[int]:
        """Members with a version pending and no transfer in flight."""
        return [h for h in self._members if self._hosts[h].pending and self._hosts[h].state == "connected" and not self._hosts[h].busy]

    def _work_to_do(self) -> bool:
        if self._regroup:
            return bool(self._connected()) or bool(self._members) or bool(self._transfers)
        return bool(self._idle())

    def _start_transfers(self) -> None:
        idle = self._idle()
        if not idle:
            return
        loop = asyncio.get_running_loop()
        if len(idle) == len(self._members) and not self._transfers:
            # Everybody idle and waiting for the same version: one broadcast.
            key = min(k for h in idle for k in self._hosts[h].pending)
            if all(key in self._hosts[h].pending for h in idle):
                self._spawn(loop, idle, key)
                return
        for h in idle:
            self._spawn(loop, [h], min(self._hosts[h].pending))

    def _spawn(self, loop: asyncio.AbstractEventLoop, hosts: list[int], key: tuple[int, int]) -> None:
        for h in hosts:
            self._hosts[h].busy = True
        task = loop.create_task(self._transfer(hosts, key), name=f"asyncsync-dist-transfer-{key[0]}-{hosts}")
        self._transfers.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._transfers.discard(t)
            for h in hosts:
                self._hosts[h].busy = False
            if not t.cancelled() and t.exception() is not None:
                logger.error("asyncsync: transfer of version %d to hosts %s failed", key[0], hosts, exc_info=t.exception())
            self._changed.notify()

        task.add_done_callback(done)

    async def _end_transfers(self) -> None:
        """Give up every transfer in flight (before the group re-forms); each one's buffer
        stays held until the backend is done with it."""
        tasks = list(self._transfers)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _form_group(self) -> None:
        self._regroup = False
        members = self._connected()
        self._generation += 1
        gen = self._generation
        if self._group is not None:
            self._group.close(background=True)
            self._group = None
        self._members = []
        if not members:
            return
        size = len(members) + 1
        for rank, host in enumerate(members, start=1):
            stream = self._hosts[host].stream
            assert stream is not None
            try:
                stream.send(Group(gen, rank, size, self.chunk_bytes))
            except BrokenChannelError:
                pass  # its reader reports it
        create = SyncGroup.create(
            self._store, gen, 0, size, timeout=self._group_timeout(), chunk_bytes=self.chunk_bytes, backend=self.backend, hostname=self._bind,
            device=self.device,
        )
        try:
            # A member lost during the rendezvous would hold it up until the timeout: give up
            # on this generation as soon as membership changes, and form the next one.
            group = await unless(create, self._changed.wait_until(lambda: self._regroup or self._state != "running", None))
        except Exception as exc:
            logger.warning("asyncsync: weight-sync group generation %d with hosts %s failed to form (%r); retrying", gen, members, exc)
            self._regroup = True
            return
        if group is None:
            logger.info("asyncsync: weight-sync group generation %d abandoned: the hosts changed while it formed", gen)
            return
        if self._regroup or self._state != "running":
            group.close()  # membership changed meanwhile: form the next generation
            return
        self._group = group
        self._members = members
        for h in members:
            self._requeue(self._hosts[h])
        logger.info("asyncsync: weight-sync group generation %d: trainer + hosts %s", gen, members)

    def _requeue(self, h: _Host) -> None:
        """After the group re-formed, transfer again each worker's newest version it has not
        acked: a relay gives up a receive when a new generation is announced, even one whose
        bytes had all left the trainer (the relay skips what it already holds)."""
        for w in h.workers.values():
            if w.latest is not None and w.applied < w.latest.version and w.state in ("waiting", "connected"):
                h.pending.setdefault((w.latest.version, w.latest.serial), (w.latest, set()))[1].add(w.wid[1])

    def _group_timeout(self) -> float:
        return self.timeout if self.timeout is not None else 300.0

    async def _transfer(self, hosts: list[int], key: tuple[int, int]) -> None:
        """Move pending *key* to *hosts*: a broadcast if they are every member, else
        point-to-point (one host, its own tags)."""
        group = self._group
        assert group is not None
        # A newer version for the same workers may have replaced this one (latest wins)
        # between the pump starting this task and the task's first step.
        hosts = [h for h in hosts if key in self._hosts[h].pending]
        if not hosts:
            return
        buf = self._hosts[hosts[0]].pending[key][0]
        version = key[0]
        p2p = set(hosts) != set(self._members)
        self._tag = (self._tag + 1) % (1 << 20)
        tag = self._tag * 2048
        named = {h: set(self._hosts[h].pending[key][1]) for h in hosts}  # the targets this transfer names
        delta = bool(buf.ranges) and all(self._holds_base(self._hosts[h], named[h], buf) for h in hosts)
        base, ranges = (buf.base_version, buf.ranges) if delta else (-1, ())
        data: torch.Tensor | list[torch.Tensor] = [buf.tensor[o : o + n] for o, n in ranges] if delta else buf.tensor
        for h in hosts:
            stream = self._hosts[h].stream
            assert stream is not None
            try:
                stream.send(Transfer(version, group.generation, p2p, tag, tuple(sorted(named[h])), base, ranges))
            except BrokenChannelError:
                pass
        buf.transfers += 1
        # Counted when issued: the bytes leave now (a worker may ack before the trainer's
        # side of the operation reports completion).
        # Point-to-point: one copy per host. A gloo broadcast is a binomial tree: the root
        # sends ceil(log2(members + 1)) copies. NCCL's broadcast is a pipelined ring: one.
        if p2p:
            copies = len(hosts)
        elif self.backend == "nccl":
            copies = 1
        else:
            copies = max(1, (len(self._members) + 1 - 1).bit_length())
        moved = (sum(n for _, n in ranges) if delta else self._layout.nbytes) * copies
        self._bytes_sent += moved
        # A version may travel in several transfers (one per host when they are not all
        # idle): last_send_bytes adds up those of the newest version transferred, the
        # last one to each set of hosts (a repeat after a regroup replaces the first).
        if version > self._last_send_version:
            self._last_send_version, self._last_send_parts = version, {}
        if version == self._last_send_version:
            self._last_send_parts[tuple(hosts)] = moved
            self._last_send_bytes = sum(self._last_send_parts.values())

        def release() -> None:
            buf.transfers -= 1

        async def move() -> bool:
            if p2p:
                ranks = {h: self._members.index(h) + 1 for h in hosts}
                left = [len(hosts)]

                def release_one() -> None:
                    left[0] -= 1
                    if left[0] == 0:
                        release()

                await asyncio.gather(*(group.send(data, ranks[h], tag, release_one) for h in hosts))
            else:
                await group.broadcast(data, 0, release)
            return True

        # A broadcast needs every member; a point-to-point transfer only its host.
        connections = {h: self._hosts[h].connections for h in (hosts if p2p else self._members)}

        def member_lost() -> bool:  # (a host that connected again was lost in between, too)
            return self._state != "running" or any(
                self._hosts[h].state != "connected" or self._hosts[h].connections != n for h, n in connections.items()
            )

        try:
            # A member whose control connection ended may still hold its end of the group
            # open (hung, or cut off on the control link only): the backend would wait for
            # it until the group's timeout. Give up at once; the backend finishes (or times
            # out) in the background, holding the buffer until then, and the next
            # generation goes on without it.
            moved = await unless(move(), self._changed.wait_until(member_lost, None))
        except BrokenChannelError as exc:
            if self._state == "running":
                logger.warning("asyncsync: transfer of version %d to hosts %s failed (%s); re-forming the group", version, hosts, exc)
                self._regroup = True
                self._changed.notify()
            return
        if moved is None:
            if self._state == "running":
                logger.warning("asyncsync: transfer of version %d to hosts %s abandoned: a host was lost during it; re-forming the group", version, hosts)
            return
        for h in hosts:
            host = self._hosts[h]
            host.delivered = max(host.delivered, version)
            host.pending.pop(key, None)
        self._changed.notify()

    @staticmethod
    def _holds_base(host: _Host, targets: set[int], buf: _Buf) -> bool:
        """Whether partial update *buf* may travel as a delta to *targets* on *host*: each
        applied its base on this connection. A relay completes a delta from its targets'
        newest version, so that must be the base; a transfer that reached the relay does not
        prove it (the relay may have lost that landing, or given up the receive), an ack
        does: the relay published the version before the worker could apply it, and it
        holds nothing newer than what the trainer gave these workers (*buf*'s base)."""
        return all(
            host.workers[i].state == "connected" and host.workers[i].applied == buf.base_version for i in targets
        )

    # ----------------------------------------------------------------- connections

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        addr = writer.get_extra_info("peername")
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        stream = ControlStream(reader, writer, f"relay at {peer}")
        self._streams.add(stream)
        try:
            host = await asyncio.wait_for(self._handshake(stream), 10.0)
        except (ProtocolError, AuthenticationError, BrokenChannelError, asyncio.TimeoutError, TimeoutError, ValueError) as exc:
            logger.warning("asyncsync: closed control connection from %s: %s", peer, exc if str(exc) else type(exc).__name__)
            await stream.aclose()
            return
        except asyncio.CancelledError:
            await stream.aclose()
            raise
        if self._state != "running":
            await stream.aclose()
            return
        h = self._hosts[host.host]
        if h.stream is not None:
            # The newest connection wins (a restarted host may come back before its old
            # connection is noticed dead); the old relay is told why it is dropped.
            old = h.stream
            self._lose(h, "it connected again (the old connection is dropped)", state="dead")
            try:
                old.send(Bye(h.idx, -1, f"replaced by another relay for host {h.idx} (pid {host.pid} at {peer})"))
            except BrokenChannelError:
                pass
            await old.aclose()
            if self._state != "running" or h.stream is not None:
                await stream.aclose()
                return
        stream.limit = FRAME_LIMIT
        h.stream = stream
        h.state = "connected"
        h.pid = host.pid
        h.peer = peer
        h.reason = None
        h.connections += 1
        h.delivered = -1
        h.pending.clear()
        for w in h.workers.values():
            self._acks.expect(w.wid, h.connections)  # nothing it answered before counts
        self._requeue(h)  # each worker's newest version goes first
        try:
            stream.send(Setup(self._layout, None, os.getpid()))
        except BrokenChannelError:
            pass
        loop = asyncio.get_running_loop()
        for t in h.tasks:  # the last connection's (its heartbeat may still sleep): aclose gathers them
            t.cancel()
        h.tasks = [t for t in h.tasks if not t.done()]
        h.tasks.append(loop.create_task(self._read_loop(h, stream)))
        stream.start_heartbeat(self.heartbeat)
        self._regroup = True
        logger.info("asyncsync: host %d joined from %s (relay pid %d, %d workers)", h.idx, peer, host.pid, h.num_workers)
        self._changed.notify()

    async def _handshake(self, stream: ControlStream) -> Auth:
        nonce = new_nonce()
        stream.send(Challenge(nonce))
        msg = await stream.recv()
        if not isinstance(msg, Auth):
            raise ProtocolError(f"{stream.peer}: expected Auth, got {type(msg).__name__}")
        if not hmac.compare_digest(msg.mac, auth_mac(self._token, nonce, msg.host, msg.num_workers)):
            raise AuthenticationError(f"{stream.peer} (claiming host {msg.host}) failed the token challenge: wrong token")
        if msg.host not in self._hosts:
            raise ValueError(f"{stream.peer} claims host {msg.host}, which is not one of {sorted(self._hosts)}")
        expected = self._hosts[msg.host].num_workers
        if msg.num_workers != expected:
            raise ValueError(f"host {msg.host} at {stream.peer} has {msg.num_workers} workers, the trainer expects {expected}")
        stream.send(Welcome(welcome_mac(self._token, msg.nonce)))
        return msg

    async def _read_loop(self, h: _Host, stream: ControlStream) -> None:
        try:
            while True:
                msg = await stream.recv(timeout=self.silence_timeout)
                if h.stream is not stream:
                    return
                if isinstance(msg, Ack):
                    self._on_ack(h, msg)
                elif isinstance(msg, Lost):
                    self._on_worker_lost(h, msg)
                elif isinstance(msg, Bye):
                    self._lose(h, f"its relay left: {msg.reason}", state="left")
                    return
                elif isinstance(msg, Beat):
                    pass
                else:
                    raise ProtocolError(f"{stream.peer}: {type(msg).__name__} is not something a relay sends")
        except ProtocolError as exc:
            logger.warning("asyncsync: closing the control connection of host %d: %s", h.idx, exc)
            if h.stream is stream:
                self._lose(h, f"it sent a malformed message ({exc}); its connection was closed")
        except BrokenChannelError as exc:
            if h.stream is stream:
                self._lose(h, str(exc))
        finally:
            stream.close()
            await stream.wait_closed()
            self._streams.discard(stream)

    def _on_ack(self, h: _Host, ack: Ack) -> None:
        w = h.workers.get(ack.worker_idx)
        if w is None:
            logger.warning("asyncsync: host %d acked unknown worker %d", h.idx, ack.worker_idx)
            return
        self._acks.connected(w.wid)  # its first answer on this connection (or a replacement process)
        self._acks.ack(w.wid, ack.version, ack.ok, ack.error, ack.stage_s, ack.commit_s)

    def _on_worker_lost(self, h: _Host, msg: Lost) -> None:
        w = h.workers.get(msg.worker_idx)
        if w is None:
            return
        wid = w.wid
        if msg.exitcode is None:
            self._acks.lost(wid, "left", WorkerLeftError(wid, f"{msg.reason} (on host {h.idx})", w.applied))  # type: ignore[arg-type]
        else:
            self._acks.lost(wid, "dead", WorkerDiedError(wid, msg.exitcode, None, f"on host {h.idx}: {msg.reason}"), msg.exitcode)  # type: ignore[arg-type]

    def _lose(self, h: _Host, reason: str, state: str = "dead") -> None:
        """Host *h* is gone: name it, with each of its workers, and re-form the group."""
        if self._state in ("closing", "closed"):
            h.state = "stopped"
            for w in h.workers.values():
                self._acks.stopped(w.wid)
        else:
            h.state = state
            h.reason = reason
            logger.warning("asyncsync: host %d lost: %s", h.idx, reason)
            for w in h.workers.values():
                self._acks.lost(w.wid, "dead", HostLostError(h.idx, w.wid, reason, h.pid))
        h.stream = None
        self._regroup = True  # without it (also while a generation is forming)
        self._changed.notify()


_MERGE_GAP = 256 << 10  # two changed ranges closer than this travel as one (fewer operations)
_MAX_RANGE_CHUNKS = 1024  # chunks of one partial transfer (a point-to-point one has 2048 tags)


def _changed_ranges(layout: Layout, flat: Mapping[str, torch.Tensor], chunk_bytes: int) -> tuple[tuple[int, int], ...]:
    """The byte ranges of the wire buffer a partial update *flat* changes, merged; empty
    (send everything) when they are too many operations or nearly the whole buffer."""
    spans = sorted((s.offset, s.nbytes) for s in layout.specs if s.key in flat and s.nbytes > 0)
    merged: list[list[int]] = []
    for offset, n in spans:
        if merged and offset - (merged[-1][0] + merged[-1][1]) <= _MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], offset + n - merged[-1][0])
        else:
            merged.append([offset, n])
    chunks = sum(SyncGroup.max_tag_chunks(n, chunk_bytes) for _, n in merged)
    if not merged or chunks > _MAX_RANGE_CHUNKS or sum(n for _, n in merged) >= 0.9 * layout.nbytes:
        return ()  # (nearly everything changed: the whole buffer, which spares the relay its base copy)
    return tuple((o, n) for o, n in merged)


def _copy_snapshot(dst: list[torch.Tensor], src: list[torch.Tensor], device: torch.device | None) -> None:
    copy_tensors(dst, src)
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the snapshot is complete when send_async returns


def _is_pair(wid: object) -> bool:
    return isinstance(wid, tuple) and len(wid) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in wid)
