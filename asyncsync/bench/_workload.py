"""Synthetic workloads for the weight-sync benchmarks (stdlib + torch only).

A workload is described by a spec such as ``"10k"`` or ``"1M/256"``: the total
number of parameter elements, optionally followed by ``/T``, the number of
parameter tensors those elements are spread over.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["DEFAULT_N_TENSORS", "make_model", "parse_params", "perturb_"]

#: Number of tensors used when a spec has no ``/T`` part.
DEFAULT_N_TENSORS = 8

_SUFFIXES: dict[str, int] = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9}
_SPEC_RE = re.compile(
    r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<suffix>[kMG]?)\s*(?:/\s*(?P<tensors>\d+)\s*)?$"
)


def parse_params(spec: str) -> tuple[int, int]:
    """Parse ``"N"`` or ``"N/T"`` (k/M/G suffixes) into ``(n_params, n_tensors)``.

    ``"10k"`` -> ``(10_000, 8)``, ``"1M/256"`` -> ``(1_000_000, 256)``,
    ``"1.5k"`` -> ``(1_500, 8)``. Without ``/T`` the tensor count is
    ``DEFAULT_N_TENSORS`` (capped at N so tiny specs such as ``"5"`` still
    work). Raises ``ValueError`` on anything else.
    """
    if not isinstance(spec, str):
        raise ValueError(f"parameter spec must be a string, got {type(spec).__name__}")
    match = _SPEC_RE.match(spec)
    if match is None:
        raise ValueError(
            f"bad parameter spec {spec!r}: expected N or N/T, where N is a number "
            "with an optional k/M/G suffix (1e3/1e6/1e9) and T a positive integer "
            "tensor count, e.g. '10k', '1M/256', '1.5G/64'"
        )
    num, suffix, tensors = match.group("num", "suffix", "tensors")
    scale = _SUFFIXES[suffix]
    if "." in num:
        whole, frac = num.split(".")
        numerator = int(whole + frac) * scale
        denominator = 10 ** len(frac)
        if numerator % denominator:
            raise ValueError(
                f"bad parameter spec {spec!r}: {num}{suffix} is not a whole number "
                "of parameters"
            )
        n_params = numerator // denominator
    else:
        n_params = int(num) * scale
    if n_params < 1:
        raise ValueError(f"bad parameter spec {spec!r}: need at least 1 parameter")
    if tensors is None:
        n_tensors = min(DEFAULT_N_TENSORS, n_params)
    else:
        n_tensors = int(tensors)
        if n_tensors < 1:
            raise ValueError(f"bad parameter spec {spec!r}: need at least 1 tensor")
        if n_tensors > n_params:
            raise ValueError(
                f"bad parameter spec {spec!r}: {n_tensors} tensors cannot hold only "
                f"{n_params} parameters (each tensor needs at least one element)"
            )
    return n_params, n_tensors


def _shape_for(numel: int) -> tuple[int, ...]:
    """Pick ``(rows, width)`` with a power-of-two width dividing ``numel``, else 1-D."""
    width = 1024
    while width >= 16:
        if numel % width == 0 and numel // width >= 2:
            return (numel // width, width)
        width //= 2
    return (numel,)


def make_model(
    n_params: int,
    n_tensors: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """Build a module of exactly ``n_tensors`` parameters, ``n_params`` elements in all.

    Parameters are named ``p000``, ``p001``, ... (zero-padded to at least three
    digits), sized as evenly as possible (the first ``n_params % n_tensors``
    get one extra element), 1-D or 2-D, and filled from a generator seeded
    with ``seed`` so equal arguments give equal models.
    """
    if isinstance(n_params, bool) or not isinstance(n_params, int):
        raise TypeError(f"n_params must be an int, got {type(n_params).__name__}")
    if isinstance(n_tensors, bool) or not isinstance(n_tensors, int):
        raise TypeError(f"n_tensors must be an int, got {type(n_tensors).__name__}")
    if n_tensors < 1:
        raise ValueError(f"n_tensors must be >= 1, got {n_tensors}")
    if n_params < n_tensors:
        raise ValueError(
            f"n_params ({n_params}) must be >= n_tensors ({n_tensors}): "
            "every tensor needs at least one element"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")

    module = nn.Module()
    gen = torch.Generator().manual_seed(seed)
    base, extra = divmod(n_params, n_tensors)
    digits = max(3, len(str(n_tensors - 1)))
    for i in range(n_tensors):
        numel = base + (1 if i < extra else 0)
        data = torch.empty(_shape_for(numel), dtype=dtype)
        data.uniform_(-1.0, 1.0, generator=gen)
        module.register_parameter(f"p{i:0{digits}d}", nn.Parameter(data))
    return module


def perturb_(model: nn.Module, step: int) -> None:
    """Change every parameter of ``model`` in place so the next send ships new values.

    Adds +1 on even steps and -1 on odd steps (one fused ``_foreach_add_``):
    every element changes at every step (also in half precision, since values
    stay near [-2, 2] instead of growing until +1 is rounded away), and every
    page is really written.
    """
    params: list[torch.Tensor] = list(model.parameters())
    if not params:
        return
    delta = 1.0 if step % 2 == 0 else -1.0
    with torch.no_grad():
        torch._foreach_add_(params, delta)
