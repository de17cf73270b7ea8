"""256-column checksum segments: widths, constants, and reductions over them.

Shared by the V-ABFT math (``abft``), the blocked CPU passes (``passes``) and the NPU
bridge; every reduction reads the operand through strided views, never a copy.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
from torch import Tensor

from .precision import C_ROBUST, SEGMENT


def num_segments(n: int) -> int:
    """Number of 256-column checksum segments for ``n`` columns.

    >>> num_segments(300)
    2
    """
    return -(-n // SEGMENT)


def segment_widths(n: int, device: torch.device | str = "cpu") -> Tensor:
    """fp32 widths ``n_s`` of the segments of ``n`` columns (256, the last one the rest).

    >>> segment_widths(300).tolist()
    [256.0, 44.0]
    """
    full, tail = divmod(n, SEGMENT)
    widths = [float(SEGMENT)] * full + ([float(tail)] if tail else [])
    return torch.tensor(widths, dtype=torch.float32, device=device)


@lru_cache(maxsize=256)
def segment_constants(n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``n_s`` (fp32, what segment means divide by), and ``c sqrt(n_s)``, ``c n_s`` and
    ``sqrt(n_s)`` in fp64 (the threshold's bracket is evaluated in fp64, see
    ``abft._bracket``), for ``n`` columns, shared between encodings (read-only): computed
    once per (N, device), not once per weight."""
    widths = segment_widths(n, device)
    w64 = widths.double()
    sqrt_n = torch.sqrt(w64)
    return widths, C_ROBUST * sqrt_n, C_ROBUST * w64, sqrt_n


Reduction = Callable[[Tensor, int], tuple[Tensor, ...]]


def column_major(x: Tensor) -> bool:
    """Whether ``x``'s last two dims are laid out column-major (``W.t()`` of a Linear).

    PyTorch's CPU reductions along a strided last dim are up to 50x slower than along a
    contiguous one; reducing the transposed view over its second-to-last dim instead
    keeps the inner loop contiguous.
    """
    return x.dim() >= 2 and x.shape[-1] > 1 and x.stride(-1) != 1 and x.stride(-2) == 1


def segment_reduce_many(x: Tensor, reduce: Reduction) -> tuple[Tensor, ...]:
    """Apply ``reduce(t, dim)`` to each 256-column segment of ``x``'s last dim, in one pass.

    Full segments are read through strided views (no copy, whatever the layout); the
    partial last segment, if any, is reduced on its own. Each result is ``[..., nseg]``.

    >>> segment_reduce_many(torch.ones(2, 300), lambda t, d: (t.sum(d),))[0].tolist()
    [[256.0, 44.0], [256.0, 44.0]]
    """
    n = x.shape[-1]
    full, tail = divmod(n, SEGMENT)
    if n == 0:
        count = len(reduce(x.new_zeros((1, 1)), -1))
        return tuple(torch.zeros((*x.shape[:-1], 0), dtype=torch.float32, device=x.device) for _ in range(count))
    parts = []
    if column_major(x):
        xt = x.mT
        if full:
            parts.append(tuple(r.mT for r in reduce(xt[..., : full * SEGMENT, :].unflatten(-2, (full, SEGMENT)), -2)))
        if tail:
            parts.append(tuple(r.unsqueeze(-1) for r in reduce(xt[..., full * SEGMENT :, :], -2)))
    else:
        if full:
            parts.append(reduce(x[..., : full * SEGMENT].unflatten(-1, (full, SEGMENT)), -1))
        if tail:
            parts.append(tuple(r.unsqueeze(-1) for r in reduce(x[..., full * SEGMENT :], -1)))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(pair, dim=-1) for pair in zip(*parts))


def segment_reduce(x: Tensor, reduce: Callable[[Tensor, int], Tensor]) -> Tensor:
    """``segment_reduce_many`` for a single reduction ``reduce(t, dim)``.

    >>> segment_reduce(torch.ones(2, 300), lambda t, d: t.sum(d)).tolist()
    [[256.0, 44.0], [256.0, 44.0]]
    """
    return segment_reduce_many(x, lambda t, d: (reduce(t, d),))[0]


def _sum32(t: Tensor, dim: int) -> Tensor:
    return t.sum(dim, dtype=torch.float32)


def _extrema32(t: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    return t.amax(dim).float(), t.amin(dim).float()


def _weighted(x: Tensor, checksum_weight: Tensor | None) -> Tensor:
    """``r[n] * x[..., n]`` in fp32, or ``x`` itself for the all-ones weight (no copy)."""
    if checksum_weight is None:
        return x
    return x.float() * checksum_weight.float()
