"""What both schemes share: the options (stored once), the role this process plays, and
the calls that go to that role.

A scheme is configured for one role per process: ``init_on_sender`` makes it the trainer
(a :class:`~.._core._sender.Sender`), ``init_on_receiver`` a worker (a
:class:`~.._local._receiver.Receiver`, or a rank that is its own worker), and the
multi-host scheme's ``init_on_relay`` a host's relay. ``connect()``, ``aclose()``,
``async with``, ``version`` and ``statistics()`` act for that role.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import torch

from .._core._options import DEFAULT, Commit, CommitMode, OnWorkerError, SchemeOptions, Strategy, Timeout
from .._core._sender import Sender
from .._local._receiver import Receiver

__all__ = ["Role", "SchemeBase"]

W = TypeVar("W")
Self = TypeVar("Self", bound="SchemeBase[Any]")


class Role(Protocol):
    """What this process is, for a scheme: its sender, its worker, or its relay."""

    @property
    def version(self) -> int: ...

    async def connect(self, timeout: Timeout = DEFAULT) -> int: ...

    def statistics(self) -> Any: ...


class _Option:
    """A read-only attribute of the scheme that reads one of its :class:`SchemeOptions`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, scheme: SchemeBase[Any] | None, owner: type) -> Any:
        if scheme is None:
            return self
        return getattr(scheme._options, self.name)


class SchemeBase(Generic[W]):
    """The part of both schemes that does not depend on the transport (see the module docstring)."""

    strategy: Strategy = _Option()  # type: ignore[assignment]
    sync: bool = _Option()  # type: ignore[assignment]
    timeout: float | None = _Option()  # type: ignore[assignment]
    commit_mode: CommitMode = _Option()  # type: ignore[assignment]
    on_worker_error: OnWorkerError = _Option()  # type: ignore[assignment]
    check_finite: bool = _Option()  # type: ignore[assignment]
    transfer_dtype: torch.dtype | None = _Option()  # type: ignore[assignment]

    def __init__(self, options: SchemeOptions) -> None:
        self._options = options
        self.model_id: str | None = None
        self._sender: Sender[W, Any] | None = None
        self._receiver: Receiver | None = None  # this process's worker (a rank that is its own worker too)
        self._role: Role | None = None

    @property
    def options(self) -> SchemeOptions:
        """The options this scheme was made with (a frozen record)."""
        return self._options

    @property
    def commit_kind(self) -> Commit:
        """The ``commit=`` option (``"swap"`` or ``"copy"``); ``commit()`` is the worker's method."""
        return self._options.commit

    @property
    def sender(self) -> Sender[W, Any]:
        """The trainer's side, after ``init_on_sender``."""
        if self._sender is None:
            raise RuntimeError("call init_on_sender() first")
        return self._sender

    @property
    def receiver(self) -> Receiver:
        """This worker's receiver, after ``init_on_receiver``."""
        if self._receiver is None:
            raise RuntimeError("call init_on_receiver() first")
        return self._receiver

    def _role_or_raise(self) -> Role:
        if self._role is None:
            raise RuntimeError("call init_on_sender() or init_on_receiver() first")
        return self._role

    # ------------------------------------------------------------------ every role

    async def connect(self, timeout: Timeout = DEFAULT) -> int:
        """Sender: send the initial weights and wait for every worker's ack.
        Worker: start the receiver task and wait for the initial weights. Returns the version."""
        return await self._role_or_raise().connect(timeout=timeout)

    def statistics(self) -> Any:
        """Sender: versions, lags and errors per worker. Worker: its version and timings."""
        return self._role_or_raise().statistics()

    @property
    def version(self) -> int:
        """Sender: newest version sent. Worker: the version its model runs."""
        return self._role_or_raise().version

    async def aclose(self) -> None:
        """Sender: stop every worker, wait for them, release everything. Worker: end the
        receiver task. Idempotent."""
        await self._close(None)

    async def _close(self, failure: str | None) -> None:
        raise NotImplementedError

    async def __aenter__(self: Self) -> Self:
        try:
            await self.connect()
        except BaseException:
            await self.aclose()  # no reader task, slot or connected worker left behind
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        # A worker whose own code failed inside the block says so in its goodbye: the
        # sender's WorkerLeftError (a multi-host trainer's too) carries it.
        await self._close(f"its code raised {summary(exc)}" if isinstance(exc, Exception) else None)

    # ------------------------------------------------------------------ the trainer

    async def send(self, weights: Any = None, worker_ids: W | Iterable[W] | None = None, *, partial: bool = False, timeout: Timeout = DEFAULT) -> int:
        """Push weights (None: read the configured source) and, if ``sync``, wait for the acks.

        *weights* may be an ``nn.Module``, a TensorDict or a state dict; *worker_ids* one
        worker id or a list (None: every worker). With *partial*, *weights* may hold a
        subset of the keys (``td.select(...)``); the rest keep their values on each
        worker. Returns the version number of this send.
        """
        return await self.sender.send(weights, worker_ids, partial=partial, timeout=timeout)

    async def send_async(
        self, weights: Any = None, worker_ids: W | Iterable[W] | None = None, *, partial: bool = False, timeout: Timeout = DEFAULT
    ) -> int:
        """Push weights without waiting for acks; returns the version (see :meth:`wait_async`).

        A worker still busy with an earlier version gets this one when it answers (latest
        wins); the call never waits for a worker. *timeout* bounds the wait for another
        send's snapshot and for room to write it.
        """
        return await self.sender.send_async(weights, worker_ids, partial=partial, timeout=timeout)

    async def wait_async(
        self, version: int | None = None, worker_ids: W | Iterable[W] | None = None, *, quorum: int | None = None, timeout: Timeout = DEFAULT
    ) -> None:
        """Wait until the targeted workers applied *version* (default: everything sent)."""
        await self.sender.wait_async(version, worker_ids, quorum=quorum, timeout=timeout)

    # ------------------------------------------------------------------ a worker

    def commit(self) -> int | None:
        """Worker, ``commit_mode="manual"``: commit the staged version now."""
        return self.receiver.commit()

    def poll_nowait(self) -> int | None:
        """Worker, ``init_on_receiver(..., poll=True)``: commit the newest version if new
        (its version, or None); no system call when nothing is new."""
        return self.receiver.poll_nowait()

    @property
    def update_pending(self) -> bool:
        """Worker: a staged version waits for :meth:`commit`."""
        return self.receiver.update_pending

    async def wait_for_version(self, version: int, *, timeout: Timeout = DEFAULT) -> int:
        """Worker: wait until the model runs *version* or newer."""
        return await self.receiver.wait_for_version(version, timeout=timeout)


def summary(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` of *exc*, cut to about *limit* characters (whatever its ``__str__`` does)."""
    try:
        message = str(exc)
    except Exception:
        message = "(its message could not be read)"
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
