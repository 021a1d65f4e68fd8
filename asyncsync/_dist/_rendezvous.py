"""Where the trainer and its relays meet: the launch's rank and size, the rendezvous store
and the control plane's token."""

from __future__ import annotations

import datetime
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from ._control import resolve_token

__all__ = ["Rendezvous"]


@dataclass
class Rendezvous:
    """A launch (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` by default, as
    torchrun sets them) and its store: the user's, torchrun's agent store, or a
    ``TCPStore`` on ``master_addr`` at ``master_port + 1`` hosted by rank 0 (the user's own
    group keeps its port)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    explicit_port: int | None
    token: bytes | None
    timeout: float | None
    user_store: Any = None
    _store: Any = field(default=None, repr=False)

    @classmethod
    def of(
        cls,
        *,
        rank: int | None,
        world_size: int | None,
        master_addr: str | None,
        master_port: int | None,
        store: Any,
        token: str | bytes | None,
        timeout: float | None,
    ) -> Rendezvous:
        return cls(
            rank=int(rank if rank is not None else os.environ.get("RANK", 0)),
            world_size=int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", 1)),
            master_addr=master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(master_port if master_port is not None else os.environ.get("MASTER_PORT", 29500)),
            explicit_port=master_port,
            token=resolve_token(token),
            timeout=timeout,
            user_store=store,
        )

    def open_store(self) -> Any:
        """A ``PrefixStore("asyncsync/", ...)`` over the user's, torchrun's or our own store
        (blocking: a store client connects)."""
        if self._store is not None:
            return self._store
        timeout = datetime.timedelta(seconds=self.timeout if self.timeout is not None else 300.0)
        if self.user_store is not None:
            base = self.user_store
        elif self._agent_store():
            base = TCPStore(self.master_addr, self.master_port, None, False, timeout)
        else:
            base = TCPStore(self.master_addr, self.store_port(), None, self.rank == 0, timeout, wait_for_workers=False)
        self._store = PrefixStore("asyncsync/", base)
        return self._store

    def close(self) -> None:
        self._store = None

    def _agent_store(self) -> bool:
        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and self.explicit_port is None

    def store_port(self) -> int:
        """The port of the rendezvous store on ``master_addr`` (unless one was passed as ``store=``)."""
        if self._agent_store():
            return self.master_port
        return self.explicit_port if self.explicit_port is not None else self.master_port + 1

    def store_name(self) -> str:
        if self.user_store is not None:
            return "the store passed as store="
        if self._agent_store():
            return f"torchrun's agent store ({self.master_addr}:{self.master_port})"
        return f"{self.master_addr}:{self.store_port()}"

    def trainer_token(self, store: Any) -> bytes:
        """The token, put in *store* for the relays when none was given."""
        if self.token is not None:
            return self.token
        store.set("token", secrets.token_hex(32))
        return bytes(store.get("token"))
