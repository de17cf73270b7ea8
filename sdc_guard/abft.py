"""V-ABFT math (VABFT.md) in portable PyTorch, and the ``comp_row`` bitstream format.

This module is the reference every backend is compared against. It computes, for
``C = alpha * A @ B + beta * bias`` and every (row, 256-column segment):

- ``D``: the checksum difference ``|sum r*C - alpha * A @ Br - beta * sum r*bias|`` in fp32;
- ``T``: the variance-adaptive threshold from A and B statistics only (never from C, so a
  corrupted C cannot move its own threshold);
- which segments cannot be judged (non-finite inputs) and which non-finite results may be
  a legitimate overflow (fp16 AMP overflows are routine; GradScaler handles them).

It never synchronises with the host and never writes to its inputs, so the dispatch mode
can call it on every GEMM and read the flags once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


def weight_side(b: Tensor, checksum_weight: Tensor | None = None) -> WeightSide:
    """Encode ``b`` (``[..., K, N]``, any strides) for V-ABFT: one pass per statistic.

    >>> ws = weight_side(torch.ones(4, 300)); ws.br[0].tolist(), ws.widths.tolist()
    ([256.0, 44.0], [256.0, 44.0])
    """
    k, n = b.shape[-2], b.shape[-1]
    bw = _weighted(b, checksum_weight)
    widths = segment_widths(n, b.device)
    br = segment_reduce(bw, _sum32)
    mu = br / widths
    hi, lo = segment_reduce_many(bw, _extrema32)
    var = _extrema_variance(mu, hi, lo)
    p1 = mu.abs().sum(-2)
    p2 = (mu * mu).sum(-2)
    v = var.sum(-2)
    col_norm = torch.maximum(hi.abs(), lo.abs()).square().sum(-2).sqrt()
    bad = ~(torch.isfinite(p1) & torch.isfinite(v))
    return WeightSide(br, p1, p2, v, col_norm, bad, widths, k, n)


@dataclass(frozen=True)
class RowStats:
    """Row statistics of ``A`` over k (fp32, ``[..., M]``)."""

    mu: Tensor
    var: Tensor
    norm: Tensor  #: ``sqrt(K (var + mu^2))`` >= ``||A[m, :]||_2`` (Bhatia-Davis): bounds |C|
    bad: Tensor  #: bool: a non-finite value lies in the row


def row_stats(a: Tensor) -> RowStats:
    """Mean, Bhatia-Davis variance and a 2-norm bound of each row of ``a`` (``[..., M, K]``).

    >>> row_stats(torch.tensor([[1.0, 3.0]])).var.tolist()
    [1.0]
    """
    if a.shape[-1] == 0:
        zeros = torch.zeros(a.shape[:-1], dtype=torch.float32, device=a.device)
        return RowStats(zeros, zeros, zeros, torch.zeros_like(zeros, dtype=torch.bool))
    rows, dim = (a.mT, -2) if column_major(a) else (a, -1)
    mu = rows.mean(dim, dtype=torch.float32)
    hi, lo = _extrema32(rows, dim)
    var = _extrema_variance(mu, hi, lo)
    # The mean square is at most var + mu^2 because var bounds the true variance: a
    # norm bound for free, where an exact norm would be one more pass over A.
    norm = torch.sqrt(a.shape[-1] * (var + mu * mu))
    bad = ~(torch.isfinite(mu) & torch.isfinite(var))
    return RowStats(mu, var, norm, bad)


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


def vabft_threshold(rows: RowStats, ws: WeightSide, e_max: float, c_dtype: torch.dtype) -> Tensor:
    """``T[..., m, s]`` of VABFT.md without the underflow floor and the bias term."""
    n_s = ws.widths
    mu = rows.mu.unsqueeze(-1)
    var = rows.var.unsqueeze(-1)
    p1, p2, v = ws.p1.unsqueeze(-2), ws.p2.unsqueeze(-2), ws.v.unsqueeze(-2)
    mean_term = n_s * mu.abs() * p1
    # sqrt(c^2 n_s mu^2 V + c^2 n_s^2 varA P2), written so that no intermediate overflows
    # fp32 before the result would (large but finite inputs must not get T = inf).
    sqrt_v, sd = torch.sqrt(v), torch.sqrt(var)
    cross_term = C_ROBUST * torch.sqrt(n_s) * torch.hypot(mu.abs() * sqrt_v, torch.sqrt(n_s) * sd * torch.sqrt(p2))
    spread_term = torch.sqrt(n_s) * sd * sqrt_v
    return effective_e_max(e_max, ws.k, c_dtype) * (mean_term + cross_term + spread_term)


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

    >>> a, b = torch.randn(4, 64), torch.randn(64, 300)
    >>> bool(vabft_check(a, b, a @ b, e_max=2e-5).ok.all())
    True
    """
    ws = weight if weight is not None else weight_side(b, checksum_weight)
    rows = row_stats(a)
    c_sum = segment_reduce(_weighted(c, checksum_weight), _sum32)
    reference = torch.matmul(a.float(), ws.br)
    if alpha != 1.0:
        reference = reference * alpha
    threshold = abs(alpha) * vabft_threshold(rows, ws, e_max, c.dtype)
    threshold = threshold + ws.widths * TINY[c.dtype]
    inputs_bad = rows.bad.unsqueeze(-1) | ws.bad.unsqueeze(-2)
    bound = abs(alpha) * rows.norm.unsqueeze(-1) * ws.col_norm.unsqueeze(-2)
    if bias is not None and beta != 0.0:
        bias_n = bias.reshape(1) if bias.dim() == 0 else bias
        if bias_n.shape[-1] != c.shape[-1]:
            bias_n = bias_n.expand(*bias_n.shape[:-1], c.shape[-1])
        bias_w = _weighted(bias_n, checksum_weight)
        bias_sum = segment_reduce(bias_w, _sum32)
        bias_abs = segment_reduce(bias_w.abs(), _sum32) * abs(beta)
        reference = reference + beta * bias_sum
        threshold = threshold + bias_rounding(c.dtype) * bias_abs
        inputs_bad = inputs_bad | ~torch.isfinite(bias_sum)
        bound = bound + bias_abs
    diff = (c_sum - reference).abs()
    ok = (diff <= threshold) & torch.isfinite(diff)
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
