"""What a send carries: the weights resolved and validated once per source (both schemes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import WeightsError
from ._layout import Layout
from ._weights import KnownSource, resolve_model, to_flat, validate

__all__ = ["ModelRef", "SourceReader", "configured_source"]


class ModelRef:
    """A model looked up at every send (``context`` + ``model_id``), as torchrl does."""

    def __init__(self, resolve: Callable[[], Any]) -> None:
        self.resolve = resolve


def configured_source(model: Any, weights: Any, context: Any, model_id: str | None, *, choices: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """What ``send(weights=None)`` reads, from a scheme's ``init_on_sender`` arguments:
    *model*, *weights*, or ``context.<model_id>`` (a :class:`ModelRef`, looked up at every
    send, as torchrl does); and its tensors now. *choices* names the arguments in errors."""
    if weights is not None and model is not None:
        raise ValueError("pass either weights or model, not both")
    by_context = model is None and weights is None
    if by_context:
        model = resolve_model(context, model_id)
        if model is None:
            where = f", or a context with the model at context.{model_id}" if model_id else ""
            raise ValueError(f"nothing to send: pass {choices}{where}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    now = model if model is not None else weights
    first = to_flat(now)
    if not first:
        raise ValueError("the weights hold no tensors")
    return (ModelRef(lambda: _lookup(context, model_id)) if by_context else now), first


def _lookup(context: Any, model_id: str | None) -> nn.Module:
    model = resolve_model(context, model_id)
    if model is None:
        raise WeightsError(f"context.{model_id} is no longer an nn.Module; nothing to send")
    return model


class SourceReader:
    """Reads a send's weights as flat tensors of the source layout, validated.

    A configured source (what ``send(weights=None)`` reads) is validated fully once, then
    only checked cheaply (:class:`~.._weights.KnownSource`); weights given to one send are
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

    def known(self, flat: Any) -> KnownSource | None:
        """The configured source whose dict *flat* is (what :meth:`source` returned), if any."""
        for known in self._known.values():
            if known.flat is flat:
                return known
        return None

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
