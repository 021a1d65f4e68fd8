"""Control messages between sender and receivers: small, picklable, versioned.

Sender -> worker: :class:`Setup` (once per connection), :class:`MapSlots` (followed by
the slots' file descriptors), :class:`Receive` (apply the weights of ``version`` that
sit in ``slot``; at most one is outstanding per worker), :class:`Stop`. Worker -> sender:
:class:`Hello`, :class:`Ack`, :class:`Staged` (manual commit mode) and :class:`Bye` (the
receiver ends, its weights already detached from every shared slot).
Every instruction names exactly the weights it refers to (slot and version), so a
late or repeated message can never make a worker apply the wrong version.
"""

from __future__ import annotations

from typing import NamedTuple

from ._layout import Layout

__all__ = ["Ack", "Bye", "Hello", "MapSlots", "Receive", "Setup", "Staged", "Stop"]


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
