"""What a :class:`~._sender.Sender` needs from the thing that moves its versions.

Two objects implement it: the single-host transport (shared-memory slots and a channel per
worker process) and the multi-host one (a control connection and a network group per
host, a relay on each). A transport reports what its peers say to the
:class:`~._delivery.Delivery` it was built with; the delivery never calls it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple, Protocol, TypeVar

import torch

from ._deadline import Deadline

__all__ = ["Group", "Silence", "Transport"]

W = TypeVar("W", bound=Hashable)
S_co = TypeVar("S_co", covariant=True)

Group = tuple[Mapping[str, torch.Tensor], list[W]]
"""One send's validated weights and the targets that get them (one group per source)."""


class Silence(NamedTuple):
    """Why some workers did not answer, as far as the transport knows: those whose
    receiver never said hello (each with its process's pid, if known), and what else may
    explain their silence (they are polled, say)."""

    never_connected: Mapping[Hashable, int | None] = {}
    hint: str = ""


class Transport(Protocol[W, S_co]):
    """Moves versions to workers (see the module docstring)."""

    async def open(self) -> None:
        """Start: watch the workers' channels, listen for peers. Called once, when the
        delivery becomes running."""

    async def publish(self, groups: Sequence[Group[W]], version: int, deadline: Deadline) -> None:
        """Write *version* (each group's weights) and make it its targets' newest version.

        Either the whole version is published when this returns, or (an error, a
        cancellation) none of it is and nothing is left reserved.
        """

    def silence(self, wids: Sequence[W]) -> Silence:
        """Why *wids* may be silent (for a timeout's message)."""

    def retire(self, wid: W) -> None:
        """Elastic membership: *wid* (gone, or never connected) stops being a member."""

    def statistics(self) -> S_co:
        """The sender's statistics, with the transport's fields."""

    async def aclose(self, timeout: float) -> None:
        """Stop every peer (waiting up to *timeout* for them to end) and release everything."""
