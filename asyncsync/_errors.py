"""The exception hierarchy of asyncsync.

::

    AsyncSyncError
    ├── ClosedError            you closed it (call after ``aclose()``)
    ├── WouldBlock             a ``*_nowait`` call found nothing to do
    ├── BrokenChannelError     the peer's end of a channel vanished
    │   ├── WorkerDiedError    a worker process died (sender side)
    │   │   ├── WorkerLeftError    its receiver ended while the process lives on
    │   │   └── HostLostError      a remote host (its relay) is gone, with its workers
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
    "WorkerLeftError",
    "WorkerProcessError",
    "WouldBlock",
]


class AsyncSyncError(Exception):
    """Base class of every error raised by asyncsync."""


class ClosedError(AsyncSyncError):
    """The object was closed by its owner (``aclose()`` or ``stop``) and cannot be used."""


class WouldBlock(AsyncSyncError):
    """A ``*_nowait`` call would have had to wait."""


class BrokenChannelError(AsyncSyncError):
    """The other end of a channel went away (process died or closed its end)."""


class WorkerDiedError(BrokenChannelError):
    """A worker process died or dropped its channel.

    ``worker_idx`` names the worker, ``exitcode`` is its exit status when known
    (negative: killed by that signal), ``pid`` its process id when known. ``reason`` is
    set when the sender cut the channel itself (the worker sent a malformed message).
    """

    def __init__(self, worker_idx: int, exitcode: int | None = None, pid: int | None = None, reason: str | None = None) -> None:
        self.worker_idx = worker_idx
        self.exitcode = exitcode
        self.pid = pid
        self.reason = reason
        code = "unknown" if exitcode is None else str(exitcode)
        who = f"worker {worker_idx}" + (f" (pid {pid})" if pid else "")
        super().__init__(f"{who} died, exit code {code}" if reason is None else f"{who} was cut off: {reason}")

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.worker_idx, self.exitcode, self.pid, self.reason))


class WorkerLeftError(WorkerDiedError):
    """A worker's receiver ended (``aclose()``, a crash of its task) while its process lives on.

    ``reason`` says why; the worker kept its last weights (detached from shared memory).
    """

    def __init__(self, worker_idx: int, reason: str, version: int = -1, pid: int | None = None) -> None:
        self.version = version
        super().__init__(worker_idx, None, pid, reason)
        who = f"worker {worker_idx}" + (f" (pid {pid})" if pid else "")
        self.args = (f"{who} left at version {version}: {reason}",)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.worker_idx, self.reason, self.version, self.pid))


class HostLostError(WorkerDiedError):
    """A remote host's relay died, left or went silent: every worker of that host is gone.

    ``host`` names the host, ``worker_idx`` the ``(host, local index)`` of the worker a
    wait was about, ``reason`` what the trainer saw (EOF, no heartbeat, a bad frame).

    Example::

        import socket

        with socket.socket() as s:                      # a free port for the rendezvous store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        common = dict(timeout=10, token="s3cret", world_size=2, master_addr="127.0.0.1", master_port=port)
        trainer = DistributedWeightSyncScheme(rank=0, **common)
        trainer.init_on_sender(model=make_policy(), hosts={1: 1})   # host 1 runs one worker
        host = DistributedWeightSyncScheme(rank=1, **common)         # (another machine, normally)
        host.init_on_relay(model=make_policy(), num_workers=1)
        worker = loopback_worker(host.local, 0)   # (spawn_workers(fn, 1, args=(host,), scheme=host.local), normally)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        await asyncio.gather(trainer.connect(), host.connect(), worker.connect())
        await host.aclose()                             # host 1 leaves (or dies)
        try:
            await trainer.send()
        except HostLostError as exc:
            print(exc.host, exc.worker_idx)       # 1 (1, 0)
        await trainer.aclose()
        await worker.aclose()
    """

    def __init__(self, host: int, worker_idx: object, reason: str, pid: int | None = None) -> None:
        self.host = host
        super().__init__(worker_idx, None, pid, reason)  # type: ignore[arg-type]
        relay = f"relay pid {pid}" if pid else "relay"
        self.args = (f"host {host} ({relay}) is lost, and with it worker {worker_idx}: {reason}",)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.host, self.worker_idx, self.reason, self.pid))


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
        await trainer.sender.start()                   # listening; no host yet
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
    outstanding answer can free one (raise ``max_slots`` or leave it at its default)."""


class SenderDiedError(BrokenChannelError):
    """The sender (trainer) went away; the worker keeps its last complete weights."""


class ProtocolError(BrokenChannelError):
    """A peer sent a control message that does not decode (bad header, field or layout).

    The message names the message type and the field. The channel is out of step with its
    peer from then on: the side that gets it closes the channel.
    """


class WeightsError(AsyncSyncError, ValueError):
    """Weights given to the sender do not fit: keys, shapes, dtypes, devices or values."""


class WorkerError(AsyncSyncError):
    """A worker rejected an update and kept its previous weights.

    ``worker_idx`` and ``version`` say which worker refused which version;
    ``message`` is the worker's own explanation.
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
    """

    def __init__(self, worker_idx: int, message: str, remote_traceback: str = "") -> None:
        self.worker_idx = worker_idx
        self.remote_traceback = remote_traceback
        super().__init__(f"worker {worker_idx}: {message}")


class SyncTimeoutError(AsyncSyncError, TimeoutError):
    """A wait for acknowledgements ran out of time.

    ``pending`` maps each worker that did not answer to the last version it applied.
    """

    def __init__(self, what: str, pending: Mapping[int, int], timeout: float | None) -> None:
        self.pending = dict(pending)
        self.timeout = timeout
        detail = ", ".join(f"worker {w} (at version {v})" for w, v in sorted(self.pending.items()))
        super().__init__(f"{what} timed out after {timeout}s; no answer from {detail or 'nobody'}")
