"""The options both schemes share, validated once, and the "scheme's timeout" default."""

from __future__ import annotations

import numbers

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

import torch

from ._core._layout import Layout
from ._core._strategy import STRATEGIES, Strategy

if TYPE_CHECKING:
    from ._local._receiver import Commit, CommitMode

__all__ = ["DEFAULT", "OnWorkerError", "SchemeOptions", "Timeout", "UseDefault", "checked_timeout", "choice", "resolve_timeout"]

OnWorkerError = Literal["raise", "skip"]


class UseDefault(enum.Enum):
    """The default of every ``timeout`` argument: the scheme's ``timeout`` option."""

    DEFAULT = "DEFAULT"

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = UseDefault.DEFAULT
"""``timeout=DEFAULT``: use the scheme's ``timeout``."""

Timeout = float | None | UseDefault


def resolve_timeout(timeout: Timeout, default: float | None, name: str = "timeout") -> float | None:
    """*timeout*, or *default* where it is :data:`DEFAULT` (or ``...``, its older spelling);
    raise :class:`ValueError` for what is not a number of seconds >= 0 or None."""
    if timeout is DEFAULT or timeout is ...:  # type: ignore[comparison-overlap]
        return default
    return checked_timeout(timeout, name)  # type: ignore[arg-type]


def checked_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    """*timeout* if it is None or a number of seconds >= 0 (0: do not wait); else raise
    :class:`ValueError` before anything is sent or awaited."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:  # (NaN fails >=)
        raise ValueError(f"{name} must be a number of seconds >= 0, or None for no bound; got {timeout!r}")
    return timeout


def choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise :class:`ValueError` unless *value* is one of *allowed*."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class SchemeOptions:
    """The options of :class:`MultiProcessWeightSyncScheme` that the multi-host scheme
    shares (and hands to each relay's local scheme); checked when built."""

    strategy: Strategy = "tensordict"
    sync: bool = True
    timeout: float | None = 60.0
    commit: Commit = "swap"
    commit_mode: CommitMode = "auto"
    on_worker_error: OnWorkerError = "raise"
    check_finite: bool = False
    transfer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        choice("commit", self.commit, ("swap", "copy"))
        choice("commit_mode", self.commit_mode, ("auto", "manual"))
        choice("on_worker_error", self.on_worker_error, ("raise", "skip"))
        if self.timeout is not None and not (checked_timeout(self.timeout) > 0):  # (a NaN is refused there)
            raise ValueError(f"timeout must be positive or None, got {self.timeout}")
        dtype = self.transfer_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"transfer_dtype must be a floating-point torch.dtype, got {dtype!r}")

    def kwargs(self) -> dict[str, Any]:
        """These options as keyword arguments of :class:`MultiProcessWeightSyncScheme`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def layouts(self, first: Mapping[str, torch.Tensor]) -> tuple[Layout, Layout]:
        """The layout of the weights *first*, and the one on the wire (floats in
        ``transfer_dtype``, if set)."""
        source_layout = Layout.from_tensors(first)
        if self.transfer_dtype is None:
            return source_layout, source_layout
        dtype_map = {s.dtype: self.transfer_dtype for s in source_layout.specs if s.dtype.is_floating_point}
        return source_layout, Layout.from_tensors(first, dtype_map)
