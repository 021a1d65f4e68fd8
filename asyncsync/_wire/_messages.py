"""The protocol's messages (plain ``NamedTuple`` values) and the wire's limits.

Which side sends which message is the planes' business (:mod:`._local`, :mod:`._control`);
every instruction names exactly the weights it refers to (slot and version), so a late or
repeated message can never make a worker apply the wrong version.
"""

from __future__ import annotations

from typing import NamedTuple, NoReturn

from .._core._layout import Layout

__all__ = [
    "MAX_ALIASES", "MAX_MAILBOX", "MAX_NDIM", "MAX_RANGES", "MAX_SLOTS", "MAX_SPECS", "MAX_STRING", "MAX_TARGETS",
    "NONCE_BYTES", "Ack", "Auth", "Beat", "Bye", "Challenge", "Group", "Hello", "Lost", "Mailbox", "MapSlots", "Message",
    "Poll", "Receive", "Setup", "Staged", "Stop", "Transfer", "Welcome", "assert_never"
]

MAX_STRING = 64 * 1024  # bytes of one UTF-8 string (keys, device, error texts, reasons)
MAX_SPECS = 1 << 20  # tensors in one layout
MAX_ALIASES = 1 << 20  # alias pairs in one layout
MAX_NDIM = 64  # dimensions of one tensor
MAX_SLOTS = 253  # slots in one MapSlots: what one SCM_RIGHTS message carries on Linux
MAX_MAILBOX = 1 << 16  # bytes of a mailbox segment
MAX_TARGETS = 1 << 16  # local workers named in one Transfer
MAX_RANGES = 1 << 16  # byte ranges in one partial Transfer
NONCE_BYTES = 32  # Challenge / Auth nonces and HMAC-SHA256 digests

# ---- the local plane: sender <-> worker over a Unix socket


class Setup(NamedTuple):
    """The wire layout of the weights, the worker's device and the sender's pid (once per
    connection; also trainer -> relay, whose answer is ``Beat`` if the layout fits, or ``Bye``)."""

    layout: Layout
    device: str | None
    sender_pid: int


class MapSlots(NamedTuple):
    """Map these slots; ``len(slot_ids)`` file descriptors follow on the socket."""

    slot_ids: tuple[int, ...]
    nbytes: tuple[int, ...]
    transient: bool = False  # unmap once released (the "queue" transport)


class Receive(NamedTuple):
    """Apply version ``version`` found in ``slot`` (at most one is outstanding per worker);
    ``skipped``: versions sent to this worker since its previous ``Receive`` that it will
    never see (latest wins)."""

    version: int
    slot: int
    skipped: int = 0


class Mailbox(NamedTuple):
    """Map this mailbox of ``nbytes``; two file descriptors follow on the socket: the
    mailbox's segment and the sender's wake (an eventfd). From now on versions arrive in the
    mailbox (no more ``Receive``), and the worker acks what it applied there too, then writes
    the wake (a rejection still goes as an ``Ack``)."""

    nbytes: int


class Stop(NamedTuple):
    """End the receiver task (or, trainer -> relay, the relay)."""

    reason: str = "stop"


class Hello(NamedTuple):
    """A receiver announces itself."""

    worker_idx: int
    pid: int


class Poll(NamedTuple):
    """This worker polls: deliver its versions through a mailbox instead of ``Receive``."""

    worker_idx: int


class Ack(NamedTuple):
    """Outcome of ``version`` on ``worker_idx`` (also relay -> trainer, for a local worker).

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
    """The receiver ends (``reason``) at ``version``; it holds no shared slot any more.
    On the control plane: a relay leaves or refuses, or the trainer drops or refuses it."""

    worker_idx: int
    version: int
    reason: str


# ---- the control plane: trainer <-> relay over TCP (also the attach handshake)


class Challenge(NamedTuple):
    """Trainer -> relay, first frame on a connection: prove you know the token."""

    nonce: bytes  # NONCE_BYTES random bytes


class Auth(NamedTuple):
    """Relay -> trainer: ``mac = HMAC-SHA256(token, b"relay" + challenge nonce + host + num_workers)``;
    ``nonce`` is the relay's own challenge for the trainer."""

    host: int
    num_workers: int
    pid: int
    nonce: bytes
    mac: bytes


class Welcome(NamedTuple):
    """Trainer -> relay: ``mac = HMAC-SHA256(token, b"trainer" + the relay's nonce)``."""

    mac: bytes


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
    """Relay -> trainer: local worker ``worker_idx`` died (``exitcode``) or left (None, ``reason``)."""

    worker_idx: int
    exitcode: int | None
    reason: str


Message = Setup | MapSlots | Receive | Mailbox | Stop | Hello | Poll | Ack | Staged | Bye | Challenge | Auth | Welcome | Beat | Group | Transfer | Lost


def assert_never(msg: NoReturn) -> NoReturn:
    """Ends a dispatch over a plane's union: mypy flags it if a message type is not handled."""
    raise AssertionError(f"unhandled message: {msg!r}")
