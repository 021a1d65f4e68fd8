"""What a send carries: the weights resolved and validated once per source (both schemes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._errors import WeightsError
from .._layout import Layout
from .._strategy import KnownSource, to_flat, validate

__all__ = ["ModelRef", "SourceReader"]


class ModelRef:
    """A model looked up at every send (``context`` + ``model_id``), as torchrl does."""

    def __init__(self, resolve: Callable[[], Any]) -> None:
        self.resolve = resolve


class SourceReader:
    """Reads a send's weights as flat tensors of the source layout, validated.

    A configured source (what ``send(weights=None)`` reads) is validated fully once, then
    only checked cheaply (:class:`~.._strategy.KnownSource`); weights given to one send are
    validated each time, *partial* ones as a subset of the keys.

    Example::

        reader = SourceReader(layout, layout)
        flat = reader.source(model, check_finite=False)    # every send(): cheap after the first
        flat = reader.weights(td.select("0.weight"), partial=True, check_finite=False)
    """

    def __init__(self, source_layout: Layout, wire_layout: Layout) -> None:
        self._source_layout = source_layout
        self._wire_layout = wire_layout
        self._known: dict[int, KnownSource] = {}  # id(source) -> its last validated tensors

    @staticmethod
    def resolve(source: Any) -> Any:
        """The object a configured source stands for now (a :class:`ModelRef` is looked up)."""
        return source.resolve() if isinstance(source, ModelRef) else source

    def source(self, source: Any, check_finite: bool) -> dict[str, torch.Tensor]:
        """A configured source's weights (resolved with :meth:`resolve` first). With
        *check_finite*, its values are checked at every call (NaN and inf rejected)."""
        known = self._known.get(id(source))
        flat = known.current() if known is not None and known.obj is source else None
        if flat is None:
            flat = self.weights(source, False, check_finite)
            known = KnownSource.of(source, flat)
            if known is not None:
                self._known[id(source)] = known
        elif check_finite:
            validate(flat, self._source_layout, check_finite=True, wire_layout=self._wire_layout)
        return flat

    def weights(self, weights: Any, partial: bool, check_finite: bool) -> dict[str, torch.Tensor]:
        """Weights given to one send (a module, TensorDict or state dict)."""
        flat = to_flat(weights, self._source_layout)
        if not flat:
            raise WeightsError("the weights hold no tensors")
        validate(flat, self._source_layout, partial=partial, check_finite=check_finite, wire_layout=self._wire_layout)
        return flat

    def is_whole(self, flat: dict[str, torch.Tensor]) -> bool:
        """Whether *flat* holds every key (else a partial update, completed from a base)."""
        return len(flat) == len(self._source_layout.specs)
