"""Control messages between sender and receivers, and their binary wire format.

Sender -> worker: :class:`Setup` (once per connection), :class:`MapSlots` (followed by
the slots' file descriptors), :class:`Receive` (apply the weights of ``version`` that
sit in ``slot``; at most one is outstanding per worker), :class:`Mailbox` (to a polled
worker, followed by the mailbox's and the wake's descriptors; it then replaces ``Receive``,
and the worker's acks of applied versions go there), :class:`Stop`.
Worker -> sender: :class:`Hello`, :class:`Poll` (this worker polls), :class:`Ack`,
:class:`Staged` (manual commit mode) and :class:`Bye` (the receiver ends, its weights
already detached from every shared slot).
Every instruction names exactly the weights it refers to (slot and version), so a
late or repeated message can never make a worker apply the wrong version.

On the wire a message is one frame (:func:`encode` / :func:`decode`): a fixed header
``!2sBBI`` (magic ``b"AS"``, protocol version 1, message type, payload length), then the
type's fixed fields (big-endian ``struct`` codes), then its variable parts, each
length-prefixed. Nothing a peer sends is unpickled: :func:`decode` only unpacks numbers
and UTF-8 strings, checks every length against the bytes actually there before it
allocates anything, and raises :class:`~._errors.ProtocolError` (naming the message type
and the field) for anything malformed. The hot messages, :class:`Receive` and an
:class:`Ack` without error text, are one ``Struct.pack`` / ``unpack_from`` each.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._core._layout import Layout, TensorSpec
from .._errors import ProtocolError

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "MAX_ALIASES",
    "MAX_NDIM",
    "MAX_SLOTS",
    "MAX_SPECS",
    "MAX_STRING",
    "PROTOCOL_VERSION",
    "MAX_TARGETS",
    "NONCE_BYTES",
    "Poll",
    "Ack",
    "Auth",
    "Beat",
    "Bye",
    "Challenge",
    "Group",
    "Hello",
    "Lost",
    "Mailbox",
    "MapSlots",
    "Message",
    "Receive",
    "Setup",
    "Staged",
    "Stop",
    "Transfer",
    "Welcome",
    "decode",
    "encode",
    "payload_length",
]


class Hello(NamedTuple):
    """A receiver announces itself."""

    worker_idx: int
    pid: int


class Setup(NamedTuple):
    """The wire layout of the weights, the worker's device and the sender's pid."""

    layout: Layout
    device: str | None
    sender_pid: int


class MapSlots(NamedTuple):
    """Map these slots; ``len(slot_ids)`` file descriptors follow on the socket."""

    slot_ids: tuple[int, ...]
    nbytes: tuple[int, ...]
    transient: bool = False  # unmap once released (the "queue" transport)


class Receive(NamedTuple):
    """Apply version ``version`` found in ``slot``; ``skipped``: versions sent to this
    worker since its previous ``Receive`` that it will never see (latest wins)."""

    version: int
    slot: int
    skipped: int = 0


class Poll(NamedTuple):
    """Worker -> sender: this worker polls; deliver its versions through a mailbox
    (a version word in shared memory) instead of ``Receive`` messages."""

    worker_idx: int


class Mailbox(NamedTuple):
    """Sender -> worker: map this mailbox of ``nbytes``; two file descriptors follow on the
    socket: the mailbox's segment and the sender's wake (an eventfd). From now on versions
    arrive in the mailbox (``Receive`` is not sent any more), and the worker acks what it
    applied there too, then writes the wake (a rejection still goes as an ``Ack``)."""

    nbytes: int


class Stop(NamedTuple):
    """End the receiver task."""

    reason: str = "stop"


class Ack(NamedTuple):
    """Outcome of ``version`` on ``worker_idx``.

    ``ok`` False means the worker kept its previous weights; ``error`` says why.
    ``holds`` is the slot the worker's model now points into (None: it owns its
    weights). Acks cover every older version the worker skipped (latest wins).
    """

    worker_idx: int
    version: int
    ok: bool
    error: str | None = None
    holds: int | None = None
    stage_s: float = 0.0
    commit_s: float = 0.0


class Staged(NamedTuple):
    """Manual commit: ``version`` is staged (in ``holds``, or in the worker's own memory
    when None) and waits for ``commit()``; every older version sent is released."""

    worker_idx: int
    version: int
    holds: int | None


class Bye(NamedTuple):
    """The receiver ends (``reason``) at ``version``; it holds no shared slot any more."""

    worker_idx: int
    version: int
    reason: str


# ---- the multi-host control plane (trainer <-> relay over TCP), same framing -------------


class Challenge(NamedTuple):
    """Trainer -> relay, first frame on a connection: prove you know the token."""

    nonce: bytes  # 32 random bytes


class Auth(NamedTuple):
    """Relay -> trainer: ``mac = HMAC-SHA256(token, b"relay" + challenge nonce + host + num_workers)``;
    ``nonce`` is the relay's own challenge for the trainer."""

    host: int
    num_workers: int
    pid: int
    nonce: bytes  # 32 bytes
    mac: bytes  # 32 bytes


class Welcome(NamedTuple):
    """Trainer -> relay: ``mac = HMAC-SHA256(token, b"trainer" + the relay's nonce)``."""

    mac: bytes  # 32 bytes


class Beat(NamedTuple):
    """Heartbeat, both ways: the connection is alive."""


class Group(NamedTuple):
    """Trainer -> relay: form weight-sync group ``generation`` as ``rank`` of ``size``;
    transfers on it travel in chunks of ``chunk_bytes``."""

    generation: int
    rank: int
    size: int
    chunk_bytes: int


class Transfer(NamedTuple):
    """Trainer -> relay: the bytes of ``version`` follow on the group of ``generation``,
    by broadcast (``p2p`` False) or a point-to-point send tagged ``tag``; publish them to
    the local workers ``targets``. With ``base >= 0`` (a partial update), only the byte
    ``ranges`` ``(offset, length)`` of the wire buffer follow: the rest is the targets'
    newest version, ``base``, which the relay already holds."""

    version: int
    generation: int
    p2p: bool
    tag: int
    targets: tuple[int, ...]
    base: int = -1
    ranges: tuple[tuple[int, int], ...] = ()


class Lost(NamedTuple):
    """Relay -> trainer: local worker ``worker_idx`` died (``exitcode``) or left (``reason``)."""

    worker_idx: int
    exitcode: int | None
    reason: str


Message = Hello | Setup | MapSlots | Receive | Stop | Ack | Staged | Bye | Challenge | Auth | Welcome | Beat | Group | Transfer | Lost | Poll | Mailbox

# ------------------------------------------------------------------------ wire format

MAGIC = b"AS"
PROTOCOL_VERSION = 1
MAX_STRING = 64 * 1024  # bytes of one UTF-8 string (keys, device, error texts, reasons)
MAX_SPECS = 1 << 20  # tensors in one layout
MAX_ALIASES = 1 << 20  # alias pairs in one layout
MAX_NDIM = 64  # dimensions of one tensor
MAX_SLOTS = 253  # slots in one MapSlots: what one SCM_RIGHTS message carries on Linux

_HEADER = struct.Struct("!2sBBI")  # magic, protocol version, message type, payload length
_HEAD = _HEADER.format[1:]
_H = _HEADER.size
_NONE = 0xFFFFFFFF  # u32 sentinel: a slot or an optional string that is None
_MAX_U32 = 0xFFFFFFFF
_MAX_I64 = (1 << 63) - 1

# Message type codes (u8). Never renumber: add new types at the end.
_HELLO, _SETUP, _MAP_SLOTS, _RECEIVE, _STOP, _ACK, _STAGED, _BYE = range(1, 9)
_CHALLENGE, _AUTH, _WELCOME, _BEAT, _GROUP, _TRANSFER, _LOST = range(9, 16)
_POLL, _MAILBOX = range(16, 18)
_NAMES = {
    _HELLO: "Hello",
    _SETUP: "Setup",
    _MAP_SLOTS: "MapSlots",
    _RECEIVE: "Receive",
    _STOP: "Stop",
    _ACK: "Ack",
    _STAGED: "Staged",
    _BYE: "Bye",
    _CHALLENGE: "Challenge",
    _AUTH: "Auth",
    _WELCOME: "Welcome",
    _BEAT: "Beat",
    _GROUP: "Group",
    _TRANSFER: "Transfer",
    _LOST: "Lost",
    _POLL: "Poll",
    _MAILBOX: "Mailbox",
}
NONCE_BYTES = 32  # Challenge / Auth nonces and HMAC-SHA256 digests
MAX_TARGETS = 1 << 16  # local workers named in one Transfer
MAX_RANGES = 1 << 16  # byte ranges in one partial Transfer

# Whole frames of the fixed-size messages, and fixed parts of the others (header included).
_HELLO_S = struct.Struct(f"!{_HEAD}II")  # worker_idx u32, pid u32
_POLL_S = struct.Struct(f"!{_HEAD}I")  # worker_idx u32
_MAILBOX_S = struct.Struct(f"!{_HEAD}I")  # nbytes u32
MAX_MAILBOX = 1 << 16  # bytes of a mailbox segment
_RECEIVE_S = struct.Struct(f"!{_HEAD}qIQ")  # version i64, slot u32, skipped u64
_STAGED_S = struct.Struct(f"!{_HEAD}IqI")  # worker_idx u32, version i64, holds u32|None
_ACK_S = struct.Struct(f"!{_HEAD}IqBIddI")  # worker_idx, version, ok u8, holds, stage_s f64, commit_s f64, error length u32|None
_BYE_S = struct.Struct(f"!{_HEAD}IqI")  # worker_idx, version, reason length; then the reason
_STOP_S = struct.Struct(f"!{_HEAD}I")  # reason length; then the reason
_MAP_S = struct.Struct(f"!{_HEAD}BI")  # transient u8, count u32; then count x (slot id u32, nbytes u64)
_MAP_ENTRY = struct.Struct("!IQ")
_SETUP_S = struct.Struct(f"!{_HEAD}II")  # sender_pid u32, device length u32|None; then the device
_LAYOUT_S = struct.Struct("!QII")  # total nbytes u64, spec count u32, alias count u32
_SPEC_S = struct.Struct("!BB")  # dtype code u8, ndim u8; then shape ndim x u64, offset u64, numel u64
_U32 = struct.Struct("!I")
_CHALLENGE_S = struct.Struct(f"!{_HEAD}32s")
_AUTH_S = struct.Struct(f"!{_HEAD}III32s32s")  # host, num_workers, pid, nonce, mac
_WELCOME_S = struct.Struct(f"!{_HEAD}32s")
_BEAT_S = struct.Struct(f"!{_HEAD}")
_GROUP_S = struct.Struct(f"!{_HEAD}IIIQ")  # generation, rank, size, chunk_bytes
_TRANSFER_S = struct.Struct(f"!{_HEAD}qIBII")  # version, generation, p2p u8, tag, target count; then count x u32, base q, range count u32, ranges x (u64, u64)
_LOST_S = struct.Struct(f"!{_HEAD}IBiI")  # worker_idx, has exit code u8, exit code i32, reason length; then the reason
_SPEC_TAIL = [struct.Struct(f"!{n + 2}Q") for n in range(MAX_NDIM + 1)]  # shape..., offset, numel
_MIN_SPEC = _U32.size + _SPEC_S.size + 16  # empty key, scalar
_MIN_ALIAS = 2 * _U32.size

# dtype codes (u8): a fixed table; never renumber. Dtypes this torch lacks are skipped.
_DTYPE_NAMES = (
    (1, "float32"),
    (2, "float64"),
    (3, "float16"),
    (4, "bfloat16"),
    (5, "uint8"),
    (6, "int8"),
    (7, "int16"),
    (8, "int32"),
    (9, "int64"),
    (10, "bool"),
    (11, "complex64"),
    (12, "complex128"),
    (13, "complex32"),
    (14, "uint16"),
    (15, "uint32"),
    (16, "uint64"),
    (17, "float8_e4m3fn"),
    (18, "float8_e5m2"),
    (19, "float8_e4m3fnuz"),
    (20, "float8_e5m2fnuz"),
    (21, "float8_e8m0fnu"),
)
_DTYPES: dict[int, torch.dtype] = {c: getattr(torch, n) for c, n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
_DTYPE_CODES: dict[torch.dtype, int] = {d: c for c, d in _DTYPES.items()}
_ITEMSIZE: dict[int, int] = {c: d.itemsize for c, d in _DTYPES.items()}


# --------------------------------------------------------------------------- encoding


def encode(msg: Message) -> bytes:
    """The frame of *msg*.

    Raises ``ValueError`` for a message that cannot travel: a number out of its field's
    range, a key or device string over :data:`MAX_STRING` bytes, a dtype outside the table,
    counts over the limits. Error texts and reasons over the limit are shortened instead.
    """
    if type(msg) is Receive:  # the hot path
        if msg.slot == _NONE:
            raise ValueError(f"cannot encode {msg!r}: slot id {_NONE} is reserved (it means None)")
        try:
            return _RECEIVE_S.pack(MAGIC, PROTOCOL_VERSION, _RECEIVE, _RECEIVE_S.size - _H, msg.version, msg.slot, msg.skipped)
        except struct.error as exc:
            raise ValueError(f"cannot encode {msg!r}: {exc}") from None
    encoder = _ENCODERS.get(type(msg))
    if encoder is None:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    try:
        return encoder(msg)
    except struct.error as exc:
        raise ValueError(f"cannot encode {type(msg).__name__}: {exc}") from None


def _slot(value: int | None) -> int:
    if value is None:
        return _NONE
    if value == _NONE:
        raise ValueError(f"slot id {value} is reserved (it means None)")
    return value


def _text(value: str, field: str, shorten: bool = False) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > MAX_STRING:
        if not shorten:
            raise ValueError(f"field {field!r} is {len(raw)} bytes of UTF-8, more than the limit of {MAX_STRING}")
        raw = raw[: MAX_STRING - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."
    return raw


def _encode_ack(m: Ack) -> bytes:
    err = b"" if m.error is None else _text(m.error, "error", shorten=True)
    n = _NONE if m.error is None else len(err)
    head = _ACK_S.pack(
        MAGIC, PROTOCOL_VERSION, _ACK, _ACK_S.size - _H + len(err), m.worker_idx, m.version, bool(m.ok), _slot(m.holds), m.stage_s, m.commit_s, n
    )
    return head + err if err else head


def _encode_hello(m: Hello) -> bytes:
    return _HELLO_S.pack(MAGIC, PROTOCOL_VERSION, _HELLO, _HELLO_S.size - _H, m.worker_idx, m.pid)


def _encode_poll(m: Poll) -> bytes:
    return _POLL_S.pack(MAGIC, PROTOCOL_VERSION, _POLL, _POLL_S.size - _H, m.worker_idx)


def _encode_mailbox(m: Mailbox) -> bytes:
    if not 0 < m.nbytes <= MAX_MAILBOX:
        raise ValueError(f"Mailbox: {m.nbytes} bytes is not in 1..{MAX_MAILBOX}")
    return _MAILBOX_S.pack(MAGIC, PROTOCOL_VERSION, _MAILBOX, _MAILBOX_S.size - _H, m.nbytes)


def _encode_staged(m: Staged) -> bytes:
    return _STAGED_S.pack(MAGIC, PROTOCOL_VERSION, _STAGED, _STAGED_S.size - _H, m.worker_idx, m.version, _slot(m.holds))


def _encode_bye(m: Bye) -> bytes:
    reason = _text(m.reason, "reason", shorten=True)
    return _BYE_S.pack(MAGIC, PROTOCOL_VERSION, _BYE, _BYE_S.size - _H + len(reason), m.worker_idx, m.version, len(reason)) + reason


def _encode_stop(m: Stop) -> bytes:
    reason = _text(m.reason, "reason", shorten=True)
    return _STOP_S.pack(MAGIC, PROTOCOL_VERSION, _STOP, _STOP_S.size - _H + len(reason), len(reason)) + reason


def _encode_map_slots(m: MapSlots) -> bytes:
    if len(m.slot_ids) != len(m.nbytes):
        raise ValueError(f"MapSlots has {len(m.slot_ids)} slot ids but {len(m.nbytes)} sizes")
    if len(m.slot_ids) > MAX_SLOTS:
        raise ValueError(f"MapSlots: at most {MAX_SLOTS} slots at a time, got {len(m.slot_ids)}")
    parts = [b""]
    for sid, nbytes in zip(m.slot_ids, m.nbytes):
        if not 0 <= nbytes <= _MAX_I64:
            raise ValueError(f"MapSlots: slot {sid} has a size of {nbytes} bytes")
        parts.append(_MAP_ENTRY.pack(_slot(sid), nbytes))
    size = _MAP_S.size - _H + _MAP_ENTRY.size * len(m.slot_ids)
    parts[0] = _MAP_S.pack(MAGIC, PROTOCOL_VERSION, _MAP_SLOTS, size, bool(m.transient), len(m.slot_ids))
    return b"".join(parts)


def _encode_setup(m: Setup) -> bytes:
    layout = m.layout
    if len(layout.specs) > MAX_SPECS or len(layout.aliases) > MAX_ALIASES:
        raise ValueError(f"Setup: a layout holds at most {MAX_SPECS} tensors and {MAX_ALIASES} aliases")
    device = b"" if m.device is None else _text(m.device, "device")
    parts = [b"", device, _LAYOUT_S.pack(layout.nbytes, len(layout.specs), len(layout.aliases))]
    for s in layout.specs:
        key = _text(s.key, f"layout key {s.key[:80]!r}")
        code = _DTYPE_CODES.get(s.dtype)
        if code is None:
            raise ValueError(f"Setup: {s.key!r} has dtype {s.dtype}, which the wire format does not carry")
        if len(s.shape) > MAX_NDIM:
            raise ValueError(f"Setup: {s.key!r} has {len(s.shape)} dimensions, more than {MAX_NDIM}")
        parts += (_U32.pack(len(key)), key, _SPEC_S.pack(code, len(s.shape)), _SPEC_TAIL[len(s.shape)].pack(*s.shape, s.offset, s.numel))
    for alias, canonical in layout.aliases:
        for name in (alias, canonical):
            raw = _text(name, f"alias {name[:80]!r}")
            parts += (_U32.pack(len(raw)), raw)
    size = _SETUP_S.size - _H + sum(len(p) for p in parts)
    if size > _MAX_U32:
        raise ValueError(f"Setup: the layout needs {size} bytes, more than a frame holds")
    parts[0] = _SETUP_S.pack(MAGIC, PROTOCOL_VERSION, _SETUP, size, m.sender_pid, _NONE if m.device is None else len(device))
    return b"".join(parts)


def _nonce(value: bytes, field: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise ValueError(f"field {field!r} must be {NONCE_BYTES} bytes")
    return value


def _encode_challenge(m: Challenge) -> bytes:
    return _CHALLENGE_S.pack(MAGIC, PROTOCOL_VERSION, _CHALLENGE, _CHALLENGE_S.size - _H, _nonce(m.nonce, "nonce"))


def _encode_auth(m: Auth) -> bytes:
    return _AUTH_S.pack(
        MAGIC, PROTOCOL_VERSION, _AUTH, _AUTH_S.size - _H, m.host, m.num_workers, m.pid, _nonce(m.nonce, "nonce"), _nonce(m.mac, "mac")
    )


def _encode_welcome(m: Welcome) -> bytes:
    return _WELCOME_S.pack(MAGIC, PROTOCOL_VERSION, _WELCOME, _WELCOME_S.size - _H, _nonce(m.mac, "mac"))


def _encode_beat(m: Beat) -> bytes:
    return _BEAT_S.pack(MAGIC, PROTOCOL_VERSION, _BEAT, 0)


def _encode_group(m: Group) -> bytes:
    if not 0 <= m.rank < m.size:
        raise ValueError(f"Group: rank {m.rank} is not in 0..{m.size - 1}")
    if not 0 < m.chunk_bytes <= _MAX_I64:
        raise ValueError(f"Group: chunk_bytes {m.chunk_bytes} must be positive")
    return _GROUP_S.pack(MAGIC, PROTOCOL_VERSION, _GROUP, _GROUP_S.size - _H, m.generation, m.rank, m.size, m.chunk_bytes)


def _encode_transfer(m: Transfer) -> bytes:
    if len(m.targets) > MAX_TARGETS:
        raise ValueError(f"Transfer: at most {MAX_TARGETS} targets, got {len(m.targets)}")
    if len(m.ranges) > MAX_RANGES:
        raise ValueError(f"Transfer: at most {MAX_RANGES} ranges, got {len(m.ranges)}")
    if m.base < -1 or (m.base >= 0) != bool(m.ranges):
        raise ValueError("Transfer: a base version goes with byte ranges, and ranges with a base")
    flat = [x for r in m.ranges for x in r]
    tail = struct.pack(f"!{len(m.targets)}IqI{len(flat)}Q", *m.targets, m.base, len(m.ranges), *flat)
    head = _TRANSFER_S.pack(
        MAGIC, PROTOCOL_VERSION, _TRANSFER, _TRANSFER_S.size - _H + len(tail), m.version, m.generation, bool(m.p2p), m.tag, len(m.targets)
    )
    return head + tail


def _encode_lost(m: Lost) -> bytes:
    reason = _text(m.reason, "reason", shorten=True)
    code = 0 if m.exitcode is None else m.exitcode
    size = _LOST_S.size - _H + len(reason)
    return _LOST_S.pack(MAGIC, PROTOCOL_VERSION, _LOST, size, m.worker_idx, m.exitcode is not None, code, len(reason)) + reason


_ENCODERS: dict[type, Callable[..., bytes]] = {
    Challenge: _encode_challenge,
    Auth: _encode_auth,
    Welcome: _encode_welcome,
    Beat: _encode_beat,
    Group: _encode_group,
    Transfer: _encode_transfer,
    Lost: _encode_lost,
    Hello: _encode_hello,
    Setup: _encode_setup,
    MapSlots: _encode_map_slots,
    Stop: _encode_stop,
    Ack: _encode_ack,
    Staged: _encode_staged,
    Bye: _encode_bye,
    Poll: _encode_poll,
    Mailbox: _encode_mailbox,
}


# --------------------------------------------------------------------------- decoding


_new = tuple.__new__  # builds a NamedTuple from checked fields, without its Python-level __new__


def _error(kind: str, field: str, problem: str) -> ProtocolError:
    return ProtocolError(f"{kind}: field {field!r}: {problem}")


def _header(data: bytes, what: str) -> tuple[str, int]:
    """The message type's name and the payload length of the header at the start of *data*;
    raise :class:`ProtocolError` if it is short (*what* says of what) or has a wrong magic,
    version or type."""
    if len(data) < _H:
        raise _error("frame", "header", f"truncated: {len(data)} bytes, {what} is {_H}")
    magic, version, kind, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise _error("frame", "magic", f"{magic!r} is not {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise _error("frame", "version", f"protocol version {version} is not supported (this end speaks {PROTOCOL_VERSION})")
    name = _NAMES.get(kind)
    if name is None:
        raise _error("frame", "type", f"unknown message type {kind}")
    return name, int(length)


def _check_header(data: bytes) -> None:
    """Raise the :class:`ProtocolError` that says what is wrong with the frame's header."""
    n = len(data)
    name, length = _header(data, "the header alone")
    if length != n - _H:
        what = "truncated" if length > n - _H else "trailing bytes"
        raise _error(name, "length", f"{what}: the header announces {length} payload bytes, the frame holds {n - _H}")


HEADER_BYTES = _H


def payload_length(header: bytes, limit: int) -> int:
    """The payload length announced by an 8-byte frame *header* (a stream transport reads
    the header, then exactly this many bytes). Raises :class:`ProtocolError` for a wrong
    magic, version or type, or a payload over *limit* bytes, before anything is read."""
    if len(header) != _H:
        raise _error("frame", "header", f"truncated: {len(header)} bytes, the header is {_H}")
    name, length = _header(header, "the header")
    if length > limit:
        raise _error(name, "length", f"{length} payload bytes, more than the {limit} allowed here")
    return length


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in frame *data* (exactly one frame); raise :class:`ProtocolError` if malformed."""
    if type(data) is not bytes:
        if not isinstance(data, (bytearray, memoryview)):
            raise TypeError(f"decode() takes bytes, not {type(data).__name__}")
        data = bytes(data)
    try:
        decoder = _DECODERS[data[3]]
    except (IndexError, KeyError):
        _check_header(data)  # raises: too short, or a bad magic, version or type
        raise AssertionError from None  # pragma: no cover
    return decoder(data)


def _decode_receive(data: bytes) -> Receive:
    if len(data) == _RECEIVE_S.size:
        magic, ver, _, length, version, slot, skipped = _RECEIVE_S.unpack_from(data)
        if magic == MAGIC and ver == PROTOCOL_VERSION and length == _RECEIVE_S.size - _H:
            if slot == _NONE:
                raise _error("Receive", "slot", "missing (the None sentinel)")
            return _new(Receive, (version, slot, skipped))
    _check_fixed(data, "Receive", _RECEIVE_S)
    raise AssertionError  # pragma: no cover


def _decode_ack(data: bytes) -> Ack:
    n = len(data)
    if n >= _ACK_S.size:
        magic, ver, _, length, worker, version, ok, holds, stage_s, commit_s, nerr = _ACK_S.unpack_from(data)
        if magic == MAGIC and ver == PROTOCOL_VERSION and length == n - _H:
            if ok > 1:
                raise _error("Ack", "ok", f"flag {ok} is neither 0 nor 1")
            if not (0.0 <= stage_s < math.inf):
                raise _error("Ack", "stage_s", f"{stage_s} is not a finite duration")
            if not (0.0 <= commit_s < math.inf):
                raise _error("Ack", "commit_s", f"{commit_s} is not a finite duration")
            error: str | None = None
            if nerr == _NONE:
                if n != _ACK_S.size:
                    raise _error("Ack", "error", f"trailing bytes: {n - _ACK_S.size} after a None error")
            else:
                error = _string(data, _ACK_S.size, nerr, n, "Ack", "error")
                if _ACK_S.size + nerr != n:
                    raise _error("Ack", "error", f"trailing bytes: {n - _ACK_S.size - nerr} after the error text")
            return _new(Ack, (worker, version, ok == 1, error, None if holds == _NONE else holds, stage_s, commit_s))
    _check_fixed(data, "Ack", _ACK_S, exact=False)
    raise AssertionError  # pragma: no cover


def _decode_hello(data: bytes) -> Hello:
    if len(data) == _HELLO_S.size:
        magic, ver, _, length, worker, pid = _HELLO_S.unpack_from(data)
        if magic == MAGIC and ver == PROTOCOL_VERSION and length == _HELLO_S.size - _H:
            return Hello(worker, pid)
    _check_fixed(data, "Hello", _HELLO_S)
    raise AssertionError  # pragma: no cover


def _decode_poll(data: bytes) -> Poll:
    _check_fixed(data, "Poll", _POLL_S)
    return Poll(_POLL_S.unpack_from(data)[4])


def _decode_mailbox(data: bytes) -> Mailbox:
    _check_fixed(data, "Mailbox", _MAILBOX_S)
    nbytes = _MAILBOX_S.unpack_from(data)[4]
    if not 0 < nbytes <= MAX_MAILBOX:
        raise _error("Mailbox", "nbytes", f"{nbytes} bytes is not in 1..{MAX_MAILBOX}")
    return Mailbox(nbytes)


def _decode_staged(data: bytes) -> Staged:
    if len(data) == _STAGED_S.size:
        magic, ver, _, length, worker, version, holds = _STAGED_S.unpack_from(data)
        if magic == MAGIC and ver == PROTOCOL_VERSION and length == _STAGED_S.size - _H:
            return Staged(worker, version, None if holds == _NONE else holds)
    _check_fixed(data, "Staged", _STAGED_S)
    raise AssertionError  # pragma: no cover


def _decode_bye(data: bytes) -> Bye:
    _check_fixed(data, "Bye", _BYE_S, exact=False)
    _, _, _, _, worker, version, nreason = _BYE_S.unpack_from(data)
    reason = _string(data, _BYE_S.size, nreason, len(data), "Bye", "reason")
    _no_trailing(data, _BYE_S.size + nreason, "Bye", "reason")
    return Bye(worker, version, reason)


def _decode_stop(data: bytes) -> Stop:
    _check_fixed(data, "Stop", _STOP_S, exact=False)
    _, _, _, _, nreason = _STOP_S.unpack_from(data)
    reason = _string(data, _STOP_S.size, nreason, len(data), "Stop", "reason")
    _no_trailing(data, _STOP_S.size + nreason, "Stop", "reason")
    return Stop(reason)


def _decode_map_slots(data: bytes) -> MapSlots:
    _check_fixed(data, "MapSlots", _MAP_S, exact=False)
    _, _, _, _, transient, count = _MAP_S.unpack_from(data)
    if transient > 1:
        raise _error("MapSlots", "transient", f"flag {transient} is neither 0 nor 1")
    if count > MAX_SLOTS:
        raise _error("MapSlots", "count", f"{count} slots, more than {MAX_SLOTS}")
    end = _MAP_S.size + count * _MAP_ENTRY.size
    if end != len(data):
        what = "truncated" if end > len(data) else "trailing bytes"
        raise _error("MapSlots", "slots", f"{what}: {count} slots need {end - _H} payload bytes, the frame holds {len(data) - _H}")
    ids: list[int] = []
    sizes: list[int] = []
    for sid, nbytes in _MAP_ENTRY.iter_unpack(memoryview(data)[_MAP_S.size :]):
        if sid == _NONE:
            raise _error("MapSlots", "slot_ids", "missing slot id (the None sentinel)")
        if nbytes > _MAX_I64:
            raise _error("MapSlots", "nbytes", f"slot {sid}: {nbytes} bytes is too large")
        ids.append(sid)
        sizes.append(nbytes)
    if len(set(ids)) != len(ids):
        raise _error("MapSlots", "slot_ids", f"a slot is named twice in {ids}")
    return MapSlots(tuple(ids), tuple(sizes), bool(transient))


def _decode_setup(data: bytes) -> Setup:
    _check_fixed(data, "Setup", _SETUP_S, exact=False)
    n = len(data)
    _, _, _, _, sender_pid, ndevice = _SETUP_S.unpack_from(data)
    pos = _SETUP_S.size
    device = _optional_string(data, pos, ndevice, n, "Setup", "device")
    if ndevice != _NONE:
        pos += ndevice
    if pos + _LAYOUT_S.size > n:
        raise _error("Setup", "layout", f"truncated: {n - pos} bytes left, the layout header alone is {_LAYOUT_S.size}")
    total, nspecs, naliases = _LAYOUT_S.unpack_from(data, pos)
    pos += _LAYOUT_S.size
    if total > _MAX_I64:
        raise _error("Setup", "layout.nbytes", f"{total} bytes is too large")
    if nspecs > MAX_SPECS:
        raise _error("Setup", "layout.specs", f"{nspecs} tensors, more than {MAX_SPECS}")
    if naliases > MAX_ALIASES:
        raise _error("Setup", "layout.aliases", f"{naliases} aliases, more than {MAX_ALIASES}")
    if nspecs * _MIN_SPEC + naliases * _MIN_ALIAS > n - pos:
        raise _error("Setup", "layout", f"truncated: {nspecs} tensors and {naliases} aliases cannot fit in the {n - pos} bytes left")
    specs: list[TensorSpec] = []
    keys: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for i in range(nspecs):
        field = f"layout.specs[{i}]"
        if pos + 4 > n:
            raise _error("Setup", f"{field}.key", "truncated")
        (nkey,) = _U32.unpack_from(data, pos)
        key = _string(data, pos + 4, nkey, n, "Setup", f"{field}.key")
        pos += 4 + nkey
        if pos + _SPEC_S.size > n:
            raise _error("Setup", field, "truncated")
        code, ndim = _SPEC_S.unpack_from(data, pos)
        pos += _SPEC_S.size
        dtype = _DTYPES.get(code)
        if dtype is None:
            raise _error("Setup", f"{field}.dtype", f"unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise _error("Setup", f"{field}.ndim", f"{ndim} dimensions, more than {MAX_NDIM}")
        tail = _SPEC_TAIL[ndim]
        if pos + tail.size > n:
            raise _error("Setup", field, f"truncated: {ndim} dimensions need {tail.size} bytes, {n - pos} left")
        *shape, offset, numel = tail.unpack_from(data, pos)
        pos += tail.size
        if key in keys:
            raise _error("Setup", f"{field}.key", f"{key!r} appears twice")
        keys.add(key)
        product = 1
        for d in shape:
            if d > _MAX_I64:
                raise _error("Setup", f"{field}.shape", f"{key!r}: dimension {d} is too large")
            product *= d
        if product != numel:
            raise _error("Setup", f"{field}.numel", f"{key!r}: {numel} elements, but shape {tuple(shape)} holds {product}")
        size = numel * _ITEMSIZE[code]
        if offset % _ITEMSIZE[code]:
            raise _error("Setup", f"{field}.offset", f"{key!r}: offset {offset} is not aligned to {dtype}")
        if offset + size > total:
            raise _error("Setup", f"{field}.offset", f"{key!r}: bytes {offset}..{offset + size} lie outside the {total}-byte buffer")
        if size:
            spans.append((offset, offset + size, key))
        specs.append(TensorSpec(key, tuple(shape), dtype, offset, numel))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise _error("Setup", "layout.specs", f"{a!r} and {b!r} overlap")
    aliases: list[tuple[str, str]] = []
    names: set[str] = set()
    for i in range(naliases):
        pair: list[str] = []
        for part in ("alias", "canonical"):
            if pos + 4 > n:
                raise _error("Setup", f"layout.aliases[{i}].{part}", "truncated")
            (nname,) = _U32.unpack_from(data, pos)
            pair.append(_string(data, pos + 4, nname, n, "Setup", f"layout.aliases[{i}].{part}"))
            pos += 4 + nname
        alias, canonical = pair
        if alias in keys or alias in names:
            raise _error("Setup", f"layout.aliases[{i}].alias", f"{alias!r} is already a key or an alias")
        if canonical not in keys:
            raise _error("Setup", f"layout.aliases[{i}].canonical", f"{canonical!r} is not a key of the layout")
        names.add(alias)
        aliases.append((alias, canonical))
    _no_trailing(data, pos, "Setup", "layout")
    return Setup(Layout(tuple(specs), total, tuple(aliases)), device, sender_pid)


def _check_fixed(data: bytes, name: str, fixed: struct.Struct, exact: bool = True) -> None:
    """Raise unless *data* has a good header and at least (or, with *exact*, exactly) *fixed*'s size."""
    _check_header(data)
    n = len(data)
    if n < fixed.size or (exact and n != fixed.size):
        what = "truncated" if n < fixed.size else "trailing bytes"
        raise _error(name, "length", f"{what}: {n - _H} payload bytes, {name} has {fixed.size - _H}")


def _optional_string(data: bytes, start: int, length: int, end: int, name: str, field: str) -> str | None:
    """Like :func:`_string`, but the sentinel length means None."""
    return None if length == _NONE else _string(data, start, length, end, name, field)


def _string(data: bytes, start: int, length: int, end: int, name: str, field: str) -> str:
    """The UTF-8 string of *length* bytes at *start*, checked against the frame's *end*."""
    if length > MAX_STRING:
        raise _error(name, field, f"a string of {length} bytes, more than the limit of {MAX_STRING}")
    if start + length > end:
        raise _error(name, field, f"truncated: a string of {length} bytes, {max(end - start, 0)} left")
    try:
        return data[start : start + length].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _error(name, field, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _no_trailing(data: bytes, pos: int, name: str, field: str) -> None:
    if pos != len(data):
        raise _error(name, field, f"trailing bytes: {len(data) - pos} after the last field")


def _decode_challenge(data: bytes) -> Challenge:
    _check_fixed(data, "Challenge", _CHALLENGE_S)
    return Challenge(_CHALLENGE_S.unpack_from(data)[4])


def _decode_auth(data: bytes) -> Auth:
    _check_fixed(data, "Auth", _AUTH_S)
    _, _, _, _, host, num_workers, pid, nonce, mac = _AUTH_S.unpack_from(data)
    return Auth(host, num_workers, pid, nonce, mac)


def _decode_welcome(data: bytes) -> Welcome:
    _check_fixed(data, "Welcome", _WELCOME_S)
    return Welcome(_WELCOME_S.unpack_from(data)[4])


def _decode_beat(data: bytes) -> Beat:
    _check_fixed(data, "Beat", _BEAT_S)
    return Beat()


def _decode_group(data: bytes) -> Group:
    _check_fixed(data, "Group", _GROUP_S)
    _, _, _, _, generation, rank, size, chunk_bytes = _GROUP_S.unpack_from(data)
    if not rank < size:
        raise _error("Group", "rank", f"rank {rank} is not in 0..{size - 1}")
    if not 0 < chunk_bytes <= _MAX_I64:
        raise _error("Group", "chunk_bytes", f"{chunk_bytes} is not a positive size")
    return Group(generation, rank, size, chunk_bytes)


def _decode_transfer(data: bytes) -> Transfer:
    _check_fixed(data, "Transfer", _TRANSFER_S, exact=False)
    _, _, _, _, version, generation, p2p, tag, count = _TRANSFER_S.unpack_from(data)
    if p2p > 1:
        raise _error("Transfer", "p2p", f"flag {p2p} is neither 0 nor 1")
    if count > MAX_TARGETS:
        raise _error("Transfer", "targets", f"{count} targets, more than {MAX_TARGETS}")
    end = _TRANSFER_S.size + 4 * count + 12
    if end > len(data):
        raise _error("Transfer", "targets", f"truncated: {count} targets need {end - _H} payload bytes, the frame holds {len(data) - _H}")
    targets = struct.unpack_from(f"!{count}I", data, _TRANSFER_S.size)
    if len(set(targets)) != count:
        raise _error("Transfer", "targets", "a worker is named twice")
    base, nranges = struct.unpack_from("!qI", data, end - 12)
    if nranges > MAX_RANGES:
        raise _error("Transfer", "ranges", f"{nranges} ranges, more than {MAX_RANGES}")
    if base < -1 or (base >= 0) != (nranges > 0):
        raise _error("Transfer", "base", f"base {base} with {nranges} ranges (a base version goes with ranges, and ranges with a base)")
    if end + 16 * nranges != len(data):
        what = "truncated" if end + 16 * nranges > len(data) else "trailing bytes"
        raise _error("Transfer", "ranges", f"{what}: {nranges} ranges need {end + 16 * nranges - _H} payload bytes, the frame holds {len(data) - _H}")
    flat = struct.unpack_from(f"!{2 * nranges}Q", data, end)
    ranges = tuple(zip(flat[0::2], flat[1::2]))
    last = 0
    for offset, length in ranges:
        if length == 0 or offset < last or offset + length > _MAX_I64:
            raise _error("Transfer", "ranges", f"range ({offset}, {length}) is empty, out of order or overlapping")
        last = offset + length
    return Transfer(version, generation, p2p == 1, tag, targets, base, ranges)


def _decode_lost(data: bytes) -> Lost:
    _check_fixed(data, "Lost", _LOST_S, exact=False)
    _, _, _, _, worker, has_code, code, nreason = _LOST_S.unpack_from(data)
    if has_code > 1:
        raise _error("Lost", "exitcode", f"flag {has_code} is neither 0 nor 1")
    reason = _string(data, _LOST_S.size, nreason, len(data), "Lost", "reason")
    _no_trailing(data, _LOST_S.size + nreason, "Lost", "reason")
    return Lost(worker, code if has_code else None, reason)


_DECODERS: dict[int, Callable[[bytes], Message]] = {
    _CHALLENGE: _decode_challenge,
    _AUTH: _decode_auth,
    _WELCOME: _decode_welcome,
    _BEAT: _decode_beat,
    _GROUP: _decode_group,
    _TRANSFER: _decode_transfer,
    _LOST: _decode_lost,
    _HELLO: _decode_hello,
    _SETUP: _decode_setup,
    _MAP_SLOTS: _decode_map_slots,
    _RECEIVE: _decode_receive,
    _STOP: _decode_stop,
    _ACK: _decode_ack,
    _STAGED: _decode_staged,
    _BYE: _decode_bye,
    _POLL: _decode_poll,
    _MAILBOX: _decode_mailbox,
}
