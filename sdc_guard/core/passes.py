"""Blocked passes over the operands: the fast CPU path of the V-ABFT statistics.

Each large operand is read once, in blocks converted into reused fp32 scratch buffers,
and every statistic of a block is taken while it is in cache (see the notes below).
``abft`` calls these and falls back to plain segment reductions where they do not apply.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from .precision import SEGMENT
from .segments import _sum32, column_major, segment_reduce


# --- blocked passes over the operands ----------------------------------------------------
#
# What profiling the CPU path found (2-core AMD EPYC, torch 2.13; ``sdc-guard bench
# overhead`` measures the result):
# - a bf16/fp16 reduction with ``dtype=torch.float32`` takes a slow path, about 17x slower
#   than converting to fp32 and reducing (9.0 ms against 0.54 ms for row sums of a
#   2048 x 4096 bf16 matrix);
# - converting a whole operand to fp32 at once allocates a buffer above glibc's mmap
#   threshold, so every call page-faults it in again (8.4 ms for 32 MiB);
# - one pass per statistic re-reads the operand from memory three or four times;
# - every op on a large tensor forks and joins the intra-op threads, and ``A @ Br`` is a
#   skinny GEMM that runs well only on many rows: blocks of an L2 (256 Ki elements) cost
#   twice as much as blocks of 2 Mi elements (bf16 2048 x 4096: 8.2 against 3.9 ms).
# So the big operands are walked in blocks of ``_CHUNK`` elements, each converted once into
# a scratch buffer that is reused (no page faults) and reduced for every statistic while
# it is in the last-level cache. A row of A or C is always reduced whole, by one call, so
# its statistics do not depend on which other rows share its block: thresholds stay
# row-local (batch-invariant).

#: fp32 elements per block of the blocked passes (8 MiB).
_CHUNK = 1 << 21
#: Blocks smaller than this are converted by one ``.float()`` rather than into scratch.
_SMALL = 1 << 15
#: Most columns per block of a column-major B's 256-row segments: whole rows up to here
#: (copying whole rows of W is 2.7x faster than strided column blocks; 4096 x 11008 bf16:
#: weight side 15 against 26 ms), so that a block of one segment fits ``2 * _CHUNK``.
_KC_CAP = 2 * _CHUNK // SEGMENT


def _fp32_rows(x: Tensor) -> Tensor:
    """``x`` in fp32 with a contiguous last dim (no copy when it already is)."""
    y = x if x.dtype == torch.float32 else x.float()
    if y.dim() >= 2 and y.shape[-1] > 1 and y.stride(-1) != 1:
        y = y.contiguous()  # reductions along a strided last dim are ~5x slower on CPU
    return y


_scratch = threading.local()


def _block32(x: Tensor, slot: int, *, dense: bool = False, copy: bool = False,
             keep_layout: bool = False) -> Tensor:
    """Block ``x`` (2-D) in fp32, with a contiguous last dim unless ``keep_layout`` and
    ``x`` is column-major (then column-major: a transposing copy costs ten times the
    statistics taken from it); ``dense``: contiguous; ``copy``: copied even when it
    already is fp32, so that several passes read the copy from cache. A CPU copy goes
    into this thread's scratch buffer ``slot`` (at most two of ``2 * _CHUNK`` fp32 elements
    each, kept for the thread's lifetime), reused by the next block: a fresh buffer per
    block would be page-faulted in again each time. Valid until the next call with
    ``slot``."""
    transposed = keep_layout and column_major(x) and x.mT.is_contiguous()
    if not copy and x.dtype == torch.float32 and (
            transposed or (x.is_contiguous() if dense else (x.stride(-1) == 1 or x.shape[-1] <= 1))):
        return x
    numel = x.numel()
    if x.device.type != "cpu" or numel > 2 * _CHUNK or numel < _SMALL:
        if transposed:
            return x.float()  # keeps the dense column-major layout
        y = _fp32_rows(x)  # small blocks: one op instead of four
        return y.contiguous() if dense else y
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = [torch.empty(0), torch.empty(0)]
    if buffers[slot].numel() < numel:
        buffers[slot] = torch.empty(min(2 * _CHUNK, max(numel, 2 * buffers[slot].numel())), dtype=torch.float32)
    flat = buffers[slot][:numel]
    out = flat.view(x.shape[1], x.shape[0]).mT if transposed else flat.view(x.shape)
    out.copy_(x)
    return out


def _blocks(rows: int, width: int, device: torch.device) -> list[tuple[int, int]]:
    """Row ranges of at most about ``_CHUNK`` elements of ``width`` (one range off CPU).

    A block after the first never holds a single row: torch reduces a lone long row
    (> 32768 elements) split across threads, in a different order than the same row among
    others, which would make that row's statistics depend on the row count.
    """
    if device.type != "cpu" or rows * width <= _CHUNK or rows < 4:
        return [(0, rows)]
    step = max(2, _CHUNK // max(width, 1))
    bounds = [(r, min(r + step, rows)) for r in range(0, rows, step)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2] = (bounds[-2][0], rows)
        bounds.pop()
    return bounds


def _segment_sums_rows(x: Tensor) -> Tensor:
    """Segment sums ``[..., nseg]`` of fp32 ``x`` ``[..., N]`` (last dim contiguous)."""
    n = x.shape[-1]
    full, tail = divmod(n, SEGMENT)
    if not tail:
        return x.unflatten(-1, (full, SEGMENT)).sum(-1)
    if not full:
        return x.sum(-1, keepdim=True)
    out = x.new_empty((*x.shape[:-1], full + 1))
    torch.sum(x[..., : full * SEGMENT].unflatten(-1, (full, SEGMENT)), -1, out=out[..., :full])
    torch.sum(x[..., full * SEGMENT :], -1, keepdim=True, out=out[..., full:])
    return out


def _row_extrema(f: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, max and min of each row of fp32 ``f`` ``[..., M, K]``, each ``[..., M, 1]``."""
    return f.mean(-1, keepdim=True), f.amax(-1, keepdim=True), f.amin(-1, keepdim=True)


def _times_br(fa: Tensor, br: Tensor) -> Tensor:
    """``fa @ br`` (fp32, ``br`` ``[..., K, nseg]``). MKL's GEMM with a transposed A and a
    few columns has pathological cases (2048 x 2048 x 2: 27 ms, as much as the product
    being verified); a column-major ``fa`` is multiplied as ``(br^T @ fa^T)^T``, a
    row-major GEMM (0.4 ms)."""
    if column_major(fa):
        return torch.matmul(br.mT, fa.mT).mT
    return torch.matmul(fa, br)


def c_sums(block_c: Tensor, squares: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Segment sums of ``block_c`` (``r * C``, any float dtype and layout), of its absolute
    values and, when ``squares``, of its squares (``[..., nseg]`` fp32 each): what the
    threshold reads of C (docs/ALGORITHM.md, "Reading C")."""
    if block_c.stride(-1) == 1 or block_c.shape[-1] == 1:
        f = _block32(block_c, 1)
        return (_segment_sums_rows(f), _segment_sums_rows(f.abs()),
                _segment_sums_rows(f * f) if squares else None)
    # column-major C: reduce the transposed view (see segment_reduce_many)
    f = block_c if block_c.dtype == torch.float32 else block_c.float()
    return (segment_reduce(f, _sum32), segment_reduce(f.abs(), _sum32),
            segment_reduce(f * f, _sum32) if squares else None)


def _row_pass(
    a: Tensor, c: Tensor, br: Tensor, babs: Tensor, weight32: Tensor | None, squares: bool = False,
) -> tuple[Tensor, ...]:
    """One read of 2-D ``a`` ``[M, K]`` and ``c`` ``[M, N]``: A's row mean, max, min
    (``[M, 1]``), ``A @ Br``, ``|A| @ Babs`` and C's weighted segment sums, absolute sums
    and (``squares``) sums of squares (``[M, nseg]``), all fp32 (the last ``None``
    without ``squares``).

    A column-major A (``grad_out.t()`` of a weight gradient) is taken as one block in its
    own layout: its rows are strided, so row blocks would need transposing copies."""
    m, k = a.shape
    bounds = [(0, m)] if column_major(a) else _blocks(m, k + c.shape[-1], a.device)
    parts = []
    for r0, r1 in bounds:
        block_a, block_c = (a, c) if r1 - r0 == m else (a[r0:r1], c[r0:r1])
        fa = _block32(block_a, 0, keep_layout=True)
        if weight32 is not None:
            block_c = block_c.float() * weight32
        stats = c_sums(block_c, squares)
        parts.append((*_row_extrema(fa), _times_br(fa, br), _times_br(fa.abs(), babs), *stats))
    if len(parts) == 1:
        return parts[0]
    return tuple(None if p[0] is None else torch.cat(p, 0) for p in zip(*parts))  # type: ignore[return-value]


def _weight_pass(b: Tensor, weight32: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """Segment sum, sum of absolute values, max and min ``[K, nseg]`` of 2-D ``r * b`` in
    one blocked read, or ``None`` for a layout this pass does not walk (neither row- nor
    column-major)."""
    k, n = b.shape
    full, tail = divmod(n, SEGMENT)
    nseg = full + (1 if tail else 0)
    cpu = b.device.type == "cpu"
    if column_major(b):
        # W.t() of an nn.Linear: x = W is [N, K] row-major, a segment is 256 whole rows,
        # so blocks of whole segments are contiguous. Their sums are one batched GEMV
        # (``ones @ segment``: 1.4x faster than an outer-dim sum), the extrema outer-dim
        # reductions.
        x = b.mT
        out = torch.empty((4, nseg, k), dtype=torch.float32, device=b.device)
        kc = min(k, _KC_CAP) if cpu else k
        group = max(1, _CHUNK // (SEGMENT * kc)) if cpu else max(full, 1)
        ones = torch.ones((min(group, full), 1, SEGMENT), dtype=torch.float32, device=b.device) if full else None
        spans = [(s, min(s + group, full)) for s in range(0, full, group)]
        if tail:
            spans.append((full, nseg))
        for s0, s1 in spans:
            lo_row, hi_row = s0 * SEGMENT, min(s1 * SEGMENT, n)
            for k0 in range(0, k, kc):
                k1 = min(k0 + kc, k)
                f = x[lo_row:hi_row, k0:k1]
                if cpu:
                    f = _block32(f, 0, dense=True, copy=True)
                elif f.dtype != torch.float32:
                    f = f.float()
                if weight32 is not None:
                    f = f * weight32[lo_row:hi_row, None]
                if s0 < full:
                    assert ones is not None
                    f = f.unflatten(0, (s1 - s0, SEGMENT))
                    torch.bmm(ones[: s1 - s0], f, out=out[0, s0:s1, k0:k1].unsqueeze(1))
                    torch.bmm(ones[: s1 - s0], f.abs(), out=out[1, s0:s1, k0:k1].unsqueeze(1))
                    dim, keep = 1, False
                else:
                    dim, keep = 0, True
                    torch.sum(f, dim, keepdim=keep, out=out[0, s0:s1, k0:k1])
                    torch.sum(f.abs(), dim, keepdim=keep, out=out[1, s0:s1, k0:k1])
                torch.amax(f, dim, keepdim=keep, out=out[2, s0:s1, k0:k1])
                torch.amin(f, dim, keepdim=keep, out=out[3, s0:s1, k0:k1])
        return out[0].mT, out[1].mT, out[2].mT, out[3].mT  # [K, nseg], segment-major
    if b.stride(-1) == 1 or n == 1:
        out = torch.empty((4, k, nseg), dtype=torch.float32, device=b.device)
        kc = max(1, _CHUNK // n) if cpu else k
        for k0 in range(0, k, kc):
            k1 = min(k0 + kc, k)
            f = _block32(b[k0:k1], 0)
            if weight32 is not None:
                f = f * weight32
            fabs = f.abs()
            if full:
                seg = f[:, : full * SEGMENT].unflatten(-1, (full, SEGMENT))
                torch.sum(seg, -1, out=out[0, k0:k1, :full])
                torch.sum(fabs[:, : full * SEGMENT].unflatten(-1, (full, SEGMENT)), -1, out=out[1, k0:k1, :full])
                torch.amax(seg, -1, out=out[2, k0:k1, :full])
                torch.amin(seg, -1, out=out[3, k0:k1, :full])
            if tail:
                rest = f[:, full * SEGMENT :]
                torch.sum(rest, -1, keepdim=True, out=out[0, k0:k1, full:])
                torch.sum(fabs[:, full * SEGMENT :], -1, keepdim=True, out=out[1, k0:k1, full:])
                torch.amax(rest, -1, keepdim=True, out=out[2, k0:k1, full:])
                torch.amin(rest, -1, keepdim=True, out=out[3, k0:k1, full:])
        return out[0], out[1], out[2], out[3]
    return None
