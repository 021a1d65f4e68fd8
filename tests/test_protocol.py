"""The binary wire format: round trips, what the decoder rejects, a fuzz test, and a peer
that sends garbage on a real channel (in-process loopback: no processes)."""

from __future__ import annotations

import asyncio
import math
import struct
import tracemalloc
from typing import Any, get_args

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync import (
    Layout,
    MultiProcessWeightSyncScheme,
    ProtocolError,
    SenderDiedError,
    TensorSpec,
    WorkerDiedError,
    loopback_worker,
)
from asyncsync._wire._codec import _DTYPES, PROTOCOL_VERSION, decode, encode
from asyncsync._wire._local import FromWorker, ToWorker, decode_from_worker, decode_to_worker
from asyncsync._wire._messages import (
    MAX_NDIM,
    MAX_SLOTS,
    MAX_STRING,
    Ack,
    Beat,
    Bye,
    Challenge,
    Group,
    Hello,
    Lost,
    Mailbox,
    MapSlots,
    Message,
    Poll,
    Receive,
    Setup,
    Staged,
    Stop,
)
from tests._strategies import texts as utf8_text
from tests._targets import fill_, make_model

I64 = (-(1 << 63), (1 << 63) - 1)
U32_MAX = (1 << 32) - 2  # the largest id: 2**32 - 1 means None

LAYOUT = Layout.from_shapes(
    [
        ("w", (3, 4), torch.float32),
        ("scalar", (), torch.float32),
        ("empty", (0, 7), torch.float32),
        ("half", (5,), torch.float16),
        ("bf", (2, 1, 2), torch.bfloat16),
        ("steps", (), torch.int64),
        ("mask", (9,), torch.bool),
        ("ключ/权重", (1,), torch.float64),
    ],
    dtype_map={torch.float64: torch.float64},
    aliases=[("head.weight", "w"), ("tied.again", "w")],
)

MESSAGES: list[Message] = [
    Hello(0, 1),
    Hello(U32_MAX, U32_MAX),
    Setup(LAYOUT, None, 1234),
    Setup(LAYOUT, "cuda:1", 0),
    Setup(LAYOUT, "", 1),
    Setup(Layout((), 0), None, 1),
    MapSlots((), ()),
    MapSlots((0,), (0,), True),
    MapSlots(tuple(range(MAX_SLOTS)), tuple(64 * i for i in range(MAX_SLOTS)), False),
    Receive(0, 0),
    Receive(I64[0], U32_MAX, 0),
    Receive(I64[1], 3, (1 << 64) - 1),
    Stop(),
    Stop(""),
    Stop("auf Wiedersehen, 再见 🙂"),
    Ack(0, 0, True),
    Ack(7, I64[1], True, None, 2, 0.001, 1e-7),
    Ack(7, I64[0], False, "", None),
    Ack(1, -1, False, "payload does not fit: «w» (3, 4) ≠ (4, 3)", U32_MAX, 0.0, 1e300),
    Staged(0, 5, None),
    Staged(U32_MAX, -1, 0),
    Bye(0, -1, ""),
    Bye(2, 10, "the worker closed its receiver ✓"),
    Poll(0),
    Poll(U32_MAX),
    Mailbox(64),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: Message) -> None:
    frame = encode(msg)
    assert frame[:2] == b"AS" and frame[2] == PROTOCOL_VERSION
    assert struct.unpack_from("!I", frame, 4)[0] == len(frame) - 8
    assert decode(frame) == msg
    assert decode(bytearray(frame)) == msg
    assert decode(memoryview(frame)) == msg


def test_a_layout_round_trips_spec_by_spec() -> None:
    got = decode(encode(Setup(LAYOUT, None, 1)))
    assert isinstance(got, Setup)
    assert got.layout.specs == LAYOUT.specs and got.layout.nbytes == LAYOUT.nbytes
    assert got.layout.aliases == LAYOUT.aliases
    assert got.layout.index["scalar"].shape == () and got.layout.index["empty"].numel == 0
    buf = torch.zeros(LAYOUT.nbytes, dtype=torch.uint8)
    assert {k: (v.shape, v.dtype) for k, v in got.layout.views(buf).items()} == {
        k: (v.shape, v.dtype) for k, v in LAYOUT.views(buf).items()
    }


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_dtype_of_the_table_round_trips() -> None:
    layout = Layout.from_shapes([(f"t{code}", (2, 3), dtype) for code, dtype in _DTYPES.items()])
    got = decode(encode(Setup(layout, None, 1)))
    assert isinstance(got, Setup) and got.layout.specs == layout.specs
    assert {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8} <= set(_DTYPES.values())


def test_hot_messages_are_fixed_size_frames() -> None:
    assert len(encode(Receive(1, 2, 3))) == len(encode(Receive(I64[1], U32_MAX, 0))) == 28
    assert len(encode(Ack(1, 2, True, None, 3, 0.1, 0.2))) == len(encode(Ack(0, 0, True))) == 45


def test_the_encoder_refuses_what_cannot_travel() -> None:
    with pytest.raises(ValueError, match="Receive"):
        encode(Receive(1 << 63, 0))
    with pytest.raises(ValueError, match="reserved"):
        encode(Receive(0, (1 << 32) - 1))
    with pytest.raises(ValueError, match="Hello"):
        encode(Hello(-1, 0))
    with pytest.raises(ValueError, match="more than the limit"):
        encode(Setup(Layout.from_shapes([("k" * (MAX_STRING + 1), (1,), torch.float32)]), None, 1))
    with pytest.raises(ValueError, match="does not carry"):
        encode(Setup(Layout((TensorSpec("q", (1,), torch.qint8, 0, 1),), 64), None, 1))
    with pytest.raises(ValueError, match="slot ids but"):
        encode(MapSlots((1, 2), (64,)))
    with pytest.raises(TypeError, match="not a protocol message"):
        encode(("Receive", 1, 2))  # type: ignore[arg-type]


def test_long_error_texts_are_shortened_not_refused() -> None:
    got = decode(encode(Ack(0, 1, False, "é" * MAX_STRING)))
    assert isinstance(got, Ack) and got.error is not None
    assert got.error.endswith("...") and len(got.error.encode()) <= MAX_STRING


# ------------------------------------------------------------------------- rejections


def _setup_frame(specs: list[tuple[str, int, tuple[int, ...], int, int]], total: int, aliases: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A Setup frame written by hand: (key, dtype code, shape, offset, numel) per spec."""
    body = [struct.pack("!II", 1, 0xFFFFFFFF), struct.pack("!QII", total, len(specs), len(aliases))]
    for key, code, shape, offset, numel in specs:
        raw = key.encode()
        body += [struct.pack("!I", len(raw)), raw, struct.pack(f"!BB{len(shape) + 2}Q", code, len(shape), *shape, offset, numel)]
    for pair in aliases:
        for name in pair:
            body += [struct.pack("!I", len(name.encode())), name.encode()]
    payload = b"".join(body)
    return struct.pack("!2sBBI", b"AS", PROTOCOL_VERSION, 2, len(payload)) + payload


def _with_u32(frame: bytes, offset: int, value: int) -> bytes:
    return frame[:offset] + struct.pack("!I", value) + frame[offset + 4 :]


RECEIVE = encode(Receive(5, 1, 0))
ACK = encode(Ack(1, 5, False, "bad", 2, 0.5, 0.25))
BYE = encode(Bye(1, 5, "bye"))

REJECTED: list[tuple[bytes, str]] = [
    (b"", r"frame: field 'header': truncated"),
    (RECEIVE[:7], r"frame: field 'header': truncated"),
    (b"XY" + RECEIVE[2:], r"frame: field 'magic'"),
    (RECEIVE[:2] + b"\x01" + RECEIVE[3:], r"frame: field 'version': protocol version 1 is not supported"),
    (RECEIVE[:3] + b"\x63" + RECEIVE[4:], r"frame: field 'type': unknown message type 99"),
    (RECEIVE[:3] + b"\x00" + RECEIVE[4:], r"frame: field 'type': unknown message type 0"),
    (RECEIVE[:-1], r"Receive: field 'length': truncated"),
    (RECEIVE + b"\x00", r"Receive: field 'length': trailing bytes"),
    (_with_u32(RECEIVE, 4, 0xFFFFFFFF), r"Receive: field 'length': truncated: the header announces 4294967295"),
    (_with_u32(RECEIVE, 4, 4)[:12], r"Receive: field 'length': truncated: 4 payload bytes"),
    (_with_u32(RECEIVE, 16, 0xFFFFFFFF), r"Receive: field 'slot': missing"),
    (_with_u32(ACK, 41, 0xFFFFFFF0), r"Ack: field 'error': a string of 4294967280 bytes"),
    (ACK[:-2] + b"\xff\xfe", r"Ack: field 'error': not valid UTF-8"),
    (ACK[:20] + b"\x02" + ACK[21:], r"Ack: field 'ok': flag 2"),
    (ACK[:25] + struct.pack("!d", math.nan) + ACK[33:], r"Ack: field 'stage_s': nan is not a finite duration"),
    (ACK[:33] + struct.pack("!d", -math.inf) + ACK[41:], r"Ack: field 'commit_s': -inf"),
    (_with_u32(BYE, 20, 4), r"Bye: field 'reason': truncated"),
    (_with_u32(BYE, 20, 2), r"Bye: field 'reason': trailing bytes"),
    (_with_u32(encode(Stop("x")), 8, MAX_STRING + 1), r"Stop: field 'reason': a string of 65537 bytes, more than the limit of 65536"),
    (encode(MapSlots((1,), (64,)))[:8] + struct.pack("!BI", 0, MAX_SLOTS + 1), r"MapSlots: field 'length'"),
    (
        struct.pack("!2sBBIBI", b"AS", PROTOCOL_VERSION, 3, 5 + 12 * 300, 0, 300) + bytes(12 * 300),
        r"MapSlots: field 'count': 300 slots, more than 253",
    ),
    (struct.pack("!2sBBIBI", b"AS", PROTOCOL_VERSION, 3, 5, 0, 2), r"MapSlots: field 'slots': truncated: 2 slots need"),
    (struct.pack("!2sBBIBIIQIQ", b"AS", PROTOCOL_VERSION, 3, 29, 0, 2, 1, 64, 1, 64), r"MapSlots: field 'slot_ids': a slot is named twice"),
    (struct.pack("!2sBBIBIIQ", b"AS", PROTOCOL_VERSION, 3, 17, 2, 1, 1, 64), r"MapSlots: field 'transient': flag 2"),
    (_setup_frame([("w", 1, (3, 4), 0, 11)], 64), r"Setup: field 'layout.specs\[0\].numel': 'w': 11 elements, but shape \(3, 4\) holds 12"),
    (_setup_frame([("w", 1, (3, 4), 32, 12)], 64), r"Setup: field 'layout.specs\[0\].offset': 'w': bytes 32..80 lie outside the 64-byte buffer"),
    (_setup_frame([("w", 1, (3,), 2, 3)], 64), r"Setup: field 'layout.specs\[0\].offset': 'w': offset 2 is not aligned"),
    (_setup_frame([("w", 200, (3,), 0, 3)], 64), r"Setup: field 'layout.specs\[0\].dtype': unknown dtype code 200"),
    (_setup_frame([("w", 1, (1,) * (MAX_NDIM + 1), 0, 1)], 64), r"Setup: field 'layout.specs\[0\].ndim': 65 dimensions"),
    (_setup_frame([("a", 1, (4,), 0, 4), ("b", 1, (4,), 8, 4)], 64), r"Setup: field 'layout.specs': 'a' and 'b' overlap"),
    (_setup_frame([("a", 1, (4,), 0, 4), ("a", 1, (4,), 16, 4)], 64), r"Setup: field 'layout.specs\[1\].key': 'a' appears twice"),
    (_setup_frame([("a", 1, (0, 1 << 63), 0, 0)], 64), r"Setup: field 'layout.specs\[0\].shape': 'a': dimension 9223372036854775808"),
    (_setup_frame([("a", 1, (4,), 0, 4)], 1 << 63), r"Setup: field 'layout.nbytes'"),
    (_setup_frame([("a", 1, (4,), 0, 4)], 64, (("b", "nope"),)), r"Setup: field 'layout.aliases\[0\].canonical': 'nope' is not a key"),
    (_setup_frame([("a", 1, (4,), 0, 4)], 64, (("a", "a"),)), r"Setup: field 'layout.aliases\[0\].alias': 'a' is already a key"),
    (_setup_frame([("a", 1, (4,), 0, 4)], 64)[:-1], r"Setup: field 'layout.specs\[0\]': truncated"),
    (_setup_frame([("a", 1, (4,), 0, 4)], 64) + b"\x00", r"Setup: field 'length': trailing bytes"),
    (_with_u32(_setup_frame([("a" * 30, 1, (4,), 0, 4)], 64), 24, 2) + b"\x00\x00", r"Setup: field 'layout.specs\[1\].key': truncated"),
    (
        _setup_frame([], 64)[:24] + struct.pack("!II", 1 << 20, 0),
        r"Setup: field 'layout': truncated: 1048576 tensors and 0 aliases cannot fit",
    ),
    (_setup_frame([], 64)[:24] + struct.pack("!II", (1 << 20) + 1, 0), r"Setup: field 'layout.specs': 1048577 tensors"),
]


def _fix_length(frame: bytes) -> bytes:
    """Rewrite the header's length field to match the frame (so inner fields are what is tested)."""
    if len(frame) < 8:
        return frame
    return frame[:4] + struct.pack("!I", len(frame) - 8) + frame[8:]


@pytest.mark.parametrize(("frame", "match"), REJECTED, ids=range(len(REJECTED)))
def test_the_decoder_rejects_malformed_frames_naming_message_and_field(frame: bytes, match: str) -> None:
    if "'length'" not in match and "frame:" not in match:
        frame = _fix_length(frame)
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def test_decode_takes_bytes_only() -> None:
    with pytest.raises(TypeError):
        decode(10**12)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        decode("AS")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the two directions

CONTROL_PLANE: list[Message] = [Challenge(b"\x00" * 32), Beat(), Group(1, 0, 2, 64), Lost(0, None, "left")]  # no local peer sends these


@pytest.mark.parametrize("msg", MESSAGES + CONTROL_PLANE, ids=lambda m: type(m).__name__)
def test_each_direction_decodes_its_own_messages_and_refuses_the_others_by_name(msg: Message) -> None:
    frame = encode(msg)
    for decode_one, kinds, sender in ((decode_to_worker, ToWorker, "a sender"), (decode_from_worker, FromWorker, "a worker")):
        if isinstance(msg, get_args(kinds)):
            assert decode_one(frame) == msg
            assert decode_one(memoryview(frame)) == msg
        else:
            with pytest.raises(ProtocolError, match=rf"^{type(msg).__name__}: {sender} never sends this message$"):
                decode_one(frame)


def test_a_message_of_the_other_direction_is_refused_before_its_payload_is_read() -> None:
    cut = _fix_length(encode(Setup(LAYOUT, None, 1))[:20])  # a Setup cut inside its layout
    with pytest.raises(ProtocolError, match="^Setup: a worker never sends this message$"):
        decode_from_worker(cut)
    with pytest.raises(ProtocolError, match="Setup: field 'layout'"):
        decode_to_worker(cut)
    with pytest.raises(ProtocolError, match="frame: field 'magic'"):  # the header is checked first
        decode_from_worker(b"XY" + cut[2:])
    with pytest.raises(ProtocolError, match="frame: field 'header': truncated"):
        decode_from_worker(cut[:5])


# ------------------------------------------------------------------------------ fuzzing

_DTYPE_LIST = sorted((d for d in _DTYPES.values() if d is not torch.complex32), key=str)  # complex32 warns in torch
keys = utf8_text(max_size=12)
shapes = st.lists(st.integers(0, 5), max_size=4).map(tuple)


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    items = draw(st.dictionaries(keys, st.tuples(shapes, st.sampled_from(_DTYPE_LIST)), max_size=6))
    names = list(items)
    aliases: list[tuple[str, str]] = []
    if names:
        for alias in draw(st.lists(keys.filter(lambda k: k not in items), max_size=3, unique=True)):
            aliases.append((alias, draw(st.sampled_from(names))))
    return Layout.from_shapes([(k, s, d) for k, (s, d) in items.items()], aliases=aliases)


u32 = st.integers(0, U32_MAX)
i64 = st.integers(*I64)
slots = st.none() | u32
texts = utf8_text(max_size=40)
durations = st.floats(0.0, 1e9, allow_nan=False)
messages = st.one_of(
    st.builds(Hello, u32, u32),
    st.builds(Setup, layouts(), st.none() | texts, u32),
    st.lists(st.tuples(u32, st.integers(0, (1 << 63) - 1)), max_size=5, unique_by=lambda t: t[0]).flatmap(
        lambda e: st.builds(MapSlots, st.just(tuple(s for s, _ in e)), st.just(tuple(n for _, n in e)), st.booleans())
    ),
    st.builds(Receive, i64, u32, st.integers(0, (1 << 64) - 1)),
    st.builds(Stop, texts),
    st.builds(Ack, u32, i64, st.booleans(), st.none() | texts, slots, durations, durations),
    st.builds(Staged, u32, i64, slots),
    st.builds(Bye, u32, i64, texts),
)


def _decode_or_reject(data: bytes) -> Message | None:
    """Decode *data*: a message or ProtocolError, nothing else, with bounded memory.

    Memory is traced during the decode only (tracing everything, hypothesis's generation
    included, makes the fuzz tests several times slower), unless the caller traces already.
    """
    outer = tracemalloc.is_tracing()
    if not outer:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        try:
            msg = decode(data)
        except ProtocolError:
            msg = None
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        if not outer:
            tracemalloc.stop()
    assert peak < 256 * 1024 + 64 * len(data), f"decoding {len(data)} bytes took {peak} bytes of memory"
    if msg is not None:
        assert decode(encode(msg)) == msg  # what decodes is a message that re-encodes
    return msg


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a hang hits the test timeout


@FUZZ
@given(messages)
def test_fuzz_round_trip_and_every_prefix_is_rejected(msg: Message) -> None:
    frame = encode(msg)
    assert _decode_or_reject(frame) == msg
    for n in range(len(frame)):
        with pytest.raises(ProtocolError):
            decode(frame[:n])
        _decode_or_reject(_fix_length(frame[:n]))  # a header that agrees: cut inside the fields
    with pytest.raises(ProtocolError):
        decode(frame + b"\x00")


@FUZZ
@given(messages, st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), min_size=1, max_size=8))
def test_fuzz_flipped_bytes(msg: Message, flips: list[tuple[int, int]]) -> None:
    frame = bytearray(encode(msg))
    for pos, mask in flips:
        frame[pos % len(frame)] ^= mask
    _decode_or_reject(bytes(frame))


@FUZZ
@given(messages, st.integers(0, 1 << 16), st.sampled_from([0xFFFFFFFF, 0xFFFFFFFE, 0x80000000, 1 << 20, MAX_STRING + 1, 0]) | u32)
def test_fuzz_oversized_length_fields(msg: Message, pos: int, value: int) -> None:
    frame = encode(msg)
    pos %= max(len(frame) - 3, 1)
    forged = _with_u32(frame, pos, value)
    _decode_or_reject(forged)
    _decode_or_reject(_fix_length(forged))  # with a header that agrees: the inner lengths are what is checked


@FUZZ
@given(st.binary(max_size=256), st.integers(0, 255), st.integers(0, 255))
def test_fuzz_random_bytes_and_headers(body: bytes, version: int, kind: int) -> None:
    _decode_or_reject(body)
    _decode_or_reject(struct.pack("!2sBBI", b"AS", version, kind, len(body)) + body)
    _decode_or_reject(struct.pack("!2sBBI", b"AS", PROTOCOL_VERSION, kind, len(body)) + body)
    if version != PROTOCOL_VERSION:
        with pytest.raises(ProtocolError, match="version"):
            decode(struct.pack("!2sBBI", b"AS", version, kind, len(body)) + body)
    if not 1 <= kind <= 17:
        with pytest.raises(ProtocolError, match="unknown message type"):
            decode(struct.pack("!2sBBI", b"AS", PROTOCOL_VERSION, kind, len(body)) + body)


@FUZZ
@given(messages, st.binary(min_size=2, max_size=2).filter(lambda m: m != b"AS"))
def test_fuzz_wrong_magic(msg: Message, magic: bytes) -> None:
    with pytest.raises(ProtocolError, match="magic"):
        decode(magic + encode(msg)[2:])


def test_a_huge_claimed_layout_is_rejected_before_allocation() -> None:
    frame = _fix_length(_setup_frame([], 64)[:24] + struct.pack("!II", 1 << 20, 1 << 20))
    assert _decode_or_reject(frame) is None
    with pytest.raises(ProtocolError, match="cannot fit"):
        decode(frame)


# ---------------------------------------------------------------- a peer sending garbage


Loopback = tuple[MultiProcessWeightSyncScheme, torch.nn.Module, dict[int, MultiProcessWeightSyncScheme], dict[int, torch.nn.Module]]


async def _loopback(n: int, **opts: Any) -> Loopback:
    """A sender and *n* connected loopback workers: (scheme, trainer model, workers, worker models)."""
    model = make_model()
    scheme = MultiProcessWeightSyncScheme(timeout=10, **opts)
    scheme.init_on_sender(model=model, num_workers=n)
    workers = {i: loopback_worker(scheme, i) for i in range(n)}
    models = {i: make_model() for i in range(n)}
    for i, w in workers.items():
        w.init_on_receiver(worker_idx=i, model=models[i])
    joining = [asyncio.ensure_future(w.connect()) for w in workers.values()]
    await scheme.connect()
    await asyncio.gather(*joining)
    return scheme, model, workers, models


async def _close(scheme: MultiProcessWeightSyncScheme, workers: dict[int, MultiProcessWeightSyncScheme]) -> None:
    await scheme.aclose()
    for w in workers.values():
        await w.aclose()


def _values(model: torch.nn.Module) -> set[float]:
    return {float(v) for t in model.state_dict().values() for v in t.unique()}


async def test_a_worker_sending_garbage_is_cut_off_and_named_the_others_go_on() -> None:
    scheme, model, workers, models = await _loopback(2)
    try:
        before = _values(models[0])
        workers[0].receiver._queue.put_bytes_nowait(b"\x80\x04garbage: not a frame")
        await scheme.sender.wait_dead(0, timeout=5)
        stats = scheme.sender.statistics().workers[0]
        assert stats.state == "dead" and "ProtocolError" in str(stats.reason)
        fill_(model, 2.0)
        with pytest.raises(WorkerDiedError, match=r"worker 0 .*was cut off: it sent a malformed message \(ProtocolError: frame: field 'magic'"):
            await scheme.send()
        await scheme.send(worker_ids=[1])
        assert _values(models[1]) == {2.0}
        assert scheme.sender.statistics().workers[1].state == "connected"
        # The cut worker's receiver saw its channel close: it keeps its weights, detached.
        with pytest.raises(SenderDiedError, match="the sender is gone"):
            await asyncio.wait_for(workers[0].receiver.wait_stopped(), 5)
        assert _values(models[0]) == before
    finally:
        await _close(scheme, workers)


async def test_a_worker_sending_a_sender_message_is_cut_off() -> None:
    scheme, _, workers, _ = await _loopback(1)
    try:
        workers[0].receiver._queue.put_bytes_nowait(encode(Receive(1, 0)))
        await scheme.sender.wait_dead(0, timeout=5)
        assert "Receive: a worker never sends this message" in str(scheme.sender.statistics().workers[0].reason)
    finally:
        await _close(scheme, workers)


async def test_a_cut_workers_slots_are_never_written_again() -> None:
    # Its process may still view them: the sender cannot know when it lets go.
    scheme, model, workers, _ = await _loopback(2, on_worker_error="skip")
    try:
        live = scheme._transport.ledger.links[0].live
        assert live is not None and live.slot is not None
        workers[0].receiver._queue.put_bytes_nowait(b"junk")
        await scheme.sender.wait_dead(0, timeout=5)
        for k in range(6):  # sends to both: worker 0's newest version moves on
            fill_(model, float(k))
            await scheme.send()
            assert live.slot in scheme._transport.ledger.owned()
            assert float(scheme._transport._pool.views(scheme._transport._pool.get(live.slot))["0.bias"][0]) != float(k)
    finally:
        await _close(scheme, workers)


async def test_a_sender_sending_garbage_ends_the_receiver_with_protocol_error() -> None:
    scheme, model, workers, models = await _loopback(2)
    try:
        before = _values(models[0])
        link = scheme._transport._workers[0].link
        assert link is not None
        link.queue.put_bytes_nowait(encode(Receive(1, 0))[:-3])
        with pytest.raises(ProtocolError, match=r"worker 0: the sender sent a malformed message \(Receive: field 'length': truncated"):
            await asyncio.wait_for(workers[0].receiver.wait_stopped(), 5)
        assert _values(models[0]) == before  # the weights it had, detached from the slot
        await scheme.sender.wait_dead(0, timeout=5)
        stats = scheme.sender.statistics().workers[0]
        assert stats.state == "left" and "malformed message from the sender" in str(stats.reason)
        fill_(model, 3.0)
        await scheme.send(worker_ids=[1])
        assert _values(models[1]) == {3.0}
    finally:
        await _close(scheme, workers)
