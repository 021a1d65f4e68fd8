"""Receiver-side fault injection for :mod:`asyncsync.testing` (nothing here runs otherwise).

A :class:`FaultHook` installed in the context where ``init_on_receiver`` runs is consulted
by that receiver once per ``Receive``, before it stages anything: it may hold the update
(the worker answers nothing until released) or refuse it (the worker keeps its weights
and the sender raises ``WorkerError`` with the hook's message). A polled receiver asks it
at each ``poll_nowait()`` that finds a new version, without awaiting: a held version stays
in the mailbox (the first poll after the release applies the newest), a refused one is
taken and refused there. Without a hook the receiver pays one ``is None`` test per update.

In a worker process, :func:`run_with_faults` installs the hook and obeys commands from
the test's process over a Unix socket (one JSON object a line, answered ``{"ok": true}``
once applied), then runs the worker function.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["FaultHook", "installed", "run_with_faults"]


class FaultHook:
    """What one receiver does with the next updates: hold them, refuse them, or apply them."""

    def __init__(self) -> None:
        self.refusal: str | None = None
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        """Updates wait, unapplied and unanswered, until :meth:`release`."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def apply(self, command: dict[str, Any]) -> None:
        """A command from :mod:`asyncsync.testing`: ``{"hold": bool}`` or ``{"refusal": str | None}``."""
        if command.get("hold") is True:
            self.hold()
        elif command.get("hold") is False:
            self.release()
        if "refusal" in command:
            self.refusal = command["refusal"]

    @property
    def held(self) -> bool:
        """True while updates wait (:meth:`hold`)."""
        return not self._open.is_set()

    @property
    def idle(self) -> bool:
        """True while no fault is in force: the receiver takes its usual (callback) path."""
        return self.refusal is None and self._open.is_set()

    async def before_apply(self, version: int) -> str | None:
        """Called by the receiver before it stages *version*; a string refuses it with that message."""
        await self._open.wait()
        return self.refusal


# The hook of receivers created (``init_on_receiver``) in this context; None: no faults.
installed: contextvars.ContextVar[FaultHook | None] = contextvars.ContextVar("asyncsync_faults", default=None)


async def run_with_faults(
    worker_idx: int,
    address: str,
    token: str,
    fn: Callable[..., Coroutine[Any, Any, Any]],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Worker entry point of ``asyncsync.testing.open_workers``: ``await fn(worker_idx, *args, **kwargs)``
    with a :class:`FaultHook` installed and driven from *address*."""
    hook = FaultHook()
    # Our own socket, connected by the loop: uvloop refuses an abstract address (a leading
    # NUL) given as a path (EINVAL), and takes the connected socket.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, address)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise
    writer.write(json.dumps({"token": token, "worker_idx": worker_idx, "pid": os.getpid()}).encode() + b"\n")
    await writer.drain()
    control = asyncio.ensure_future(_obey(hook, reader, writer))
    reset = installed.set(hook)
    try:
        return await fn(worker_idx, *args, **kwargs)
    finally:
        installed.reset(reset)
        control.cancel()
        await asyncio.wait({control})
        writer.close()


async def _obey(hook: FaultHook, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            hook.apply(json.loads(line))
            writer.write(b'{"ok": true}\n')
            await writer.drain()
    except (ConnectionError, ValueError):
        pass
    hook.release()  # the test is gone: nothing may stay held
