"""The trainer's table of remote hosts: each relay's control connection (accept, the
handshake, the read loop), its workers' answers and losses, and a host's loss.

A relay connects over TCP and proves the shared token; the newest connection for a host
wins. Its workers' acks and losses come back over that stream and go to the sender's
:class:`~.._core._acks.AckTracker`, named ``(host, local index)``. A host whose
connection ends (EOF, no heartbeat, a malformed frame) is declared lost at once, with
every one of its workers. Each join or loss sets :attr:`HostTable.regroup`: the transfer
side re-forms the weight-sync group from the hosts connected then.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os

from .._core._acks import GONE, WorkerRecord
from .._core._delivery import Delivery
from .._core._layout import Layout
from .._core._options import WorkerState
from .._core._ownership import SnapshotLedger
from .._errors import AuthenticationError, BrokenChannelError, HostLostError, ProtocolError, WorkerDiedError, WorkerLeftError
from .._wire._control import Ack, Auth, Beat, Bye, Challenge, FromRelay, Lost, Setup, Welcome, assert_never, decode_from_relay
from ._control import FRAME_LIMIT, ControlStream, auth_mac, new_nonce, welcome_mac

__all__ = ["Host", "HostTable", "RemoteWorker", "WorkerId"]

logger = logging.getLogger("asyncsync")

WorkerId = tuple[int, int]


class RemoteWorker(WorkerRecord):
    """One remote worker's delivery state (kept by the :class:`AckTracker`)."""

    def __init__(self, wid: WorkerId) -> None:
        super().__init__(wid)
        self.wid: WorkerId = wid


class Host:
    """One remote host: its relay's connection and its workers (what is pending for it is
    the :class:`~.._core._ownership.SnapshotLedger`'s)."""

    def __init__(self, idx: int, num_workers: int) -> None:
        self.idx = idx
        self.num_workers = num_workers
        self.state: WorkerState = "waiting"
        self.stream: ControlStream[FromRelay] | None = None
        self.pid: int | None = None
        self.peer: str | None = None
        self.connections = 0
        self.reason: str | None = None
        self.workers = {i: RemoteWorker((idx, i)) for i in range(num_workers)}
        self.delivered = -1
        self.tasks: list[asyncio.Task[None]] = []
        self.busy = False  # a transfer to this host is in flight


class HostTable:
    """The hosts and their control connections (see the module docstring)."""

    def __init__(
        self,
        hosts: dict[int, Host],
        *,
        delivery: Delivery[WorkerId, RemoteWorker],
        snapshots: SnapshotLedger,
        layout: Layout,
        token: bytes,
        heartbeat: float,
        silence_timeout: float | None,
    ) -> None:
        self.hosts = hosts
        # The sender's delivery, shared with the transfer side: acks, change signal, phase.
        self.acks = delivery.acks
        self.changed = delivery.changed
        self.life = delivery.life
        self.elastic = delivery.elastic
        self.snapshots = snapshots
        self._layout = layout
        self._token = token
        self.heartbeat = heartbeat
        self.silence_timeout = silence_timeout
        self.regroup = True  # the connected hosts changed since the group last formed
        self._server: asyncio.Server | None = None
        self._streams: set[ControlStream[FromRelay]] = set()  # every control connection not yet closed

    @staticmethod
    def make(hosts: dict[int, int]) -> dict[int, Host]:
        """One record per host, for ``{host: number of workers}``."""
        return {h: Host(h, n) for h, n in sorted(hosts.items())}

    def requeue(self, h: Host) -> None:
        """Transfer again each of *h*'s workers' newest version it has not acked (after the
        group re-formed, or the host connected again): a relay gives up a receive when a new
        generation is announced, even one whose bytes had all left the trainer (the relay
        skips what it already holds)."""
        self.snapshots.requeue(h.idx, [(i, w.applied, w.state) for i, w in h.workers.items()])

    def host(self, host: int) -> Host:
        try:
            return self.hosts[host]
        except KeyError:
            raise ValueError(f"unknown host {host!r}; hosts are {sorted(self.hosts)}") from None

    def connected(self) -> list[int]:
        return [h.idx for h in self.hosts.values() if h.state == "connected"]

    def connected_streams(self) -> list[ControlStream[FromRelay]]:
        return [h.stream for h in self.hosts.values() if h.state == "connected" and h.stream is not None]

    async def listen(self, bind: str, port: int) -> int:
        """Accept relays on *bind*:*port* (0: any free port); return the port."""
        self._server = await asyncio.start_server(self._accept, bind, port)
        return int(self._server.sockets[0].getsockname()[1])

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    def tasks(self) -> list[asyncio.Task[None]]:
        return [t for h in self.hosts.values() for t in h.tasks]

    async def aclose(self) -> None:
        """Close every control connection and the listener (the tasks are ended already)."""
        for h in self.hosts.values():
            h.tasks = []
            h.stream = None
        streams, self._streams = list(self._streams), set()
        for stream in streams:  # (those of lost hosts are closed already: their threads end)
            await stream.aclose()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # ----------------------------------------------------------------- connections

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        addr = writer.get_extra_info("peername")
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        stream = ControlStream(reader, writer, f"relay at {peer}", decode_from_relay)
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
        if self.life.phase != "running":
            await stream.aclose()
            return
        refusal = await self._refusal(stream)
        if refusal is None and host.host not in self.hosts:
            self.add_host(host.host, host.num_workers)  # elastic membership: a new host joins
        h = self.hosts.get(host.host)
        if h is None:  # (refused, and new: nothing to record)
            await stream.aclose()
            logger.warning("asyncsync: closed control connection from %s (host %d): %s", peer, host.host, refusal)
            return
        if refusal is not None:
            await stream.aclose()
            if h.stream is None and self.life.phase == "running":
                self.lose(h, refusal)
            else:  # a relay already connected for this host stays
                logger.warning("asyncsync: closed control connection from %s (host %d): %s", peer, h.idx, refusal)
            return
        if h.stream is not None:
            # The newest connection wins (a restarted host may come back before its old
            # connection is noticed dead); the old relay is told why it is dropped.
            old = h.stream
            self.lose(h, "it connected again (the old connection is dropped)", state="dead")
            try:
                old.send(Bye(h.idx, -1, f"replaced by another relay for host {h.idx} (pid {host.pid} at {peer})"))
            except BrokenChannelError:
                pass
            await old.aclose()
            if self.life.phase != "running" or h.stream is not None:
                await stream.aclose()
                return
        h.stream = stream
        h.state = "connected"
        h.pid = host.pid
        h.peer = peer
        h.reason = None
        h.connections += 1
        h.delivered = -1
        self.snapshots.drop_pending(h.idx)
        for w in h.workers.values():
            self.acks.expect(w.wid, h.connections)  # nothing it answered before counts
            caught_up = self.snapshots.catch_up(w.wid)  # a member that joins gets the members' newest
            if caught_up is not None:
                self.acks.sent(w.wid, caught_up.version)
        self.requeue(h)  # each worker's newest version goes first
        loop = asyncio.get_running_loop()
        for t in h.tasks:  # the last connection's (its heartbeat may still sleep): aclose gathers them
            t.cancel()
        h.tasks = [t for t in h.tasks if not t.done()]
        h.tasks.append(loop.create_task(self._read_loop(h, stream)))
        stream.start_heartbeat(self.heartbeat)
        self.regroup = True
        logger.info("asyncsync: host %d joined from %s (relay pid %d, %d worker%s)", h.idx, peer, host.pid, h.num_workers, "" if h.num_workers == 1 else "s")
        self.changed.notify()

    async def _handshake(self, stream: ControlStream[FromRelay]) -> Auth:
        nonce = new_nonce()
        stream.send(Challenge(nonce))
        msg = await stream.recv()
        if not isinstance(msg, Auth):
            raise ProtocolError(f"{stream.peer}: expected Auth, got {type(msg).__name__}")
        if not hmac.compare_digest(msg.mac, auth_mac(self._token, nonce, msg.host, msg.num_workers)):
            raise AuthenticationError(f"{stream.peer} (claiming host {msg.host}) failed the token challenge: wrong token")
        # Authenticated: the relay proved the token (a stranger learns nothing). Refused now,
        # it is told why, after Welcome, so that it can trust the reason: Bye instead of Setup.
        stream.send(Welcome(welcome_mac(self._token, msg.nonce)))
        reason = None
        if msg.host not in self.hosts and not self.elastic:
            reason = f"host {msg.host} is not one of the trainer's hosts {sorted(self.hosts)}"
        elif msg.host not in self.hosts:
            if not (msg.host > 0 and msg.num_workers >= 1):
                reason = f"a new host needs an id >= 1 and at least one worker, got host {msg.host} with {msg.num_workers}"
        elif msg.num_workers != self.hosts[msg.host].num_workers:
            reason = f"host {msg.host} has {msg.num_workers} worker{'' if msg.num_workers == 1 else 's'} (num_workers), the trainer expects {self.hosts[msg.host].num_workers}"
        if reason is not None:
            try:
                stream.send(Bye(msg.host, -1, reason))
                await stream.drain()
            except BrokenChannelError:
                pass
            raise ValueError(f"refused {stream.peer}: {reason}")
        return msg

    async def _refusal(self, stream: ControlStream[FromRelay]) -> str | None:
        """Send the wire layout; the relay checks it against its model and answers ``Beat``
        (it fits: None) or ``Bye`` (why not). Only a relay that accepted is admitted, so no
        group forms with one that is about to leave."""
        stream.limit = FRAME_LIMIT  # authenticated: a Bye may say at length why it refuses
        try:
            stream.send(Setup(self._layout, None, os.getpid()))
            answer = await stream.recv(timeout=self.silence_timeout)
        except ProtocolError as exc:
            return f"its relay sent a malformed message ({exc})"
        except BrokenChannelError as exc:
            return f"its relay left before accepting the weights' layout ({exc})"
        if isinstance(answer, Bye):
            return f"its relay refused the trainer's weights: {answer.reason}"
        if not isinstance(answer, Beat):
            return f"its relay answered the weights' layout with {type(answer).__name__}"
        return None

    async def _read_loop(self, h: Host, stream: ControlStream[FromRelay]) -> None:
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
                    self.lose(h, f"its relay left: {msg.reason}", state="left")
                    return
                elif isinstance(msg, Beat):
                    pass
                elif isinstance(msg, Auth):
                    raise ProtocolError(f"{stream.peer}: Auth after the handshake")
                else:
                    assert_never(msg)
        except ProtocolError as exc:
            logger.warning("asyncsync: closing the control connection of host %d: %s", h.idx, exc)
            if h.stream is stream:
                self.lose(h, f"it sent a malformed message ({exc}); its connection was closed")
        except BrokenChannelError as exc:
            if h.stream is stream:
                self.lose(h, str(exc))
        finally:
            stream.close()
            await stream.wait_closed()
            self._streams.discard(stream)

    def _on_ack(self, h: Host, ack: Ack) -> None:
        w = h.workers.get(ack.worker_idx)
        if w is None:
            logger.warning("asyncsync: host %d acked unknown worker %d", h.idx, ack.worker_idx)
            return
        self.acks.connected(w.wid)  # its first answer on this connection (or a replacement process)
        self.acks.ack(w.wid, ack.version, ack.ok, ack.error, ack.stage_s, ack.commit_s)

    def _on_worker_lost(self, h: Host, msg: Lost) -> None:
        w = h.workers.get(msg.worker_idx)
        if w is None:
            return
        wid = w.wid
        if msg.exitcode is None:
            self.acks.lost(wid, "left", WorkerLeftError(wid, f"{msg.reason} (on host {h.idx})", w.applied))  # type: ignore[arg-type]
        else:
            self.acks.lost(wid, "dead", WorkerDiedError(wid, msg.exitcode, None, f"on host {h.idx}: {msg.reason}"), msg.exitcode)  # type: ignore[arg-type]
        if self.elastic:
            self.snapshots.forget(wid)

    def add_host(self, idx: int, num_workers: int) -> Host:
        """Elastic membership: host *idx* joins with *num_workers* workers."""
        h = Host(idx, num_workers)
        self.hosts[idx] = h
        for w in h.workers.values():
            self.acks.add(w.wid, w)
        return h

    def lose(self, h: Host, reason: str, state: str = "dead") -> None:
        """Host *h* is gone: name it, with each of its workers, and re-form the group."""
        if self.life.phase in ("closing", "closed"):
            h.state = "stopped"
            for w in h.workers.values():
                self.acks.stopped(w.wid)
        else:
            h.state = state
            h.reason = reason
            logger.warning("asyncsync: host %d lost: %s", h.idx, reason)
            for w in h.workers.values():
                if self.acks.records[w.wid].state not in GONE:  # one that left or died before keeps its own reason
                    self.acks.lost(w.wid, "dead", HostLostError(h.idx, w.wid, reason, h.pid))
                if self.elastic:
                    self.snapshots.forget(w.wid)
        h.stream = None
        self.regroup = True  # without it (also while a generation is forming)
        self.changed.notify()
