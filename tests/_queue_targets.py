"""Process targets for the AsyncQueue tests (module level: spawn pickles them by name)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds
from typing import Any

from asyncsync import WouldBlock
from asyncsync._io._queues import AsyncQueue


def blob(seed: int, size: int) -> bytes:
    """*size* bytes that differ from one *seed* to the next (cheap to build, cheap to check)."""
    pattern = hashlib.sha256(seed.to_bytes(8, "little")).digest()
    return (pattern * (size // len(pattern) + 1))[:size]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def slow_reader(conn: Connection, ctrl: Connection) -> None:
    """Read nothing until told on *ctrl*; then digest ``(i, bytes)`` messages until ``None``.

    Reports ``(released, [(i, digest), ...])`` on *ctrl*; ``released`` is False when the
    go-ahead never came (the parent's loop was blocked) and it read anyway after 30 s.
    """
    released = ctrl.poll(30)
    if released:
        ctrl.recv()
    got: list[tuple[int, str]] = []
    while True:
        msg = conn.recv()
        if msg is None:
            break
        got.append((msg[0], digest(msg[1])))
    ctrl.send((released, got))


def exchange(conn: Connection, size: int) -> None:
    """``await put`` *size* bytes, then ``get`` the peer's, then report their digest."""

    async def main() -> None:
        q: AsyncQueue[Any] = AsyncQueue(conn)
        await q.put(blob(2, size))
        theirs = await q.get(timeout=30)
        await q.put(digest(theirs))
        await q.flush()
        await q.aclose()

    asyncio.run(main())


def echo(inp: Connection, out: Connection) -> None:
    """Plain ``Connection.recv``/``send``: send back every message, up to and including ``None``."""
    while True:
        msg = inp.recv()
        out.send(msg)
        if msg is None:
            break


async def _nowait_fds(q: AsyncQueue[Any], count: int) -> list[int]:
    """``receive_fds_nowait`` until the descriptors are here (WouldBlock until then)."""
    while True:
        try:
            return q.receive_fds_nowait(count)
        except WouldBlock:
            await asyncio.sleep(0.001)


def fd_reader(conn: Connection, mode: str) -> None:
    """Read ``("big", bytes)``, ``("fds", n)`` (then n descriptors), ``("msg", x)`` until ``("stop",)``.

    Reports what it saw, reading the first bytes of each received file. *mode* is
    ``receive_fds_nowait`` (an AsyncQueue, trying again while it raises WouldBlock: the
    descriptors have not arrived yet) or ``receive_fds`` (an AsyncQueue, waiting in the
    loop) or ``plain`` (Connection.recv and multiprocessing.reduction.recvfds).
    """
    report: list[tuple[Any, ...]] = []

    def note(msg: tuple[Any, ...], fds: list[int] | None) -> None:
        if msg[0] == "big":
            report.append(("big", digest(msg[1])))
        elif msg[0] == "fds":
            assert fds is not None
            report.append(("fds", [os.pread(fd, 64, 0) for fd in fds]))
            for fd in fds:
                os.close(fd)
        else:
            report.append(msg)

    if mode == "plain":
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            fds = None
            if msg[0] == "fds":
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    fds = recvfds(sock, msg[1])
            note(msg, fds)
        conn.send(report)
        return

    async def main() -> None:
        q: AsyncQueue[Any] = AsyncQueue(conn)
        while True:
            msg = await q.get(timeout=30)
            if msg[0] == "stop":
                break
            fds = None
            if msg[0] == "fds":
                fds = await _nowait_fds(q, msg[1]) if mode == "receive_fds_nowait" else await q.receive_fds(msg[1])
            note(msg, fds)
        await q.put(report)
        await q.flush()
        await q.aclose()

    asyncio.run(main())
