"""asyncsync: asyncio-native weight synchronisation from a trainer to worker processes.

Example::

    from asyncsync import MultiProcessWeightSyncScheme

    scheme = MultiProcessWeightSyncScheme(strategy="tensordict")
    scheme.init_on_sender(model=policy, num_workers=2)
    ...  # start the workers with `scheme`
    async with scheme:
        await scheme.send()
"""

from ._core._acks import MembershipEvent
from ._core._flat import flatten_parameters
from ._core._layout import Layout, TensorSpec
from ._core._options import DEFAULT
from ._core._sender import Sender
from ._errors import (
    AsyncSyncError,
    AuthenticationError,
    BrokenChannelError,
    CapacityError,
    ClosedError,
    HostLostError,
    ProtocolError,
    SenderDiedError,
    SyncTimeoutError,
    WeightsError,
    WorkerDiedError,
    WorkerError,
    WorkerGoneError,
    WorkerLeftError,
    WorkerProcessError,
    WouldBlock,
)
from ._io._queues import AsyncQueue
from ._local._attach import WorkerAddress
from ._local._receiver import Receiver
from ._schemes._dist import DistributedWeightSyncScheme
from ._schemes._local import MultiProcessWeightSyncScheme, loopback_worker
from ._stats import DistributedStatistics, HostStatistics, ReceiverStatistics, SenderStatistics, WorkerStatistics
from ._workers import WorkerGroup, spawn_workers

__version__ = "0.1.0"

__all__ = [
    "DEFAULT",
    "AsyncQueue",
    "AsyncSyncError",
    "AuthenticationError",
    "BrokenChannelError",
    "CapacityError",
    "ClosedError",
    "DistributedStatistics",
    "DistributedWeightSyncScheme",
    "HostLostError",
    "HostStatistics",
    "Layout",
    "MembershipEvent",
    "MultiProcessWeightSyncScheme",
    "ProtocolError",
    "Receiver",
    "ReceiverStatistics",
    "Sender",
    "SenderDiedError",
    "SenderStatistics",
    "SyncTimeoutError",
    "TensorSpec",
    "WeightsError",
    "WorkerAddress",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGoneError",
    "WorkerGroup",
    "WorkerLeftError",
    "WorkerProcessError",
    "WorkerStatistics",
    "WouldBlock",
    "flatten_parameters",
    "loopback_worker",
    "spawn_workers",
]
