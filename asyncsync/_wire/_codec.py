"""Frames: the header and each message's binary codec (``struct`` only, nothing unpickled).

A frame is a fixed header ``!2sBBI`` (magic ``b"AS"``, :data:`PROTOCOL_VERSION`, message
type, payload length), the type's fixed fields (big-endian ``struct`` codes), then its
variable parts, each length-prefixed. A message that is one struct plus at most one
trailing string is declared once, in the table at the end (:class:`_Fixed`); the hot
:class:`Receive` and :class:`Ack` are one ``Struct.pack`` / ``unpack_from`` each;
:class:`Setup`, :class:`MapSlots` and :class:`Transfer` are written by hand. A decoder
checks every length against the bytes actually there before it allocates anything, and
raises :class:`ProtocolError` naming the message type and the field.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._core._layout import Layout, TensorSpec
from .._errors import ProtocolError
from ._messages import (
    MAX_ALIASES,
    MAX_MAILBOX,
    MAX_NDIM,
    MAX_RANGES,
    MAX_SLOTS,
    MAX_SPECS,
    MAX_STRING,
    MAX_TARGETS,
    NONCE_BYTES,
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

__all__ = ["HEADER_BYTES", "MAGIC", "PROTOCOL_VERSION", "Frame", "decode", "decoder", "encode", "payload_length"]

Frame = bytes | bytearray | memoryview

MAGIC = b"AS"
PROTOCOL_VERSION = 2
_HEADER = struct.Struct("!2sBBI")  # magic, protocol version, message type, payload length
_HEAD = _HEADER.format[1:]
HEADER_BYTES = _H = _HEADER.size
_NONE = 0xFFFFFFFF  # u32 sentinel: a slot or an optional string that is None
_MAX_I64 = (1 << 63) - 1

# Message type codes (u8): never renumber; add new types at the end.
_CODES: dict[type, int] = {Hello: 1, Setup: 2, MapSlots: 3, Receive: 4, Stop: 5, Ack: 6, Staged: 7, Bye: 8, Challenge: 9}
_CODES |= {Auth: 10, Welcome: 11, Beat: 12, Group: 13, Transfer: 14, Lost: 15, Poll: 16, Mailbox: 17}
_NAMES = {code: kind.__name__ for kind, code in _CODES.items()}
_RECEIVE, _ACK = _CODES[Receive], _CODES[Ack]

# dtype codes (u8): the position in this list, from 1; append only. Dtypes this torch lacks are skipped.
_DTYPE_NAMES = "float32 float64 float16 bfloat16 uint8 int8 int16 int32 int64 bool complex64 complex128 complex32 uint16 uint32 uint64"
_DTYPE_NAMES += " float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu"
_DTYPES: dict[int, torch.dtype] = {
    c: d for c, d in enumerate((getattr(torch, n, None) for n in _DTYPE_NAMES.split()), 1) if isinstance(d, torch.dtype)
}
_DTYPE_CODES = {d: c for c, d in _DTYPES.items()}
_ITEMSIZE = {c: d.itemsize for c, d in _DTYPES.items()}

# ------------------------------------------------------------------------- primitives


def _error(kind: str, field: str, problem: str) -> ProtocolError:
    return ProtocolError(f"{kind}: field {field!r}: {problem}")


def _header(data: bytes, what: str) -> tuple[str, int]:
    """The message type's name and payload length of the header that starts *data*; raise
    :class:`ProtocolError` if it is short (*what* says of what) or has a wrong magic, version or type."""
    if len(data) < _H:
        raise _error("frame", "header", f"truncated: {len(data)} bytes, {what} is {_H}")
    magic, version, kind, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise _error("frame", "magic", f"{magic!r} is not {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise _error("frame", "version", f"protocol version {version} is not supported (this end speaks {PROTOCOL_VERSION})")
    if kind not in _NAMES:
        raise _error("frame", "type", f"unknown message type {kind}")
    return _NAMES[kind], int(length)


def _check_fixed(data: bytes, name: str, fixed: struct.Struct, exact: bool = True) -> None:
    """Raise unless *data* has a good header and at least (or, with *exact*, exactly) *fixed*'s size."""
    n = len(data)
    _, length = _header(data, "the header alone")
    if length != n - _H:
        what = "truncated" if length > n - _H else "trailing bytes"
        raise _error(name, "length", f"{what}: the header announces {length} payload bytes, the frame holds {n - _H}")
    if n < fixed.size or (exact and n != fixed.size):
        what = "truncated" if n < fixed.size else "trailing bytes"
        raise _error(name, "length", f"{what}: {n - _H} payload bytes, {name} has {fixed.size - _H}")


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


def _text(value: str, field: str, shorten: bool = False) -> bytes:
    """The UTF-8 of *value*: over :data:`MAX_STRING` bytes it is shortened, or refused."""
    raw = value.encode("utf-8")
    if len(raw) > MAX_STRING:
        if not shorten:
            raise ValueError(f"field {field!r} is {len(raw)} bytes of UTF-8, more than the limit of {MAX_STRING}")
        raw = raw[: MAX_STRING - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."
    return raw


def _slot(value: int | None, none: int) -> int:
    """*value* on the wire, where *none* stands for None (so *none* itself cannot travel)."""
    if value is None:
        return none
    if value == none:
        raise ValueError(f"the value {value} is reserved (it means None)")
    return value


# ------------------------------------------------------------- the hot messages, by hand

_RECEIVE_S = struct.Struct(f"!{_HEAD}qIQ")  # version i64, slot u32, skipped u64
# worker_idx u32, version i64, ok u8, holds u32|None, stage_s f64, commit_s f64, error length u32|None; then the error
_ACK_S = struct.Struct(f"!{_HEAD}IqBIddI")
_new = tuple.__new__  # builds a NamedTuple from checked fields, without its Python-level __new__


def _decode_receive(data: bytes) -> Receive:
    if len(data) == _RECEIVE_S.size:
        magic, ver, _, length, version, slot, skipped = _RECEIVE_S.unpack_from(data)
        if magic == MAGIC and ver == PROTOCOL_VERSION and length == _RECEIVE_S.size - _H:
            if slot == _NONE:
                raise _error("Receive", "slot", "missing (the None sentinel)")
            return _new(Receive, (version, slot, skipped))
    _check_fixed(data, "Receive", _RECEIVE_S)
    raise AssertionError  # pragma: no cover


def _encode_ack(m: Ack) -> bytes:
    err = b"" if m.error is None else _text(m.error, "error", shorten=True)
    n = _NONE if m.error is None else len(err)
    head = _ACK_S.pack(
        MAGIC, PROTOCOL_VERSION, _ACK, _ACK_S.size - _H + len(err), m.worker_idx, m.version, bool(m.ok), _slot(m.holds, _NONE), m.stage_s, m.commit_s, n
    )
    return head + err if err else head


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
            error = None
            if nerr != _NONE:
                error = _string(data, _ACK_S.size, nerr, n, "Ack", "error")
                n -= nerr
            if n != _ACK_S.size:
                raise _error("Ack", "error", f"trailing bytes: {n - _ACK_S.size} after the last field")
            return _new(Ack, (worker, version, ok == 1, error, None if holds == _NONE else holds, stage_s, commit_s))
    _check_fixed(data, "Ack", _ACK_S, exact=False)
    raise AssertionError  # pragma: no cover


# ------------------------------------------------------- the variable messages, by hand

_MAP_S = struct.Struct(f"!{_HEAD}BI")  # transient u8, count u32; then count x (slot id u32, nbytes u64)
_MAP_ENTRY = struct.Struct("!IQ")


def _encode_map_slots(m: MapSlots) -> bytes:
    if len(m.slot_ids) != len(m.nbytes):
        raise ValueError(f"MapSlots has {len(m.slot_ids)} slot ids but {len(m.nbytes)} sizes")
    if len(m.slot_ids) > MAX_SLOTS:
        raise ValueError(f"MapSlots: at most {MAX_SLOTS} slots at a time, got {len(m.slot_ids)}")
    size = _MAP_S.size - _H + _MAP_ENTRY.size * len(m.slot_ids)
    parts = [_MAP_S.pack(MAGIC, PROTOCOL_VERSION, _CODES[MapSlots], size, bool(m.transient), len(m.slot_ids))]
    for sid, nbytes in zip(m.slot_ids, m.nbytes):
        if not 0 <= nbytes <= _MAX_I64:
            raise ValueError(f"MapSlots: slot {sid} has a size of {nbytes} bytes")
        parts.append(_MAP_ENTRY.pack(_slot(sid, _NONE), nbytes))
    return b"".join(parts)


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


# version i64, generation u32, p2p u8, tag u32, target count u32; then count x u32, base i64,
# range count u32, ranges x (offset u64, length u64)
_TRANSFER_S = struct.Struct(f"!{_HEAD}qIBII")


def _encode_transfer(m: Transfer) -> bytes:
    if len(m.targets) > MAX_TARGETS:
        raise ValueError(f"Transfer: at most {MAX_TARGETS} targets, got {len(m.targets)}")
    if len(m.ranges) > MAX_RANGES:
        raise ValueError(f"Transfer: at most {MAX_RANGES} ranges, got {len(m.ranges)}")
    if m.base < -1 or (m.base >= 0) != bool(m.ranges):
        raise ValueError("Transfer: a base version goes with byte ranges, and ranges with a base")
    flat = [x for r in m.ranges for x in r]
    tail = struct.pack(f"!{len(m.targets)}IqI{len(flat)}Q", *m.targets, m.base, len(m.ranges), *flat)
    size = _TRANSFER_S.size - _H + len(tail)
    return _TRANSFER_S.pack(MAGIC, PROTOCOL_VERSION, _CODES[Transfer], size, m.version, m.generation, bool(m.p2p), m.tag, len(m.targets)) + tail


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


_SETUP_S = struct.Struct(f"!{_HEAD}II")  # sender_pid u32, device length u32|None; then the device
_LAYOUT_S = struct.Struct("!QII")  # total nbytes u64, spec count u32, alias count u32; then specs, aliases
_SPEC_S = struct.Struct("!BB")  # per spec, after its key: dtype code u8, ndim u8; then shape ndim x u64, offset u64, numel u64
_SPEC_TAIL = [struct.Struct(f"!{n + 2}Q") for n in range(MAX_NDIM + 1)]  # shape..., offset, numel
_U32 = struct.Struct("!I")  # a string's length; then its UTF-8
_MIN_SPEC = _U32.size + _SPEC_S.size + 16  # empty key, scalar
_MIN_ALIAS = 2 * _U32.size


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
    for names in layout.aliases:
        for raw in (_text(name, f"alias {name[:80]!r}") for name in names):
            parts += (_U32.pack(len(raw)), raw)
    size = _SETUP_S.size - _H + sum(len(p) for p in parts)
    if size > _NONE:
        raise ValueError(f"Setup: the layout needs {size} bytes, more than a frame holds")
    parts[0] = _SETUP_S.pack(MAGIC, PROTOCOL_VERSION, _CODES[Setup], size, m.sender_pid, _NONE if m.device is None else len(device))
    return b"".join(parts)


def _decode_setup(data: bytes) -> Setup:
    _check_fixed(data, "Setup", _SETUP_S, exact=False)
    n = len(data)
    _, _, _, _, sender_pid, ndevice = _SETUP_S.unpack_from(data)
    pos = _SETUP_S.size
    device = None if ndevice == _NONE else _string(data, pos, ndevice, n, "Setup", "device")
    pos += 0 if device is None else ndevice
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

    def string(field: str) -> str:
        nonlocal pos
        if pos + 4 > n:
            raise _error("Setup", field, "truncated")
        (length,) = _U32.unpack_from(data, pos)
        text = _string(data, pos + 4, length, n, "Setup", field)
        pos += 4 + length
        return text

    specs: list[TensorSpec] = []
    keys: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for i in range(nspecs):
        field = f"layout.specs[{i}]"
        key = string(f"{field}.key")
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
        for d in shape:
            if d > _MAX_I64:
                raise _error("Setup", f"{field}.shape", f"{key!r}: dimension {d} is too large")
        if math.prod(shape) != numel:
            raise _error("Setup", f"{field}.numel", f"{key!r}: {numel} elements, but shape {tuple(shape)} holds {math.prod(shape)}")
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
        alias, canonical = string(f"layout.aliases[{i}].alias"), string(f"layout.aliases[{i}].canonical")
        if alias in keys or alias in names:
            raise _error("Setup", f"layout.aliases[{i}].alias", f"{alias!r} is already a key or an alias")
        if canonical not in keys:
            raise _error("Setup", f"layout.aliases[{i}].canonical", f"{canonical!r} is not a key of the layout")
        names.add(alias)
        aliases.append((alias, canonical))
    _no_trailing(data, pos, "Setup", "layout")
    return Setup(Layout(tuple(specs), total, tuple(aliases)), device, sender_pid)


# ------------------------------------------------------------------ the table engine

_NONE_OF = {"I": _NONE, "i": -(1 << 31)}  # the value that stands for None in an optional u32 / i32
_Check = Callable[[Any], tuple[str, str] | None]  # a message -> None, or (field, what is wrong)


class _Fixed:
    """The codec of a message that is one struct, plus at most one trailing UTF-8 string.

    *fields* holds one ``struct`` code per field of *kind*, in order; ``I?`` / ``i?``: an
    optional int (a reserved value means None); ``str``: the last field is a string (its
    length u32 in the struct, its UTF-8 after it; shortened past :data:`MAX_STRING`);
    ``32s``: exactly 32 bytes. *check* validates a message both ways.
    """

    def __init__(self, kind: type, fields: str, check: _Check | None = None) -> None:
        codes = fields.split()
        self.kind, self.name, self.code, self.check = kind, kind.__name__, _CODES[kind], check
        self.fields: tuple[str, ...] = kind._fields  # type: ignore[attr-defined]
        self.text = codes[-1:] == ["str"]
        self.optional = [(i, _NONE_OF[c[0]]) for i, c in enumerate(codes) if c.endswith("?")]
        self.sized = [(i, int(c[:-1])) for i, c in enumerate(codes) if c.endswith("s") and c != "str"]
        self.struct = struct.Struct(f"!{_HEAD}" + "".join("I" if c == "str" else c.rstrip("?") for c in codes))

    def encode(self, msg: tuple[Any, ...]) -> bytes:
        values = list(msg)
        for i, none in self.optional:
            values[i] = _slot(values[i], none)
        for i, size in self.sized:
            if not isinstance(values[i], bytes) or len(values[i]) != size:
                raise ValueError(f"cannot encode {self.name}: field {self.fields[i]!r} must be {size} bytes")
        problem = self.check(msg) if self.check else None
        if problem is not None:
            raise ValueError(f"cannot encode {self.name}: field {problem[0]!r}: {problem[1]}")
        tail = b""
        if self.text:
            tail = _text(values[-1], self.fields[-1], shorten=True)
            values[-1] = len(tail)
        return self.struct.pack(MAGIC, PROTOCOL_VERSION, self.code, self.struct.size - _H + len(tail), *values) + tail

    def decode(self, data: bytes) -> Any:
        fixed = self.struct
        _check_fixed(data, self.name, fixed, exact=not self.text)
        values = list(fixed.unpack_from(data)[4:])
        if self.text:
            end = fixed.size + values[-1]
            values[-1] = _string(data, fixed.size, values[-1], len(data), self.name, self.fields[-1])
            _no_trailing(data, end, self.name, self.fields[-1])
        for i, none in self.optional:
            if values[i] == none:
                values[i] = None
        msg = self.kind._make(values)  # type: ignore[attr-defined]
        problem = self.check(msg) if self.check else None
        if problem is not None:
            raise _error(self.name, *problem)
        return msg


def _check_mailbox(m: Mailbox) -> tuple[str, str] | None:
    return None if 0 < m.nbytes <= MAX_MAILBOX else ("nbytes", f"{m.nbytes} bytes is not in 1..{MAX_MAILBOX}")


def _check_group(m: Group) -> tuple[str, str] | None:
    if not 0 <= m.rank < m.size:
        return "rank", f"rank {m.rank} is not in 0..{m.size - 1}"
    return None if 0 < m.chunk_bytes <= _MAX_I64 else ("chunk_bytes", f"{m.chunk_bytes} is not a positive size")


_NONCE = f"{NONCE_BYTES}s"
_TABLE = (
    _Fixed(Hello, "I I"),  # worker_idx, pid
    _Fixed(Poll, "I"),  # worker_idx
    _Fixed(Mailbox, "I", _check_mailbox),  # nbytes
    _Fixed(Staged, "I q I?"),  # worker_idx, version, holds
    _Fixed(Bye, "I q str"),  # worker_idx, version, reason
    _Fixed(Stop, "str"),  # reason
    _Fixed(Challenge, _NONCE),  # nonce
    _Fixed(Auth, f"I I I {_NONCE} {_NONCE}"),  # host, num_workers, pid, nonce, mac
    _Fixed(Welcome, _NONCE),  # mac
    _Fixed(Beat, ""),
    _Fixed(Group, "I I I Q", _check_group),  # generation, rank, size, chunk_bytes
    _Fixed(Lost, "I i? str"),  # worker_idx, exitcode, reason
)
_ENCODERS: dict[type, Callable[[Any], bytes]] = {f.kind: f.encode for f in _TABLE}
_ENCODERS |= {Ack: _encode_ack, MapSlots: _encode_map_slots, Transfer: _encode_transfer, Setup: _encode_setup}
_DECODERS: dict[int, Callable[[bytes], Any]] = {f.code: f.decode for f in _TABLE}
_DECODERS |= {_RECEIVE: _decode_receive, _ACK: _decode_ack, _CODES[MapSlots]: _decode_map_slots}
_DECODERS |= {_CODES[Transfer]: _decode_transfer, _CODES[Setup]: _decode_setup}

# ------------------------------------------------------------------------ entry points


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


def decoder(kinds: Iterable[type], refusal: str) -> Callable[[Frame], Any]:
    """A decoder of one frame of a message of *kinds*: a frame of any other message is a
    :class:`ProtocolError` naming it and saying *refusal*, before its payload is read."""
    table = {_CODES[kind]: _DECODERS[_CODES[kind]] for kind in kinds}

    # Defaults, not a closure's cells: local lookups, some 10 ns less on every Receive.
    def decode(data: Frame, _table: dict[int, Callable[[bytes], Any]] = table, _refusal: str = refusal) -> Any:
        if type(data) is not bytes:
            if not isinstance(data, (bytearray, memoryview)):
                raise TypeError(f"decode() takes bytes, not {type(data).__name__}")
            data = bytes(data)
        try:
            read = _table[data[3]]
        except (IndexError, KeyError):
            name, _ = _header(data, "the header alone")  # raises: too short, or a bad magic, version or type
            raise ProtocolError(f"{name}: {_refusal}") from None
        return read(data)

    return decode


# Any message, whoever sends it (the tests); the transports decode with their plane's decoders.
decode: Callable[[Frame], Message] = decoder(_CODES, "")


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
