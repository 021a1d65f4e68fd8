"""The relay: one per remote host, between the trainer's network transfers and local workers.

A relay *is* a host's local sender whose weights come from the network: for each transfer
it reserves a free shared-memory slot of the local transport
(:meth:`~.._local._transport.LocalTransport.reserve`), receives the bytes (broadcast or point-to-point, on the
weight-sync group) straight into it, and publishes it to the host's workers through the
local path (latest wins, atomic commits, acks, the ownership ledger: all unchanged). A
receive given up while the backend still writes the slot abandons the reservation with
that writer, so the slot stays reserved until it is done. As the local transport's observer
(:meth:`~.._local._transport.LocalTransport.observe`), the relay forwards every local ack and every local worker's death
to the trainer over its control stream, so the trainer knows each remote worker by
``(host, local index)``.

If the trainer goes away (EOF, no heartbeat, a malformed frame), the relay closes its
local channels without ``Stop``: every local worker ends with :class:`SenderDiedError`
and keeps its last complete weights, and so does :meth:`Relay.wait_stopped`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from .._core._deadline import Deadline, unless
from .._core._offload import Offload
from .._core._options import DEFAULT, Timeout, resolve_timeout
from .._core._sender import Sender
from .._core._signal import Signal
from .._errors import (
    AsyncSyncError,
    AuthenticationError,
    BrokenChannelError,
    ClosedError,
    ProtocolError,
    SenderDiedError,
    SyncTimeoutError,
    WeightsError,
    WorkerDiedError,
    WorkerGoneError,
    WorkerLeftError,
)
from .._local._publisher import Reservation
from .._local._transport import LocalTransport
from .._wire._control import (
    Ack,
    Auth,
    Beat,
    Bye,
    Challenge,
    Group,
    Lost,
    Setup,
    Stop,
    ToRelay,
    Transfer,
    Welcome,
    assert_never,
    decode_to_relay,
)
from ._control import FRAME_LIMIT, ControlStream, auth_mac, new_nonce, welcome_mac
from ._dataplane import SyncGroup

__all__ = ["Relay"]

RelayState = Literal["new", "running", "stopped", "closed"]

logger = logging.getLogger("asyncsync")


class Relay:
    """Receives weights for one host and fans them out to its local workers."""

    def __init__(
        self,
        *,
        host: int,
        local: Sender[int, Any],
        landing: LocalTransport,
        open_store: Callable[[], Any],
        store_name: str,
        token: bytes | None,
        timeout: float | None,
        heartbeat: float,
        silence_timeout: float | None,
        backend: str,
        hostname: str | None,
        device: torch.device | None = None,
    ) -> None:
        self.host = host
        self.local = local
        self.landing = landing  # the local sender's transport: slots to land in, its workers' answers
        self._open_store = open_store  # blocking (a store client connects): run off the loop
        self._store_name = store_name
        self._store: Any = None
        self._token = token  # None: the trainer's, from the store
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.silence_timeout = silence_timeout
        self.backend = backend
        self._hostname = hostname
        self.device = device  # the wire's device (NCCL): transfers land through it
        self._stream: ControlStream[ToRelay] | None = None
        self._group: SyncGroup | None = None
        self._ops: asyncio.Queue[Group | Transfer | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._scratch: torch.Tensor | None = None
        self._changed = Signal()
        self._published = -1
        self._error: BaseException | None = None
        self._displaced = False
        self._leaving = False  # aclose() said Bye: the trainer closing the connection is the answer
        self._state: RelayState = "new"
        self._joining = False
        self._store_job: concurrent.futures.Future[Any] | None = None
        self.trainer: str | None = None

    @property
    def version(self) -> int:
        """Newest version landed on this host and published to its workers (-1: none)."""
        return self._published

    @property
    def error(self) -> BaseException | None:
        """Why this relay stopped, if not by the trainer's ``Stop`` (it died, or replaced this relay)."""
        return self._error

    async def connect(self, timeout: Timeout = DEFAULT) -> int:
        """Join the trainer, then wait until the first weights reached every local worker.

        Joining (the rendezvous store, the trainer's control address, the connection,
        the handshake) is bounded by *timeout* together, and so is then the wait for the
        first weights (the trainer forms the group, the local workers start); nothing
        blocks the loop; a timeout raises :class:`SyncTimeoutError` saying what
        it waited for, and ``connect()`` can be called again: it goes on from there."""
        if self._state == "closed":
            raise ClosedError(f"host {self.host}: the relay is closed")
        if self._joining:
            raise RuntimeError("connect() is already running")
        limit = resolve_timeout(timeout, self.timeout)
        deadline = Deadline(limit)
        if self._state == "new":
            self._joining = True
            try:
                await self._join(limit, deadline)
            finally:
                self._joining = False
            deadline = Deadline(limit)  # joined: the first weights have a timeout of their own
        if not await self._changed.wait_until(lambda: self._published >= 0 or self._error is not None or self._state != "running", deadline.remaining()):
            raise SyncTimeoutError(f"host {self.host} waiting for its first weights", {}, limit)
        if self._error is not None:
            raise self._error
        if self._state == "closed":
            raise ClosedError(f"host {self.host}: the relay was closed while connecting")
        await self.local.wait_async(self._published, timeout=deadline.remaining())
        return self._published

    async def _join(self, limit: float | None, deadline: Deadline) -> None:
        """Find the trainer in the store, connect, authenticate; then start the tasks."""
        self.landing.start()
        self.landing.observe(self)
        where = f"the rendezvous store at {self._store_name}"
        if self._store is None:
            if self._store_job is None or self._store_job.done() and self._store_job.exception() is not None:
                ends_by = time.monotonic() + _connect_bound(self.timeout)
                self._store_job = _STORE_CALLS.start(self._open_store, ends_by=ends_by)  # a retry waits for the same attempt
            self._store = await _wait_job(self._store_job, deadline.remaining(), f"host {self.host} connecting to {where}", limit)
        store = self._store
        if self._token is None:  # no shared token: rank 0 put one in the store
            self._token = bytes(await _store_get(store, "token", deadline.remaining(), f"host {self.host} waiting for the trainer's token in {where}", limit))
        key = "control"
        address = (await _store_get(store, key, deadline.remaining(), f"host {self.host} waiting for the trainer to publish its control address in {where}", limit)).decode()
        addr, _, port = address.rpartition(":")
        self.trainer = f"trainer at {address}"
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, int(port)), deadline.remaining())
        except (TimeoutError, asyncio.TimeoutError):
            raise SyncTimeoutError(f"host {self.host} connecting to the {self.trainer}", {}, limit) from None
        except OSError as exc:
            raise BrokenChannelError(f"host {self.host}: cannot reach the {self.trainer}: {exc}") from None
        stream = ControlStream(reader, writer, self.trainer, decode_to_relay)
        try:
            await asyncio.wait_for(self._handshake(stream), deadline.remaining())
            if self._state == "closed":
                raise ClosedError(f"host {self.host}: the relay was closed while connecting")
        except BaseException as exc:
            await stream.aclose()
            if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
                raise SyncTimeoutError(f"host {self.host} in its handshake with the {self.trainer}", {}, limit) from None
            raise
        self._stream = stream
        stream.start_heartbeat(self.heartbeat)
        self._state = "running"
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_loop(stream), name=f"asyncsync-relay-{self.host}-read"),
            loop.create_task(self._run_ops(), name=f"asyncsync-relay-{self.host}-ops"),
        ]

    async def _handshake(self, stream: ControlStream[ToRelay]) -> None:
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
                "(a wrong token; see the trainer's log)"
            ) from exc
        if not isinstance(welcome, Welcome) or not hmac.compare_digest(welcome.mac, welcome_mac(self._token, nonce)):
            raise AuthenticationError(f"host {self.host}: the {stream.peer} failed the token challenge")
        stream.limit = FRAME_LIMIT
        setup = await stream.recv()
        if isinstance(setup, Bye):  # authenticated, and refused: e.g. a host id or a worker count it does not expect
            raise ValueError(f"host {self.host}: the {stream.peer} refused this relay: {setup.reason}")
        if not isinstance(setup, Setup):
            raise ProtocolError(f"{stream.peer}: expected Setup, got {type(setup).__name__}")
        if setup.layout != self.local.layout:
            error = ValueError(
                f"host {self.host}: the trainer's weights do not fit this host's model: the wire layouts differ "
                f"({len(setup.layout.specs)} tensors, {setup.layout.nbytes} bytes vs {len(self.local.layout.specs)} tensors, "
                f"{self.local.layout.nbytes} bytes here); build the same model, with the same transfer_dtype"
            )
            with contextlib.suppress(BrokenChannelError):
                stream.send(Bye(self.host, -1, str(error)))
                await stream.drain()
            raise error
        stream.send(Beat())  # the layout fits: the trainer admits this host

    async def _read_loop(self, stream: ControlStream[ToRelay]) -> None:
        try:
            while True:
                msg = await stream.recv(timeout=self.silence_timeout)
                if isinstance(msg, (Group, Transfer)):
                    self._ops.put_nowait(msg)
                    self._changed.notify()
                elif isinstance(msg, Stop):
                    self._ops.put_nowait(None)
                    return
                elif isinstance(msg, Bye):  # the trainer dropped this connection: say why
                    logger.warning("asyncsync: host %d: the %s dropped this relay: %s", self.host, stream.peer, msg.reason)
                    if self._state == "running":
                        self._error = BrokenChannelError(f"host {self.host}: {msg.reason}; this relay stopped, keeping version {self._published}")
                        self._displaced = True
                        self._ops.put_nowait(None)
                        self._changed.notify()
                    return
                elif isinstance(msg, Beat):
                    pass
                elif isinstance(msg, (Challenge, Welcome, Setup)):
                    raise ProtocolError(f"{stream.peer}: {type(msg).__name__} after the handshake")
                else:
                    assert_never(msg)
        except BrokenChannelError as exc:  # ProtocolError included
            if isinstance(exc, ProtocolError):
                logger.warning("asyncsync: host %d: closing the control connection: %s", self.host, exc)
            # Trainer and relay agree on whether this host is there: a relay that gives up
            # on the trainer ends the connection, and the trainer declares the host lost.
            stream.close()
            if self._state == "running" and not self._leaving:
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
        nbytes = self.local.layout.nbytes
        if any(o + n > nbytes for o, n in op.ranges):
            logger.error("asyncsync: host %d: transfer of version %d names bytes beyond the %d of the layout; ignored", self.host, op.version, nbytes)
            return
        try:
            # Targets that do not have this version yet (a version may come in several
            # transfers for different workers, and a transfer repeated after a regroup).
            fresh = [i for i in op.targets if self.local.sent_version(i) < op.version]
            if not fresh:  # already landed before a regroup: consume the bytes, publish nothing
                await self._receive(op, group, self._scratch_buffer(), None)
                return
            base = op.base if op.base >= 0 else None
            try:
                async with self.landing.reserve(op.version, fresh, base_version=base) as landing:
                    if await self._receive(op, group, landing.buffer, landing):
                        landing.publish()
            except WeightsError as exc:  # a partial update this host cannot complete (not expected)
                logger.error("asyncsync: host %d: %s; the targets reject version %d", self.host, exc, op.version)
                await self._receive(op, group, self._scratch_buffer(), None)  # every member of a broadcast takes part
                for i in fresh:
                    self._forward_ack(i, Ack(i, op.version, False, f"host {self.host}: {exc}", None, 0.0, 0.0))
                return
            if landing.published:
                self._published = op.version
                self._changed.notify()
        except BrokenChannelError as exc:
            logger.warning("asyncsync: host %d: transfer of version %d failed (%s); waiting for the group to re-form", self.host, op.version, exc)
        except ClosedError:
            pass
        except Exception:  # e.g. CapacityError under a max_slots cap: this transfer is lost, the relay goes on
            logger.exception("asyncsync: host %d: landing version %d failed; the trainer will time out waiting for its acks", self.host, op.version)

    async def _receive(self, op: Transfer, group: SyncGroup, whole: torch.Tensor, landing: Reservation | None) -> bool:
        """Receive *op* into *whole* (or, for a partial update, into its changed byte
        ranges); True once it is complete. Gives up (False), leaving the receive to the
        backend, as soon as the trainer announces a new group: a peer died mid-transfer,
        and this receive may never complete (gloo cannot abort it; it ends at the group's
        timeout). Whenever the backend may still write *whole* after this returns or raises,
        *landing* is abandoned with that writer, so its slot stays reserved until it is done."""
        buf: torch.Tensor | list[torch.Tensor] = [whole[o : o + n] for o, n in op.ranges] if op.ranges else whole
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def release() -> None:
            if not released.done():
                released.set_result(None)

        def left_writing(why: str) -> bool:
            if landing is not None:
                landing.abandon(still_writing=released)
            logger.warning("asyncsync: host %d: transfer of version %d %s; waiting for the group to re-form", self.host, op.version, why)
            return False

        receive = group.recv(buf, 0, op.tag, release) if op.p2p else group.broadcast(buf, 0, release)
        task = asyncio.ensure_future(receive)
        announced = asyncio.ensure_future(self._changed.wait_until(self._group_announced, None))
        try:
            await asyncio.wait({task, announced}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (the relay closes): the backend may still write buf
            if not task.done():
                task.cancel()
                if landing is not None:
                    landing.abandon(still_writing=released)
            raise
        finally:
            announced.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            return left_writing("abandoned: the trainer re-forms the group")
        failed = task.exception()
        if failed is not None and not released.done():
            # Failed on this side (a timeout) while the backend still writes buf.
            return left_writing(f"failed ({failed})")
        task.result()
        return True

    def _scratch_buffer(self) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(self.local.layout.nbytes, dtype=torch.uint8)
        return self._scratch

    async def _finish(self) -> None:
        """The trainer said Stop (stop the workers) or died (leave them with SenderDiedError).
        A relay the trainer replaced stops its workers (nothing died)."""
        died = self._error is not None
        await self.landing.aclose(_CLOSE_S, stop=not died or self._displaced)
        if not died and self._stream is not None:
            try:
                self._stream.send(Bye(self.host, self._published, "stopped by the trainer"))
                await asyncio.wait_for(self._stream.drain(), 2.0)
            except (BrokenChannelError, asyncio.TimeoutError, TimeoutError):
                pass
        self._state = "stopped"
        self._changed.notify()

    # The local sender's observer (see SenderObserver): forwarded to the trainer as they come.

    def worker_answered(self, worker_idx: int, ack: Ack) -> None:
        self._forward_ack(worker_idx, ack)

    def worker_lost(self, worker_idx: int, death: WorkerGoneError) -> None:
        if self._stream is None:
            return
        if isinstance(death, WorkerLeftError):
            msg = Lost(worker_idx, None, death.reason or "left")
        else:
            code = death.exitcode if isinstance(death, WorkerDiedError) else None
            msg = Lost(worker_idx, code if code is not None else -1, str(death))
        try:
            self._stream.send(msg)
        except BrokenChannelError:
            pass

    def _forward_ack(self, idx: int, ack: Ack) -> None:
        if self._stream is not None:
            try:
                self._stream.send(Ack(idx, ack.version, ack.ok, ack.error, None, ack.stage_s, ack.commit_s))
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
            self._leaving = True
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
        await self.landing.aclose(_CLOSE_S, stop=stop)
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None
        group, self._group = self._group, None
        self._store = self._store_job = None  # the job holds the store client too: its socket closes now
        if group is not None and not keep_group:
            group.close()
            group = None
        return group


_CLOSE_S = 10.0  # how long closing waits for the local workers to end


_EXIT_GRACE = 3.0  # seconds the interpreter's exit may wait for a store call to end
_POLL_FIRST, _POLL_MAX = 0.005, 0.1  # seconds between two looks for a key in the store


class _StoreCalls:
    """Blocking calls into the rendezvous store, each on a daemon thread of its own (one
    may block past any deadline: a client connecting to a listener that never answers).

    torch aborts the process (SIGABRT) when a store call returns while the interpreter
    finalizes, so none may be running then. A stoppable call (given *stop*: a wait for a
    key, which polls) ends once its caller leaves, or the interpreter exits; at exit, the
    interpreter waits for those, and for the calls that end within :data:`_EXIT_GRACE`
    seconds by their own timeout (*ends_by*). One that ends later (or never: a client
    whose listener never answers) still runs when the process is gone.
    """

    def __init__(self) -> None:
        self._offload = Offload("asyncsync-blocking-call", daemon=True)
        self._lock = threading.Lock()
        self._running: dict[object, tuple[threading.Thread, threading.Event | None, float | None]] = {}
        self._exiting = False
        atexit.register(self._at_exit)
        os.register_at_fork(after_in_child=self._forget_all)  # (the threads stay with the parent)

    def start(self, fn: Callable[..., Any], *args: Any, stop: threading.Event | None = None, ends_by: float | None = None) -> concurrent.futures.Future[Any]:
        """``fn(*args)`` on a thread of its own: it watches *stop* and returns soon once
        it is set, or else returns by *ends_by* (``time.monotonic()``) if known."""
        token = object()

        def call() -> Any:
            with self._lock:
                if self._exiting:
                    raise ClosedError("the interpreter is exiting")
                self._running[token] = (threading.current_thread(), stop, ends_by)
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self._running.pop(token, None)

        return self._offload.start(call)

    async def wait(self, job: concurrent.futures.Future[Any], timeout: float | None, what: str) -> Any:
        return await self._offload.wait(job, timeout=timeout, what=what)

    def _at_exit(self) -> None:
        with self._lock:
            self._exiting = True
            running = list(self._running.values())
        now = time.monotonic()
        deadline = now + _EXIT_GRACE
        for _thread, stop, _ends_by in running:
            if stop is not None:
                stop.set()
        for thread, stop, ends_by in running:
            if stop is not None or (ends_by is not None and ends_by <= deadline):
                thread.join(max(deadline - time.monotonic(), 0.0))

    def _forget_all(self) -> None:
        self._lock = threading.Lock()
        self._running = {}


# The store client connects with the scheme's timeout (300 s without one), retrying at
# most twice that long.
def _connect_bound(timeout: float | None) -> float:
    return 2.0 * (timeout if timeout is not None else 300.0) + 1.0


_STORE_CALLS = _StoreCalls()


async def _wait_job(job: concurrent.futures.Future[Any], remaining: float | None, what: str, limit: float | None) -> Any:
    try:
        return await _STORE_CALLS.wait(job, remaining, what)
    except SyncTimeoutError:
        raise SyncTimeoutError(what, {}, limit) from None
    except AsyncSyncError:
        raise
    except Exception as exc:  # the store's own error (refused, timed out)
        raise BrokenChannelError(f"{what}: {exc}") from None


async def _store_get(store: Any, key: str, remaining: float | None, what: str, limit: float | None) -> bytes:
    """``store.get(key)`` once *key* is set, waiting at most *remaining* seconds, off the
    loop. The thread looks for the key every few milliseconds and ends once this call
    does (returned, timed out or cancelled): no wait is left behind in the store."""
    stop = threading.Event()
    end = None if remaining is None else time.monotonic() + remaining

    def get() -> bytes:
        pause = _POLL_FIRST
        while not store.check([key]):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise SyncTimeoutError(what, {}, limit)
            if stop.wait(pause if left is None else min(pause, left)):
                raise ClosedError(f"{what}: given up")  # (nobody waits for it any more)
            pause = min(pause * 2, _POLL_MAX)
        return bytes(store.get(key))

    try:
        job = _STORE_CALLS.start(get, stop=stop)
        return await _wait_job(job, None if remaining is None else remaining + 1.0, what, limit)  # type: ignore[no-any-return]
    finally:
        stop.set()
