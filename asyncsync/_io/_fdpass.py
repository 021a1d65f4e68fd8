"""Channel ends that pickle by passing their descriptor, whatever the pickler."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Endpoint"]


class Endpoint:
    """A channel end that pickles by passing its descriptor, whatever the pickler.

    A plain ``pickle`` of a ``Connection`` would copy the descriptor *number*; this goes
    through multiprocessing's reduction: inherited when pickled for a process being
    started, else handed over by multiprocessing's resource sharer, once (:class:`_SharedFd`).
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.connection import rebuild_connection, reduce_connection  # type: ignore[attr-defined]

        if mp.context.get_spawning_popen() is not None:  # pickled for a process being started
            return (Endpoint._rebuild, (reduce_connection(self.conn),))
        shared = _SharedFd(self.conn.fileno())
        return (Endpoint._rebuild, ((rebuild_connection, (shared, self.conn.readable, self.conn.writable)),))

    @staticmethod
    def _rebuild(reduced: tuple[Any, tuple[Any, ...]]) -> Endpoint:
        fn, args = reduced
        try:
            return Endpoint(fn(*args))
        except (EOFError, OSError, KeyError) as exc:
            raise RuntimeError(
                "a worker's channel end can be unpickled once, by one process: this scheme was already "
                "unpickled elsewhere (pickle the scheme once per worker process)"
            ) from exc


class _SharedFd:
    """multiprocessing's ``resource_sharer.DupFd``, except that asking for it again is refused
    quietly (the peer gets EOF) instead of printing a ``KeyError`` from the sharer's thread.

    The sharer hands each registered descriptor out once and then forgets its key; here the
    key is re-armed with a refusal after every hand-out.
    """

    def __init__(self, fd: int) -> None:
        from multiprocessing import reduction, resource_sharer

        sharer = resource_sharer._resource_sharer  # type: ignore[attr-defined]
        new_fd = os.dup(fd)
        key: list[int] = []

        def refuse(conn: Any, pid: int) -> None:
            pass  # nothing sent: the asking side reads EOF

        def rearm() -> None:  # the sharer calls this right after it popped the key
            sharer._cache[key[0]] = (refuse, rearm)

        def send(conn: Any, pid: int) -> None:
            reduction.send_handle(conn, new_fd, pid)

        def close() -> None:
            os.close(new_fd)
            rearm()

        self._id = sharer.register(send, close)
        key.append(self._id[1])

    def detach(self) -> int:
        """The descriptor (this process's own copy)."""
        from multiprocessing import reduction, resource_sharer

        with resource_sharer._resource_sharer.get_connection(self._id) as conn:  # type: ignore[attr-defined]
            return int(reduction.recv_handle(conn))
