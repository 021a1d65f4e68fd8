"""The vocabulary of both schemes: option values, states, timeouts, worker ids and devices.

Everything here is checked once, where the user passes it, with an error naming the
option; the layers above only read the checked values.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

__all__ = [
    "DEFAULT",
    "Commit",
    "CommitMode",
    "LocalOptions",
    "OnWorkerError",
    "Phase",
    "SchemeOptions",
    "Strategy",
    "Timeout",
    "TransportKind",
    "UseDefault",
    "WorkerState",
    "check_poll",
    "checked_timeout",
    "choice",
    "device_problem",
    "parse_device",
    "parse_worker_ids",
    "resolve_timeout",
]

Strategy = Literal["tensordict", "state_dict"]
Commit = Literal["swap", "copy"]
CommitMode = Literal["auto", "manual"]
OnWorkerError = Literal["raise", "skip"]
TransportKind = Literal["shm", "queue"]
Phase = Literal["new", "running", "closing", "closed"]
"""A sender's lifecycle: ``connect()`` makes it running, ``aclose()`` closing then closed."""
WorkerState = Literal["waiting", "connected", "dead", "left", "stopped", "retired"]
"""A worker as its sender sees it (``WorkerStatistics.state``)."""

STRATEGIES: tuple[Strategy, ...] = ("tensordict", "state_dict")


class UseDefault(enum.Enum):
    """The type of :data:`DEFAULT`: a ``timeout`` left at ``DEFAULT`` is the scheme's ``timeout`` option.

    Example::

        scheme = MultiProcessWeightSyncScheme(timeout=10)
        scheme.init_on_sender(model=make_policy(), num_workers=1)
        worker = loopback_worker(scheme, 0)
        worker.init_on_receiver(worker_idx=0, model=make_policy())
        await asyncio.gather(scheme.connect(), worker.connect())
        await scheme.send(timeout=DEFAULT)     # as send(): within the scheme's 10 s
        await scheme.send(timeout=None)        # this call: no bound

        async def push(timeout=DEFAULT):       # a helper of yours passes the default on
            return await scheme.send(timeout=timeout)

        print(await push(), repr(DEFAULT))     # 3 DEFAULT
        await scheme.aclose()
        await worker.aclose()
    """

    DEFAULT = "DEFAULT"

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = UseDefault.DEFAULT
"""The default of every ``timeout`` argument: the scheme's ``timeout`` option."""

Timeout = float | None | UseDefault


def checked_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    """*timeout* if it is None or a number of seconds >= 0 (0: do not wait); else raise
    :class:`ValueError` before anything is sent or awaited."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:  # (NaN fails >=)
        raise ValueError(f"{name} must be a number of seconds >= 0, or None for no bound; got {timeout!r}")
    return timeout


def resolve_timeout(timeout: Timeout, default: float | None, name: str = "timeout") -> float | None:
    """*timeout*, or *default* where it is :data:`DEFAULT`; checked as :func:`checked_timeout`."""
    if timeout is DEFAULT:
        return default
    return checked_timeout(timeout, name)


def choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise :class:`ValueError` unless *value* is one of *allowed*."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_poll(poll: bool, commit_mode: str) -> None:
    """A polled receiver commits at each ``poll_nowait()``: refuse it with manual commits."""
    if poll and commit_mode == "manual":
        raise ValueError("poll=True commits at each poll_nowait(): it needs commit_mode='auto', not 'manual'")


@dataclass(frozen=True)
class SchemeOptions:
    """The options both schemes take (a relay's local scheme gets the trainer's); checked when built."""

    strategy: Strategy = "tensordict"
    sync: bool = True
    timeout: float | None = 60.0
    commit: Commit = "swap"
    commit_mode: CommitMode = "auto"
    on_worker_error: OnWorkerError = "raise"
    check_finite: bool = False
    transfer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        choice("strategy", self.strategy, STRATEGIES)
        choice("commit", self.commit, ("swap", "copy"))
        choice("commit_mode", self.commit_mode, ("auto", "manual"))
        choice("on_worker_error", self.on_worker_error, ("raise", "skip"))
        if self.timeout is not None and not (checked_timeout(self.timeout) > 0):  # (a NaN is refused there)
            raise ValueError(f"timeout must be positive or None, got {self.timeout}")
        dtype = self.transfer_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"transfer_dtype must be a floating-point torch.dtype, got {dtype!r}")

    def kwargs(self) -> dict[str, Any]:
        """These options as keyword arguments of a scheme."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class LocalOptions:
    """The options of the single-host scheme's shared-memory slots; checked when built."""

    transport: TransportKind = "shm"
    num_slots: int = 2
    max_slots: int | None = None

    def __post_init__(self) -> None:
        choice("transport", self.transport, ("shm", "queue"))
        if not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.max_slots is not None and self.max_slots < self.num_slots:
            raise ValueError(f"max_slots ({self.max_slots}) must be >= num_slots ({self.num_slots})")


def _is_index(i: object) -> bool:
    return isinstance(i, int) and not isinstance(i, bool)


def parse_worker_ids(
    params_map: Mapping[int, Any] | None,
    devices: Any,
    device_map_fn: Any,
    num_workers: int | None,
    worker_ids: Iterable[int] | None,
) -> list[int]:
    """The worker ids that ``init_on_sender``'s arguments name (they must agree)."""
    candidates: list[list[int]] = []
    if params_map is not None:
        candidates.append(list(params_map))
    if worker_ids is not None:
        candidates.append(list(worker_ids))
    if isinstance(devices, Mapping):
        candidates.append(list(devices))
    if num_workers is not None and (not _is_index(num_workers) or num_workers < 1):
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    if not candidates:
        if devices is not None:
            n = len(devices)
            if num_workers is not None and num_workers != n:
                raise ValueError(f"num_workers={num_workers} but {n} device{' was' if n == 1 else 's were'} given")
            candidates.append(list(range(n)))
        elif num_workers is not None:
            candidates.append(list(range(num_workers)))
        elif device_map_fn is not None:
            raise ValueError("device_map_fn needs num_workers (or worker_ids)")
        else:
            raise ValueError("say how many workers: num_workers=, worker_ids=, devices= or params_map=")
    ids = candidates[0]
    for other in candidates[1:]:
        if sorted(other) != sorted(ids):
            raise ValueError(f"worker ids disagree: {sorted(ids)} vs {sorted(other)}")
    if num_workers is not None and num_workers != len(ids):
        raise ValueError(f"num_workers={num_workers} but {len(ids)} worker ids were given")
    if devices is not None and not isinstance(devices, Mapping) and len(devices) != len(ids):
        raise ValueError(f"{len(devices)} device{'' if len(devices) == 1 else 's'} for {len(ids)} worker{'' if len(ids) == 1 else 's'}")
    for i in ids:
        if not _is_index(i) or i < 0:
            raise ValueError(f"worker ids must be non-negative ints, got {i!r}")
    if len(set(ids)) != len(ids) or not ids:
        raise ValueError(f"worker ids must be distinct and non-empty, got {ids}")
    return ids


def parse_device(value: Any, who: str) -> torch.device:
    """*value* (a ``torch.device`` or its string) as a device usable here, before anything
    starts: a string torch does not read is a ValueError naming it, another type a TypeError."""
    if isinstance(value, torch.device):
        device = value
    else:
        try:
            device = torch.device(value)
        except (RuntimeError, TypeError) as exc:
            if isinstance(value, str):
                raise ValueError(f"{who}: {value!r} is not a device (such as 'cpu', 'cuda' or 'cuda:0'): {exc}") from None
            raise TypeError(f"{who}: a device is a torch.device or a string such as 'cuda:0', got {type(value).__name__} {value!r}") from None
    unusable = device_problem(device)
    if unusable is not None:
        raise ValueError(f"{who}: device {device} requested, but {unusable}")
    return device


def device_problem(device: torch.device) -> str | None:
    """Why this process cannot use *device* (a CUDA device it has not), or None."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available in this process"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"this process sees {count} CUDA device(s)"
    elif device.type == "meta":
        return "the meta device holds no data"
    elif device.type != "cpu":
        module = getattr(torch, device.type, None)
        is_available = getattr(module, "is_available", None)
        if callable(is_available) and not is_available():
            return f"the {device.type!r} backend is not available in this process"
    return None
