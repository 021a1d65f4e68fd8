"""Flat layouts: a model's tensors packed into a few contiguous per-dtype buckets.

A :class:`Layout` fixes, once, where every tensor lives inside one byte buffer:
tensors of one dtype sit back to back in one bucket, buckets are 64-byte aligned.
A 500-tensor model then costs one fused copy per send, not 500 pickled storages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["Layout", "TensorSpec"]

_ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives: its key, shape, dtype and byte offset in the buffer.

    Example::

        layout = Layout.from_tensors({"w": torch.zeros(3, 4), "steps": torch.zeros((), dtype=torch.int64)})
        w, steps = layout.specs
        print(w)                               # TensorSpec(key='w', shape=(3, 4), dtype=torch.float32, offset=0, numel=12)
        print(w.nbytes, steps.offset)          # 48 64: each dtype's bucket is 64-byte aligned
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _storage_key(t: torch.Tensor) -> tuple[object, ...] | None:
    """What makes two tensors one: same storage, offset, shape, stride, dtype, device.

    ``None`` for tensors that cannot alias anything worth sharing (empty, meta, sparse,
    storage-less): they always stay keys of their own.
    """
    if t.layout != torch.strided or t.is_meta or t.numel() == 0:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


@dataclass(frozen=True)
class Layout:  # not slots: cached_property needs the instance dict
    """An ordered set of :class:`TensorSpec`, the total buffer size in bytes, and aliases.

    *aliases* holds ``(alias, canonical)`` pairs: names of tensors tied to another key
    (``head.weight`` tied to ``emb.weight``). An alias gets no bytes; it travels as its
    canonical key. ``specs``, ``keys`` and ``index`` hold canonical keys only.

    Example::

        policy = make_policy()
        layout = Layout.from_tensors(policy.state_dict())
        print(layout.keys)                     # ['0.weight', '0.bias', '2.weight', '2.bias']
        print(layout.nbytes)                   # 256: 58 float32 values, padded to 64 bytes
        wire = Layout.from_tensors(policy.state_dict(), {torch.float32: torch.bfloat16})
        print(wire.nbytes)                     # 128: what transfer_dtype=torch.bfloat16 sends
    """

    specs: tuple[TensorSpec, ...]
    nbytes: int
    aliases: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.aliases:
            keys = {s.key for s in self.specs}
            for alias, canonical in self.aliases:
                if alias in keys:
                    raise ValueError(f"alias {alias!r} is also a key of the layout")
                if canonical not in keys:
                    raise ValueError(f"alias {alias!r} names {canonical!r}, which is not a key of the layout")

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], dtype_map: Mapping[torch.dtype, torch.dtype] | None = None) -> Layout:
        """Build the layout of *tensors*; *dtype_map* changes the dtype on the wire.

        A key whose tensor is a view of exactly the same memory as an earlier key's
        (tied weights: a ``state_dict`` lists every name of a tied tensor) becomes an
        alias of that earlier key and gets no bytes.
        """
        first: dict[tuple[object, ...], str] = {}
        aliases: list[tuple[str, str]] = []
        items: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for key, t in tensors.items():
            sk = _storage_key(t)
            if sk is not None:
                canonical = first.setdefault(sk, key)
                if canonical != key:
                    aliases.append((key, canonical))
                    continue
            items.append((key, tuple(t.shape), t.dtype))
        return cls.from_shapes(items, dtype_map, aliases)

    @classmethod
    def pair(cls, tensors: Mapping[str, torch.Tensor], transfer_dtype: torch.dtype | None) -> tuple[Layout, Layout]:
        """The layout of *tensors*, and the one on the wire (floats in *transfer_dtype*, if set)."""
        source = cls.from_tensors(tensors)
        if transfer_dtype is None:
            return source, source
        return source, cls.from_tensors(tensors, {s.dtype: transfer_dtype for s in source.specs if s.dtype.is_floating_point})

    @classmethod
    def from_shapes(
        cls,
        items: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
        dtype_map: Mapping[torch.dtype, torch.dtype] | None = None,
        aliases: Iterable[tuple[str, str]] = (),
    ) -> Layout:
        by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
        for key, shape, dtype in items:
            wire = (dtype_map or {}).get(dtype, dtype)
            by_dtype.setdefault(wire, []).append((key, shape))
        specs: list[TensorSpec] = []
        offset = 0
        for dtype, entries in by_dtype.items():
            offset = -(-offset // _ALIGN) * _ALIGN
            size = _itemsize(dtype)
            for key, shape in entries:
                numel = 1
                for d in shape:
                    numel *= d
                specs.append(TensorSpec(key, shape, dtype, offset, numel))
                offset += numel * size
        return cls(tuple(specs), -(-offset // _ALIGN) * _ALIGN, tuple(aliases))

    @cached_property
    def keys(self) -> list[str]:
        """Canonical keys, in buffer order."""
        return [s.key for s in self.specs]

    @cached_property
    def index(self) -> dict[str, TensorSpec]:
        """``key -> spec`` (canonical keys only)."""
        return {s.key: s for s in self.specs}

    @cached_property
    def alias_map(self) -> dict[str, str]:
        """``alias -> canonical key``."""
        return dict(self.aliases)

    def canonical(self, key: str) -> str:
        """The key *key* travels under: itself, or the key it is an alias of."""
        return self.alias_map.get(key, key)

    def aliases_of(self, key: str) -> tuple[str, ...]:
        """The other names of canonical *key* (``()`` for an untied key)."""
        return self._aliases_by_key.get(key, ())

    @cached_property
    def _aliases_by_key(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        for alias, canonical in self.aliases:
            out[canonical] = (*out.get(canonical, ()), alias)
        return out

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every tensor inside *buffer* (a uint8 tensor of ``nbytes``)."""
        out: dict[str, torch.Tensor] = {}
        for s in self.specs:
            out[s.key] = buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)
        return out

    def describe(self, key: str) -> str:
        """``"key: (shape) dtype"``; an alias also names its canonical key."""
        s = self.index.get(key)
        if s is not None:
            return f"{key}: {tuple(s.shape)} {str(s.dtype).replace('torch.', '')}"
        canonical = self.alias_map.get(key)
        if canonical is not None:
            return f"{key} (alias of {self.describe(canonical)})"
        return key
