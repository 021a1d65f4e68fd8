"""The trainer's data plane: snapshots, the weight-sync group, and the transfer pump.

A send copies the weights once into a flat wire buffer (a
:class:`~.._core._ownership.Snapshot`, held as the :class:`~.._core._ownership.SnapshotLedger`
says), then the
*pump* task moves it: one network transfer per host, a ``broadcast`` when the version
goes to every member of the group, point-to-point sends otherwise. At most one transfer
is in flight per host: a busy host is left out and gets its workers' newest version once
it is done (latest wins), never holding up the others. When the connected hosts change
(:attr:`~._hosts.HostTable.regroup`), the transfers in flight are given up and the group
is re-formed from the hosts connected then (a new store prefix, a new generation).

Snapshots are held only by the workers whose newest version they carry and by a transfer
in progress, so at most ``W + 1`` exist (one, two in the usual case where every send goes
to everybody).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from .._core._deadline import unless
from .._core._layout import Layout
from .._core._offload import THREAD_COPY_BYTES, Offload
from .._core._ownership import Snapshot
from .._errors import BrokenChannelError
from .._io._staging import copy_tensors, stream_done
from .._wire._control import Group, Transfer
from ._dataplane import SyncGroup
from ._hosts import Host, HostTable, WorkerId

__all__ = ["Transfers", "changed_ranges"]

logger = logging.getLogger("asyncsync")


class Transfers:
    """Snapshots, the group and the pump (see the module docstring)."""

    def __init__(
        self,
        table: HostTable,
        *,
        layout: Layout,
        copier: Offload,
        store: Any,
        chunk_bytes: int,
        backend: str,
        hostname: str,
        device: torch.device | None,
        timeout: float | None,
    ) -> None:
        self._table = table
        self._hosts = table.hosts
        self._layout = layout
        self._acks = table.acks
        self._changed = table.changed
        self._life = table.life  # the sender's phase
        self._copier = copier
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.backend = backend
        self._hostname = hostname
        self.device = device  # where the snapshots live and travel from (None: host memory)
        self._timeout = timeout
        self.snapshots = table.snapshots
        self.bytes_sent = 0
        self.last_send_bytes = 0
        self.last_copy_s = 0.0
        self.group: SyncGroup | None = None
        self.members: list[int] = []
        self.generation = 0
        self._tag = 0
        self._transfers: set[asyncio.Task[None]] = set()  # in flight, at most one per host
        self._last_send_version = -1
        self._last_send_parts: dict[tuple[int, ...], int] = {}

    # ----------------------------------------------------------------- snapshots

    async def snapshot(
        self, flat: Mapping[str, torch.Tensor], version: int, by_base: list[tuple[Snapshot | None, list[WorkerId]]]
    ) -> list[tuple[Snapshot, list[WorkerId]]]:
        """Write *version*: one snapshot per base (None: whole), each with its members.
        They stay reserved until :meth:`assign`; if a write fails or is cancelled, none is."""
        ledger = self.snapshots
        written: list[tuple[Snapshot, list[WorkerId]]] = []
        try:
            for base, members in by_base:
                buf = ledger.reserve()  # held until assigned: the next group must not take it
                written.append((buf, members))
                await self._write(buf, flat, base)
                ledger.written(buf, version, base, () if base is None else changed_ranges(self._layout, flat, self.chunk_bytes))
        except BaseException:
            for buf, _ in written:
                ledger.release(buf)
            raise
        return written

    def assign(self, written: list[tuple[Snapshot, list[WorkerId]]]) -> None:
        """Make each snapshot its members' newest version (the pump moves it)."""
        for buf, members in written:
            for wid in members:
                self.snapshots.assign(wid, buf)
                self._acks.sent(wid, buf.version)
            self.snapshots.release(buf)

    async def _write(self, buf: Snapshot, flat: Any, base: Snapshot | None) -> None:
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
                self.snapshots.hold(buf)

            def release() -> None:
                self.snapshots.release(buf)
                self._changed.notify()

            await self._copier.run(_copy_snapshot, dst, src, self.device, keep=keep, release=release)
        self.last_copy_s = time.perf_counter() - t0

    async def aclose(self) -> None:
        """Drop the group and every snapshot (the pump and the transfers are ended already)."""
        if self.group is not None:
            self.group.close()
            self.group = None
        await self._copier.aclose()
        self.snapshots.clear()
        self.store = None

    # ----------------------------------------------------------------- the pump

    async def pump(self) -> None:
        """Form the group when membership changed; else start a transfer for every idle
        host with something pending. One transfer is in flight per host at most: a busy
        host (still landing, or its relay not answering) is left out, and gets its
        workers' newest version once it is done (latest wins), never holding up the others."""
        try:
            while self._life.phase == "running":
                await self._changed.wait_until(lambda: self._life.phase != "running" or self._work_to_do(), None)
                if self._life.phase != "running":
                    return
                if self._table.regroup:
                    await self._end_transfers()
                    await self._form_group()
                    continue
                self._start_transfers()
        finally:
            await self._end_transfers()

    def _idle(self) -> list[int]:
        """Members with a version pending and no transfer in flight."""
        pending = self.snapshots.pending
        return [h for h in self.members if pending.get(h) and self._hosts[h].state == "connected" and not self._hosts[h].busy]

    def _work_to_do(self) -> bool:
        if self._table.regroup:
            return bool(self._table.connected()) or bool(self.members) or bool(self._transfers)
        return bool(self._idle())

    def _start_transfers(self) -> None:
        idle = self._idle()
        if not idle:
            return
        loop = asyncio.get_running_loop()
        if len(idle) == len(self.members) and not self._transfers:
            # Everybody idle and waiting for the same version: one broadcast.
            pending = self.snapshots.pending
            key = min(k for h in idle for k in pending[h])
            if all(key in pending[h] for h in idle):
                self._spawn(loop, idle, key)
                return
        for h in idle:
            self._spawn(loop, [h], min(self.snapshots.pending[h]))

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
        self._table.regroup = False
        members = self._table.connected()
        self.generation += 1
        gen = self.generation
        if self.group is not None:
            self.group.close(background=True)
            self.group = None
        self.members = []
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
            self.store, gen, 0, size, timeout=self._group_timeout(), chunk_bytes=self.chunk_bytes, backend=self.backend, hostname=self._hostname,
            device=self.device,
        )
        try:
            # A member lost during the rendezvous would hold it up until the timeout: give up
            # on this generation as soon as membership changes, and form the next one.
            group = await unless(create, self._changed.wait_until(lambda: self._table.regroup or self._life.phase != "running", None))
        except Exception as exc:
            logger.warning("asyncsync: weight-sync group generation %d with hosts %s failed to form (%r); retrying", gen, members, exc)
            self._table.regroup = True
            return
        if group is None:
            logger.info("asyncsync: weight-sync group generation %d abandoned: the hosts changed while it formed", gen)
            return
        if self._table.regroup or self._life.phase != "running":
            group.close()  # membership changed meanwhile: form the next generation
            return
        self.group = group
        self.members = members
        for h in members:
            self._table.requeue(self._hosts[h])
        logger.info("asyncsync: weight-sync group generation %d: trainer + hosts %s", gen, members)

    def _group_timeout(self) -> float:
        return self._timeout if self._timeout is not None else 300.0

    async def _transfer(self, hosts: list[int], key: tuple[int, int]) -> None:
        """Move pending *key* to *hosts*: a broadcast if they are every member, else
        point-to-point (one host, its own tags)."""
        group = self.group
        assert group is not None
        # A newer version for the same workers may have replaced this one (latest wins)
        # between the pump starting this task and the task's first step.
        pending = self.snapshots.pending
        hosts = [h for h in hosts if key in pending.get(h, {})]
        if not hosts or any(self._hosts[h].stream is None for h in hosts):
            return  # (a host lost meanwhile: the group re-forms, and the pump starts again)
        buf = pending[hosts[0]][key][0]
        version = key[0]
        p2p = set(hosts) != set(self.members)
        self._tag = (self._tag + 1) % (1 << 20)
        tag = self._tag * 2048
        named = {h: set(pending[h][key][1]) for h in hosts}  # the targets this transfer names
        delta = bool(buf.ranges) and all(self._holds_base(self._hosts[h], named[h], buf) for h in hosts)
        base, ranges = (buf.base_version, buf.ranges) if delta else (-1, ())
        data: torch.Tensor | list[torch.Tensor] = [buf.tensor[o : o + n] for o, n in ranges] if delta else buf.tensor
        for h in hosts:
            stream = self._hosts[h].stream
            assert stream is not None  # (checked above; nothing awaited since)
            try:
                stream.send(Transfer(version, group.generation, p2p, tag, tuple(sorted(named[h])), base, ranges))
            except BrokenChannelError:
                pass
        self.snapshots.hold(buf)
        # Counted when issued: the bytes leave now (a worker may ack before the trainer's
        # side of the operation reports completion).
        # Point-to-point: one copy per host. A gloo broadcast is a binomial tree: the root
        # sends ceil(log2(members + 1)) copies. NCCL's broadcast is a pipelined ring: one.
        if p2p:
            copies = len(hosts)
        elif self.backend == "nccl":
            copies = 1
        else:
            copies = max(1, (len(self.members) + 1 - 1).bit_length())
        moved = (sum(n for _, n in ranges) if delta else self._layout.nbytes) * copies
        self.bytes_sent += moved
        # A version may travel in several transfers (one per host when they are not all
        # idle): last_send_bytes adds up those of the newest version transferred, the
        # last one to each set of hosts (a repeat after a regroup replaces the first).
        if version > self._last_send_version:
            self._last_send_version, self._last_send_parts = version, {}
        if version == self._last_send_version:
            self._last_send_parts[tuple(hosts)] = moved
            self.last_send_bytes = sum(self._last_send_parts.values())

        def release() -> None:
            self.snapshots.release(buf)

        async def move() -> bool:
            if p2p:
                ranks = {h: self.members.index(h) + 1 for h in hosts}
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
        connections = {h: self._hosts[h].connections for h in (hosts if p2p else self.members)}

        def member_lost() -> bool:  # (a host that connected again was lost in between, too)
            return self._life.phase != "running" or any(
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
            if self._life.phase == "running":
                logger.warning("asyncsync: transfer of version %d to hosts %s failed (%s); re-forming the group", version, hosts, exc)
                self._table.regroup = True
                self._changed.notify()
            return
        if moved is None:
            if self._life.phase == "running":
                logger.warning("asyncsync: transfer of version %d to hosts %s abandoned: a host was lost during it; re-forming the group", version, hosts)
            return
        for h in hosts:
            host = self._hosts[h]
            host.delivered = max(host.delivered, version)
            self.snapshots.delivered(h, key)
        self._changed.notify()

    @staticmethod
    def _holds_base(host: Host, targets: set[int], buf: Snapshot) -> bool:
        """Whether partial update *buf* may travel as a delta to *targets* on *host*: each
        applied its base on this connection. A relay completes a delta from its targets'
        newest version, so that must be the base; a transfer that reached the relay does not
        prove it (the relay may have lost that landing, or given up the receive), an ack
        does: the relay published the version before the worker could apply it, and it
        holds nothing newer than what the trainer gave these workers (*buf*'s base)."""
        return all(
            host.workers[i].state == "connected" and host.workers[i].applied == buf.base_version for i in targets
        )


_MERGE_GAP = 256 << 10  # two changed ranges closer than this travel as one (fewer operations)
_MAX_RANGE_CHUNKS = 1024  # chunks of one partial transfer (a point-to-point one has 2048 tags)


def changed_ranges(layout: Layout, flat: Mapping[str, torch.Tensor], chunk_bytes: int) -> tuple[tuple[int, int], ...]:
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
