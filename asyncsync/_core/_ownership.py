"""Who owns what: shared-memory slots on the sender, buffer sets on the receiver.

This module is the one place where a slot or a buffer set changes hands; the sender and
the receiver only call its transitions. With ``ASYNCSYNC_DEBUG=1`` in the environment (or
:func:`set_debug`), every transition checks the invariants below and raises
:class:`InvariantError` at the first violation.

Sender side, per slot (a :class:`SlotLedger`)::

    free ──acquire──► writing ──publish(v)──► held by {latest, in flight, staged, live}
      ▲                  │ (cancelled)                     of one or more workers
      └──────────────────┴──────────── owner set empty ◄───────────┘

A worker's roles on slots, one connection (a :class:`Link`) at a time:

- ``latest``: the newest version sent to the worker (kept for a replacement worker and
  as the base of a partial update). It belongs to the worker id, not the connection.
- ``in flight``: the one ``Receive`` outstanding on the channel (at most one per worker).
  When its answer arrives, the worker gets its ``latest`` if that is newer (latest wins).
  A polled worker's is the version in its mailbox, which a send replaces by the newest
  (:meth:`SlotLedger.replace`).
- ``maybe``: polled workers only: a version replaced in the mailbox while the worker may
  have been taking it (its claim named it). Held until the worker's next answer of that
  version or a newer one, which says what it holds; at most one per connection.
- ``staged``: manual commit: the version waits for ``commit()`` in that slot.
- ``live``: the worker's parameters view the slot (CPU, ``commit="swap"``).

A connection the sender cuts because the worker broke the protocol is *retired*: its process
may still view what it held, so those slots stay owned for good (at most k more slots per
such connection).

Invariants: a slot being written has no owner; every owned slot holds exactly the version
its owners name; a link has at most one version in flight, and a ``maybe`` only beside an
in-flight version newer than it; versions only go up; the pool never holds more slots than
:func:`slot_bound`.

Receiver side (a :class:`BufferRoles`): every set of weights is exactly one of ``live``
(the model's parameters are these tensors), ``pending`` (staged, manual commit) or
``staging`` (being written off the loop), or free. A set is written only while it is
``staging``; a free set is never referenced by the model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "BufferRoles",
    "InvariantError",
    "Snapshot",
    "SnapshotLedger",
    "Link",
    "Ref",
    "SlotLedger",
    "Weights",
    "debug_enabled",
    "set_debug",
    "slot_bound",
]

_debug = os.environ.get("ASYNCSYNC_DEBUG", "") not in ("", "0")


def set_debug(enabled: bool) -> None:
    """Switch the executable invariant checks on or off (default: ``ASYNCSYNC_DEBUG``)."""
    global _debug
    _debug = enabled


def debug_enabled() -> bool:
    return _debug


class InvariantError(AssertionError):
    """An ownership invariant does not hold: a bug in asyncsync."""


def slot_bound(workers: int, manual: bool, latest: int, writing: int, polled: int = 0) -> int:
    """Most slots that can be owned at once.

    ``k·W + P + L + G + 1``: each of *workers* (W) holds at most k slots of its own (in
    flight and live, plus staged with manual commit: k = 2 or 3), each of the *polled* (P)
    among them one more (``maybe``), *latest* (L) distinct newest versions, *writing* (G)
    slots written by the current send, plus one slot whose copy was cancelled but whose
    copy thread is still finishing.
    """
    return (3 if manual else 2) * workers + polled + latest + writing + 1


# ---------------------------------------------------------------------------------- sender


@dataclass(frozen=True)
class Ref:
    """One version of the weights, in a slot (``slot`` is its id) or in a worker's own memory (None)."""

    version: int
    slot: int | None


@dataclass
class Link:
    """Slot roles of one connection to one worker (a replacement gets a new Link)."""

    in_flight: Ref | None = None
    staged: Ref | None = None
    live: Ref | None = None
    maybe: Ref | None = None  # polled: replaced in the mailbox while perhaps being taken
    delivered: int = -1  # newest version handed to this connection
    polled: bool = False  # versions go to a mailbox, where a newer one may replace them

    def refs(self) -> Iterator[Ref]:
        for r in (self.in_flight, self.staged, self.live, self.maybe):
            if r is not None:
                yield r


_ROLES = ("in_flight", "staged", "live", "maybe")


@dataclass
class _SlotState:
    version: int = -1
    writing: bool = False  # reserved by the send that writes it (or its copy thread)


@dataclass
class SlotLedger:
    """Owner sets of the sender's slots, and the only code that changes them."""

    manual: bool
    latest: dict[int, Ref] = field(default_factory=dict)  # worker id -> newest version sent
    links: dict[int, Link] = field(default_factory=dict)  # worker id -> current connection
    slots: dict[int, _SlotState] = field(default_factory=dict)
    retired: list[Link] = field(default_factory=list)  # cut connections that may still view their slots
    # Elastic membership: the newest version sent to every member, which a joining member
    # catches up to (held like a worker's latest).
    newest: Ref | None = None

    # -- the slot pool's view ---------------------------------------------------------

    def add_slot(self, slot_id: int) -> None:
        self.slots[slot_id] = _SlotState()

    def remove_slot(self, slot_id: int) -> None:
        if _debug and slot_id in self.owned():
            raise InvariantError(f"slot {slot_id} freed while owned by {self.owners(slot_id)}")
        del self.slots[slot_id]

    def owned(self) -> set[int]:
        """Slots some worker holds in some role."""
        out = {r.slot for r in self.latest.values()}
        if self.newest is not None:
            out.add(self.newest.slot)
        for link in (*self.links.values(), *self.retired):  # (every send's slot search: no generator per link)
            for r in (link.in_flight, link.staged, link.live, link.maybe):
                if r is not None:
                    out.add(r.slot)
        out.discard(None)
        return out

    def in_use(self) -> set[int]:
        """Slots that must not be written: owned or being written."""
        return self.owned() | {s for s, st in self.slots.items() if st.writing}

    def free(self) -> list[int]:
        used = self.in_use()
        return [s for s in self.slots if s not in used]

    def owners(self, slot_id: int) -> list[str]:
        """Who holds *slot_id*, as ``"worker 1 live"`` strings (for errors and debugging)."""
        out = [f"worker {w} latest" for w, r in self.latest.items() if r.slot == slot_id]
        if self.newest is not None and self.newest.slot == slot_id:
            out.append("members' newest")
        for w, link in self.links.items():
            for role in _ROLES:
                r = getattr(link, role)
                if r is not None and r.slot == slot_id:
                    out.append(f"worker {w} {role.replace('_', ' ')}")
        out += [f"a retired connection ({i})" for i, link in enumerate(self.retired) for r in link.refs() if r.slot == slot_id]
        if slot_id in self.slots and self.slots[slot_id].writing:
            out.append("being written")
        return out

    # -- transitions --------------------------------------------------------------------

    def reserve(self, slot_id: int) -> None:
        """A send takes a free slot to write into it."""
        if _debug and slot_id in self.in_use():
            raise InvariantError(f"slot {slot_id} reserved while in use by {self.owners(slot_id)}")
        self.slots[slot_id].writing = True

    def unreserve(self, slot_id: int) -> None:
        """The write was abandoned (or its copy thread finished after a cancel)."""
        if slot_id in self.slots:
            self.slots[slot_id].writing = False

    def publish(self, slot_id: int, version: int, workers: Iterable[int]) -> None:
        """The slot now holds *version*, the newest for *workers*."""
        st = self.slots[slot_id]
        st.writing = False
        st.version = version
        ref = Ref(version, slot_id)  # immutable: one for all of them
        latest = self.latest
        for w in workers:
            latest[w] = ref
        if _debug:
            self.check()

    def hold_newest(self, version: int, slot_id: int) -> None:
        """*version* in *slot_id* went to every member: a member that joins later catches up to it."""
        self.newest = Ref(version, slot_id)
        if _debug:
            self.check()

    def catch_up(self, worker: int) -> Ref | None:
        """*worker* joins (or comes back): the members' newest version becomes its latest,
        if newer than what it was sent; that version, or None."""
        newest = self.newest
        latest = self.latest.get(worker)
        if newest is None or (latest is not None and latest.version >= newest.version):
            return None
        self.latest[worker] = newest
        if _debug:
            self.check()
        return newest

    def forget(self, worker: int) -> None:
        """*worker* is no longer a member (elastic membership): it stops holding its latest
        version (it catches up to the members' newest if it comes back)."""
        self.latest.pop(worker, None)
        if _debug:
            self.check()

    def connect(self, worker: int) -> Link:
        """A (new) connection for *worker*: it holds nothing yet."""
        link = Link()
        self.links[worker] = link
        return link

    def disconnect(self, worker: int) -> None:
        """The worker's connection is gone (it died, or left after detaching its weights)."""
        self.links.pop(worker, None)
        self.check()

    def retire(self, worker: int) -> None:
        """The sender cut the worker's connection (it broke the protocol) while its process
        may still view the slots that connection held: they stay owned, never written again."""
        link = self.links.pop(worker, None)
        if link is not None and any(r.slot is not None for r in link.refs()):
            self.retired.append(link)
        self.check()

    def poll(self, worker: int) -> None:
        """The worker's connection polls: its versions go to a mailbox (one ``maybe`` more)."""
        self.links[worker].polled = True

    def next_delivery(self, worker: int) -> Ref | None:
        """The ``Receive`` to send now, if nothing is in flight and a newer version waits."""
        link = self.links.get(worker)
        latest = self.latest.get(worker)
        if link is None or latest is None or link.in_flight is not None or latest.version <= link.delivered:
            return None
        link.in_flight = latest
        link.delivered = latest.version
        if _debug:
            self.check()
        return latest

    def replace(self, worker: int, claimed: bool, still_claimed: bool) -> bool:
        """A polled worker's mailbox now holds its ``latest`` in place of its version in flight
        (the send wrote it there, then read the worker's claim; it takes the worker's ack
        words next: an answer written before that claim says what the worker holds).

        *claimed*: the claim named the replaced version, which the worker may be applying:
        it becomes ``maybe`` (True is returned); else the worker never takes it: let go.
        *still_claimed*: the claim named the current ``maybe``, which stays; else the worker
        is past it (any answer it gave for it was taken first): let go.
        """
        link = self.links[worker]
        latest = self.latest[worker]
        old = link.in_flight
        if _debug and (not link.polled or latest.version <= link.delivered):
            raise InvariantError(f"worker {worker}: version {latest.version} replaces version {link.delivered} in a mailbox")
        became = old is not None and claimed
        link.maybe = old if became else link.maybe if still_claimed else None
        link.in_flight = latest
        link.delivered = latest.version
        if _debug:
            self.check()
        return became

    def on_staged(self, worker: int, version: int, holds: int | None) -> None:
        """Manual commit: *version* is staged (in slot *holds*, or in the worker's memory)."""
        link = self.links[worker]
        if link.in_flight is not None and link.in_flight.version <= version:
            link.in_flight = None
        if link.staged is None or link.staged.version <= version:
            link.staged = Ref(version, holds)
        self.check()

    def on_ack(self, worker: int, version: int, ok: bool, holds: int | None) -> None:
        """The worker answered *version*: applied (its weights now in *holds*) or rejected."""
        link = self.links[worker]
        sent = link.in_flight
        if sent is not None and sent.version <= version:
            link.in_flight = None
        if link.maybe is not None and link.maybe.version <= version:
            link.maybe = None  # the worker is past it: what it holds is in this answer
        if ok:
            if link.staged is not None and link.staged.version <= version:
                link.staged = None
            if _debug and link.live is not None and version < link.live.version:
                raise InvariantError(f"worker {worker} went back from version {link.live.version} to {version}")
            # The usual answer: the version sent, applied in its slot (Refs are immutable: reuse it).
            link.live = sent if sent is not None and sent.version == version and sent.slot == holds else Ref(version, holds)
        if _debug:  # (the hot transitions check here, not by a call that returns at once)
            self.check()

    # -- invariants ---------------------------------------------------------------------

    def check(self, pool_size: int | None = None, floor: int = 0, adding: int = 0) -> None:
        """Raise :class:`InvariantError` if an invariant is broken (only with debug on).

        *pool_size* slots may not exceed the bound for the current owners (or *floor*, the
        slots kept allocated whether used or not); *adding*: slots about to be reserved.
        """
        if not _debug:
            return
        for who, r in self._all_refs():
            if r.slot is None:
                continue
            st = self.slots.get(r.slot)
            if st is None:
                raise InvariantError(f"{who} names slot {r.slot}, which does not exist")
            if st.writing:
                raise InvariantError(f"{who} holds slot {r.slot} while it is being written")
            if st.version != r.version:
                raise InvariantError(f"{who} expects version {r.version} in slot {r.slot}, which holds {st.version}")
        for w, link in self.links.items():
            latest = self.latest.get(w)
            if link.in_flight is not None and (latest is None or link.in_flight.version > latest.version):
                raise InvariantError(f"worker {w} has version {link.in_flight.version} in flight, newer than its latest")
            maybe = link.maybe
            if maybe is not None and (not link.polled or link.in_flight is None or maybe.version >= link.in_flight.version):
                raise InvariantError(f"worker {w} may hold version {maybe.version} beside {link.in_flight} in flight (polled: {link.polled})")
            for r in link.refs():
                if r.version > link.delivered:
                    raise InvariantError(f"worker {w} holds version {r.version}, never delivered (delivered {link.delivered})")
        if pool_size is not None:
            bound = slot_bound(
                len(self.latest) or len(self.links),
                self.manual,
                len({r.slot for r in self.latest.values()} | ({self.newest.slot} if self.newest is not None else set())),
                sum(st.writing for st in self.slots.values()) + adding,
                sum(link.polled for link in self.links.values()),
            ) + sum(r.slot is not None for link in self.retired for r in link.refs())
            if pool_size > max(bound, floor):
                raise InvariantError(f"{pool_size} slots allocated, above the bound {bound}")

    def _all_refs(self) -> Iterator[tuple[str, Ref]]:
        if self.newest is not None:
            yield "the members' newest", self.newest
        for w, r in self.latest.items():
            yield f"worker {w} (latest)", r
        for w, link in self.links.items():
            for role in _ROLES:
                r = getattr(link, role)
                if r is not None:
                    yield f"worker {w} ({role.replace('_', ' ')})", r
        for i, link in enumerate(self.retired):
            for r in link.refs():
                yield f"retired connection {i}", r


# ------------------------------------------------------------------------ multi-host trainer


class Snapshot:
    """One flat wire buffer of the multi-host trainer: the snapshot of one version."""

    def __init__(self, tensor: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        self.tensor = tensor
        self.views = views
        self.version = -1
        self.serial = -1  # which write this is (a buffer is reused)
        # A partial update: the version it completed and the byte ranges it changed; a
        # host whose targets applied that version gets only these ranges.
        self.base_version = -1
        self.ranges: tuple[tuple[int, int], ...] = ()


PendingKey = tuple[int, int]  # (version, snapshot serial)


class SnapshotLedger:
    """Who holds which snapshot on a multi-host trainer, and the only code that changes it.

    A snapshot is held by the workers whose newest version it carries (``latest``, keyed
    ``(host, local index)``) and by its *readers*: a send writing it, a network transfer
    in flight, a copy thread still finishing. Each host's *pending* versions are the
    snapshots still to transfer to it, each with its local targets. A snapshot held by
    nobody is free and reused; so at most ``W + 1`` exist for ``W`` workers.
    """

    def __init__(self, make: Callable[[], Snapshot]) -> None:
        self._make = make
        self.bufs: list[Snapshot] = []
        self.latest: dict[tuple[int, int], Snapshot] = {}
        self.pending: dict[int, dict[PendingKey, tuple[Snapshot, set[int]]]] = {}
        self._readers: dict[int, int] = {}  # id(snapshot) -> readers
        self._owners: dict[int, int] = {}  # id(snapshot) -> workers whose newest it is
        self._serial = 0
        self.newest: Snapshot | None = None  # elastic: the members' newest, which joiners catch up to

    def reserve(self) -> Snapshot:
        """A free snapshot, held for the send that writes it (:meth:`release` or :meth:`written`)."""
        for buf in self.bufs:
            if not self._owners.get(id(buf)) and not self._readers.get(id(buf)):
                break
        else:
            buf = self._make()
            self.bufs.append(buf)
        self.hold(buf)
        return buf

    def written(self, buf: Snapshot, version: int, base: Snapshot | None, ranges: tuple[tuple[int, int], ...]) -> None:
        """*buf* holds *version* now (a partial update of *base*, changing *ranges*)."""
        self._serial += 1
        buf.version, buf.serial = version, self._serial
        buf.base_version, buf.ranges = (-1, ()) if base is None else (base.version, ranges)

    def hold(self, buf: Snapshot) -> None:
        """One more reader of *buf* (a transfer, a copy thread): it is not reused meanwhile."""
        self._readers[id(buf)] = self._readers.get(id(buf), 0) + 1

    def release(self, buf: Snapshot) -> None:
        self._readers[id(buf)] -= 1
        self._check()

    def assign(self, wid: tuple[int, int], buf: Snapshot) -> None:
        """*buf* is *wid*'s newest version: it replaces the older one waiting for its host."""
        old = self.latest.get(wid)
        if old is not None:
            self._owners[id(old)] -= 1
        self.latest[wid] = buf
        self._owners[id(buf)] = self._owners.get(id(buf), 0) + 1
        host, local = wid
        pending = self.pending.setdefault(host, {})
        for key in list(pending):
            targets = pending[key][1]
            targets.discard(local)
            if not targets:
                del pending[key]
        pending.setdefault((buf.version, buf.serial), (buf, set()))[1].add(local)
        self._check()

    def hold_newest(self, buf: Snapshot) -> None:
        """*buf* went to every member: a member that joins later catches up to it."""
        if self.newest is not None:
            self._owners[id(self.newest)] -= 1
        self.newest = buf
        self._owners[id(buf)] = self._owners.get(id(buf), 0) + 1
        self._check()

    def catch_up(self, wid: tuple[int, int]) -> Snapshot | None:
        """*wid* joins (or comes back): the members' newest becomes its newest, if newer."""
        newest, latest = self.newest, self.latest.get(wid)
        if newest is None or (latest is not None and latest.version >= newest.version):
            return None
        self.assign(wid, newest)
        return newest

    def forget(self, wid: tuple[int, int]) -> None:
        """*wid* is no longer a member: it stops holding its newest version."""
        old = self.latest.pop(wid, None)
        if old is not None:
            self._owners[id(old)] -= 1
        host, local = wid
        pending = self.pending.get(host, {})
        for key in list(pending):
            pending[key][1].discard(local)
            if not pending[key][1]:
                del pending[key]
        self._check()

    def requeue(self, host: int, workers: Iterable[tuple[int, int, str]]) -> None:
        """Transfer again to *host* each worker's newest version it has not applied
        (*workers*: ``(local index, applied version, state)``): after the group re-formed,
        or the host connected again."""
        pending = self.pending.setdefault(host, {})
        for local, applied, state in workers:
            buf = self.latest.get((host, local))
            if buf is not None and applied < buf.version and state in ("waiting", "connected"):
                pending.setdefault((buf.version, buf.serial), (buf, set()))[1].add(local)

    def delivered(self, host: int, key: PendingKey) -> None:
        self.pending.get(host, {}).pop(key, None)

    def drop_pending(self, host: int) -> None:
        self.pending.pop(host, None)

    def clear(self) -> None:
        self.bufs, self.latest, self.pending, self.newest = [], {}, {}, None
        self._readers.clear()
        self._owners.clear()

    def _check(self) -> None:
        if not _debug:
            return
        owners: dict[int, int] = {}
        for buf in (*self.latest.values(), *((self.newest,) if self.newest is not None else ())):
            owners[id(buf)] = owners.get(id(buf), 0) + 1
        if any(n for k, n in self._owners.items() if n != owners.get(k, 0)):
            raise InvariantError(f"snapshot owner counts {self._owners} do not match the workers' newest versions {owners}")
        if any(n < 0 for n in self._readers.values()):
            raise InvariantError(f"a snapshot was released more often than held: {self._readers}")
        for host, pending in self.pending.items():
            for (version, serial), (buf, targets) in pending.items():
                if (buf.version, buf.serial) != (version, serial) or not targets:
                    raise InvariantError(f"host {host}: pending {version}/{serial} names snapshot {buf.version}/{buf.serial} for {targets}")
                for local in targets:
                    if self.latest.get((host, local)) is not buf:
                        raise InvariantError(f"host {host}: pending {version} for worker {local}, whose newest is another snapshot")


# -------------------------------------------------------------------------------- receiver


@dataclass
class Weights:
    """One version of the weights on a worker: slot views (``slot`` set) or a private set."""

    version: int
    tensors: dict[str, torch.Tensor]
    slot: int | None = None
    stage_s: float = 0.0  # how long staging it took


class BufferRoles:
    """Roles of a worker's weight sets: ``live``, ``pending``, ``staging``, or free.

    Private sets (device buffers shaped like the model) are recycled through a free list;
    slot views are never recycled here (the sender owns the slot).
    """

    def __init__(self, live: Weights, allocate: Callable[[], dict[str, torch.Tensor]], *, keep_free: bool = True) -> None:
        self.live = live
        self.keep_free = keep_free  # False: staging never needs a private set; let freed ones go
        self.pending: Weights | None = None
        self.staging: Weights | None = None
        self._free: list[dict[str, torch.Tensor]] = []
        self._allocate = allocate

    def begin_staging(self, version: int) -> Weights:
        """A free private set (allocated if none) becomes ``staging`` for *version*."""
        if self.staging is not None:
            raise InvariantError("a second staging set while one is being written")
        tensors = self._free.pop() if self._free else self._allocate()
        self.staging = Weights(version, tensors, None)
        self.check()
        return self.staging

    def end_staging(self, completed: bool) -> Weights | None:
        """The staging copy finished (the set is returned) or was abandoned (set freed)."""
        staged, self.staging = self.staging, None
        if staged is None:
            return None
        if not completed:
            self._release(staged)
            return None
        return staged

    def stage(self, staged: Weights) -> None:
        """Manual commit: *staged* becomes ``pending``; the previous pending set is freed."""
        old, self.pending = self.pending, staged
        if old is not None:
            self._release(old)
        self.check()

    def take_pending(self) -> Weights | None:
        staged, self.pending = self.pending, None
        return staged

    def committed(self, new_live: Weights, consumed: Weights | None) -> None:
        """Commit done: *new_live* is what the model runs; *consumed* (copied from) is freed.

        With a pointer swap the former live set is freed; with an in-place copy the live set
        keeps its tensors and the staged set was *consumed*.
        """
        old = self.live
        self.live = new_live
        if old is not new_live and old.tensors is not new_live.tensors:
            self._release(old)
        if consumed is not None and consumed is not new_live:
            self._release(consumed)
        self.check()

    def detach(self, clone: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> bool:
        """Leaving: replace every role that views a shared slot by a private copy.

        Returns True if the live set was copied (the model must be re-pointed at it).
        """
        moved = False
        if self.pending is not None and self.pending.slot is not None:
            self.pending = Weights(self.pending.version, clone(self.pending.tensors), None)
        if self.live.slot is not None:
            self.live = Weights(self.live.version, clone(self.live.tensors), None)
            moved = True
        return moved

    def views_slot(self) -> set[int]:
        return {w.slot for w in (self.live, self.pending) if w is not None and w.slot is not None}

    def _release(self, w: Weights) -> None:
        if self.keep_free and w.slot is None and all(w.tensors is not other.tensors for other in self._holders()):
            self._free.append(w.tensors)

    def _holders(self) -> Iterator[Weights]:
        for w in (self.live, self.pending, self.staging):
            if w is not None:
                yield w

    def check(self, model_tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Raise :class:`InvariantError` if two roles share a set (only with debug on)."""
        if not _debug:
            return
        sets = [(name, w) for name, w in (("live", self.live), ("pending", self.pending), ("staging", self.staging)) if w is not None]
        ptrs: dict[int, str] = {}
        for name, w in sets:
            for t in w.tensors.values():
                if t.numel() == 0:
                    continue
                p = t.data_ptr()
                if p in ptrs and ptrs[p] != name:
                    raise InvariantError(f"the {name} set shares storage with the {ptrs[p]} set")
                ptrs[p] = name
        for free in self._free:
            for t in free.values():
                if t.numel() and t.data_ptr() in ptrs:
                    raise InvariantError(f"a free set shares storage with the {ptrs[t.data_ptr()]} set")
        if model_tensors is not None:
            for key, t in model_tensors.items():
                live = self.live.tensors.get(key)
                if live is not None and t.numel() and t.data_ptr() != live.data_ptr():
                    raise InvariantError(f"the model's {key!r} is not the live set's tensor")
