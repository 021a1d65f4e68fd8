"""Weights in and out of models: extraction, validation, the user-facing format, apply.

``strategy="tensordict"`` hands weights around as a :class:`tensordict.TensorDict`,
``strategy="state_dict"`` as a plain ``dict`` of dotted keys. On the wire both are a
flat mapping ``"layer.0.weight" -> tensor`` (parameters and buffers of the module).
"""

from __future__ import annotations

import difflib
import logging
import operator
import sys
from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn

from .._errors import WeightsError
from ._layout import Layout, TensorSpec, _storage_key
from ._options import Strategy

__all__ = ["KnownSource", "Strategy", "named_tensors", "to_flat", "validate", "bind_targets", "as_user_weights", "resolve_model"]



def _is_tensordict(weights: Any) -> bool:
    # tensordict is imported where it is used (it takes seconds): weights cannot be one of its
    # objects before it was imported.
    td = sys.modules.get("tensordict")
    return td is not None and isinstance(weights, td.TensorDictBase)


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of *module* by dotted name (live tensors, no copy).

    The keys of ``module.state_dict()`` in its order (per module: parameters, then
    buffers), except that a tied tensor appears once, under its first name, and
    non-persistent buffers are left out. One walk over the modules: this runs on
    every send.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, mod in module.named_modules():
        dot = prefix + "." if prefix else ""
        for name, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out[dot + name] = p
        if mod._buffers:
            skip = mod._non_persistent_buffers_set
            for name, b in mod._buffers.items():
                if b is not None and id(b) not in seen and name not in skip:
                    seen.add(id(b))
                    out[dot + name] = b
    return out


def _all_names(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every name of every tensor of *module*: ``(persistent, non_persistent)``.

    *persistent* holds the keys of ``module.state_dict()`` (tied tensors under each of
    their names, shared submodules under each path), mapped to the live tensors.
    """
    persistent: dict[str, torch.Tensor] = {}
    non_persistent: dict[str, torch.Tensor] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in mod._parameters.items():
            if p is not None:
                persistent[dot + name] = p
        skip = mod._non_persistent_buffers_set
        for name, b in mod._buffers.items():
            if b is not None:
                (non_persistent if name in skip else persistent)[dot + name] = b
    return persistent, non_persistent


def to_flat(weights: Any, layout: Layout | None = None) -> dict[str, torch.Tensor]:
    """Turn a module, TensorDict or (possibly nested) state dict into a flat mapping.

    Without *layout*: every name the weights hold, as they list it. A module gives the
    keys of its ``state_dict()`` (tied tensors under each name, so that
    :meth:`Layout.from_tensors` records them as aliases); a TensorDict or a mapping
    gives its leaves.

    With *layout*: the keys of *layout* (canonical keys) that the weights provide, plus
    whatever does not fit it (for :func:`validate` to report). Dropped or renamed:

    * an alias of *layout* (``head.weight`` tied to ``emb.weight``): the canonical
      key's value is used, or the alias's value under the canonical key if the
      canonical key is absent;
    * a key not in *layout* whose tensor is storage-identical to another key's (the
      second name of a tied tensor in a ``state_dict``);
    * a TensorDict leaf not in *layout* that is not an ``nn.Parameter``, when the
      TensorDict gives every key of *layout*: a non-persistent buffer, which
      ``TensorDict.from_module`` lists and a ``state_dict`` does not. (In a TensorDict
      that gives fewer keys, an unknown key is kept, for :func:`validate` to name.)

    A module provides any key of *layout* it has under any name, non-persistent
    buffers included. The usual case (the weights list exactly the layout's keys)
    costs one key-set comparison on top of the walk.
    """
    if isinstance(weights, nn.Module):
        if layout is None:
            flat, _ = _all_names(weights)
            if not flat:
                raise WeightsError(f"{type(weights).__name__} has no parameters or buffers to send")
            return flat
        flat = named_tensors(weights)
        if flat.keys() == layout.index.keys():
            return flat
        if not flat:
            raise WeightsError(f"{type(weights).__name__} has no parameters or buffers to send")
        return _module_for_layout(weights, flat, layout)
    if _is_tensordict(weights):
        flat_td = weights.flatten_keys(".")
        out: dict[str, torch.Tensor] = {}
        for key in flat_td.keys(include_nested=True, leaves_only=True):
            name = key if isinstance(key, str) else ".".join(key)
            value = flat_td.get(key)
            if not isinstance(value, torch.Tensor):
                raise WeightsError(f"weights[{name!r}] is {type(value).__name__}, not a tensor")
            out[name] = value
        return out if layout is None else _fit_mapping(out, layout, is_tensordict=True)
    if isinstance(weights, Mapping):
        out = {}
        _flatten_mapping(weights, "", out)
        return out if layout is None else _fit_mapping(out, layout, is_tensordict=False)
    raise TypeError(
        f"weights must be None, an nn.Module, a TensorDict or a state dict, not {type(weights).__name__}"
    )


def _module_for_layout(module: nn.Module, flat: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The slow path of :func:`to_flat` for a module whose first names differ from *layout*'s keys."""
    persistent, non_persistent = _all_names(module)
    out: dict[str, torch.Tensor] = {}
    used: set[int] = set()
    for key in layout.keys:
        for name in (key, *layout.aliases_of(key)):
            t = persistent.get(name)
            if t is None:
                t = non_persistent.get(name)
            if t is not None:
                out[key] = t
                used.add(id(t))
                break
    for key, t in flat.items():  # tensors the layout has no name for: validate reports them
        if id(t) not in used:
            out[key] = t
    return out


def _fit_mapping(flat: dict[str, torch.Tensor], layout: Layout, is_tensordict: bool) -> dict[str, torch.Tensor]:
    """Drop or rename the keys of *flat* that *layout* knows under another name (see :func:`to_flat`)."""
    index = layout.index
    if flat.keys() <= index.keys():
        return flat
    alias_map = layout.alias_map
    kept = {k: t for k, t in flat.items() if k in index}
    rest: list[str] = []
    for key, t in flat.items():
        if key in index:
            continue
        canonical = alias_map.get(key)
        if canonical is None:
            rest.append(key)
        elif canonical not in kept:
            kept[canonical] = t  # only the alias was given
    extra: dict[str, torch.Tensor] = {}
    if rest:
        # Only a TensorDict that gives every key of the layout is read from a whole module
        # (``TensorDict.from_module``): its other non-Parameter leaves are non-persistent
        # buffers. In any other TensorDict an unknown key is a mistake: validate names it.
        whole = len(kept) == len(index)
        by_storage: set[tuple[object, ...]] = set()
        for t in kept.values():
            sk = _storage_key(t) if isinstance(t, torch.Tensor) else None
            if sk is not None:
                by_storage.add(sk)
        for key in rest:
            t = flat[key]
            if isinstance(t, torch.Tensor):
                sk = _storage_key(t)
                if sk is not None:
                    if sk in by_storage:
                        continue  # another name of a tensor given under an earlier key
                    by_storage.add(sk)
                if is_tensordict and whole and not isinstance(t, nn.Parameter):
                    continue  # a non-persistent buffer (TensorDict.from_module lists them)
            extra[key] = t  # validate reports it
    out = {k: kept[k] for k in layout.keys if k in kept}
    out.update(extra)
    return out


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
    wire_layout: Layout | None = None,
) -> None:
    """Raise :class:`WeightsError` unless *flat* fits *layout* (keys, shapes, dtypes, values).

    *flat* is what :func:`to_flat` returns with *layout*. With *check_finite*, floating
    point values must be finite, and, where *wire_layout* sends a key in another
    floating point dtype (``transfer_dtype``), finite in that dtype too (1e5 is inf in
    float16).
    """
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
        _check_finite(flat, wire_layout.index if wire_layout is not None else {}, who)


def _check_finite(flat: Mapping[str, torch.Tensor], wire: Mapping[str, TensorSpec], who: str) -> None:
    bad: list[str] = []
    overflow: list[str] = []
    for key, t in flat.items():
        if not (t.is_floating_point() or t.is_complex()):
            continue
        spec = wire.get(key)
        if spec is not None and spec.dtype != t.dtype and spec.dtype.is_floating_point and t.is_floating_point():
            if t.numel() == 0:
                continue
            # Rounding is monotonic: the tensor fits the wire dtype iff its extremes do.
            lo, hi = torch.aminmax(t.detach())
            ends = torch.stack([lo, hi])
            if not bool(torch.isfinite(ends).all()):
                bad.append(key)
            elif not bool(torch.isfinite(ends.to(spec.dtype)).all()):
                peak = float(ends.abs().max())
                wire_name = str(spec.dtype).replace("torch.", "")
                overflow.append(f"{key!r} (|x| up to {peak:g}, {wire_name} holds {torch.finfo(spec.dtype).max:g})")
        elif not bool(torch.isfinite(t).all()):
            bad.append(key)
    if bad:
        raise WeightsError(f"{who} hold NaN or inf in " + ", ".join(repr(k) for k in bad[:8]))
    if overflow:
        wire_dtypes = sorted({str(wire[k].dtype).replace("torch.", "") for k in flat if k in wire and wire[k].dtype != flat[k].dtype})
        raise WeightsError(
            f"{who} would be inf on the wire ({'/'.join(wire_dtypes)}, transfer_dtype): " + ", ".join(overflow[:8])
        )


def _raise_misfit(flat: Mapping[str, torch.Tensor], layout: Layout, partial: bool, who: str) -> None:
    """The slow path of :func:`validate`: say exactly what does not fit."""
    expected = layout.index
    missing = [k for k in expected if k not in flat]
    extra = [k for k in flat if k not in expected]
    problems: list[str] = []
    if extra:
        close = sorted({m for k in extra[:8] for m in difflib.get_close_matches(k, list(expected), n=1)})
        problems.append(
            "unexpected keys " + ", ".join(_with_shape(k, flat[k]) for k in extra[:8]) + (" ..." if len(extra) > 8 else "")
            + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
        )
        if partial or not missing:  # else the missing keys below name what is expected
            problems.append(f"the model's keys are {_abbreviated(list(expected))}")
    if missing and not partial:
        problems.append(
            "missing keys "
            + ", ".join(f"{k!r} {expected[k].shape} {str(expected[k].dtype).replace('torch.', '')}" for k in missing[:8])
            + (" ..." if len(missing) > 8 else "")
        )
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


def _abbreviated(keys: list[str], limit: int = 8) -> str:
    """``'a', 'b', ... (12 keys)``: the first *limit* keys, and how many there are."""
    shown = ", ".join(map(repr, keys[:limit]))
    return shown if len(keys) <= limit else f"{shown}, ... ({len(keys)} keys)"


def _with_shape(key: str, t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{key!r} {tuple(t.shape)}"
    return repr(key)


def bind_targets(model: nn.Module, layout: Layout) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Match the wire keys of *layout* to *model*'s live tensors (on the worker).

    Returns ``(targets, problems)``: *targets* maps each key of *layout* the model has
    (under that name, or under any name the model or the layout gives the same
    tensor) to the model's tensor; *problems* says, one line each, what does not fit:
    keys the model lacks, shape and dtype mismatches (floating point dtypes convert),
    model tensors no key covers, and two keys landing on one tensor. The layout fits
    iff *problems* is empty.

    Non-persistent buffers are not part of the model's state: never required, never
    reported, but a key naming one (``TensorDict.from_module`` lists them) binds to it.
    """
    persistent, non_persistent = _all_names(model)
    targets: dict[str, torch.Tensor] = {}
    owner: dict[int, str] = {}  # id(model tensor) -> the key that landed on it
    problems: list[str] = []
    for spec in layout.specs:
        key = spec.key
        t: torch.Tensor | None = None
        for name in (key, *layout.aliases_of(key)):
            t = persistent.get(name)
            if t is None:
                t = non_persistent.get(name)
            if t is not None:
                break
        if t is None:
            problems.append(f"unexpected key {layout.describe(key)}")
            continue
        other = owner.get(id(t))
        if other is not None:
            problems.append(f"keys {other!r} and {key!r} both land on one model tensor (tied in the model, not in the sent weights)")
            continue
        owner[id(t)] = key
        if tuple(t.shape) != spec.shape:
            problems.append(f"{key!r}: sent shape {spec.shape}, model has {tuple(t.shape)}")
        elif t.dtype != spec.dtype and not (t.dtype.is_floating_point and spec.dtype.is_floating_point):
            problems.append(f"{key!r}: sent dtype {spec.dtype}, model has {t.dtype}")
        else:
            targets[key] = t
    missing: list[str] = []
    for name, t in persistent.items():
        if id(t) in owner:
            continue
        owner[id(t)] = ""  # report each tensor once, under its first name
        note = ""
        canonical = layout.alias_map.get(name)
        if canonical is not None:
            note = f" (the sender ties it to {canonical!r})"
        missing.append(f"{name}: {tuple(t.shape)}{note}")
    if missing:
        problems.append("model keys not sent: " + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
    return targets, problems


def as_user_weights(flat: Mapping[str, torch.Tensor], strategy: Strategy, layout: Layout | None = None) -> Any:
    """The format callbacks and ``update_policy_weights_`` receive for *strategy*.

    With *layout*, every alias of a key in *flat* is listed too, as the same tensor, so
    that the result has the keys of the model's ``state_dict()`` (``load_state_dict``
    with ``strict=True`` accepts it on a model with tied weights).
    """
    if layout is not None and layout.aliases:
        flat = dict(flat)
        for alias, canonical in layout.aliases:
            if canonical in flat and alias not in flat:
                flat[alias] = flat[canonical]
    if strategy == "state_dict":
        return dict(flat)
    if "tensordict" not in sys.modules:  # its first import takes seconds: say what is happening
        logging.getLogger("asyncsync").info("asyncsync: importing tensordict (strategy='tensordict')...")
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


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")
_is_cpu = operator.attrgetter("is_cpu")
_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_contiguous = torch.Tensor.is_contiguous


class KnownSource:
    """A weights source validated once, and a cheap check that it still gives the same tensors.

    The sender validates a source fully the first time (and whenever the check fails); on
    every later send it only re-reads the tensors from the containers that held them and
    compares identities, shapes, dtypes and devices: a fixed number of C-level ``map``
    passes, no walk over the modules, no Python call per tensor or per submodule. For an
    ``nn.Module`` the check also covers its structure (every submodule, and how many
    parameters, buffers and children each holds); for a plain dict, its keys. Anything
    else (a TensorDict, a nested dict) is not cached. While nothing changed,
    :meth:`current` returns one dict built at validation (callers must not modify it).

    After :meth:`track_memory` (the sender found the tensors laid out in flat spans and
    copies them as such), :meth:`current` also proves that every tensor still views the
    memory it viewed then: the same data pointer, still contiguous (or the same strides).
    A tensor re-pointed (``p.data = other``), resized or viewed another way fails it.
    """

    def __init__(self, obj: Any, flat: dict[str, torch.Tensor]) -> None:
        self.obj = obj
        self.flat = dict(flat)
        self.keys = list(flat)
        self.tensors = list(flat.values())
        self.shapes = list(map(_shape, self.tensors))
        self.dtypes = list(map(_dtype, self.tensors))
        self.devices = list(map(_device, self.tensors))
        self.on_cpu = all(d.type == "cpu" for d in self.devices)
        self.ptrs: list[int] | None = None  # set by track_memory
        self.strides: list[tuple[int, ...]] | None = None  # the same, where not all are contiguous
        self._storages: list[torch.UntypedStorage] = []
        self.modules: list[nn.Module] = []
        if isinstance(obj, nn.Module):
            self.modules = list(obj.modules())
            self.params = [m._parameters for m in self.modules]
            self.buffers = [m._buffers for m in self.modules]
            self.submodules = [m._modules for m in self.modules]
            self.sizes = self._sizes()
            self.children = list(self._children())
            where: dict[int, tuple[dict[str, Any], str]] = {}
            for m in self.modules:
                for d in (m._parameters, m._buffers):
                    for name, t in d.items():
                        if t is not None and id(t) not in where:
                            where[id(t)] = (d, name)
            self.containers = [where[id(t)][0] for t in self.tensors]
            self.names = [where[id(t)][1] for t in self.tensors]

    def track_memory(self) -> None:
        """From now on :meth:`current` also checks that the tensors view the memory they view
        now (call it right after a :meth:`current` that returned this source's dict)."""
        tensors = self.tensors
        # Held so that no other allocation can take these addresses: an equal data pointer
        # is the same memory (and, on the CPU, the same device).
        self._storages = [t.untyped_storage() for t in tensors]
        self.ptrs = list(map(_ptr, tensors))
        self.strides = None if all(map(_contiguous, tensors)) else list(map(_stride, tensors))

    @property
    def memory_tracked(self) -> bool:
        """Whether :meth:`track_memory` was called."""
        return self.ptrs is not None

    def _sizes(self) -> tuple[list[int], list[int], list[int]]:
        return list(map(len, self.params)), list(map(len, self.buffers)), list(map(len, self.submodules))

    def _children(self) -> Iterator[Any]:
        return chain.from_iterable(map(dict.values, self.submodules))

    @classmethod
    def of(cls, obj: Any, flat: dict[str, torch.Tensor]) -> KnownSource | None:
        if isinstance(obj, nn.Module):
            return cls(obj, flat)
        if type(obj) is dict and all(type(k) is str and isinstance(v, torch.Tensor) for k, v in obj.items()) and list(obj) == list(flat):
            return cls(obj, flat)
        return None

    def current(self) -> dict[str, torch.Tensor] | None:
        """The source's tensors now, if nothing but their values changed; else None."""
        obj = self.obj
        if self.modules:
            if self._sizes() != self.sizes:
                return None  # a parameter, buffer or submodule was added or removed
            # Same counts per module: one identity pass over every child covers replacements.
            if not all(map(operator.is_, self._children(), self.children)):
                return None  # a submodule was replaced
            try:
                tensors = list(map(operator.getitem, self.containers, self.names))
            except KeyError:
                return None
        else:
            if len(obj) != len(self.keys) or list(obj) != self.keys:
                return None
            tensors = list(obj.values())
        if not all(map(operator.is_, tensors, self.tensors)):
            return None  # a tensor object was replaced: validate again
        if list(map(_shape, tensors)) != self.shapes or list(map(_dtype, tensors)) != self.dtypes:
            return None  # `p.data = ...` with another shape or dtype
        if self.ptrs is not None:
            if list(map(_ptr, tensors)) != self.ptrs:
                return None  # `p.data = other`: other memory (the held storages: no address is reused)
            if not all(map(_contiguous, tensors)) if self.strides is None else list(map(_stride, tensors)) != self.strides:
                return None  # the same memory viewed another way (`p.data = p.data.t()`)
            if self.on_cpu:
                return self.flat  # the same live host memory: still on the CPU, no device pass needed
        if not (all(map(_is_cpu, tensors)) if self.on_cpu else list(map(_device, tensors)) == self.devices):
            return None  # moved to another device (`is_cpu` is a cached bool: no device object made)
        return self.flat
