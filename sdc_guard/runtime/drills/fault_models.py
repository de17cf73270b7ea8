"""How a drill corrupts one GEMM output: the fault models of ``GemmFault.kind``.

Single-bit flips are under 40 % of the bit-flip events a faulty GPU produces, NaN/Inf about
1 % of its silent corruptions, and corrupted addresses repeat with the hardware's lane and
tile structure (arXiv 2605.04213, "The Anatomy of SDC"); a faulty unit repeats its error at
every call. So a drill can corrupt, in place and as hardware would (through an integer
view, seen by no dispatch mode and no autograd hook):

- ``"bit"``: one element; the bits ``bits`` (one or several: a multi-bit error) set,
  cleared or toggled (``direction``);
- ``"stuck"``: one element position (a lane) with ``bits`` stuck at 1 or 0, at every call
  the fault matches (the injector makes it sticky);
- ``"rows"`` / ``"columns"``: tile-aligned periodic patterns: in the ``tile`` holding the
  element, its column at every ``period``-th row (or its row at every ``period``-th
  column), each with ``bits`` changed;
- ``"zero_tile"``: every element of that tile set to +0;
- ``"swap_rows"``: the element's row and its partner row ``row ^ 1`` exchanged within the
  tile's columns (a row-address bit stuck);
- ``"nan"``, ``"inf"``: the element replaced by NaN, or by an infinity of its sign.

Tiles are aligned on the output's last two dimensions (a batched output: the element's
batch index only). :func:`corrupt` applies one model and says what changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from ...core.torch_private import disable_current_modes

#: The fault models, in the order the module docstring describes them.
KINDS = ("bit", "stuck", "rows", "columns", "zero_tile", "swap_rows", "nan", "inf")
#: Models that change chosen bits (``GemmFault.bit`` / ``bits`` and ``direction``).
BIT_KINDS = ("bit", "stuck", "rows", "columns")
#: Models that act on a tile (``GemmFault.tile``).
TILE_KINDS = ("rows", "columns", "zero_tile", "swap_rows")
#: Models that repeat a stride inside the tile (``GemmFault.period``).
PERIODIC_KINDS = ("rows", "columns")

INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
#: (exponent bits, mantissa bits) per dtype
_LAYOUT = {torch.float32: (8, 23), torch.float16: (5, 10), torch.bfloat16: (8, 7)}


@dataclass(frozen=True)
class Corruption:
    """What one application of a fault model did."""

    element: tuple[int, ...]  #: the anchor element (the one drawn or given)
    before: float  #: the anchor's value before
    after: float  #: and after
    elements: int  #: elements whose bits changed (0: the fault was a no-op here)


def width(dtype: torch.dtype) -> int:
    """Bits of a floating-point dtype the drills support."""
    if dtype not in INT_VIEW:
        raise TypeError(f"x: expected dtype float32, float16 or bfloat16, got {dtype}")
    return 32 if dtype == torch.float32 else 16


def _signed(mask: int, bits: int) -> int:
    """An unsigned bit mask as the signed integer of the dtype's integer view."""
    return mask - (1 << bits) if mask >= 1 << (bits - 1) else mask


def bit_mask(dtype: torch.dtype, bits: tuple[int, ...]) -> int:
    """The mask of ``bits`` in ``dtype``'s signed integer view; a bit past the dtype's
    width is a ``ValueError`` naming it.

    >>> bit_mask(torch.bfloat16, (15, 0))
    -32767
    """
    w = width(dtype)
    for b in bits:
        if not 0 <= b < w:
            raise ValueError(f"bit: expected 0..{w - 1} for {dtype}, got {b}")
    return _signed(sum(1 << b for b in set(bits)), w)


def _apply_bits(raw: Tensor, mask: int, direction: str) -> Tensor:
    if direction == "on":
        return torch.bitwise_or(raw, mask)
    if direction == "off":
        return torch.bitwise_and(raw, ~mask)
    return torch.bitwise_xor(raw, mask)


def tile_bounds(shape: torch.Size, element: tuple[int, ...], tile: tuple[int, int]) -> tuple[slice, slice]:
    """The rows and columns (of the last two dimensions) of the ``tile`` holding
    ``element``, aligned on multiples of the tile and clipped to the output.

    >>> tile_bounds(torch.Size([100, 70]), (65, 3), (64, 64))
    (slice(64, 100, None), slice(0, 64, None))
    """
    if len(shape) < 2:  # a vector: one row
        c, tc = element[-1], tile[1]
        return slice(0, 1), slice(c // tc * tc, min(shape[-1], (c // tc + 1) * tc))
    r, c = element[-2], element[-1]
    (tr, tc), (rows, cols) = tile, (shape[-2], shape[-1])
    return (slice(r // tr * tr, min(rows, (r // tr + 1) * tr)), slice(c // tc * tc, min(cols, (c // tc + 1) * tc)))


def _region(shape: torch.Size, kind: str, element: tuple[int, ...], tile: tuple[int, int],
            period: int) -> tuple:
    """The index (a tuple of ints and slices) of the elements ``kind`` changes."""
    if kind in ("bit", "stuck", "nan", "inf"):
        return element
    rows, cols = tile_bounds(shape, element, tile)
    batch = element[:-2] if len(shape) >= 2 else ()
    if len(shape) < 2:  # a vector is one row: its "rows" pattern is the element itself
        every = slice(cols.start + (element[-1] - cols.start) % period, cols.stop, period)
        return {"rows": element, "columns": (every,), "zero_tile": (cols,)}.get(kind, element)
    r, c = element[-2], element[-1]
    if kind == "rows":
        return (*batch, slice(rows.start + (r - rows.start) % period, rows.stop, period), c)
    if kind == "columns":
        return (*batch, r, slice(cols.start + (c - cols.start) % period, cols.stop, period))
    return (*batch, rows, cols)  # zero_tile


def _special(dtype: torch.dtype, raw: Tensor, kind: str) -> Tensor:
    """NaN (a quiet one), or an infinity with the sign of the value it replaces."""
    exponent, mantissa = _LAYOUT[dtype]
    w = width(dtype)
    ones = ((1 << exponent) - 1) << mantissa
    if kind == "nan":
        return torch.full_like(raw, _signed(ones | 1 << (mantissa - 1), w))
    return torch.bitwise_or(torch.bitwise_and(raw, _signed(1 << (w - 1), w)), ones)


def corrupt(out: Tensor, kind: str, element: tuple[int, ...], *, bits: tuple[int, ...] = (), direction: str = "flip",
            tile: tuple[int, int] = (64, 64), period: int = 8) -> Corruption:
    """Apply fault model ``kind`` to ``out`` in place, anchored at ``element``: through an
    integer view and with every dispatch mode off, as a faulty unit writes its output.

    >>> t = torch.ones(4, 4)
    >>> corrupt(t, "rows", (1, 2), bits=(31,), tile=(4, 4), period=2).elements, t[:, 2].tolist()
    (2, [1.0, -1.0, 1.0, -1.0])
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    width(out.dtype)  # a TypeError naming the dtype where drills cannot corrupt it
    mask = bit_mask(out.dtype, bits) if kind in BIT_KINDS else 0
    values = out.data  # a view with its own version counter: the write bumps no version, as hardware's would not
    raw = values.view(INT_VIEW[out.dtype])
    before = float(values[element])
    with disable_current_modes():  # as hardware would: no dispatch mode sees the writes
        if kind == "swap_rows":
            changed = _swap_rows(raw, element, tile)
        else:
            index = _region(out.shape, kind, element, tile, period)
            old = raw[index].clone()
            if kind in BIT_KINDS:
                new = _apply_bits(old, mask, direction)
            elif kind == "zero_tile":
                new = torch.zeros_like(old)
            else:
                new = _special(out.dtype, old, kind)
            raw[index] = new
            changed = int((old != new).sum())
    return Corruption(element, before, float(values[element]), changed)


def _swap_rows(raw: Tensor, element: tuple[int, ...], tile: tuple[int, int]) -> int:
    """Exchange the element's row with row ``row ^ 1`` (``row - 1`` where that is past the
    output) within the tile's columns; returns the elements that changed."""
    if raw.dim() < 2 or raw.shape[-2] < 2:
        return 0
    r = element[-2]
    partner = r ^ 1 if (r ^ 1) < raw.shape[-2] else r - 1
    _, cols = tile_bounds(raw.shape, element, tile)
    batch = element[:-2]
    here, there = (*batch, r, cols), (*batch, partner, cols)
    a, b = raw[here].clone(), raw[there].clone()
    raw[here], raw[there] = b, a
    return 2 * int((a != b).sum())
