"""The exception hierarchy of asyncsync.

::

    AsyncSyncError
    ├── ClosedError            you closed it (call after ``aclose()``)
    ├── WouldBlock             a ``*_nowait`` call found nothing to do
    ├── BrokenChannelError     the peer's end of a channel vanished
    │   ├── WorkerGoneError    a worker is gone (sender side): catch this for all three
    │   │   ├── WorkerDiedError    its process died, or the sender cut it off
    │   │   ├── WorkerLeftError    its receiver ended cleanly while the process lives on
    │   │   └── HostLostError      its remote host (the relay) is gone, with its workers
    │   ├── SenderDiedError    the trainer died (worker or relay side)
    │   ├── ProtocolError      a peer sent a malformed control message
    │   └── AuthenticationError    a control-plane peer failed the token challenge
    ├── WeightsError           bad weights given to ``send`` (also ``ValueError``)
    ├── WorkerError            a worker rejected a payload; it kept its old weights
    ├── WorkerProcessError     a worker function started by ``spawn_workers`` raised
    ├── CapacityError          no shared-memory slot can be freed under ``max_slots``
    └── SyncTimeoutError       a wait ran out of time (also ``TimeoutError``)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AsyncSyncError",
    "AuthenticationError",
    "HostLostError",
    "BrokenChannelError",
    "CapacityError",
    "ClosedError",
    "ProtocolError",
    "SenderDiedError",
    "SyncTimeoutError",
    "WeightsError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGoneError",
    "WorkerLeftError",
    "WorkerProcessError",
    "WouldBlock",
]


class AsyncSyncError(Exception):
    """Base class of every error raised by asyncsync.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=0.1)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        try:
            async with scheme:                 # no worker process was started
                ...
        except AsyncSyncError as e:            # anything asyncsync raises
            print(type(e).__name__)            # SyncTimeoutError
    """


class ClosedError(AsyncSyncError):
    """The object was closed by its owner (``aclose()`` or ``stop``) and cannot be used.

    Example::

        scheme = MultiProcessWeightSyncScheme()
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        await scheme.aclose()                  # idempotent; using the scheme after it is not
        try:
            await scheme.send()
        except ClosedError as e:
            print(e)                           # the sender is closed
    """


class WouldBlock(AsyncSyncError):
    """A ``*_nowait`` call would have had to wait.

    Example::

        import multiprocessing as mp

        ours, theirs = mp.get_context("spawn").Pipe()
        queue = AsyncQueue(ours)
        try:
            queue.get_nowait()                 # nothing has arrived yet
        except WouldBlock:
            print("nothing yet")
        theirs.send("hello")
        print(await queue.get(timeout=5))      # hello
        await queue.aclose()
        theirs.close()
    """


class BrokenChannelError(AsyncSyncError):
    """The other end of a channel went away (process died or closed its end).

    Example::

        import multiprocessing as mp

        ours, theirs = mp.get_context("spawn").Pipe()
        queue = AsyncQueue(ours)
        theirs.send("last words")
        theirs.close()                         # the peer goes away
        print(await queue.get(timeout=5))      # last words: complete messages still arrive
        try:
            await queue.get(timeout=5)
        except BrokenChannelError:
            print("peer gone")
        await queue.aclose()
    """


class WorkerGoneError(BrokenChannelError):
    """A worker is gone: its process died, it left, or its host was lost.

    ``worker_idx`` names the worker, ``pid`` its process id when known, ``reason`` why it
    is gone when known. ``applied_by``: raised by ``send``, ``wait_async`` or ``connect``,
    the targets of that call that applied its version (a tuple of worker ids, in target
    order; the message names them too). A worker that is gone never keeps the others
    from a version: the call raises once every other target answered (or at its timeout,
    naming the silent ones). None when it comes from elsewhere (``wait_joined``, a restart).

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=2)
        workers = [loopback_worker(scheme, i) for i in range(2)]
        for i, worker in enumerate(workers):
            worker.init_on_receiver(worker_idx=i, model=make_policy())
        await asyncio.gather(scheme.connect(), *(w.connect() for w in workers))
        await workers[0].aclose()              # worker 0 leaves
        try:
            await scheme.send()
        except WorkerGoneError as e:           # died, left or host lost: all three
            print(type(e).__name__, e.applied_by)   # WorkerLeftError (1,)
        await scheme.aclose()
        await workers[1].aclose()
    """

    applied_by: tuple[Any, ...] | None = None

    def __init__(self, worker_idx: Any, message: str, *, pid: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.worker_idx = worker_idx
        self.pid = pid
        self.reason = reason

    def _sent_state(self) -> dict[str, Any]:
        """What a pickled copy keeps beyond the arguments: ``applied_by``, and the message naming them."""
        return {"applied_by": self.applied_by, "args": self.args}


class WorkerDiedError(WorkerGoneError):
    """A worker process died or dropped its channel.

    ``exitcode`` is its exit status when known (negative: killed by that signal);
    ``reason`` is set when the sender cut the channel itself (the worker sent a malformed
    message). See :class:`WorkerGoneError` for ``worker_idx``, ``pid`` and ``applied_by``.

    Example::

        import multiprocessing as mp
        import time

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        # A worker process started by hand (spawn_workers(..., scheme=) does this for you):
        process = mp.get_context("spawn").Process(target=time.sleep, args=(60,))
        process.start()
        scheme.watch_process(0, process)       # its death is noticed through its sentinel
        process.kill()
        try:
            await scheme.connect()
        except WorkerDiedError as e:
            print(e.worker_idx, e.exitcode)    # 0 -9
        await scheme.aclose()
        process.join()
    """

    def __init__(self, worker_idx: Any, exitcode: int | None = None, pid: int | None = None, reason: str | None = None) -> None:
        self.exitcode = exitcode
        code = "unknown" if exitcode is None else str(exitcode)
        who = f"worker {worker_idx}" + (f" (pid {pid})" if pid else "")
        super().__init__(worker_idx, f"{who} died, exit code {code}" if reason is None else f"{who} was cut off: {reason}", pid=pid, reason=reason)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.worker_idx, self.exitcode, self.pid, self.reason), self._sent_state())


class WorkerLeftError(WorkerGoneError):
    """A worker's receiver ended (``aclose()``, a crash of its task) while its process lives on.

    ``reason`` says why; the worker kept its last weights (detached from shared memory).

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        await asyncio.gather(scheme.connect(), worker.connect())
        await worker.aclose()                  # the worker stops receiving, keeps version 0
        try:
            await scheme.send()
        except WorkerLeftError as e:
            print(e.worker_idx, e.version, e.reason)   # 0 0 the worker closed its receiver
        await scheme.aclose()
    """

    def __init__(self, worker_idx: Any, reason: str, version: int = -1, pid: int | None = None) -> None:
        self.version = version
        who = f"worker {worker_idx}" + (f" (pid {pid})" if pid else "")
        super().__init__(worker_idx, f"{who} left at version {version}: {reason}", pid=pid, reason=reason)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.worker_idx, self.reason, self.version, self.pid), self._sent_state())


class HostLostError(WorkerGoneError):
    """A remote host's relay died, left or went silent: every worker of that host is gone.

    ``host`` names the host, ``worker_idx`` the ``(host, local index)`` of the worker a
    wait was about, ``reason`` what the trainer saw (EOF, no heartbeat, a bad frame).

    Example::

        from asyncsync.testing import open_loopback_hosts

        async with open_loopback_hosts(make_policy(), make_policy, hosts={1: 1}, timeout=10) as lh:
            await lh.hosts[1].aclose()                  # host 1 leaves (or dies)
            try:
                await lh.trainer.send()
            except HostLostError as exc:
                print(exc.host, exc.worker_idx)         # 1 (1, 0)
    """

    def __init__(self, host: int, worker_idx: object, reason: str, pid: int | None = None) -> None:
        self.host = host
        relay = f"relay pid {pid}" if pid else "relay"
        super().__init__(worker_idx, f"host {host} ({relay}) is lost, and with it worker {worker_idx}: {reason}", pid=pid, reason=reason)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.host, self.worker_idx, self.reason, self.pid), self._sent_state())


class AuthenticationError(BrokenChannelError):
    """A control-plane peer did not prove it knows the shared token (or spoke no protocol).

    Example::

        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        common = dict(timeout=10, world_size=2, master_addr="127.0.0.1", master_port=port)
        trainer = DistributedWeightSyncScheme(rank=0, token="s3cret", **common)
        trainer.init_on_sender(model=make_policy(), hosts={1: 1})
        await trainer.listen()                         # listening; no host yet
        host = DistributedWeightSyncScheme(rank=1, token="guess", **common)
        host.init_on_relay(model=make_policy(), num_workers=1)
        try:
            await host.connect()
        except AuthenticationError as exc:
            print("refused:", exc)   # refused: host 1: the trainer at ... closed the connection during the handshake ...
        await host.aclose()
        await trainer.aclose()
    """


class CapacityError(AsyncSyncError):
    """A send needs a free shared-memory slot, ``max_slots`` allows no more, and no
    outstanding answer can free one (raise ``max_slots`` or leave it at its default).

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10, max_slots=2)
        scheme.init_on_sender(model=make_policy(), num_workers=2)
        workers = [loopback_worker(scheme, i) for i in range(2)]
        for i, worker in enumerate(workers):
            worker.init_on_receiver(worker_idx=i, model=make_policy())
        await asyncio.gather(scheme.connect(), *(w.connect() for w in workers))
        await scheme.send(worker_ids=[0])      # workers 0 and 1 now live on two slots
        try:
            await scheme.send()                # needs a third; no answer could free one
        except CapacityError as e:
            print(e)                           # no free shared-memory slot among max_slots=2 ...
        await scheme.aclose()
        for worker in workers:
            await worker.aclose()
    """


class SenderDiedError(BrokenChannelError):
    """The sender (trainer) went away; the worker keeps its last complete weights.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        connecting = asyncio.ensure_future(worker.connect())  # says hello, waits for weights
        await asyncio.sleep(0)
        await scheme.aclose()                  # the trainer goes before sending anything
        try:
            await connecting                   # (or later: await worker.wait_stopped())
        except SenderDiedError as e:
            print(e)                           # worker 0: the sender is gone (...); keeping version -1
        await worker.aclose()
    """


class ProtocolError(BrokenChannelError):
    """A peer sent a control message that does not decode (bad header, field or layout).

    The message names the message type and the field. The channel is out of step with its
    peer from then on: the side that gets it closes the channel.

    Example::

        import multiprocessing
        sender_end, worker_end = multiprocessing.Pipe()
        receiver = Receiver(worker_end, worker_idx=0, model=make_policy(), strategy="tensordict", context=None,
                            on_update=None, commit="swap", commit_mode="auto", timeout=10)
        # Something that is not an asyncsync sender writes on the worker's channel:
        sender_end.send_bytes(b"not an asyncsync message")
        try:
            await receiver.connect()
        except ProtocolError as e:             # the receiver closed the channel
            print(e)                           # worker 0: the sender sent a malformed message (frame: ...)
        await receiver.aclose()
    """


class WeightsError(AsyncSyncError, ValueError):
    """Weights given to the sender do not fit: keys, shapes, dtypes, devices or values.

    Raised before anything is sent; the version counter does not move.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        await asyncio.gather(scheme.connect(), worker.connect())
        try:
            await scheme.send({"0.weight": torch.zeros(3, 3)}, partial=True)
        except WeightsError as e:              # also a ValueError
            print(e)                           # names the key, the shape sent and the one expected
        print(scheme.version)                  # 0
        await scheme.aclose()
        await worker.aclose()
    """


class WorkerError(AsyncSyncError):
    """A worker rejected an update and kept its previous weights.

    ``worker_idx`` and ``version`` say which worker refused which version;
    ``message`` is the worker's own explanation.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        worker = loopback_worker(scheme, 0)
        other = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))  # does not fit
        worker.init_on_receiver(worker_idx=0, model=other)
        connecting = asyncio.ensure_future(worker.connect())
        try:
            await scheme.connect()
        except WorkerError as e:
            print(e.worker_idx, e.version)     # 0 0
            print(e.message)                   # payload does not fit the model: '0.weight': sent shape (8, 4), model has (16, 4); ...
        await connecting                       # the worker keeps its own weights and goes on
        await scheme.aclose()
        await worker.aclose()
    """

    def __init__(self, worker_idx: int, version: int, message: str) -> None:
        self.worker_idx = worker_idx
        self.version = version
        self.message = message
        super().__init__(f"worker {worker_idx} rejected version {version}: {message}")

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.worker_idx, self.version, self.message))


class WorkerProcessError(AsyncSyncError):
    """A worker function started by :func:`spawn_workers` raised or the process crashed.

    The original exception, when it could be pickled, is the ``__cause__``;
    ``remote_traceback`` holds the child's formatted traceback.

    Example (a script: spawned workers import their function from it)::

        import asyncio

        from asyncsync import WorkerProcessError, spawn_workers


        async def worker(worker_idx: int) -> None:
            raise ValueError(f"worker {worker_idx}: no such environment")


        async def main() -> None:
            try:
                async with spawn_workers(worker, 1):
                    pass
            except WorkerProcessError as e:
                print(e.worker_idx, repr(e.__cause__))  # 0 ValueError('worker 0: no such environment')


        if __name__ == "__main__":
            asyncio.run(main())
    """

    def __init__(self, worker_idx: int, message: str, remote_traceback: str = "") -> None:
        self.worker_idx = worker_idx
        self.remote_traceback = remote_traceback
        super().__init__(f"worker {worker_idx}: {message}")


class SyncTimeoutError(AsyncSyncError, TimeoutError):
    """A wait for acknowledgements ran out of time.

    ``pending`` maps each worker that did not answer to the last version it applied;
    ``never_connected`` holds those of them that never said hello (their receiver was
    never connected), each with the pid of its process when the sender watches one.

    Example::

        scheme = MultiProcessWeightSyncScheme()
        scheme.init_on_sender(model=make_policy(), num_workers=2)
        try:
            await scheme.connect(timeout=0.1)  # no worker process was started
        except SyncTimeoutError as e:          # also a TimeoutError
            print(e.pending)                   # {0: -1, 1: -1}
            print(e)                           # connect timed out after 0.1 s; no answer from worker 0 (at version -1), ...
        await scheme.aclose()
    """

    def __init__(
        self,
        what: str,
        pending: Mapping[int, int],
        timeout: float | None,
        *,
        never_connected: Mapping[int, int | None] | None = None,
        hint: str = "",
    ) -> None:
        self.what = what
        self.pending = dict(pending)
        self.timeout = timeout
        self.never_connected = dict(never_connected or {})
        self.hint = hint
        detail = ", ".join(f"worker {w} (at version {v})" for w, v in sorted(self.pending.items()))
        message = f"{what} timed out after {format_seconds(timeout)}"
        if detail:
            message += f"; no answer from {detail}"
        super().__init__(message + _never_connected_hint(self.never_connected) + (f". {hint}" if hint else ""))

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild_timeout, (self.what, self.pending, self.timeout, self.never_connected, self.hint))


def _rebuild_timeout(
    what: str, pending: Mapping[int, int], timeout: float | None, never: Mapping[int, int | None], hint: str = ""
) -> SyncTimeoutError:
    return SyncTimeoutError(what, pending, timeout, never_connected=never, hint=hint)


def _never_connected_hint(never: Mapping[int, int | None]) -> str:
    """What most likely went wrong with workers that never said hello."""
    running = sorted((w, pid) for w, pid in never.items() if pid is not None)
    unknown = sorted(w for w, pid in never.items() if pid is None)
    out = ""
    if running:
        who = ", ".join(f"{w} (pid {pid})" for w, pid in running)
        one = len(running) == 1
        out += (
            f". {_workers(len(running))} {who} {'is' if one else 'are'} running, but {'its receiver' if one else 'their receivers'} "
            "never connected: unless still starting up, the worker lacks `async with scheme` (or "
            "`await scheme.connect()`) after `init_on_receiver`"
        )
    if unknown:
        who = ", ".join(map(str, unknown))
        out += (
            f". {_workers(len(unknown))} {who} never said hello: is a worker process running with this scheme, "
            "and does it connect its receiver (`async with scheme`)?"
        )
    return out


def _workers(n: int) -> str:
    return "Worker" if n == 1 else "Workers"


def format_seconds(seconds: float | None) -> str:
    """A duration for messages: ``60.0 s``, ``0.05 s``; ``no limit`` for None.

    Example::

        print(format_seconds(59.99925428199958), format_seconds(0.05))   # 60.0 s 0.05 s
    """
    if seconds is None:
        return "no limit"
    if seconds >= 0.1 or seconds <= 0:
        return f"{seconds:.1f} s"
    return f"{seconds:.2g} s"
