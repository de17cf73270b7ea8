"""V-ABFT math (VABFT.md) in portable PyTorch, and the ``comp_row`` bitstream format.

This module is the reference every backend is compared against. It computes, for
``C = alpha * A @ B + beta * bias`` and every (row, 256-column segment):

- ``D``: the checksum difference ``|sum r*C - alpha * A @ Br - beta * sum r*bias|`` in fp32;
- ``T``: the variance-adaptive threshold from A and B statistics only (never from C, so a
  corrupted C cannot move its own threshold);
- which segments cannot be judged (non-finite inputs) and which non-finite results may be
  a legitimate overflow (fp16 AMP overflows are routine; GradScaler handles them).

It never writes to its inputs and never synchronises an accelerator with the host, so the
dispatch mode can call it on every GEMM and read the flags once per step. (On CPU, where
reading a value is free, a check that passes everywhere takes a shortcut; see
``vabft_check``.)
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Callable

import torch
from torch import Tensor

from .precision import C_ROBUST, SEGMENT, TINY, UNIT_ROUNDOFF, bias_rounding, overflow_limit


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
def _segment_constants(n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``n_s``, ``c sqrt(n_s)``, ``c n_s`` and ``sqrt(n_s)`` for ``n`` columns, shared
    between encodings (read-only): computed once per (N, device), not once per weight."""
    widths = segment_widths(n, device)
    sqrt_n = torch.sqrt(widths)
    return widths, C_ROBUST * sqrt_n, C_ROBUST * widths, sqrt_n


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


def _extrema_variance(mu: Tensor, hi: Tensor, lo: Tensor) -> Tensor:
    """Bhatia-Davis bound ``|(max - mu)(mu - min)|``: never below the true variance."""
    return ((hi - mu) * (mu - lo)).abs()


def _weighted(x: Tensor, checksum_weight: Tensor | None) -> Tensor:
    """``r[n] * x[..., n]`` in fp32, or ``x`` itself for the all-ones weight (no copy)."""
    if checksum_weight is None:
        return x
    return x.float() * checksum_weight.float()


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


def _row_pass(
    a: Tensor, c: Tensor, br: Tensor, weight32: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One read of 2-D ``a`` ``[M, K]`` and ``c`` ``[M, N]``: A's row mean, max, min
    (``[M, 1]``), ``A @ Br`` and C's weighted segment sums (``[M, nseg]``), all fp32.

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
        if block_c.stride(-1) == 1 or block_c.shape[-1] == 1:
            c_sum = _segment_sums_rows(_block32(block_c, 1))
        else:  # column-major C: reduce the transposed view (see segment_reduce_many)
            c_sum = segment_reduce(block_c, _sum32)
        parts.append((*_row_extrema(fa), _times_br(fa, br), c_sum))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(p, 0) for p in zip(*parts))  # type: ignore[return-value]


def _weight_pass(b: Tensor, weight32: Tensor | None) -> tuple[Tensor, Tensor, Tensor] | None:
    """Segment sum, max and min ``[K, nseg]`` of 2-D ``r * b`` in one blocked read, or
    ``None`` for a layout this pass does not walk (neither row- nor column-major)."""
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
        out = torch.empty((3, nseg, k), dtype=torch.float32, device=b.device)
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
                    dim, keep = 1, False
                else:
                    dim, keep = 0, True
                    torch.sum(f, dim, keepdim=keep, out=out[0, s0:s1, k0:k1])
                torch.amax(f, dim, keepdim=keep, out=out[1, s0:s1, k0:k1])
                torch.amin(f, dim, keepdim=keep, out=out[2, s0:s1, k0:k1])
        return out[0].mT, out[1].mT, out[2].mT  # [K, nseg], segment-major
    if b.stride(-1) == 1 or n == 1:
        out = torch.empty((3, k, nseg), dtype=torch.float32, device=b.device)
        kc = max(1, _CHUNK // n) if cpu else k
        for k0 in range(0, k, kc):
            k1 = min(k0 + kc, k)
            f = _block32(b[k0:k1], 0)
            if weight32 is not None:
                f = f * weight32
            if full:
                seg = f[:, : full * SEGMENT].unflatten(-1, (full, SEGMENT))
                torch.sum(seg, -1, out=out[0, k0:k1, :full])
                torch.amax(seg, -1, out=out[1, k0:k1, :full])
                torch.amin(seg, -1, out=out[2, k0:k1, :full])
            if tail:
                rest = f[:, full * SEGMENT :]
                torch.sum(rest, -1, keepdim=True, out=out[0, k0:k1, full:])
                torch.amax(rest, -1, keepdim=True, out=out[1, k0:k1, full:])
                torch.amin(rest, -1, keepdim=True, out=out[2, k0:k1, full:])
        return out[0], out[1], out[2]
    return None


@dataclass(frozen=True)
class WeightSide:
    """What V-ABFT needs from ``B`` (and the checksum weight): O(KN) once per weight.

    Cacheable for as long as ``B`` does not change (a parameter between optimizer steps).
    ``br`` is ``[..., K, nseg]``; the aggregates are ``[..., nseg]``.
    """

    br: Tensor  #: ``Br[k, s] = sum_{n in s} r[n] B[k, n]`` (fp32)
    p1: Tensor  #: ``sum_k |muB[k, s]|``
    p2: Tensor  #: ``sum_k muB[k, s]^2``
    v: Tensor  #: ``sum_k varB[k, s]``
    col_norm: Tensor  #: ``sqrt(sum_k max_{n in s} (r[n] B[k, n])^2)`` >= every column norm in s
    bad: Tensor  #: bool: a non-finite value of B lies in the segment
    widths: Tensor  #: fp32 ``n_s``
    k: int
    n: int

    @property
    def nbytes(self) -> int:
        """Memory held, for the cache's bound."""
        return sum(t.numel() * t.element_size() for t in (self.br, self.p1, self.p2, self.v,
                                                           self.col_norm, self.bad))

    @cached_property
    def _factors(self) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
        """Per-segment factors of the threshold's bracket, ``[..., 1, nseg]``, and the
        scale of ``|muA|`` in the mean term (see ``_bracket``): computed once per
        encoding, so that a cached weight costs a call none of this."""
        n_s = self.widths
        if n_s.dim() == 1 and n_s.shape[0] == num_segments(self.n):
            _, c_sqrt_n, c_n, sqrt_n = _segment_constants(self.n, n_s.device)
        else:  # an encoding built elsewhere with its own widths
            sqrt_n = torch.sqrt(n_s)
            c_sqrt_n, c_n = C_ROBUST * sqrt_n, C_ROBUST * n_s
        sqrt_v = torch.sqrt(self.v)
        f_mean, mu_scale = n_s * self.p1, 1.0
        # n_s P1 can overflow where (n_s |muA|) P1 need not: then keep VABFT.md's order,
        # (256 |muA|) (P1 n_s / 256), which is n_s |muA| P1 exactly on full segments.
        # (A host read: once per encoding, and only on CPU.)
        if self.p1.device.type != "cpu" or not (f_mean.numel() == 0 or math.isfinite(float(f_mean.amax()))):
            f_mean, mu_scale = self.p1 * (n_s / SEGMENT), float(SEGMENT)
        f_cross_mu = c_sqrt_n * sqrt_v
        f_cross_sd = c_n * torch.sqrt(self.p2)
        f_spread = sqrt_n * sqrt_v
        factors = tuple(f.unsqueeze(-2) for f in (f_mean, f_cross_mu, f_cross_sd, f_spread))
        return (*factors, mu_scale)  # type: ignore[return-value]

    @cached_property
    def _floors(self) -> dict[torch.dtype, Tensor]:
        """``n_s * tiny(C's dtype)`` per C dtype, filled on first use."""
        return {}

    def _floor(self, c_dtype: torch.dtype) -> Tensor:
        floor = self._floors.get(c_dtype)
        if floor is None:
            floor = self._floors[c_dtype] = self.widths * TINY[c_dtype]
        return floor


def weight_side(b: Tensor, checksum_weight: Tensor | None = None) -> WeightSide:
    """Encode ``b`` (``[..., K, N]``, any strides) for V-ABFT: one blocked read of ``b``.

    >>> ws = weight_side(torch.ones(4, 300)); ws.br[0].tolist(), ws.widths.tolist()
    ([256.0, 44.0], [256.0, 44.0])
    """
    if b.requires_grad:  # the blocked pass writes into out= buffers; verification needs no graph
        b = b.detach()
    k, n = b.shape[-2], b.shape[-1]
    widths = _segment_constants(n, b.device)[0]
    stats = None
    if b.dim() == 2 and k and n:
        weight32 = checksum_weight.float() if checksum_weight is not None else None
        stats = _weight_pass(b, weight32)
    if stats is None:
        bw = _weighted(b, checksum_weight)
        if bw.dtype != torch.float32:
            bw = bw.float()  # bf16/fp16 reductions into fp32 take a slow path on CPU
        br = segment_reduce(bw, _sum32)
        hi, lo = segment_reduce_many(bw, _extrema32)
    else:
        br, hi, lo = stats
    if br.stride(-2) != 1 and br.shape[-2] > 1:
        # Segment-major, like the column-major pass produces: MKL's skinny GEMM A @ Br is
        # up to 3x faster with Br's columns contiguous (1024 x 256 x 4: 45 against 127 us).
        br = br.mT.contiguous().mT
    mu = br / widths
    var = _extrema_variance(mu, hi, lo)
    p1 = mu.abs().sum(-2)
    p2 = (mu * mu).sum(-2)
    v = var.sum(-2)
    # max(|hi|, |lo|) is max(hi, -lo), as hi >= lo (and NaN propagates alike)
    col_norm = torch.maximum(hi, -lo).square().sum(-2).sqrt()
    # x - x is 0 exactly where x is finite, NaN elsewhere: one op where isfinite is four
    bad = ((p1 - p1) + (v - v)) != 0
    return WeightSide(br, p1, p2, v, col_norm, bad, widths, k, n)


@dataclass(frozen=True)
class RowStats:
    """Row statistics of ``A`` over k (fp32, ``[..., M]``)."""

    mu: Tensor
    var: Tensor
    norm: Tensor  #: ``sqrt(K (var + mu^2))`` >= ``||A[m, :]||_2`` (Bhatia-Davis): bounds |C|
    bad: Tensor  #: bool: a non-finite value lies in the row


def _row_moments(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, max, min of each row of ``a`` ``[..., M, K]`` (K > 0), fp32 ``[..., M, 1]``."""
    if a.dim() == 2:
        bounds = [(0, a.shape[0])] if column_major(a) else _blocks(a.shape[0], a.shape[1], a.device)
        parts = [_row_extrema(_block32(a if r1 - r0 == a.shape[0] else a[r0:r1], 0, keep_layout=True))
                 for r0, r1 in bounds]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(p, 0) for p in zip(*parts))  # type: ignore[return-value]
    return _row_extrema(a if a.dtype == torch.float32 else a.float())  # layout kept: no transposing copy


def _finish_rows(k: int, mu: Tensor, hi: Tensor, lo: Tensor) -> RowStats:
    """``RowStats`` (``[..., M]``) from a row mean, max and min (``[..., M, 1]``)."""
    mu, hi, lo = mu.squeeze(-1), hi.squeeze(-1), lo.squeeze(-1)
    var = _extrema_variance(mu, hi, lo)
    # The mean square is at most var + mu^2 because var bounds the true variance: a
    # norm bound for free, where an exact norm would be one more pass over A.
    norm = torch.sqrt(k * (var + mu * mu))
    bad = ~(torch.isfinite(mu) & torch.isfinite(var))
    return RowStats(mu, var, norm, bad)


def row_stats(a: Tensor) -> RowStats:
    """Mean, Bhatia-Davis variance and a 2-norm bound of each row of ``a`` (``[..., M, K]``).

    >>> row_stats(torch.tensor([[1.0, 3.0]])).var.tolist()
    [1.0]
    """
    if a.shape[-1] == 0:
        zeros = torch.zeros(a.shape[:-1], dtype=torch.float32, device=a.device)
        return RowStats(zeros, zeros, zeros, torch.zeros_like(zeros, dtype=torch.bool))
    return _finish_rows(a.shape[-1], *_row_moments(a))


def effective_e_max(e_max: float, k: int, c_dtype: torch.dtype) -> float:
    """``e_eff``: the NPU operator's scaling of ``e_max`` with ``K``, floored at C's roundoff.

    ``e_max * 6 * sqrt(K / 1024)`` models accumulation error, which grows with ``K``. The
    final rounding of C to its dtype does not shrink with ``K``: each element may move by
    up to ``u_C`` of its value, and the bracket of the threshold is at least the segment's
    ``sum |C|`` (its mean term alone is, when means dominate). Without the floor ``u_C``,
    bf16 GEMMs with ``K < 432`` raise false alarms on mean-shifted data (measured: D/T 1.57
    at K = 64); with it, even every element rounding the same way stays below T. This is
    sdc_guard's one deliberate addition to the operator's formula; it never binds for
    fp32 C, nor for fp16 C at the default e_max unless K < 7.

    >>> effective_e_max(1e-3, 1024, torch.float32)
    0.006
    >>> effective_e_max(1e-3, 64, torch.bfloat16) == 2.0**-8
    True
    """
    return max(e_max * 6.0 * math.sqrt(k / 1024.0), UNIT_ROUNDOFF[c_dtype])


def _bracket(mu: Tensor, var: Tensor, ws: WeightSide) -> Tensor:
    """The bracket of VABFT.md's threshold for row statistics ``[..., M, 1]``:

    ``n_s |muA| P1 + c sqrt(n_s) hypot(|muA| sqrt(V), sqrt(n_s) sdA sqrt(P2)) + sqrt(n_s) sdA sqrt(V)``

    with the segment factors folded in ahead (``WeightSide._factors``). The cross term is
    a ``hypot`` so that no intermediate overflows fp32 before the result would (large but
    finite inputs must not get T = inf).
    """
    f_mean, f_cross_mu, f_cross_sd, f_spread, mu_scale = ws._factors
    mu_abs = mu.abs()
    sd = torch.sqrt(var)
    out = (mu_abs * mu_scale if mu_scale != 1.0 else mu_abs) * f_mean
    out += torch.hypot(mu_abs * f_cross_mu, sd * f_cross_sd)
    return out.addcmul_(sd, f_spread)


def vabft_threshold(rows: RowStats, ws: WeightSide, e_max: float, c_dtype: torch.dtype) -> Tensor:
    """``T[..., m, s]`` of VABFT.md without the underflow floor and the bias term."""
    bracket = _bracket(rows.mu.unsqueeze(-1), rows.var.unsqueeze(-1), ws)
    return bracket.mul_(effective_e_max(e_max, ws.k, c_dtype))


@dataclass(frozen=True)
class AbftCheck:
    """Per-(row, segment) outcome of one V-ABFT check, all tensors ``[..., M, nseg]``.

    ``ok`` is the operator's bit (``D <= T`` and finite). The other masks say why a
    failed bit is not corruption: ``inputs_bad`` (a non-finite A row, B segment or bias:
    unverifiable) and ``possible_overflow`` (finite inputs, non-finite result, magnitudes
    large enough for a legitimate overflow). ``diff`` and ``threshold`` are ``None`` for
    backends that only return bits (the NPU operator).
    """

    ok: Tensor
    inputs_bad: Tensor
    possible_overflow: Tensor
    diff: Tensor | None = None
    threshold: Tensor | None = None

    @property
    def sdc(self) -> Tensor:
        """Segments whose failure can only be corruption (conservative: zero false alarms)."""
        return ~self.ok & ~self.inputs_bad & ~self.possible_overflow

    @property
    def ratio(self) -> Tensor | None:
        """``D / T`` (fp32), or ``None`` where the backend does not report ``D``."""
        if self.diff is None or self.threshold is None:
            return None
        return self.diff / self.threshold


def _bias_sums(bias: Tensor, n: int, checksum_weight: Tensor | None, beta: float) -> tuple[Tensor, Tensor]:
    """``sum r*bias`` and ``|beta| sum |r*bias|`` per segment (``[..., nseg]``, fp32)."""
    bias_n = bias.reshape(1) if bias.dim() == 0 else bias
    if bias_n.shape[-1] != n:
        bias_n = bias_n.expand(*bias_n.shape[:-1], n)
    bias_w = _weighted(bias_n, checksum_weight)
    if bias_w.stride(-1) == 1:
        bias_w = _fp32_rows(bias_w)
        return _segment_sums_rows(bias_w), _segment_sums_rows(bias_w.abs()) * abs(beta)
    return segment_reduce(bias_w, _sum32), segment_reduce(bias_w.abs(), _sum32) * abs(beta)


def vabft_check(
    a: Tensor,
    b: Tensor,
    c: Tensor,
    checksum_weight: Tensor | None = None,
    *,
    e_max: float,
    bias: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    weight: WeightSide | None = None,
) -> AbftCheck:
    """Check ``c == alpha * a @ b + beta * bias`` (VABFT.md), all on ``c``'s device.

    Operands are assumed validated (``verify.check_operands``); batch dims broadcast as in
    ``torch.matmul``. ``weight`` is a cached ``weight_side(b, checksum_weight)``.

    Cost: one blocked read each of A and C (and of B without ``weight``), a few dozen
    small ops on ``[M, nseg]``. On CPU, where reading a flag costs nothing, a check that
    passes everywhere skips building the masks that explain failures.

    >>> a, b = torch.randn(4, 64), torch.randn(64, 300)
    >>> bool(vabft_check(a, b, a @ b, e_max=2e-5).ok.all())
    True
    """
    if a.requires_grad or c.requires_grad:  # verification needs no autograd graph
        a, c = a.detach(), c.detach()
    if bias is not None and bias.requires_grad:
        bias = bias.detach()
    if checksum_weight is not None and checksum_weight.requires_grad:
        checksum_weight = checksum_weight.detach()
    ws = weight if weight is not None else weight_side(b, checksum_weight)
    k, n = a.shape[-1], c.shape[-1]
    weight32 = checksum_weight.float() if checksum_weight is not None else None
    batch = c.shape[:-2]
    if k and n and a.shape[-2] and ws.br.dim() == 2 and a.shape[:-2] == batch:
        # Rows are independent: any batch of A against one B is one [rows, K] product.
        a2, c2 = (a, c) if not batch else (a.reshape(-1, k), c.reshape(-1, n))
        mu, hi, lo, reference, c_sum = _row_pass(a2, c2, ws.br, weight32)
        if batch:
            mu, hi, lo, reference, c_sum = (t.unflatten(0, (*batch, a.shape[-2]))
                                            for t in (mu, hi, lo, reference, c_sum))
    else:
        if k:
            mu, hi, lo = _row_moments(a)
        else:
            mu = hi = lo = torch.zeros((*a.shape[:-1], 1), dtype=torch.float32, device=a.device)
        c_sum = segment_reduce(_weighted(c, checksum_weight), _sum32)
        fa = a if a.dtype == torch.float32 else a.float()
        if ws.br.shape[-1] == 1 and fa.dim() > 2 and fa.numel() <= _CHUNK:
            # batched GEMV (attention with N <= 256): MKL's bmm with one column costs 4x
            # an elementwise product and a row sum (32 x 128 x 128: 200 against 42 us)
            reference = (fa * ws.br.mT).sum(-1, keepdim=True)
        else:
            reference = _times_br(fa, ws.br)
    var = _extrema_variance(mu, hi, lo)
    if alpha != 1.0:
        reference = reference * alpha
    floor = ws._floor(c.dtype)
    bias_sum = bias_abs = None
    if bias is not None and beta != 0.0:
        bias_sum, bias_abs = _bias_sums(bias, n, checksum_weight, beta)
        reference = reference + beta * bias_sum
        floor = floor + bias_rounding(c.dtype) * bias_abs
    threshold = torch.add(floor, _bracket(mu, var, ws), alpha=abs(alpha) * effective_e_max(e_max, ws.k, c.dtype))
    diff = (c_sum - reference).abs_()
    ok = diff <= threshold
    if c.device.type == "cpu" and diff.numel():
        # T - D >= 0 everywhere: every segment passed; finite everywhere: no T is infinite,
        # so no input was non-finite (a non-finite A row or B segment makes T inf or nan)
        # and no D is. The masks that explain failures are then all False.
        lowest, highest = torch.aminmax(threshold - diff)
        if float(lowest) >= 0.0 and math.isfinite(float(highest)):
            none = torch.zeros(ok.shape, dtype=torch.bool, device=c.device)  # read-only, like every mask
            return AbftCheck(ok, none, none, diff, threshold)
    ok &= torch.isfinite(diff)
    rows = _finish_rows(k, mu, hi, lo)
    inputs_bad = rows.bad.unsqueeze(-1) | ws.bad.unsqueeze(-2)
    bound = abs(alpha) * rows.norm.unsqueeze(-1) * ws.col_norm.unsqueeze(-2)
    if bias_sum is not None and bias_abs is not None:
        inputs_bad = inputs_bad | ~torch.isfinite(bias_sum)
        bound = bound + bias_abs
    possible_overflow = ~torch.isfinite(diff) & ~inputs_bad & (bound >= overflow_limit(c.dtype))
    shape = torch.broadcast_shapes(diff.shape, inputs_bad.shape)
    return AbftCheck(ok, inputs_bad.expand(shape), possible_overflow, diff, threshold)


def encode_comp_row(ok: Tensor) -> Tensor:
    """Pack per-(row, segment) OK bits ``[..., M, nseg]`` into the operator's bitstream.

    Byte ``s * ceil(M/8) + m // 8``, bit ``m % 8`` (LSB first, segment-major); 1 = OK;
    padding bits (rows >= M) are set to 1. Returns uint8 ``[..., ceil(M/8) * nseg]``.

    >>> encode_comp_row(torch.tensor([[True], [False], [True]])).tolist()
    [253]
    """
    m, nseg = ok.shape[-2], ok.shape[-1]
    groups = -(-m // 8)
    bits = ok.transpose(-1, -2).to(torch.uint8)
    pad = groups * 8 - m
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad), value=1)
    bits = bits.reshape(*ok.shape[:-2], nseg, groups, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=ok.device)
    return (bits * weights).sum(-1, dtype=torch.uint8).reshape(*ok.shape[:-2], nseg * groups)


def decode_comp_row(comp_row: Tensor, m: int, n: int) -> Tensor:
    """Unpack a ``comp_row`` bitstream to bool ``[..., m, ceil(n/256)]``, True = OK.

    Padding bits are masked out, so a stream whose padding bits are garbage (as the
    Ascend operator leaves them) decodes correctly.

    >>> decode_comp_row(torch.tensor([0b11111101], dtype=torch.uint8), 3, 10).tolist()
    [[True], [False], [True]]
    """
    if not isinstance(comp_row, Tensor):
        raise TypeError(f"comp_row: expected a torch.Tensor, got {type(comp_row).__name__}")
    if comp_row.dtype != torch.uint8:
        raise TypeError(f"comp_row: expected dtype uint8, got {comp_row.dtype}")
    for name, value in (("m", m), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    groups, nseg = -(-m // 8), num_segments(n)
    if comp_row.dim() == 0 or comp_row.shape[-1] != groups * nseg:
        raise ValueError(
            f"comp_row: expected last dim ceil(m/8)*ceil(n/256) = {groups * nseg} for "
            f"m={m}, n={n}, got shape {tuple(comp_row.shape)}"
        )
    shifts = torch.arange(8, dtype=torch.uint8, device=comp_row.device)
    stream = comp_row.reshape(*comp_row.shape[:-1], nseg, groups, 1)
    bits = (stream >> shifts) & 1
    bits = bits.reshape(*comp_row.shape[:-1], nseg, groups * 8)[..., :m]
    return bits.transpose(-1, -2).bool()
