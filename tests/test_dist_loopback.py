"""The multi-host scheme in one process: trainer, relay and a loopback worker share this
event loop (the gloo group and the control plane are real, on 127.0.0.1): fast checks of
the round trip, the relay's latest-wins fan-out and cleanup."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
from anyio import wait_all_tasks_blocked

from asyncsync import DistributedWeightSyncScheme, HostLostError, MultiProcessWeightSyncScheme, loopback_worker
from asyncsync.testing import open_loopback_hosts
from tests._dist_cluster import free_port
from tests._targets import fill_, make_model

Trio = tuple[DistributedWeightSyncScheme, torch.nn.Module, DistributedWeightSyncScheme, MultiProcessWeightSyncScheme, torch.nn.Module]


@asynccontextmanager
async def trio(wire: torch.device | None = None, **kw: Any) -> AsyncIterator[Trio]:
    """A trainer, one relay (host 1) and its loopback worker, in this loop, not connected yet:
    ``(trainer, its model, relay, worker, the worker's model)``; all closed at the end.
    *wire*: run the NCCL path's steps (a device, its own thread) with gloo on this device."""
    port = free_port()
    common = dict(timeout=30, token="t0ken", world_size=2, master_addr="127.0.0.1", master_port=port, heartbeat=0.5, **kw)
    model = make_model()
    trainer = DistributedWeightSyncScheme(rank=0, **common)  # type: ignore[arg-type]
    trainer._wire_device = wire
    trainer.init_on_sender(model=model, hosts={1: 1})
    relay = DistributedWeightSyncScheme(rank=1, **common)  # type: ignore[arg-type]
    relay._wire_device = wire
    relay.init_on_relay(model=make_model(), num_workers=1)
    worker = loopback_worker(relay.local, 0)
    local = make_model()
    fill_(local, -1.0)
    worker.init_on_receiver(worker_idx=0, model=local)
    try:
        yield trainer, model, relay, worker, local
    finally:
        await trainer.aclose()
        await relay.aclose()
        await worker.aclose()


@asynccontextmanager
async def pair(**kw: Any) -> AsyncIterator[tuple[DistributedWeightSyncScheme, torch.nn.Module, MultiProcessWeightSyncScheme, torch.nn.Module]]:
    """:func:`trio`, connected: ``(trainer, its model, worker, the worker's model)``."""
    async with trio(**kw) as (trainer, model, relay, worker, local):
        await asyncio.gather(trainer.connect(), relay.connect(), worker.connect())
        yield trainer, model, worker, local


async def test_in_process_round_trip_versions_and_partial() -> None:
    async with pair() as (trainer, model, worker, local):
        assert worker.version == 0
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), local.state_dict().values()))
        fill_(model, 2.0)
        v = await trainer.send()
        assert worker.version == v == 1
        assert all(bool((p == 2.0).all()) for p in local.parameters())
        v = await trainer.send(weights={"0.bias": torch.zeros(16)}, partial=True)
        assert worker.version == v
        assert bool((local[0].bias == 0).all()) and bool((local[0].weight == 2.0).all())
        assert trainer.statistics().last_send_bytes == 16 * 4  # only the changed bytes travelled
        v = await trainer.send(weights={"2.bias": torch.full((3,), 3.0)}, partial=True)  # a partial on a partial
        assert worker.version == v and trainer.statistics().last_send_bytes == 3 * 4
        assert bool((local[0].bias == 0).all()) and bool((local[2].bias == 3.0).all()) and bool((local[2].weight == 2.0).all())
        stats = trainer.statistics()
        assert stats.worker((1, 0)).applied_version == v and stats.host(1).connections == 1


@pytest.mark.parametrize("wire", [None, torch.device("cpu")], ids=["host", "device-path"])
async def test_in_process_burst_latest_wins(wire: torch.device | None) -> None:
    async with pair(wire=wire, chunk_bytes=1000) as (trainer, model, worker, local):
        seen: list[int] = []
        worker.receiver.on_update = lambda w, v: seen.append(v)
        for k in range(10):
            fill_(model, float(k))
            await trainer.send_async()
        await trainer.wait_async()
        assert seen == sorted(set(seen)) and seen[-1] == trainer.version == worker.version
        assert all(bool((p == 9.0).all()) for p in local.parameters())


async def test_device_path_round_trip_subsets_and_partial_on_a_cpu_stand_in() -> None:
    """NCCL's steps (every transfer issued and awaited in the group's thread), with gloo on
    CPU memory: broadcasts, point-to-point sends to a subset and partial updates, in chunks."""
    async with trio(torch.device("cpu"), chunk_bytes=256) as (trainer, model, relay, worker, local):
        await asyncio.gather(trainer.connect(), relay.connect(), worker.connect())
        group = trainer._transport.group  # the weight-sync group: a transport seam
        assert group is not None and group.device == torch.device("cpu")
        fill_(model, 3.0)
        v = await trainer.send(worker_ids=[(1, 0)])
        assert worker.version == v and all(bool((p == 3.0).all()) for p in local.parameters())
        v = await trainer.send(weights={"0.bias": torch.full((16,), 7.0)}, partial=True)
        assert worker.version == v and bool((local[0].bias == 7.0).all()) and bool((local[0].weight == 3.0).all())


def test_a_host_buffer_is_received_through_two_device_chunks_in_a_pipeline() -> None:
    """The relay's landing with NCCL: chunk i+1 is issued before chunk i is copied out, the
    two device chunks alternate, and the host buffer ends up with every byte."""
    from asyncsync._dist._dataplane import SyncGroup

    group = SyncGroup(None, 1, 1, 2, chunk_bytes=4, timeout=5.0, device=torch.device("cpu"))
    source = torch.arange(10, dtype=torch.uint8)
    events: list[str] = []
    landings: list[int] = []

    class Work:
        def __init__(self, landing: torch.Tensor, i: int) -> None:
            self.landing, self.i = landing, i

        def wait(self) -> None:
            self.landing.copy_(source[self.i * 4 : self.i * 4 + self.landing.numel()])  # the receive lands now
            events.append(f"copy {self.i}")

    def issue(landing: torch.Tensor, i: int) -> Work:
        events.append(f"issue {i}")
        landings.append(landing.data_ptr())
        return Work(landing, i)

    buf = torch.zeros(10, dtype=torch.uint8)
    group._receive_through_ring(buf, issue)
    assert torch.equal(buf, source)
    assert events == ["issue 0", "issue 1", "copy 0", "issue 2", "copy 1", "copy 2"]
    assert landings[0] == landings[2] != landings[1]


async def test_a_hung_host_does_not_hold_up_the_others_until_the_backend_times_out() -> None:
    """Host 1 takes a transfer's announcement, never receives, and its control connection
    ends while its end of the group stays open: the trainer gives that broadcast up at once
    (gloo would wait the group's 60 s timeout) and host 2 gets the version, then more."""
    def big() -> torch.nn.Module:  # 32 MB: more than the sockets buffer, so a broadcast waits for host 1
        return torch.nn.Linear(1, 8_000_000, bias=False)

    model = big()
    async with open_loopback_hosts(model, big, hosts={1: 1, 2: 1}, timeout=60, heartbeat=0.5, chunk_bytes=1 << 20) as lh:
        trainer, relays, workers, models = lh.trainer, lh.hosts, lh.workers, lh.models
        hung_group = None
        try:
            entered = asyncio.Event()

            async def hang(op: Any) -> None:
                entered.set()
                await asyncio.Event().wait()

            relays[1].relay._land = hang  # type: ignore[method-assign]
            fill_(model, 1.0)
            v = await trainer.send_async()
            await entered.wait()  # the trainer announced the transfer and issued the broadcast
            hung_group = await relays[1].relay._crash(hang=True)
            assert hung_group is not None
            await trainer.wait_async(v, worker_ids=[(2, 0)], timeout=20)
            assert bool((models[2, 0].weight == 1.0).all())
            fill_(model, 2.0)
            v = await trainer.send(worker_ids=[(2, 0)], timeout=20)
            assert workers[2, 0].version == v and bool((models[2, 0].weight == 2.0).all())
            with pytest.raises(HostLostError):
                await trainer.send(worker_ids=[(1, 0)])
        finally:
            if hung_group is not None:
                hung_group.close()  # idle: its connections close, and the trainer's old broadcast ends


async def test_a_rank_can_be_the_worker_itself_with_init_on_receiver() -> None:
    """torchrl's layout: every non-trainer rank is one worker. Its relay and worker share
    this loop; the trainer names it (host, 0); manual commits, stop and versions work."""
    common: dict[str, Any] = dict(timeout=30, token="t0ken", world_size=2, master_addr="127.0.0.1", master_port=free_port(), heartbeat=0.5)
    model = make_model()
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender(model=model, hosts={1: 1})
    rank1 = DistributedWeightSyncScheme(rank=1, commit_mode="manual", **common)
    policy = make_model()
    fill_(policy, -1.0)
    seen: list[int] = []
    rank1.init_on_receiver(model=policy, on_update=lambda _w, v: seen.append(v))
    with pytest.raises(RuntimeError, match="already initialised"):
        rank1.init_on_receiver(model=policy)
    try:
        joining = asyncio.gather(trainer.connect(), rank1.connect())
        await rank1.wait_for_version(0)  # staged, not committed: manual mode
        assert rank1.update_pending and rank1.version == -1 and bool((policy[0].weight == -1.0).all())
        assert rank1.commit() == 0
        await joining
        fill_(model, 5.0)
        sending = asyncio.ensure_future(trainer.send())
        await rank1.wait_for_version(1)
        assert rank1.commit() == 1 and rank1.version == 1 == await sending
        assert all(bool((p == 5.0).all()) for p in policy.parameters())
        assert trainer.sender.applied_versions() == {(1, 0): 1} and seen == [0, 1]
        assert rank1.statistics().version == 1  # type: ignore[union-attr]
        stopped = asyncio.ensure_future(rank1.wait_stopped())
        await trainer.aclose()
        await stopped  # the trainer's aclose stops the rank's worker
    finally:
        await trainer.aclose()
        await rank1.aclose()


async def test_a_device_transfer_that_times_out_releases_its_buffer_only_once_the_backend_is_done() -> None:
    """The loop gives up at the group's timeout, but the thread (NCCL) may still write the
    buffer: ``release`` (which frees a relay's slot) waits for it; a closed group refuses."""
    from asyncsync import BrokenChannelError
    from asyncsync._dist._dataplane import SyncGroup

    group = SyncGroup(None, 1, 1, 2, chunk_bytes=4, timeout=0.05, device=torch.device("cpu"))
    go = threading.Event()
    released = asyncio.get_running_loop().create_future()

    class Stuck:
        def __init__(self, landing: torch.Tensor) -> None:
            self.landing = landing

        def wait(self) -> None:
            go.wait(30)  # a receive the backend has not finished
            self.landing.fill_(7)

    with pytest.raises(BrokenChannelError, match="took more than"):
        await group._on_device(torch.zeros(8, dtype=torch.uint8), lambda landing, i: Stuck(landing), receive=True, release=lambda: released.set_result(None))
    assert not released.done() and group.busy
    go.set()
    await released
    assert not group.busy
    group.close()
    with pytest.raises(BrokenChannelError, match="closed"):
        await group._on_device(torch.zeros(8, dtype=torch.uint8), lambda landing, i: Stuck(landing), receive=True, release=None)


async def test_after_a_rejoin_a_partial_goes_whole_to_a_worker_that_lacks_its_base() -> None:
    """Worker (1, 1)'s newest is a partial whose base (version 0) reaches only (1, 0) after
    host 1 rejoins: (1, 1) must get it whole, not as a delta it cannot complete."""
    common: dict[str, Any] = dict(timeout=30, token="t0ken", world_size=2, master_addr="127.0.0.1", master_port=free_port(), heartbeat=0.5)
    model = make_model()
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender(model=model, hosts={1: 2})
    relays: list[DistributedWeightSyncScheme] = []
    workers: list[MultiProcessWeightSyncScheme] = []

    async def join() -> list[torch.nn.Module]:
        relay = DistributedWeightSyncScheme(rank=1, **common)
        relay.init_on_relay(model=make_model(), num_workers=2)
        relays.append(relay)
        models = []
        for i in range(2):
            w = loopback_worker(relay.local, i)
            m = make_model()
            w.init_on_receiver(worker_idx=i, model=m)
            workers.append(w)
            models.append(m)
        await asyncio.gather(relay.connect(), *(w.connect() for w in workers[-2:]))
        return models

    try:
        await asyncio.gather(trainer.connect(), join())
        v = await trainer.send(weights={"2.bias": torch.full((3,), 9.0)}, worker_ids=[(1, 1)], partial=True)
        assert trainer.statistics().last_send_bytes == 3 * 4  # a delta: (1, 1) holds version 0
        await relays[0].relay._crash()
        await trainer.wait_lost(1, timeout=10)
        models = await join()
        await trainer.wait_async(worker_ids=[(1, 0), (1, 1)])
        assert workers[-1].version == v and workers[-2].version == 0
        assert trainer.statistics().last_send_bytes == trainer.statistics().buffer_bytes  # whole
        expected = {k: t.clone() for k, t in model.state_dict().items()}
        expected["2.bias"] = torch.full((3,), 9.0)
        assert all(torch.equal(t, expected[k]) for k, t in models[1].state_dict().items())
    finally:
        await trainer.aclose()
        for r in relays:
            await r.aclose()
        for w in workers:
            await w.aclose()


def test_a_partial_update_travels_as_merged_byte_ranges_or_whole() -> None:
    from asyncsync._core._layout import Layout
    from asyncsync._dist._transfer import changed_ranges as _changed_ranges

    flat = {"a": torch.zeros(4), "b": torch.zeros(4), "big": torch.zeros(1 << 20), "c": torch.zeros(4)}
    layout = Layout.from_tensors(flat)
    spec = {s.key: s for s in layout.specs}
    # neighbours merge into one range; a range beyond the merge gap stays apart
    got = _changed_ranges(layout, {"a": flat["a"], "b": flat["b"], "c": flat["c"]}, 64 << 20)
    assert len(got) == 2 and got[0][0] == min(spec["a"].offset, spec["b"].offset)
    assert {got[0][1], got[1][1]} >= {16} and sum(n for _, n in got) < layout.nbytes
    assert _changed_ranges(layout, flat, 64 << 20) == ()  # everything changed: the whole buffer
    assert _changed_ranges(layout, {"big": flat["big"]}, 1024) == ()  # too many operations: whole


def test_backend_and_device_are_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        DistributedWeightSyncScheme(backend="mpi", rank=0, world_size=2)
    with pytest.raises(ValueError, match="NCCL wire's CUDA device"):
        DistributedWeightSyncScheme(backend="gloo", device="cuda:0", rank=0, world_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            DistributedWeightSyncScheme(backend="nccl", rank=0, world_size=2)
    else:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            DistributedWeightSyncScheme(backend="nccl", device="cpu", rank=0, world_size=2)


def snapshot() -> tuple[set[str], set[int]]:
    gc.collect()
    return set(os.listdir("/proc/self/fd")), {t.ident or 0 for t in threading.enumerate()}


async def test_nothing_left_after_aclose() -> None:
    async with pair() as (trainer, _, _, _):  # first use opens what torch keeps for the process
        await trainer.send()
    fds0, threads0 = snapshot()
    async with pair() as (trainer, model, _, _):
        for k in range(3):
            fill_(model, float(k))
            await trainer.send()
    await wait_all_tasks_blocked()  # every callback the close scheduled has run
    fds1, threads1 = snapshot()
    assert threads1 == threads0, threading.enumerate()
    assert fds1 == fds0, {fd: _link(fd) for fd in fds1 ^ fds0}


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


@pytest.mark.parametrize("dtype", [torch.bfloat16])
async def test_in_process_transfer_dtype(dtype: torch.dtype) -> None:
    async with pair(transfer_dtype=dtype) as (trainer, model, worker, local):
        fill_(model, 1.5)
        await trainer.send()
        assert all(p.dtype == torch.float32 and bool((p == 1.5).all()) for p in local.parameters())
        assert trainer.statistics().buffer_bytes < sum(t.numel() * 4 for t in model.state_dict().values())


async def test_in_process_manual_commit() -> None:
    async with trio(commit_mode="manual") as (trainer, model, relay, worker, local):
        joining = asyncio.gather(trainer.connect(), relay.connect(), worker.connect())
        await worker.wait_for_version(0)  # staged, not committed: nobody acked yet
        assert worker.update_pending and worker.version == -1
        assert worker.commit() == 0
        await joining
        fill_(model, 3.0)
        send = asyncio.ensure_future(trainer.send())
        await worker.wait_for_version(1)
        assert not send.done() and all(bool((p != 3.0).all()) for p in local.parameters())
        assert worker.commit() == 1
        assert await send == 1
        assert all(bool((p == 3.0).all()) for p in local.parameters())


async def test_in_process_context_model_id_is_looked_up_at_every_send() -> None:
    class Ctx:
        policy = make_model()

    port = free_port()
    common: dict[str, Any] = dict(timeout=30, token="t0ken", world_size=2, master_addr="127.0.0.1", master_port=port)
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender("policy", Ctx, hosts={1: 1})
    relay = DistributedWeightSyncScheme(rank=1, **common)
    relay.init_on_relay(model=make_model(), num_workers=1)
    worker = loopback_worker(relay.local, 0)
    local = make_model()
    worker.init_on_receiver(worker_idx=0, model=local)
    try:
        await asyncio.gather(trainer.connect(), relay.connect(), worker.connect())
        Ctx.policy = make_model()  # a new module object: the next send reads it
        fill_(Ctx.policy, 4.0)
        await trainer.send()
        assert all(bool((p == 4.0).all()) for p in local.parameters())
    finally:
        await trainer.aclose()
        await relay.aclose()
        await worker.aclose()


async def test_a_relay_with_another_model_is_refused_with_the_reason() -> None:
    port = free_port()
    common: dict[str, Any] = dict(timeout=30, token="t0ken", world_size=2, master_addr="127.0.0.1", master_port=port)
    trainer = DistributedWeightSyncScheme(rank=0, **common)
    trainer.init_on_sender(model=make_model(), hosts={1: 1})
    relay = DistributedWeightSyncScheme(rank=1, **common)
    relay.init_on_relay(model=make_model("wide"), num_workers=1)
    await trainer.listen()
    try:
        with pytest.raises(ValueError, match="host 1: the trainer's weights do not fit this host's model"):
            await relay.connect()
        await trainer.wait_lost(1, timeout=30)
        host = trainer.statistics().host(1)
        assert host.state == "dead" and "its relay refused the trainer's weights: host 1: the trainer's weights do not fit" in str(host.reason)
    finally:
        await relay.aclose()
        await trainer.aclose()
    # The refusal came before the host was admitted: no group began to form with it, so
    # no rendezvous thread is left waiting for a relay that is gone.
    assert not [t.name for t in threading.enumerate() if t.name == "asyncsync-group"]


async def test_a_relay_that_leaves_is_named_as_left() -> None:
    async with trio() as (trainer, _model, relay, worker, _local):
        await asyncio.gather(trainer.connect(), relay.connect(), worker.connect())
        await relay.aclose()  # the host leaves: its workers are stopped, keeping their weights
        await trainer.wait_lost(1, timeout=30)
        stats = trainer.statistics()
        assert stats.host(1).state == "left" and "its relay left: the relay closed" in str(stats.host(1).reason)
        with pytest.raises(HostLostError, match="host 1 .* is lost, and with it worker \\(1, 0\\): its relay left"):
            await trainer.send()
        await worker.wait_stopped()  # stopped by its relay, not an error
        assert worker.version == 0


async def test_a_silent_relay_is_declared_lost() -> None:
    """A peer that authenticates, then sends nothing (no heartbeat) for silence_timeout."""
    from asyncsync._dist._control import auth_mac
    from asyncsync._wire._control import Auth, Challenge, Setup, Welcome, decode_to_relay, encode

    port = free_port()
    trainer = DistributedWeightSyncScheme(
        rank=0, timeout=30, token="t0ken", world_size=2, master_addr="127.0.0.1", master_port=port, heartbeat=0.2, silence_timeout=1.0
    )
    trainer.init_on_sender(model=make_model(), hosts={1: 1})
    address = await trainer.listen()
    reader, writer = await asyncio.open_connection(*address)
    try:
        challenge = decode_to_relay(await reader.readexactly(40))
        assert isinstance(challenge, Challenge)
        writer.write(encode(Auth(1, 1, 4242, b"\x03" * 32, auth_mac(b"t0ken", challenge.nonce, 1, 1))))
        assert isinstance(decode_to_relay(await reader.readexactly(40)), Welcome)
        header = await reader.readexactly(8)
        setup = decode_to_relay(header + await reader.readexactly(int.from_bytes(header[4:], "big")))
        assert isinstance(setup, Setup) and setup.layout == trainer.sender.layout
        await trainer.wait_lost(1, timeout=30)  # ...and now it says nothing
        host = trainer.statistics().host(1)
        assert host.state == "dead" and "sent nothing for 1.0 s (no heartbeat)" in str(host.reason)
    finally:
        writer.close()
        await trainer.aclose()


async def test_loopback_hosts_in_manual_commit_mode_connect_with_version_0_committed() -> None:
    model = make_model()
    fill_(model, 4.0)
    async with open_loopback_hosts(model, make_model, hosts={1: 2}, commit_mode="manual", timeout=20) as lh:
        assert {wid: w.version for wid, w in lh.workers.items()} == {(1, 0): 0, (1, 1): 0}
        assert all(bool((p == 4.0).all()) for m in lh.models.values() for p in m.parameters())
        assert lh.trainer.sender.applied_versions() == {(1, 0): 0, (1, 1): 0}
        fill_(model, 5.0)
        sending = asyncio.ensure_future(lh.trainer.send())
        for w in lh.workers.values():
            await w.wait_for_version(1)
            assert w.commit() == 1
        assert await sending == 1


async def test_a_partial_update_is_whole_to_a_host_that_did_not_publish_its_base() -> None:
    """The trainer's transfer of version 2 completes, but the relay loses that landing (its
    bytes are consumed, nothing is published: the worker's newest there stays 1). A partial
    update on version 2 must then travel whole: a delta would name a base the relay lacks,
    and the worker would reject it."""
    async with trio() as (trainer, model, relay, worker, local):
        await asyncio.gather(trainer.connect(), relay.connect(), worker.connect())
        relay_local = relay.relay.landing  # the relay's local transport: where landings are reserved
        fill_(model, 1.0)
        assert await trainer.send() == 1
        real = relay_local.reserve
        lost: list[int] = []

        def reserve(version: int, *args: Any, **kwargs: Any) -> Any:
            landing = real(version, *args, **kwargs)
            if version == 2:

                def lose() -> None:  # received, then lost
                    lost.append(version)
                    raise RuntimeError("landing lost")

                landing.publish = lose  # type: ignore[method-assign]
            return landing

        relay_local.reserve = reserve  # type: ignore[method-assign]
        fill_(model, 2.0)
        assert await trainer.send_async() == 2
        remote = trainer._transport
        host = remote.host(1)
        assert await remote._delivery.changed.wait_until(lambda: bool(lost) and not host.busy and not remote._snapshots.pending.get(1), 10)
        assert worker.version == 1
        v = await trainer.send(weights={"0.bias": torch.zeros(16)}, partial=True, timeout=10)
        assert worker.version == v == 3
        assert trainer.statistics().last_send_bytes == trainer.statistics().buffer_bytes  # whole
        assert bool((local[0].bias == 0).all()) and bool((local[0].weight == 2.0).all()) and bool((local[2].bias == 2.0).all())


class _Tied(torch.nn.Module):
    """An embedding whose output head is the same Parameter (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


async def test_tied_weights_reach_workers_through_a_relay() -> None:
    # The relay's copy of its model keeps the tie, so its wire layout is the trainer's.
    model = _Tied()
    async with open_loopback_hosts(model, _Tied, timeout=30) as lh:
        with torch.no_grad():
            model.emb.weight.fill_(2.0)
        assert await lh.trainer.send() == 1
        worker_model = lh.models[1, 0]
        assert worker_model.head.weight is worker_model.emb.weight
        assert torch.equal(worker_model.emb.weight, torch.full((5, 3), 2.0))
        assert lh.workers[1, 0].version == 1


async def test_the_trainer_has_the_local_senders_sent_version_and_wait_dead() -> None:
    """``scheme.sender.sent_version(wid)`` and ``await scheme.sender.wait_dead(wid)`` with
    ``(host, local index)`` ids, as the local sender has them with ints."""
    async with open_loopback_hosts(make_model(), make_model, hosts={1: 2}, timeout=30, on_worker_error="skip") as lh:
        sender = lh.trainer.sender
        assert sender.sent_version((1, 0)) == sender.sent_version((1, 1)) == 0
        await lh.trainer.send(worker_ids=[(1, 0)])
        assert (sender.sent_version((1, 0)), sender.sent_version((1, 1))) == (1, 0)
        with pytest.raises(ValueError, match=r"unknown worker id \(3, 0\)"):
            sender.sent_version((3, 0))
        await lh.workers[1, 1].aclose()  # worker (1, 1) leaves; its relay tells the trainer
        await sender.wait_dead((1, 1), timeout=30)
        assert lh.trainer.statistics().worker((1, 1)).state == "left"
        assert await lh.trainer.send() == 2 and sender.sent_version((1, 0)) == 2  # "skip": the living go on
