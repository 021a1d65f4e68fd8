"""The length framing of ``multiprocessing.connection.Connection``, so either end may be one.

A frame is a 4-byte big-endian signed length, or ``-1`` and an 8-byte length for payloads
above 2 GiB, then the payload: a pickle (``Connection.send``) or raw bytes
(``Connection.send_bytes``).

Example::

    buf = bytearray(frame_header(5) + b"hello")
    assert parse_frame(buf, raw=True) == b"hello" and not buf
    assert parse_frame(buf, raw=True) is EMPTY
"""

from __future__ import annotations

import struct
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .._errors import BrokenChannelError

__all__ = ["EMPTY", "HEADER", "LONG_LIMIT", "dumps", "frame_header", "header_bytes", "parse_frame"]

HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!iQ")
_LONG_SIZE = struct.Struct("!Q")
LONG_LIMIT = 0x7FFFFFFF  # payloads above this take the long header
EMPTY: Any = object()  # "no complete frame yet"

dumps = ForkingPickler.dumps


def frame_header(size: int) -> bytes:
    """The length header ``Connection.send`` writes before a payload of *size* bytes."""
    if size > LONG_LIMIT:
        return _LONG_HEADER.pack(-1, size)
    return HEADER.pack(size)


def header_bytes(size: int) -> int:
    """How long :func:`frame_header` of *size* is."""
    return 4 if size <= LONG_LIMIT else 12


def parse_frame(buf: bytearray, raw: bool) -> Any:
    """Take the first frame out of *buf* if it is complete: its payload unpickled (its
    bytes with *raw*); else :data:`EMPTY`, leaving *buf* as it is.

    A frame that does not unpickle is consumed all the same, as with ``Connection.recv``.
    Raises :class:`BrokenChannelError` on a header no ``Connection`` writes.
    """
    have = len(buf)
    if have < 4:
        return EMPTY
    (size,) = HEADER.unpack_from(buf)
    start = 4
    if size < 0:
        if size != -1:
            raise BrokenChannelError(f"corrupt message header (length {size})")
        if have < 12:
            return EMPTY
        (size,) = _LONG_SIZE.unpack_from(buf, 4)
        start = 12
    end = start + size
    if have < end:
        return EMPTY
    view = memoryview(buf)[start:end]
    try:
        return bytes(view) if raw else ForkingPickler.loads(view)
    finally:
        view.release()
        del buf[:end]
