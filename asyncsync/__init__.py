"""asyncsync: asyncio-native weight synchronisation from a trainer to worker processes.

Example::

    from asyncsync import MultiProcessWeightSyncScheme

    scheme = MultiProcessWeightSyncScheme(strategy="tensordict")
    scheme.init_on_sender(model=policy, num_workers=2)
    ...  # start the workers with `scheme`
    async with scheme:
        await scheme.send()
"""

from ._core._layout import Layout, TensorSpec
from ._dist._scheme import DistributedWeightSyncScheme
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
    WorkerLeftError,
    WorkerProcessError,
    WouldBlock,
)
from ._core._flat import flatten_parameters
from ._io._queues import AsyncQueue
from ._local._attach import WorkerAddress
from ._local._loopback import loopback_worker
from ._local._receiver import Receiver
from ._local._scheme import MultiProcessWeightSyncScheme
from ._local._sender import Sender
from ._local._workers import WorkerGroup, spawn_workers
from ._stats import DistributedStatistics, HostStatistics, ReceiverStatistics, SenderStatistics, WorkerStatistics

__version__ = "0.1.0"

__all__ = [
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
    "WorkerGroup",
    "WorkerLeftError",
    "WorkerProcessError",
    "WorkerStatistics",
    "WouldBlock",
    "flatten_parameters",
    "loopback_worker",
    "spawn_workers",
]
