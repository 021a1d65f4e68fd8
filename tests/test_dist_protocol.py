"""The control-plane frames of the multi-host scheme: round trips, a fuzz of the decoder,
and a fuzz of the stream reader (header checked, size bounded, before any payload is read)."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync import BrokenChannelError, Layout, ProtocolError
from asyncsync._dist._control import HANDSHAKE_LIMIT, ControlStream, auth_mac, welcome_mac
from asyncsync._wire._codec import PROTOCOL_VERSION, decode, encode
from asyncsync._wire._control import FromRelay, Handshake, ToRelay, decode_from_relay, decode_handshake, decode_to_relay
from asyncsync._wire._messages import (
    MAX_TARGETS,
    Ack,
    Auth,
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
    Transfer,
    Welcome,
)
from tests._strategies import texts
from tests.test_protocol import _decode_or_reject, _fix_length

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def traced() -> Iterator[None]:
    """Memory tracing for ``_decode_or_reject``."""
    tracemalloc.start()
    yield
    tracemalloc.stop()

U32 = st.integers(0, (1 << 32) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
NONCE = st.binary(min_size=32, max_size=32)

MESSAGES: list[Message] = [
    Challenge(b"\x00" * 32),
    Auth(1, 2, 3, b"\x01" * 32, b"\xff" * 32),
    Welcome(b"\x07" * 32),
    Beat(),
    Group(1, 0, 1, 64 << 20),
    Group((1 << 32) - 1, 2, 3, 1),
    Transfer(0, 1, False, 0, ()),
    Transfer(-1, 7, True, 4096, (0, 1, 5)),
    Transfer(9, 2, False, 0, (1,), 8, ((0, 64), (128, 4))),
    Lost(0, None, "left: its receiver closed"),
    Lost(3, -9, "died ✝"),
]

messages = st.one_of(
    st.builds(Challenge, NONCE),
    st.builds(Auth, U32, U32, U32, NONCE, NONCE),
    st.builds(Welcome, NONCE),
    st.just(Beat()),
    st.integers(1, 1 << 16).flatmap(lambda size: st.builds(Group, U32, st.integers(0, size - 1), st.just(size), st.integers(1, 1 << 40))),
    st.builds(Transfer, I64, U32, st.booleans(), U32, st.lists(U32, max_size=8, unique=True).map(tuple), st.just(-1), st.just(())),
    st.builds(
        Transfer,
        I64,
        U32,
        st.booleans(),
        U32,
        st.lists(U32, max_size=8, unique=True).map(tuple),
        st.integers(0, (1 << 63) - 1),
        st.lists(st.integers(1, 1 << 20), min_size=2, max_size=16)
        .map(lambda xs: tuple(sorted(set(xs))))
        .filter(lambda xs: len(xs) >= 2)
        .map(lambda xs: tuple((a, b - a) for a, b in zip(xs[0::2], xs[1::2]))),
    ),
    st.builds(Lost, U32, st.none() | st.integers(-(1 << 31) + 1, (1 << 31) - 1), texts(max_size=40)),  # -2**31 means None
)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_control_messages_round_trip(msg: Message) -> None:
    assert decode(encode(msg)) == msg


def test_encoder_refuses_what_cannot_travel() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        encode(Challenge(b"short"))
    with pytest.raises(ValueError, match="rank 3"):
        encode(Group(1, 3, 3, 1))
    with pytest.raises(ValueError, match="targets"):
        encode(Transfer(0, 0, False, 0, tuple(range(MAX_TARGETS + 1))))
    with pytest.raises(ValueError, match="base version goes with byte ranges"):
        encode(Transfer(0, 0, False, 0, (), 3, ()))


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (encode(Group(1, 0, 2, 1))[:-8] + struct.pack("!IIIQ", 1, 2, 2, 1)[8:], "Group: field 'length'"),
        (encode(Group(1, 1, 2, 1))[:12] + struct.pack("!I", 2) + encode(Group(1, 1, 2, 1))[16:], "Group: field 'rank'"),
        (_fix_length(encode(Transfer(0, 0, False, 0, ()))[:-16] + struct.pack("!IIIqI", 2, 1, 1, -1, 0)), "Transfer: field 'targets'"),
        (encode(Transfer(0, 0, False, 0, (1,)))[:-4], "Transfer"),
        (_fix_length(encode(Transfer(0, 0, False, 0, ()))[:-12] + struct.pack("!qI", 3, 0)), "Transfer: field 'base'"),
        (_fix_length(encode(Transfer(0, 0, False, 0, ()))[:-12] + struct.pack("!qIQQQQ", 3, 2, 8, 4, 4, 4)), "Transfer: field 'ranges'"),
        (_fix_length(encode(Lost(0, 1, "x"))[:-1]), "Lost: field 'reason': truncated"),
    ],
)
def test_decoder_rejects_malformed_control_frames(frame: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


SHARED: list[Message] = [Setup(Layout((), 0), None, 1), Stop(), Ack(0, 1, True), Bye(0, -1, "refused")]  # local messages the control plane reuses
LOCAL_ONLY: list[Message] = [Hello(0, 1), Receive(1, 0), Poll(0), Mailbox(64), MapSlots((0,), (64,)), Staged(0, 1, None)]
DIRECTIONS: list[tuple[Callable[[bytes], Any], Any, str]] = [
    (decode_to_relay, ToRelay, "a trainer never sends this message"),
    (decode_from_relay, FromRelay, "a relay never sends this message"),
    (decode_handshake, Handshake, "not a handshake message"),
]


@pytest.mark.parametrize("msg", MESSAGES + SHARED + LOCAL_ONLY, ids=lambda m: type(m).__name__)
def test_each_control_direction_decodes_its_own_messages_and_refuses_the_others_by_name(msg: Message) -> None:
    frame = encode(msg)
    for decode_one, kinds, refusal in DIRECTIONS:
        if isinstance(msg, get_args(kinds)):
            assert decode_one(frame) == msg
        else:
            with pytest.raises(ProtocolError, match=rf"^{type(msg).__name__}: {refusal}$"):
                decode_one(frame)


def test_the_stream_reader_refuses_a_message_of_the_other_direction_naming_the_peer() -> None:
    async def read() -> BaseException:
        reader = asyncio.StreamReader()
        reader.feed_data(encode(Beat()) + encode(Group(1, 0, 2, 64)))
        stream = ControlStream(reader, None, "relay at 10.0.0.1:1234", decode_from_relay)
        assert await stream.recv(timeout=5) == Beat()
        with pytest.raises(ProtocolError) as info:
            await stream.recv(timeout=5)
        return info.value

    assert str(asyncio.run(read())) == "relay at 10.0.0.1:1234: Group: a relay never sends this message"


def test_macs_bind_the_token_the_nonce_and_the_claim() -> None:
    nonce = b"\x05" * 32
    good = auth_mac(b"token", nonce, 1, 2)
    assert good != auth_mac(b"token2", nonce, 1, 2)
    assert good != auth_mac(b"token", b"\x06" * 32, 1, 2)
    assert good != auth_mac(b"token", nonce, 2, 2)  # another host cannot reuse it
    assert good != auth_mac(b"token", nonce, 1, 3)
    assert welcome_mac(b"token", nonce) != good  # the two directions differ


@FUZZ
@given(messages)
def test_fuzz_control_round_trip_and_prefixes(traced: None, msg: Message) -> None:
    frame = encode(msg)
    assert _decode_or_reject(frame) == msg
    for n in range(len(frame)):
        with pytest.raises(ProtocolError):
            decode(frame[:n])
        _decode_or_reject(_fix_length(frame[:n]))
    with pytest.raises(ProtocolError):
        decode(frame + b"\x00")


@FUZZ
@given(messages, st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), min_size=1, max_size=8))
def test_fuzz_control_flipped_bytes(traced: None, msg: Message, flips: list[tuple[int, int]]) -> None:
    frame = bytearray(encode(msg))
    for pos, mask in flips:
        frame[pos % len(frame)] ^= mask
    _decode_or_reject(bytes(frame))


async def _read_all(data: bytes, limit: int) -> list[Message | BaseException]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    stream = ControlStream(reader, None, "peer 10.0.0.1:1234", decode)
    stream.limit = limit
    out: list[Message | BaseException] = []
    while True:
        try:
            out.append(await stream.recv(timeout=5))
        except (ProtocolError, BrokenChannelError) as exc:
            out.append(exc)
            return out


@FUZZ
@given(st.lists(messages, max_size=4), st.binary(max_size=200), st.sampled_from([HANDSHAKE_LIMIT, 1 << 20]))
def test_fuzz_stream_reader(msgs: list[Message], junk: bytes, limit: int) -> None:
    """Good frames then junk: every good frame comes out, then one clear error naming the peer."""
    good = [m for m in msgs if len(encode(m)) - 8 <= limit]
    out = asyncio.run(_read_all(b"".join(encode(m) for m in good) + junk, limit))
    assert out[: len(good)] == good
    err = out[-1]
    assert isinstance(err, (ProtocolError, BrokenChannelError)) and "peer 10.0.0.1:1234" in str(err)


def test_stream_reader_refuses_an_oversized_frame_before_reading_it() -> None:
    header = struct.pack("!2sBBI", b"AS", PROTOCOL_VERSION, 10, 1 << 31)
    out = asyncio.run(_read_all(header, HANDSHAKE_LIMIT))
    assert isinstance(out[0], ProtocolError) and "more than the 76 allowed" in str(out[0])
