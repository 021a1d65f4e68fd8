"""Immutable statistics records returned by ``statistics()``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DistributedStatistics", "HostStatistics", "ReceiverStatistics", "SenderStatistics", "WorkerStatistics"]


@dataclass(frozen=True)
class WorkerStatistics:
    """One worker as the sender sees it.

    Attributes:
        worker_idx: the worker's id.
        state: ``"waiting"`` (not connected yet), ``"connected"``, ``"dead"`` (its process
            died, or the sender cut its channel for a malformed message), ``"left"`` (its receiver ended; ``reason`` says why) or ``"stopped"``
            (after the sender's ``aclose()``).
        pid: the worker's process id once it said hello.
        exitcode: exit status of a dead worker, when known.
        sent_version: newest version sent to it (-1: none).
        applied_version: newest version it acknowledged as applied (-1: none).
        lag: ``sender.version - applied_version``: how many versions it is behind.
        last_error: the last rejection it reported, or None.
        stage_ms: its stage time for the last applied version.
        commit_ms: its commit time for the last applied version.
        generation: its connection number (1 for the first process, +1 per replacement);
            ``applied_version``, ``last_error`` and timings belong to this connection.
        in_flight_version: the version sent and not answered yet (at most one), or None.
        reason: why a worker in state ``"left"`` left, or why the sender cut a ``"dead"``
            worker's channel (a malformed message); else None.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=2)
        workers = [loopback_worker(scheme, i) for i in range(2)]
        for i, worker in enumerate(workers):
            worker.init_on_receiver(worker_idx=i, model=make_policy())
        await asyncio.gather(scheme.connect(), *(w.connect() for w in workers))
        await scheme.send(worker_ids=[0])
        for w in scheme.statistics().workers:
            print(w.worker_idx, w.state, w.applied_version, w.lag)
        # 0 connected 1 0
        # 1 connected 0 1
        await scheme.aclose()
        for worker in workers:
            await worker.aclose()
    """

    worker_idx: int | tuple[int, int]
    state: str
    pid: int | None
    exitcode: int | None
    sent_version: int
    applied_version: int
    lag: int
    last_error: str | None
    stage_ms: float
    commit_ms: float
    generation: int = 1
    in_flight_version: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class SenderStatistics:
    """The sender's view of the whole group.

    Attributes:
        version: newest version sent (-1 before ``connect``).
        sends: number of sends published.
        bytes_copied: bytes written into shared memory so far.
        slots: shared-memory slots now allocated.
        slot_bytes: bytes of one slot.
        last_copy_ms: time the last send spent copying weights into its slot.
        workers: one :class:`WorkerStatistics` per worker.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        await asyncio.gather(scheme.connect(), worker.connect())
        await scheme.send()
        stats = scheme.statistics()            # an immutable snapshot
        print(stats.version, stats.sends, stats.slots)   # 1 2 2
        print(stats.worker(0).state, stats.worker(0).lag)  # connected 0
        await scheme.aclose()
        await worker.aclose()
    """

    version: int
    sends: int
    bytes_copied: int
    slots: int
    slot_bytes: int
    last_copy_ms: float
    workers: tuple[WorkerStatistics, ...]

    def worker(self, worker_idx: int | tuple[int, int]) -> WorkerStatistics:
        for w in self.workers:
            if w.worker_idx == worker_idx:
                return w
        raise KeyError(worker_idx)


@dataclass(frozen=True)
class ReceiverStatistics:
    """A worker's own view.

    Attributes:
        worker_idx: this worker's id.
        version: version the model runs now (-1: none yet).
        pending_version: version staged but not committed (manual commit), or None.
        updates: number of versions applied.
        skipped: versions skipped (latest wins).
        rejected: updates rejected (bad payload).
        last_stage_ms: time spent staging the last update.
        last_commit_ms: time spent committing the last update.
        callback_errors: exceptions raised by ``on_update`` or ``update_policy_weights_``
            (logged; the receiver goes on).
        last_callback_error: the newest of them, as text.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        await asyncio.gather(scheme.connect(), worker.connect())
        await scheme.send()
        await scheme.send()
        stats = worker.statistics()            # on the worker: its own view
        print(stats.version, stats.updates, stats.rejected)  # 2 3 0
        await scheme.aclose()
        await worker.aclose()
    """

    worker_idx: int
    version: int
    pending_version: int | None
    updates: int
    skipped: int
    rejected: int
    last_stage_ms: float
    last_commit_ms: float
    callback_errors: int = 0
    last_callback_error: str | None = None


@dataclass(frozen=True)
class HostStatistics:
    """One remote host (its relay) as the trainer sees it.

    Attributes:
        host: the host's id. state: ``"waiting"``, ``"connected"``, ``"dead"`` (its
            connection ended: EOF, no heartbeat, a malformed frame), ``"left"`` (its relay
            said goodbye) or ``"stopped"``. pid / peer: its relay's process id and address.
        connections: how many times it connected (a restarted host counts again).
        delivered_version: newest version whose bytes reached it (-1: none).
        pending_versions: versions waiting to be transferred to it (latest wins per worker).
        reason: why it was lost, or None.

    Example::

        from asyncsync.testing import open_loopback_hosts

        async with open_loopback_hosts(make_policy(), make_policy, hosts={1: 1}, timeout=10) as lh:
            await lh.hosts[1].aclose()                  # host 1 leaves
            await lh.trainer.wait_lost(1, timeout=10)
            h = lh.trainer.statistics().host(1)
            print(h.state, h.connections, h.reason)   # left 1 its relay left: the relay closed
    """

    host: int
    state: str
    pid: int | None
    peer: str | None
    connections: int
    delivered_version: int
    pending_versions: tuple[int, ...]
    reason: str | None


@dataclass(frozen=True)
class DistributedStatistics:
    """The trainer's view of a multi-host group.

    Attributes:
        version: newest version sent (-1 before ``connect``). sends: sends published.
        bytes_sent: bytes the trainer put on the network so far (counted when a transfer
            is issued); last_send_bytes: bytes of the last transfer issued: ``buffer_bytes``
            (or, for a partial update to hosts holding its base, its changed bytes) times
            the copies the trainer sends (point-to-point: one per host; a gloo
            broadcast, a binomial tree: ``ceil(log2(hosts + 1))``; an NCCL broadcast, a
            pipelined ring: one).
        buffers / buffer_bytes: wire buffers (snapshots) allocated, and the size of one.
        last_copy_ms: time the last send spent copying weights into its buffer.
        generation / members: the weight-sync group now formed, and the hosts in it.
        hosts: one :class:`HostStatistics` per host. workers: one :class:`WorkerStatistics`
            per worker, ``worker_idx`` being ``(host, local index)``.

    Example::

        from asyncsync.testing import open_loopback_hosts

        async with open_loopback_hosts(make_policy(), make_policy, hosts={1: 1}, timeout=10) as lh:
            await lh.trainer.send()
            stats = lh.trainer.statistics()
            print(stats.version, stats.members, stats.last_send_bytes == stats.buffer_bytes)   # 1 (1,) True
            print(stats.worker((1, 0)).applied_version)   # 1
    """

    version: int
    sends: int
    bytes_sent: int
    last_send_bytes: int
    buffers: int
    buffer_bytes: int
    last_copy_ms: float
    generation: int
    members: tuple[int, ...]
    hosts: tuple[HostStatistics, ...]
    workers: tuple[WorkerStatistics, ...]

    def worker(self, worker_idx: tuple[int, int]) -> WorkerStatistics:
        for w in self.workers:
            if w.worker_idx == worker_idx:
                return w
        raise KeyError(worker_idx)

    def host(self, host: int) -> HostStatistics:
        for h in self.hosts:
            if h.host == host:
                return h
        raise KeyError(host)
