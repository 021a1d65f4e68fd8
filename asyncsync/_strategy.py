"""Weights in and out of models: extraction, validation, the user-facing format, apply.

``strategy="tensordict"`` hands weights around as a :class:`tensordict.TensorDict`,
``strategy="state_dict"`` as a plain ``dict`` of dotted keys. On the wire both are a
flat mapping ``"layer.0.weight" -> tensor`` (parameters and buffers of the module).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from tensordict import TensorDictBase
from torch import nn

from ._errors import WeightsError
from ._layout import Layout

__all__ = ["Strategy", "named_tensors", "to_flat", "validate", "as_user_weights", "resolve_model"]

Strategy = Literal["tensordict", "state_dict"]
STRATEGIES = ("tensordict", "state_dict")


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, then buffers, of *module* by dotted name (live tensors, no copy).

    Same keys and order as ``named_parameters()`` + ``named_buffers()`` (tied tensors
    once), in one walk over the modules: this runs on every send.
    """
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, mod in module.named_modules():
        dot = prefix + "." if prefix else ""
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params[dot + name] = p
        for name, b in mod._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                buffers[dot + name] = b
    params.update(buffers)
    return params


def to_flat(weights: Any) -> dict[str, torch.Tensor]:
    """Turn a module, TensorDict or (possibly nested) state dict into a flat mapping."""
    if isinstance(weights, nn.Module):
        flat = named_tensors(weights)
        if not flat:
            raise WeightsError(f"{type(weights).__name__} has no parameters or buffers to send")
        return flat
    if isinstance(weights, TensorDictBase):
        flat_td = weights.flatten_keys(".")
        out: dict[str, torch.Tensor] = {}
        for key in flat_td.keys(include_nested=True, leaves_only=True):
            name = key if isinstance(key, str) else ".".join(key)
            value = flat_td.get(key)
            if not isinstance(value, torch.Tensor):
                raise WeightsError(f"weights[{name!r}] is {type(value).__name__}, not a tensor")
            out[name] = value
        return out
    if isinstance(weights, Mapping):
        out = {}
        _flatten_mapping(weights, "", out)
        return out
    raise TypeError(
        f"weights must be None, an nn.Module, a TensorDict or a state dict, not {type(weights).__name__}"
    )


def _flatten_mapping(m: Mapping[Any, Any], prefix: str, out: dict[str, torch.Tensor]) -> None:
    for k, v in m.items():
        if not isinstance(k, str):
            raise WeightsError(f"weights key {k!r} is not a string")
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif isinstance(v, Mapping):
            _flatten_mapping(v, name + ".", out)
        else:
            raise WeightsError(f"weights[{name!r}] is {type(v).__name__}, not a tensor")


def validate(
    flat: Mapping[str, torch.Tensor],
    layout: Layout,
    *,
    partial: bool = False,
    check_finite: bool = False,
    who: str = "weights",
) -> None:
    """Raise :class:`WeightsError` unless *flat* fits *layout* (keys, shapes, dtypes, values)."""
    expected = layout.index
    ok = partial or len(flat) == len(expected)
    strided = torch.strided
    for key, t in flat.items():  # the fast path: a few attribute reads per tensor
        spec = expected.get(key)
        if (
            spec is None
            or not isinstance(t, torch.Tensor)
            or t.dtype != spec.dtype
            or t.shape != spec.shape
            or t.layout != strided
            or t.is_meta
        ):
            ok = False
            break
    if not ok:
        _raise_misfit(flat, layout, partial, who)
    if check_finite:
        bad = [k for k, t in flat.items() if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())]
        if bad:
            raise WeightsError(f"{who} hold NaN or inf in " + ", ".join(repr(k) for k in bad[:8]))


def _raise_misfit(flat: Mapping[str, torch.Tensor], layout: Layout, partial: bool, who: str) -> None:
    """The slow path of :func:`validate`: say exactly what does not fit."""
    expected = layout.index
    missing = [k for k in expected if k not in flat]
    extra = [k for k in flat if k not in expected]
    problems: list[str] = []
    if extra:
        problems.append("unexpected keys " + ", ".join(repr(k) for k in extra[:8]) + (" ..." if len(extra) > 8 else ""))
    if missing and not partial:
        problems.append("missing keys " + ", ".join(repr(k) for k in missing[:8]) + (" ..." if len(missing) > 8 else ""))
    for key, t in flat.items():
        spec = expected.get(key)
        if spec is None:
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"{key!r} is {type(t).__name__}, not a tensor")
            continue
        if tuple(t.shape) != spec.shape:
            problems.append(f"{key!r} has shape {tuple(t.shape)}, expected {spec.shape}")
        if t.device.type == "meta":
            problems.append(f"{key!r} is on the meta device and holds no data")
        if t.layout != torch.strided:
            problems.append(f"{key!r} has layout {t.layout}; only dense tensors can be sent")
        if t.dtype != spec.dtype:
            problems.append(f"{key!r} has dtype {t.dtype}, expected {spec.dtype}")
    raise WeightsError(f"{who} do not fit the model: " + "; ".join(problems or ["unknown mismatch"]))


def as_user_weights(flat: Mapping[str, torch.Tensor], strategy: Strategy) -> Any:
    """The format callbacks and ``update_policy_weights_`` receive for *strategy*."""
    if strategy == "state_dict":
        return dict(flat)
    from tensordict import TensorDict

    return TensorDict(dict(flat), batch_size=[]).unflatten_keys(".")


def resolve_model(context: Any, model_id: str | None) -> nn.Module | None:
    """Find the model named by *model_id* (a dotted attribute path) on *context*."""
    if context is None or model_id is None:
        return None
    obj = context
    for part in model_id.split("."):
        if isinstance(obj, nn.Module) and part.isdigit():
            obj = obj[int(part)]  # type: ignore[index]
        else:
            obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None
