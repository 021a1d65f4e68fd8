"""One flat buffer per dtype for a model's tensors, and the one-copy send it allows.

:func:`flatten_parameters` moves a module's parameters and persistent buffers into one
contiguous buffer per ``(dtype, device)``, in ``state_dict`` order, so that they are
consecutive views of one storage (each with its own strides). The sender then notices (:class:`SpanCopier`) that a
run of the wire layout is one contiguous span of the source and copies it in one
``copy_`` instead of one per tensor; from then on the source's check at each send also
proves that memory (:meth:`KnownSource.track_memory <._weights.KnownSource.track_memory>`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ._layout import Layout
from ._weights import KnownSource

__all__ = ["SpanCopier", "contiguous_runs", "flatten_parameters"]

_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
#: Bumped by every :func:`flatten_parameters`: a source found unmergeable is looked at again.
_generation = 0


def flatten_parameters(model: nn.Module) -> nn.Module:
    """Move *model*'s parameters and persistent buffers into one flat buffer per dtype and device.

    Every parameter keeps its ``nn.Parameter`` object and its ``requires_grad``; only its
    ``.data`` becomes a view into the flat buffer (so an optimizer built before or after
    keeps updating the model). ``state_dict()`` keeps its keys and values. Buffers are
    re-registered as views under the same names. Tied tensors stay tied. Each tensor keeps
    its strides (a ``channels_last`` convolution weight, a weight stored transposed): its
    memory in the flat buffer is laid out in its own order. A send of the flattened model
    copies each flat buffer in one go (a tensor that is not row-major, on its own). Returns
    *model*. A lazy module (``nn.LazyLinear``) must run one forward pass first: a parameter
    that has no shape yet raises :class:`ValueError` naming it.

    Replacing a parameter later (``p.data = other`` or a new ``nn.Parameter``) is allowed:
    that tensor is then copied on its own, the rest still in spans.

    Workers need no such call: with ``commit="swap"`` on CPU their receiver commits a
    many-tensor model with one storage swap (after a first commit per tensor).

    Example::

        policy = flatten_parameters(make_policy())
        optim = torch.optim.Adam(policy.parameters())  # before or after: the same Parameters
        scheme = MultiProcessWeightSyncScheme()
        scheme.init_on_sender(model=policy, num_workers=2)  # a send: one copy per dtype
    """
    from ._weights import named_tensors

    named = named_tensors(model)
    for name, t in named.items():
        if is_lazy(t):
            raise ValueError(
                f"flatten_parameters: {name!r} is not initialised yet (a lazy module such as nn.LazyLinear): "
                "run one forward pass to give it its shape, then flatten"
            )
    global _generation
    _generation += 1
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in named.values():
        if t.layout != torch.strided or t.is_meta:
            continue
        groups.setdefault((t.dtype, t.device), []).append(t)
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                owners.setdefault(id(b), []).append((mod, name))
    with torch.no_grad():
        for (dtype, device), tensors in groups.items():
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
            offset = 0
            for t in tensors:
                view = flat.as_strided(t.shape, _dense_strides(t), offset)
                view.copy_(t)
                offset += t.numel()
                if isinstance(t, nn.Parameter):
                    t.data = view
                else:  # a buffer: register the view under every name that held it
                    for mod, name in owners.get(id(t), ()):
                        mod._buffers[name] = view
    return model


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """*t*'s strides if it is dense (channels_last, transposed: a permutation of a
    contiguous layout), else the row-major ones: a view with them spans ``t.numel()``
    elements."""
    return torch.empty_like(t, device="meta").stride()


def contiguous_runs(layout: Layout, src: Sequence[torch.Tensor]) -> list[tuple[int, int, torch.dtype, torch.Tensor]] | None:
    """Runs of *layout*'s specs whose *src* tensors are consecutive in one storage.

    Returns ``[(byte_offset, nbytes, wire_dtype, span)]`` covering every spec in order: *span* is the
    source memory of the run (a 1-D view for a run of several tensors, the tensor itself
    for a run of one) and ``(byte_offset, nbytes)`` its place in the wire buffer. ``None``
    when no two tensors can be merged (the per-tensor copy is then as good).
    """
    specs = layout.specs
    runs: list[tuple[int, int, torch.dtype, torch.Tensor]] = []
    i = 0
    n = len(specs)
    while i < n:
        j = i + 1
        t = src[i]
        if t.layout == torch.strided and not t.is_meta and t.is_contiguous():
            end = t.storage_offset() + t.numel()
            storage = t.untyped_storage().data_ptr()
            while j < n:
                u, prev, cur = src[j], specs[j - 1], specs[j]
                if not (
                    cur.dtype == prev.dtype
                    and cur.offset == prev.offset + prev.nbytes
                    and u.layout == torch.strided
                    and u.dtype == t.dtype
                    and u.device == t.device
                    and not u.is_meta
                    and u.is_contiguous()
                    and u.untyped_storage().data_ptr() == storage
                    and u.storage_offset() == end
                ):
                    break
                end += u.numel()
                j += 1
        if j - i > 1:
            numel = sum(s.numel for s in specs[i:j])
            span = t.detach().as_strided((numel,), (1,))
        else:
            span = t.detach()
        runs.append((specs[i].offset, sum(s.nbytes for s in specs[i:j]), specs[i].dtype, span))
        i = j
    return runs if len(runs) < n else None


class SpanCopier:
    """Copies a source into a wire buffer in as few ``copy_`` calls as its memory allows.

    The runs are found once and re-checked cheaply on every send (data pointers and
    strides, with C-level ``map``; shapes and dtypes are the layout's, checked by the
    sender): a tensor whose memory was replaced since (``p.data = other``) makes the runs
    be found again, so a span never copies stale memory. The spans keep their storage
    alive, so a matching data pointer really is the same memory. The same tensor objects
    with nothing to merge cost one identity check per send (they are looked at again
    after a :func:`flatten_parameters`). For a configured source (:meth:`plan` with its
    :class:`KnownSource`), the source's own check proves the memory instead and the plan
    is reused with no pass here.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._src: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._strides: list[tuple[int, ...]] = []
        self._runs: list[tuple[int, int, torch.dtype, torch.Tensor]] | None = None
        self._spans: list[torch.Tensor] = []
        self._dst: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # id(buffer) -> (buffer, its run views)
        self._generation = -1
        self._known: Mapping[str, torch.Tensor] | None = None  # the known source's dict the runs were found in

    def plan(
        self, buffer: torch.Tensor, flat: Mapping[str, torch.Tensor], known: KnownSource | None = None
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        """``(dst, src)`` for the copy of *flat* into *buffer* (the wire buffer as uint8).

        *dst* is None when there is no span to merge: then *src* is *flat*'s tensors in layout
        order, to copy one by one. Else *dst* and *src* are the runs' views, one ``copy_``
        each. *known*: the configured source *flat* comes from (its :meth:`KnownSource.current`
        just returned *flat*). Once runs are found in a known source's tensors, the source
        proves their memory at each send (:meth:`KnownSource.track_memory`), and this
        checks nothing per tensor: the same dict is the same memory.
        """
        if known is not None and flat is self._known and known.memory_tracked and self._runs is not None:
            return self._dst_views(buffer), self._spans  # the flat source's send: no pass over its tensors
        src = list(map(flat.__getitem__, self.layout.keys))
        fused = self.pairs(buffer, src)
        self._known = None
        if fused is None:
            return None, src
        if known is not None and flat is known.flat:
            known.track_memory()  # the tensors the runs were just found in, as they are now
            self._known = flat
        return fused

    def _dst_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The runs' places in *buffer* (made once per buffer, for a few buffers: the reused slots)."""
        entry = self._dst.get(id(buffer))
        if entry is None or entry[0] is not buffer:
            assert self._runs is not None
            if len(self._dst) >= 16:  # transient slots: a new buffer per send
                self._dst.clear()
            entry = (buffer, [buffer[off : off + nb].view(dtype).view(span.shape) for off, nb, dtype, span in self._runs])
            self._dst[id(buffer)] = entry
        return entry[1]

    def pairs(self, buffer: torch.Tensor, src: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """``(dst, src)`` for one fused copy of *src* (in layout order) into *buffer*, or None.

        *buffer* is the wire buffer as uint8 (``layout.nbytes``). None: no span to merge,
        copy per tensor.
        """
        same = len(src) == len(self._src) and all(map(operator.is_, src, self._src))
        if same and self._runs is None and self._generation == _generation:
            return None  # nothing to merge in this source: the per-tensor copy (always right)
        ptrs, strides = list(map(_ptr, src)), list(map(_stride, src))
        if ptrs != self._ptrs or strides != self._strides or (self._runs is None and self._generation != _generation):
            self._generation = _generation
            self._runs = contiguous_runs(self.layout, src)
            self._ptrs, self._strides = ptrs, strides
            self._spans = [r[3] for r in self._runs] if self._runs is not None else []
            self._dst.clear()
        self._src = list(src)
        if self._runs is None:
            return None
        return self._dst_views(buffer), self._spans
