"""The multi-host scheme on loopback: a trainer here, two simulated hosts (spawned relays)
with probe workers, gloo on 127.0.0.1, bfloat16 on the wire. One cluster is shared by
the tests of this module (host 1 has two workers, host 2 one)."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch
from anyio import wait_all_tasks_blocked

from asyncsync import AuthenticationError, DistributedWeightSyncScheme, WeightsError, spawn_workers
from asyncsync._dist._control import auth_mac
from asyncsync._wire._codec import PROTOCOL_VERSION
from asyncsync._wire._control import Auth, Challenge, decode_to_relay, encode
from tests._dist_cluster import TOKEN, DistCluster, free_port
from tests._dist_targets import state_dict_host
from tests._targets import fill_, make_model
from tests.conftest import assert_same

# The module's cluster starts within its first test: spawned workers import torch (slow on a busy machine).
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

ALL = [(1, 0), (1, 1), (2, 0)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dc() -> AsyncIterator[DistCluster]:
    c = DistCluster({1: 2, 2: 1}, transfer_dtype=torch.bfloat16)
    try:
        await c.start()
        yield c
    finally:
        await c.close()


def all_equal(sd: dict[str, torch.Tensor], value: float) -> bool:
    return all(bool((t == value).all()) for t in sd.values())


async def test_round_trip_reaches_every_remote_worker(dc: DistCluster) -> None:
    fill_(dc.model, 3.0)
    v = await dc.scheme.send()
    assert dc.scheme.sender.applied_versions() == {w: v for w in ALL}
    for wid in ALL:
        version, sd = await dc.state(wid)
        assert version == v and all_equal(sd, 3.0)
        dtypes = await dc.hosts[wid[0]].probes[wid[1]].ask("dtypes")
        assert set(dtypes.values()) == {"torch.float32"}  # bf16 on the wire, cast back on the worker
    stats = dc.scheme.statistics()
    assert stats.members == (1, 2) and stats.version == v
    assert stats.last_send_bytes == 2 * stats.buffer_bytes  # one transfer per host, not per worker
    assert all(h.state == "connected" and h.delivered_version == v for h in stats.hosts)
    assert all(w.applied_version == v and w.state == "connected" for w in stats.workers)


async def test_subsets_across_hosts(dc: DistCluster) -> None:
    fill_(dc.model, 1.5)
    v_all = await dc.scheme.send()
    fill_(dc.model, 2.5)
    v_pair = await dc.scheme.send(worker_ids=[(1, 1), (2, 0)])  # both hosts: one broadcast
    fill_(dc.model, 4.0)
    v_one = await dc.scheme.send(worker_ids=(2, 0))  # one host: point-to-point
    assert dc.scheme.statistics().last_send_bytes == dc.scheme.statistics().buffer_bytes
    expect = {(1, 0): (v_all, 1.5), (1, 1): (v_pair, 2.5), (2, 0): (v_one, 4.0)}
    for wid, (v, value) in expect.items():
        version, sd = await dc.state(wid)
        assert version == v and all_equal(sd, value), wid
    fill_(dc.model, 5.0)
    v_host1 = await dc.scheme.send(worker_ids=[(1, 0), (1, 1)])
    for wid in [(1, 0), (1, 1)]:
        assert (await dc.state(wid))[0] == v_host1
    assert (await dc.state((2, 0)))[0] == v_one


async def test_send_async_quorum_then_all(dc: DistCluster) -> None:
    fill_(dc.model, 6.0)
    v = await dc.scheme.send_async()
    await dc.scheme.wait_async(v, quorum=1)
    assert sum(a >= v for a in dc.scheme.sender.applied_versions().values()) >= 1
    await dc.scheme.wait_async(v)
    assert set(dc.scheme.sender.applied_versions().values()) == {v}
    with pytest.raises(ValueError, match="quorum=4"):
        await dc.scheme.wait_async(v, quorum=4)
    with pytest.raises(ValueError, match="not sent yet"):
        await dc.scheme.wait_async(v + 1)


async def test_burst_latest_wins_never_backwards_no_torn_forward(dc: DistCluster) -> None:
    for wid in ALL:
        assert await dc.hosts[wid[0]].probes[wid[1]].ask("forward_start") == "started"
    first = dc.scheme.version + 1
    for k in range(20):  # no waiting: hosts and workers fall behind and skip
        fill_(dc.model, float(10 + k))
        await dc.scheme.send_async()
    last = dc.scheme.version
    await dc.scheme.wait_async()
    for wid in ALL:
        probe = dc.hosts[wid[0]].probes[wid[1]]
        report = await probe.ask("forward_stop")
        assert report["passes"] > 0 and report["mixed"] == 0, (wid, report)
        updates = [u for u in await probe.ask("updates") if u >= first]
        assert updates == sorted(set(updates)) and updates[-1] == last, (wid, updates)
        version, sd = await dc.state(wid)
        assert version == last and all_equal(sd, 29.0)
    # latest wins on the network too: snapshots never exceed one per worker plus the one written
    assert dc.scheme.statistics().buffers <= len(ALL) + 1


async def test_snapshot_isolation(dc: DistCluster) -> None:
    fill_(dc.model, 7.0)
    v = await dc.scheme.send_async()
    fill_(dc.model, 8.0)  # after the snapshot: reaches nobody
    await dc.scheme.wait_async(v)
    for wid in ALL:
        version, sd = await dc.state(wid)
        assert version == v and all_equal(sd, 7.0)


async def test_partial_update_keeps_other_keys(dc: DistCluster) -> None:
    fill_(dc.model, 9.0)
    await dc.scheme.send()
    part = {"2.bias": torch.full((3,), 0.5)}
    v = await dc.scheme.send(weights=part, partial=True, worker_ids=[(1, 0), (2, 0)])
    for wid in [(1, 0), (2, 0)]:
        version, sd = await dc.state(wid)
        assert version == v
        assert bool((sd["2.bias"] == 0.5).all())
        assert all(bool((t == 9.0).all()) for k, t in sd.items() if k != "2.bias")
    version, sd = await dc.state((1, 1))
    assert version == v - 1 and all_equal(sd, 9.0)


async def test_bad_calls_send_nothing(dc: DistCluster) -> None:
    before = dc.scheme.version
    sd = {k: t.clone() for k, t in dc.model.state_dict().items()}
    with pytest.raises(WeightsError, match="0.weight"):
        await dc.scheme.send(weights=dict(sd, **{"0.weight": torch.zeros(3, 3)}))
    with pytest.raises(ValueError, match=r"unknown worker id \(3, 0\)"):
        await dc.scheme.send(worker_ids=[(3, 0)])
    with pytest.raises(TypeError, match="not a \\(host, local index\\) pair"):
        await dc.scheme.send(worker_ids=[1])
    assert dc.scheme.version == before


# ------------------------------------------------------------------ the control plane, attacked


async def _raw(dc: DistCluster) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    address = await dc.scheme.listen()  # connected already: the control address it listens on
    return await asyncio.open_connection(*address)


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Read until EOF (bounded): the trainer closed the connection."""
    while True:
        data = await asyncio.wait_for(reader.read(1 << 16), 10)
        if not data:
            return True


@pytest.mark.parametrize(
    "frame",
    [
        b"GET / HTTP/1.1\r\n\r\n",  # not our magic
        struct.pack("!2sBBI", b"AS", PROTOCOL_VERSION, 10, 1 << 30),  # an Auth that announces 1 GiB
        struct.pack("!2sBBI", b"AS", PROTOCOL_VERSION, 10, 76) + b"\x00" * 10,  # truncated, then EOF
        encode(Challenge(b"\x01" * 32)),  # the trainer's message, from a client
        b"\x80\x04\x95" + b"pickle!" * 4,  # a pickle: never unpickled
    ],
)
async def test_garbage_and_truncated_frames_close_the_connection(dc: DistCluster, frame: bytes, caplog: pytest.LogCaptureFixture) -> None:
    reader, writer = await _raw(dc)
    try:
        challenge = decode_to_relay(await reader.readexactly(40))
        assert isinstance(challenge, Challenge)
        with caplog.at_level(logging.WARNING, logger="asyncsync"):
            writer.write(frame)
            if b"\x00" * 10 in frame:
                writer.write_eof()
            assert await _closed(reader)
            await wait_all_tasks_blocked()  # the server's handler is done (it logs, then closes)
        assert any("closed control connection from 127.0.0.1" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        writer.close()
    v = await dc.scheme.send()  # the trainer and every host go on
    assert set(dc.scheme.sender.applied_versions().values()) == {v}


async def test_wrong_token_is_refused_by_the_trainer(dc: DistCluster, caplog: pytest.LogCaptureFixture) -> None:
    reader, writer = await _raw(dc)
    try:
        challenge = decode_to_relay(await reader.readexactly(40))
        assert isinstance(challenge, Challenge)
        with caplog.at_level(logging.WARNING, logger="asyncsync"):
            writer.write(encode(Auth(2, 1, 1, b"\x02" * 32, auth_mac(b"not-the-token", challenge.nonce, 2, 1))))
            assert await _closed(reader)
            await wait_all_tasks_blocked()
        assert any("wrong token" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        writer.close()
    assert dc.scheme.statistics().host(2).state == "connected"  # the real host 2 is untouched


async def test_relay_with_wrong_token_raises(dc: DistCluster) -> None:
    relay = DistributedWeightSyncScheme(
        timeout=10, token="wrong-" + TOKEN, rank=2, world_size=3, master_addr="127.0.0.1", master_port=dc.port, transfer_dtype=torch.bfloat16
    )
    relay.init_on_relay(model=make_model(), num_workers=1)
    with pytest.raises(AuthenticationError, match="host 2: the trainer at 127.0.0.1:.* closed the connection during the handshake"):
        async with relay:
            pass
    assert dc.scheme.statistics().host(2).state == "connected"


async def test_remote_workers_that_return_tensors_return_them_by_value() -> None:
    """``return model.state_dict()`` on a host: from a relay's spawned worker (through the
    relay's process, itself a spawned host) and from a rank that is its own worker."""
    port = free_port()
    policy = make_model()
    fill_(policy, 2.5)
    trainer = DistributedWeightSyncScheme(timeout=30, token=TOKEN, rank=0, world_size=3, master_addr="127.0.0.1", master_port=port, heartbeat=0.5)
    trainer.init_on_sender(model=policy, hosts={1: 1, 2: 1})
    relay = spawn_workers(state_dict_host, worker_ids=[1], args=(port, TOKEN, False), start_method="spawn")
    own = spawn_workers(state_dict_host, worker_ids=[2], args=(port, TOKEN, True), start_method="spawn")
    async with relay, own:
        async with trainer:
            pass  # version 0 applied everywhere, then both hosts are stopped
        from_relay = await relay.join(timeout=60)
        from_own = await own.join(timeout=60)
    assert list(from_relay) == [1] and list(from_relay[1]) == [0]
    for sd in (from_relay[1][0], from_own[2]):
        assert_same(policy, sd)
        assert all(not t.is_shared() for t in sd.values())
