"""The relay: one per remote host, between the trainer's network transfers and local workers.

A relay *is* a local :class:`~._scheme.MultiProcessWeightSyncScheme` sender whose weights
come from the network: each transfer is received (broadcast or point-to-point, on the
weight-sync group) straight into a free shared-memory slot of that local sender, which
then publishes it to the host's workers through the local path (latest wins, atomic
commits, acks, the ownership ledger: all unchanged). The relay forwards every local ack
and every local worker's death to the trainer over its control stream, so the trainer
knows each remote worker by ``(host, local index)``.

If the trainer goes away (EOF, no heartbeat, a malformed frame), the relay closes its
local channels without ``Stop``: every local worker ends with :class:`SenderDiedError`
and keeps its last complete weights, and so does :meth:`Relay.wait_stopped`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ._control import FRAME_LIMIT, ControlStream, auth_mac, new_nonce, welcome_mac
from ._dataplane import SyncGroup
from ._dist_sender import unless
from ._errors import (
    AuthenticationError,
    BrokenChannelError,
    ClosedError,
    ProtocolError,
    SenderDiedError,
    SyncTimeoutError,
    WeightsError,
    WorkerDiedError,
    WorkerLeftError,
)
from ._options import DEFAULT, Timeout, resolve_timeout
from ._protocol import Ack, Auth, Beat, Bye, Challenge, Group, Lost, Setup, Stop, Transfer, Welcome
from ._sender import Sender, StillWriting
from ._signal import Signal

__all__ = ["Relay"]

logger = logging.getLogger("asyncsync")


class Relay:
    """Receives weights for one host and fans them out to its local workers."""

    def __init__(
        self,
        *,
        host: int,
        local: Sender,
        store: Any,
        token: bytes,
        timeout: float | None,
        heartbeat: float,
        silence_timeout: float | None,
        backend: str,
        hostname: str | None,
        device: torch.device | None = None,
    ) -> None:
        self.host = host
        self.local = local
        self._store = store
        self._token = token
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.silence_timeout = silence_timeout
        self.backend = backend
        self._hostname = hostname
        self.device = device  # the wire's device (NCCL): transfers land through it
        self._stream: ControlStream | None = None
        self._group: SyncGroup | None = None
        self._ops: asyncio.Queue[Group | Transfer | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._scratch: torch.Tensor | None = None
        self._changed = Signal()
        self._published = -1
        self._error: BaseException | None = None
        self._state = "new"
        self.trainer: str | None = None

    @property
    def version(self) -> int:
        """Newest version landed on this host and published to its workers (-1: none)."""
        return self._published

    async def connect(self, timeout: Timeout = DEFAULT) -> int:
        """Join the trainer, then wait until the first weights reached every local worker."""
        if self._state != "new":
            raise RuntimeError("connect() was already called")
        self._state = "running"
        limit = resolve_timeout(timeout, self.timeout)
        self.local.start()
        self.local.on_ack = self._forward_ack
        self.local.on_lost = self._forward_lost
        address = (await _off_loop(self._store.get, "control")).decode()  # waits for the trainer (store timeout)
        addr, _, port = address.rpartition(":")
        self.trainer = f"trainer at {address}"
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, int(port)), limit)
        except OSError as exc:
            raise BrokenChannelError(f"host {self.host}: cannot reach the {self.trainer}: {exc}") from None
        stream = ControlStream(reader, writer, self.trainer)
        self._stream = stream
        try:
            await asyncio.wait_for(self._handshake(stream), limit)
        except BaseException:
            await stream.aclose()
            self._stream = None
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_loop(stream), name=f"asyncsync-relay-{self.host}-read"),
            loop.create_task(self._run_ops(), name=f"asyncsync-relay-{self.host}-ops"),
            loop.create_task(stream.heartbeat(self.heartbeat), name=f"asyncsync-relay-{self.host}-beat"),
        ]
        if not await self._changed.wait_until(lambda: self._published >= 0 or self._error is not None or self._state != "running", limit):
            raise SyncTimeoutError(f"host {self.host} waiting for its first weights", {}, limit)
        if self._error is not None:
            raise self._error
        await self.local.wait_async(self._published, timeout=limit)
        return self._published

    async def _handshake(self, stream: ControlStream) -> None:
        try:
            challenge = await stream.recv()
            if not isinstance(challenge, Challenge):
                raise ProtocolError(f"{stream.peer}: expected Challenge, got {type(challenge).__name__}")
            nonce = new_nonce()
            n = len(self.local.worker_ids)
            stream.send(Auth(self.host, n, os.getpid(), nonce, auth_mac(self._token, challenge.nonce, self.host, n)))
            welcome = await stream.recv()
        except BrokenChannelError as exc:
            if isinstance(exc, ProtocolError):
                raise
            raise AuthenticationError(
                f"host {self.host}: the {stream.peer} closed the connection during the handshake "
                "(a wrong token, or a host id or worker count it does not expect; see the trainer's log)"
            ) from exc
        if not isinstance(welcome, Welcome) or not hmac.compare_digest(welcome.mac, welcome_mac(self._token, nonce)):
            raise AuthenticationError(f"host {self.host}: the {stream.peer} failed the token challenge")
        stream.limit = FRAME_LIMIT
        setup = await stream.recv()
        if not isinstance(setup, Setup):
            raise ProtocolError(f"{stream.peer}: expected Setup, got {type(setup).__name__}")
        if setup.layout != self.local.layout:
            raise ValueError(
                f"host {self.host}: the trainer's weights do not fit this host's model: the wire layouts differ "
                f"({len(setup.layout.specs)} tensors, {setup.layout.nbytes} bytes vs {len(self.local.layout.specs)} tensors, "
                f"{self.local.layout.nbytes} bytes here); build the same model, with the same transfer_dtype"
            )

    async def _read_loop(self, stream: ControlStream) -> None:
        try:
            while True:
                msg = await stream.recv(timeout=self.silence_timeout)
                if isinstance(msg, (Group, Transfer)):
                    self._ops.put_nowait(msg)
                    self._changed.notify()
                elif isinstance(msg, Stop):
                    self._ops.put_nowait(None)
                    return
                elif isinstance(msg, Beat):
                    pass
                else:
                    raise ProtocolError(f"{stream.peer}: {type(msg).__name__} is not something a trainer sends")
        except BrokenChannelError as exc:  # ProtocolError included
            if isinstance(exc, ProtocolError):
                logger.warning("asyncsync: host %d: closing the control connection: %s", self.host, exc)
            if self._state == "running":
                self._error = SenderDiedError(f"host {self.host}: the trainer is gone ({exc}); keeping version {self._published}")
                self._ops.put_nowait(None)
                self._changed.notify()

    async def _run_ops(self) -> None:
        while True:
            op = await self._ops.get()
            if op is None:
                break
            if isinstance(op, Group):
                await self._form(op)
            else:
                await self._land(op)
        await self._finish()

    async def _form(self, op: Group) -> None:
        if self._group is not None:
            self._group.close(background=True)  # its connections close: a peer blocked in it gets an error
            self._group = None
        queued = self._ops._queue  # type: ignore[attr-defined]
        if queued and isinstance(queued[0], Group):
            return  # superseded before any transfer used it: the trainer dropped it already
        create = SyncGroup.create(
            self._store,
            op.generation,
            op.rank,
            op.size,
            timeout=self.timeout if self.timeout is not None else 300.0,
            chunk_bytes=op.chunk_bytes,
            backend=self.backend,
            hostname=self._hostname,
            device=self.device,
        )
        try:
            # The trainer gives up on a generation whose members changed: so does the relay,
            # as soon as the next generation is announced.
            self._group = await unless(create, self._changed.wait_until(self._group_announced, None))
            logger.info(
                "asyncsync: host %d: weight-sync group generation %d %s", self.host, op.generation, "formed" if self._group else "abandoned"
            )
        except Exception as exc:
            logger.warning("asyncsync: host %d: weight-sync group generation %d failed to form: %r", self.host, op.generation, exc)

    def _group_announced(self) -> bool:
        return any(isinstance(op, Group) for op in self._ops._queue)  # type: ignore[attr-defined]

    async def _land(self, op: Transfer) -> None:
        group = self._group
        if group is None or group.generation != op.generation:
            logger.warning("asyncsync: host %d: transfer of version %d on generation %d, which this host is not part of", self.host, op.version, op.generation)
            return

        async def fill(whole: torch.Tensor) -> None:
            """Receive into *whole* (or, for a partial update, into its changed byte ranges);
            give up (leaving the receive to the backend) as soon as the trainer announces a
            new group: a peer died mid-transfer, and this receive may never complete (gloo
            cannot abort it; it ends at the group's timeout)."""
            buf: torch.Tensor | list[torch.Tensor] = [whole[o : o + n] for o, n in op.ranges] if op.ranges else whole
            loop = asyncio.get_running_loop()
            released: asyncio.Future[None] = loop.create_future()

            def release() -> None:
                if not released.done():
                    released.set_result(None)

            receive = group.recv(buf, 0, op.tag, release) if op.p2p else group.broadcast(buf, 0, release)
            task = asyncio.ensure_future(receive)
            announced = asyncio.ensure_future(self._changed.wait_until(self._group_announced, None))
            try:
                await asyncio.wait({task, announced}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException as exc:  # cancelled (the relay closes): the backend may still write buf
                if not task.done():
                    task.cancel()
                    exc.still_writing = released  # type: ignore[attr-defined]  # publish_filled keeps the slot mapped
                raise
            finally:
                announced.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
                raise StillWriting(f"transfer of version {op.version} abandoned: the trainer re-forms the group", released)
            if task.exception() is not None and not released.done():
                # Failed on this side (a timeout) while the backend still writes buf: the
                # slot must stay reserved and mapped until it is done.
                raise StillWriting(f"transfer of version {op.version} failed: {task.exception()}", released)
            task.result()

        nbytes = self.local.layout.nbytes
        if any(o + n > nbytes for o, n in op.ranges):
            logger.error("asyncsync: host %d: transfer of version %d names bytes beyond the %d of the layout; ignored", self.host, op.version, nbytes)
            return
        try:
            # Targets that do not have this version yet (a version may come in several
            # transfers for different workers, and a transfer repeated after a regroup).
            fresh = [i for i in op.targets if self.local.sent_version(i) < op.version]
            if fresh:
                base = op.base if op.base >= 0 else None
                try:
                    await self.local.publish_filled(fill, op.version, fresh, base_version=base)
                except WeightsError as exc:  # a partial update this host cannot complete (not expected)
                    logger.error("asyncsync: host %d: %s; the targets reject version %d", self.host, exc, op.version)
                    await fill(self._scratch_buffer())  # every member of a broadcast takes part
                    for i in fresh:
                        self._forward_ack(i, Ack(i, op.version, False, f"host {self.host}: {exc}", None, 0.0, 0.0))
                    return
                self._published = op.version
                self._changed.notify()
            else:  # already landed before a regroup: consume the bytes, publish nothing
                await fill(self._scratch_buffer())
        except (BrokenChannelError, StillWriting) as exc:
            logger.warning("asyncsync: host %d: transfer of version %d failed (%s); waiting for the group to re-form", self.host, op.version, exc)
        except ClosedError:
            pass
        except Exception:  # e.g. CapacityError under a max_slots cap: this transfer is lost, the relay goes on
            logger.exception("asyncsync: host %d: landing version %d failed; the trainer will time out waiting for its acks", self.host, op.version)

    def _scratch_buffer(self) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(self.local.layout.nbytes, dtype=torch.uint8)
        return self._scratch

    async def _finish(self) -> None:
        """The trainer said Stop (stop the workers) or died (leave them with SenderDiedError)."""
        died = self._error is not None
        await self.local.aclose(stop=not died)
        if not died and self._stream is not None:
            try:
                self._stream.send(Bye(self.host, self._published, "stopped by the trainer"))
                await asyncio.wait_for(self._stream.drain(), 2.0)
            except (BrokenChannelError, asyncio.TimeoutError, TimeoutError):
                pass
        self._state = "stopped"
        self._changed.notify()

    def _forward_ack(self, idx: int, ack: Ack) -> None:
        if self._stream is not None:
            try:
                self._stream.send(Ack(idx, ack.version, ack.ok, ack.error, None, ack.stage_s, ack.commit_s))
            except BrokenChannelError:
                pass

    def _forward_lost(self, idx: int, death: WorkerDiedError) -> None:
        if self._stream is None:
            return
        if isinstance(death, WorkerLeftError):
            msg = Lost(idx, None, death.reason or "left")
        else:
            msg = Lost(idx, death.exitcode if death.exitcode is not None else -1, str(death))
        try:
            self._stream.send(msg)
        except BrokenChannelError:
            pass

    async def _crash(self, hang: bool = False) -> SyncGroup | None:
        """What a killed relay process leaves behind, in this process (a test's fault): the
        control connection ends without ``Bye``, the local workers lose their sender
        without ``Stop`` (:class:`SenderDiedError`, last weights kept), and the group is
        dropped (a receive still running in it ends in the backend). With *hang*, the
        group stays open and receives nothing more, as a hung host's would: it is
        returned, for the test to close."""
        if self._state == "closed":
            return None
        if self._stream is not None:
            self._stream.close()
        return await self._release(stop=False, keep_group=hang)

    async def wait_stopped(self) -> None:
        """Until the trainer stops this host; raises :class:`SenderDiedError` if it died."""
        await self._changed.wait_until(lambda: self._state != "running", None)
        if self._error is not None:
            raise self._error

    def statistics(self) -> Any:
        return self.local.statistics()

    async def aclose(self) -> None:
        """Leave: say goodbye to the trainer, stop the local workers, release everything."""
        if self._state == "closed":
            return
        if self._state == "running" and self._stream is not None:
            try:
                self._stream.send(Bye(self.host, self._published, "the relay closed"))
                await asyncio.wait_for(self._stream.drain(), 2.0)
            except (BrokenChannelError, asyncio.TimeoutError, TimeoutError):
                pass
        await self._release(stop=True)

    async def _release(self, stop: bool, keep_group: bool = False) -> SyncGroup | None:
        """Close: end the tasks, the local sender (*stop*: its workers get ``Stop``, else
        they see their sender gone), the control stream and the group (unless *keep_group*:
        then it is returned, open)."""
        self._state = "closed"
        self._changed.notify()
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.local.aclose(stop=stop)
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None
        group, self._group = self._group, None
        self._store = None
        if group is not None and not keep_group:
            group.close()
            group = None
        return group


async def _off_loop(fn: Any, *args: Any) -> Any:
    """*fn(*args)* in a thread of its own, joined before returning (no thread outlives it)."""
    with ThreadPoolExecutor(1, thread_name_prefix="asyncsync-store") as ex:
        fut = asyncio.get_running_loop().run_in_executor(ex, fn, *args)
        return await asyncio.shield(fut)
