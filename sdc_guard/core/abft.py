"""V-ABFT's screen (docs/ALGORITHM.md) in portable PyTorch: weight side, row statistics, threshold.

This module is the reference every backend is compared against. It computes, for
``C = alpha * A @ B + beta * bias`` and every (row, 256-column segment):

- ``D``: the checksum difference ``|sum r*C - alpha * A @ Br - beta * sum r*bias|`` in fp32;
- ``T``: the threshold: the variance-adaptive V-ABFT bracket times ``e_eff`` (accumulation
  error, at the device's precision), plus ``u_acc |alpha| (|A| @ |B|r)`` (one accumulator
  rounding of the worst-case magnitude, which follows C where the bracket's independence
  model does not: sparse rows, mean-shifted columns), plus C's own rounding read from C
  (``u_C / (1 - u_C) sum |r C|``: rigorous, and a corrupted element raises it by only
  ``u_C`` of its own error, so C cannot hide behind it; docs/ALGORITHM.md, "Reading C"),
  plus the bias's fp32 arithmetic and an underflow floor. The bracket is evaluated in fp64
  from statistics that are never squared in fp32, so no finite input underflows or
  overflows it and a power-of-two scaling of A (and C) scales D and T exactly;
- which segments cannot be judged (non-finite inputs) and which non-finite results may be
  a legitimate overflow (fp16 AMP overflows are routine; GradScaler handles them).

This is the *screen*: a segment it flags is a suspect, which ``sdc_guard.core.confirm`` then
settles exactly before anything acts on it.

It never writes to its inputs and never synchronises an accelerator with the host, so the
dispatch mode can call it on every GEMM and read the flags once per step. (On CPU, where
reading a value is free, a check that passes everywhere takes a shortcut; see
``vabft_check``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from .precision import SEGMENT, ScreenTerms, bias_rounding, element_floor, overflow_limit


from .comp_row import decode_comp_row, encode_comp_row
from .passes import (
    _CHUNK,
    _block32,
    _blocks,
    _fp32_rows,
    _row_extrema,
    _row_pass,
    _segment_sums_rows,
    _times_br,
    c_sums,
    _weight_pass,
)
from .segments import (
    _extrema32,
    segment_constants,
    _sum32,
    _weighted,
    column_major,
    num_segments,
    segment_reduce,
    segment_reduce_many,
    segment_widths,
)

__all__ = [
    "AbftCheck", "RowStats", "WeightSide", "column_major", "decode_comp_row", "effective_e_max",
    "encode_comp_row", "num_segments", "row_stats", "segment_reduce", "segment_reduce_many",
    "segment_widths", "vabft_check", "vabft_threshold", "weight_side",
]


def extrema_variance64(mu: Tensor, hi: Tensor, lo: Tensor) -> Tensor:
    """Bhatia-Davis bound ``|(max - mu)(mu - min)|`` in fp64: never below the true
    variance. The differences and the product are taken in fp64, where the product of two
    fp32 values is exact and cannot underflow or overflow (fp32 squares leave fp32's range
    below 1e-19 and above 1e19: attention probabilities and their gradients live there)."""
    return ((hi.double() - mu.double()) * (mu.double() - lo.double())).abs()


@dataclass(frozen=True)
class WeightSide:
    """What V-ABFT needs from ``B`` (and the checksum weight): O(KN) once per weight.

    Cacheable for as long as ``B`` does not change (a parameter between optimizer steps).
    ``br`` and ``babs`` are ``[..., K, nseg]`` fp32; the aggregates are ``[..., nseg]`` fp64.
    """

    br: Tensor  #: ``Br[k, s] = sum_{n in s} r[n] B[k, n]`` (fp32)
    babs: Tensor  #: ``(|B| r)[k, s] = sum_{n in s} |r[n] B[k, n]|`` (fp32)
    p1: Tensor  #: ``sum_k |muB[k, s]|`` (fp64)
    p2: Tensor  #: ``sum_k muB[k, s]^2`` (fp64)
    v: Tensor  #: ``sum_k varB[k, s]`` (fp64)
    col_norm: Tensor  #: ``sqrt(sum_k max_{n in s} (r[n] B[k, n])^2)`` >= every column norm in s (fp64)
    bad: Tensor  #: bool: a non-finite value of B lies in the segment
    widths: Tensor  #: fp32 ``n_s``
    k: int
    n: int

    @property
    def nbytes(self) -> int:
        """Memory held, for the cache's bound."""
        return sum(t.numel() * t.element_size() for t in (self.br, self.babs, self.p1, self.p2, self.v,
                                                           self.col_norm, self.bad))

    @cached_property
    def factors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per-segment factors of the threshold's bracket, fp64 ``[..., 1, nseg]`` (see
        ``_bracket``): computed once per encoding, so that a cached weight costs a call
        none of this (a backend that computes them with the encoding supplies them with
        ``set_factors``)."""
        n_s = self.widths
        if n_s.dim() == 1 and n_s.shape[0] == num_segments(self.n):
            _, c_sqrt_n, c_n, sqrt_n = segment_constants(self.n, n_s.device)
            w64 = c_n / 4.0
        else:  # an encoding built elsewhere with its own widths
            w64 = n_s.double()
            sqrt_n = torch.sqrt(w64)
            c_sqrt_n, c_n = 4.0 * sqrt_n, 4.0 * w64
        sqrt_v = torch.sqrt(self.v)
        f_mean = w64 * self.p1
        f_cross_mu = c_sqrt_n * sqrt_v
        f_cross_sd = c_n * torch.sqrt(self.p2)
        f_spread = sqrt_n * sqrt_v
        return tuple(f.unsqueeze(-2) for f in (f_mean, f_cross_mu, f_cross_sd, f_spread))  # type: ignore[return-value]

    def set_factors(self, factors: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
        """Supply ``factors`` computed elsewhere, exactly as ``factors`` computes them (the
        native kernel computes them in the encoding's pass): they are then not computed."""
        self.__dict__["factors"] = tuple(factors)  # the cached_property's slot

    @cached_property
    def attached(self) -> dict[str, Any]:
        """Data a backend derives from this encoding once and keeps with it (the native
        backend's pointers and layouts, under ``"native"``): dropped with the encoding,
        not part of its value."""
        return {}

    @cached_property
    def _floors(self) -> dict[torch.dtype, Tensor]:
        """``n_s * element_floor(K, C's dtype)`` (fp64) per C dtype, filled on first use."""
        return {}

    def floor(self, c_dtype: torch.dtype) -> Tensor:
        """The threshold's floor term for C's dtype (``threshold64`` adds it), per segment."""
        floor = self._floors.get(c_dtype)
        if floor is None:
            floor = self._floors[c_dtype] = self.widths.double() * element_floor(self.k, c_dtype)
        return floor


def weight_side(b: Tensor, checksum_weight: Tensor | None = None) -> WeightSide:
    """Encode ``b`` (``[..., K, N]``, any strides) for V-ABFT: one blocked read of ``b``.

    >>> ws = weight_side(torch.ones(4, 300)); ws.br[0].tolist(), ws.widths.tolist()
    ([256.0, 44.0], [256.0, 44.0])
    """
    if b.requires_grad:  # the blocked pass writes into out= buffers; verification needs no graph
        b = b.detach()
    k, n = b.shape[-2], b.shape[-1]
    widths = segment_constants(n, b.device)[0]
    stats = None
    if b.dim() == 2 and k and n:
        weight32 = checksum_weight.float() if checksum_weight is not None else None
        stats = _weight_pass(b, weight32)
    if stats is None:
        bw = _weighted(b, checksum_weight)
        if bw.dtype != torch.float32:
            bw = bw.float()  # bf16/fp16 reductions into fp32 take a slow path on CPU
        br = segment_reduce(bw, _sum32)
        babs = segment_reduce(bw.abs(), _sum32)
        hi, lo = segment_reduce_many(bw, _extrema32)
    else:
        br, babs, hi, lo = stats
    if br.stride(-2) != 1 and br.shape[-2] > 1:
        # Segment-major, like the column-major pass produces: MKL's skinny GEMM A @ Br is
        # up to 3x faster with Br's columns contiguous (1024 x 256 x 4: 45 against 127 us).
        br = br.mT.contiguous().mT
    if babs.stride(-2) != 1 and babs.shape[-2] > 1:
        babs = babs.mT.contiguous().mT
    mu = br / widths
    var = extrema_variance64(mu, hi, lo)
    mu64 = mu.double()
    p1 = mu64.abs().sum(-2)
    p2 = (mu64 * mu64).sum(-2)
    v = var.sum(-2)
    # max(|hi|, |lo|) is max(hi, -lo), as hi >= lo (and NaN propagates alike)
    col_norm = torch.maximum(hi, -lo).double().square().sum(-2).sqrt()
    # x - x is 0 exactly where x is finite, NaN elsewhere: one op where isfinite is four
    bad = ((p1 - p1) + (v - v)) != 0
    return WeightSide(br, babs, p1, p2, v, col_norm, bad, widths, k, n)


@dataclass(frozen=True)
class RowStats:
    """Row statistics of ``A`` over k, ``[..., M]``."""

    mu: Tensor  #: fp32 row mean
    sd: Tensor  #: fp64 ``sqrt(|(max - mu)(mu - min)|)``: the Bhatia-Davis bound of the standard deviation
    norm: Tensor  #: fp64 ``sqrt(K (sd^2 + mu^2))`` >= ``||A[m, :]||_2`` (Bhatia-Davis): bounds |C|
    bad: Tensor  #: bool: a non-finite value lies in the row

    @property
    def var(self) -> Tensor:
        """The Bhatia-Davis variance bound (fp64)."""
        return self.sd * self.sd


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
    var = extrema_variance64(mu, hi, lo)
    # The mean square is at most var + mu^2 because var bounds the true variance: a
    # norm bound for free, where an exact norm would be one more pass over A.
    mu64 = mu.double()
    norm = torch.sqrt(k * (var + mu64 * mu64))
    bad = ~(torch.isfinite(mu) & torch.isfinite(var))
    return RowStats(mu, var.sqrt(), norm, bad)


def row_stats(a: Tensor) -> RowStats:
    """Mean, Bhatia-Davis standard deviation and a 2-norm bound of each row of ``a`` (``[..., M, K]``).

    >>> row_stats(torch.tensor([[1.0, 3.0]])).var.tolist()
    [1.0]
    """
    if a.shape[-1] == 0:
        zeros = torch.zeros(a.shape[:-1], dtype=torch.float32, device=a.device)
        z64 = zeros.double()
        return RowStats(zeros, z64, z64, torch.zeros_like(zeros, dtype=torch.bool))
    return _finish_rows(a.shape[-1], *_row_moments(a))


def effective_e_max(e_max: float, k: int, c_dtype: torch.dtype | None = None) -> float:
    """``e_eff``: the NPU operator's scaling of ``e_max`` with ``K``, ``e_max * 6 * sqrt(K / 1024)``.

    It models accumulation error, which grows with ``K``. (C's own final rounding, which
    does not shrink with ``K``, has its own term in the threshold, read from C.)
    ``c_dtype`` is accepted for the callers of the earlier signature and not used.

    >>> effective_e_max(1e-3, 1024)
    0.006
    """
    return e_max * 6.0 * math.sqrt(k / 1024.0)


def _bracket(mu: Tensor, sd: Tensor, ws: WeightSide) -> Tensor:
    """The bracket of the threshold for row statistics ``[..., M, 1]`` (mean fp32, sd fp64), fp64:

    ``n_s |muA| P1 + c sqrt(n_s) hypot(|muA| sqrt(V), sqrt(n_s) sdA sqrt(P2)) + sqrt(n_s) sdA sqrt(V)``

    with the segment factors folded in ahead (``WeightSide.factors``). In fp64 every
    product of an A statistic and a B factor is exact to rounding and inside the range,
    for any finite fp32 operands: no scale of the inputs underflows or overflows it.
    """
    f_mean, f_cross_mu, f_cross_sd, f_spread = ws.factors
    mu_abs = mu.double().abs()
    out = mu_abs * f_mean
    out += torch.hypot(mu_abs * f_cross_mu, sd * f_cross_sd)
    return out.addcmul_(sd, f_spread)


def vabft_threshold(rows: RowStats, ws: WeightSide, e_max: float, c_dtype: torch.dtype) -> Tensor:
    """The bracket part of ``T[..., m, s]`` (fp64): ``e_eff * bracket``, without C's
    rounding, the bias term and the underflow floor."""
    bracket = _bracket(rows.mu.unsqueeze(-1), rows.sd.unsqueeze(-1), ws)
    return bracket.mul_(effective_e_max(e_max, ws.k))


@dataclass(frozen=True)
class CSums:
    """What the threshold reads of C per (row, segment) (``[..., M, nseg]`` fp32): the
    sums of ``|r C|`` and, for the tight screen, of ``(r C)^2``, and the checksum
    ``sum r C`` itself (its absolute value is the coherent term)."""

    total: Tensor
    abs: Tensor
    sq: Tensor | None = None


def threshold64(mu: Tensor, hi: Tensor, lo: Tensor, rabs: Tensor, ws: WeightSide, e_max: float, alpha: float,
                c_dtype: torch.dtype, bias_abs: Tensor | None = None, terms: ScreenTerms | None = None,
                csums: CSums | None = None) -> Tensor:
    """``T`` in fp64 from A's row mean, max, min (``[..., M, 1]``), ``|A| @ Babs``
    (``[..., M, nseg]``), the weight side, the bias's ``|beta| sum |r bias|`` and C's sums:

    ``|alpha| e_eff bracket + a_round (|A| @ Babs) + c_abs sum |r C| + c_sq sqrt(sum (r C)^2)
    + c_coh |sum r C| + bias_rounding sum |beta r bias| + n_s floor``

    with the coefficients of ``terms`` (``precision.ScreenTerms.coefficients``; default:
    the default screen with fp32 accumulation). A term whose coefficient is 0 is not
    computed; ``csums`` is needed unless all three of C's are 0.
    """
    terms = terms if terms is not None else ScreenTerms()
    a_round, c_abs, c_sq, c_coh = terms.coefficients(c_dtype, alpha, epilogue=alpha != 1.0 or bias_abs is not None)
    sd = extrema_variance64(mu, hi, lo).sqrt()
    t = _bracket(mu, sd, ws).mul_(abs(alpha) * effective_e_max(e_max, ws.k))
    t.add_(rabs.double(), alpha=a_round)
    t.add_(ws.floor(c_dtype))
    if bias_abs is not None:
        t.add_(bias_abs.double(), alpha=bias_rounding(c_dtype))
    if c_abs or c_sq or c_coh:
        assert csums is not None, "threshold64: the screen reads C, csums is required"
        t.add_(c_round64(csums, c_abs, c_sq, c_coh))
    return t


def c_round64(csums: CSums, c_abs: float, c_sq: float, c_coh: float) -> Tensor:
    """C's rounding term (fp64) from C's sums (``precision.ScreenTerms``): ``c_abs sum |r C|``,
    or with ``c_sq`` its minimum with ``c_sq sqrt(Q) + c_coh |sum r C|`` where the fp32 sum of
    squares ``Q`` is a normal number (elsewhere C's squares left fp32's range, and the
    rigorous term alone serves)."""
    rigorous = csums.abs.double() * c_abs
    if not c_sq:
        return rigorous.add_(csums.total.double().abs_(), alpha=c_coh) if c_coh else rigorous
    assert csums.sq is not None, "c_round64: the tight screen needs the sums of squares"
    q = csums.sq
    normal = (q >= torch.finfo(torch.float32).tiny) & (q < float("inf"))
    prob = q.double().sqrt_().mul_(c_sq).add_(csums.total.double().abs_(), alpha=c_coh)
    return torch.where(normal, torch.minimum(prob, rigorous), rigorous)


def to_threshold32(t: Tensor) -> Tensor:
    """``T`` as fp32 for comparison with the fp32 ``D`` (rounded to nearest). A T past
    fp32's range becomes inf, and an infinite T is not a pass: it reads C, so a corrupted
    C whose sums leave fp32's range must not pass with it (the confirmation settles the
    segment instead)."""
    return t.float()


@dataclass(frozen=True)
class AbftCheck:
    """Per-(row, segment) outcome of one V-ABFT screen, all tensors ``[..., M, nseg]``.

    ``ok`` is the screen's bit (``D <= T`` and finite). The other masks say why a
    failed bit is not corruption: ``inputs_bad`` (a non-finite A row, B segment or bias:
    unverifiable) and ``possible_overflow`` (finite inputs, non-finite result, magnitudes
    large enough for a legitimate overflow). ``diff`` and ``threshold`` are ``None`` for
    backends that only return bits (the NPU operator). ``clear``: known on the host
    without a synchronisation (CPU backends) that every segment passed with D and T
    finite, so the masks are all False and a summary need not reduce them;
    ``worst_ratio``: the largest ``D / T`` of a clear check, where the backend had it.
    """

    ok: Tensor
    inputs_bad: Tensor
    possible_overflow: Tensor
    diff: Tensor | None = None
    threshold: Tensor | None = None
    clear: bool = False
    worst_ratio: float | None = None

    @property
    def sdc(self) -> Tensor:
        """Segments the screen suspects of corruption (to be confirmed: ``sdc_guard.core.confirm``)."""
        return ~self.ok & ~self.inputs_bad & ~self.possible_overflow

    @property
    def ratio(self) -> Tensor | None:
        """``D / T`` (fp32), or ``None`` where the backend does not report ``D``."""
        if self.diff is None or self.threshold is None:
            return None
        return self.diff / self.threshold


def bias_sums(bias: Tensor, n: int, checksum_weight: Tensor | None, beta: float) -> tuple[Tensor, Tensor]:
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
    rounding: ScreenTerms | None = None,
) -> AbftCheck:
    """Screen ``c == alpha * a @ b + beta * bias`` (docs/ALGORITHM.md), all on ``c``'s device.

    Operands are assumed validated (``verify.check_operands``); batch dims broadcast as in
    ``torch.matmul``. ``weight`` is a cached ``weight_side(b, checksum_weight)``;
    ``rounding`` the screen's ``precision.ScreenTerms`` (default: the default screen with
    fp32 accumulation; ``precision.resolve_screen`` gives a device's).

    Cost: one blocked read each of A and C (and of B without ``weight``), the two skinny
    products ``A @ Br`` and ``|A| @ Babs``, a few dozen small ops on ``[M, nseg]``. On
    CPU, where reading a flag costs nothing, a check that passes everywhere skips
    building the masks that explain failures.

    >>> a, b = torch.randn(4, 64), torch.randn(64, 300)
    >>> bool(vabft_check(a, b, a @ b, e_max=2e-5).ok.all())
    True
    """
    terms = rounding if rounding is not None else ScreenTerms()
    squares = terms.sigmas != 0.0
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
        mu, hi, lo, reference, rabs, c_sum, c_abs, c_sq = _row_pass(a2, c2, ws.br, ws.babs, weight32, squares)
        if batch:
            mu, hi, lo, reference, rabs, c_sum, c_abs, c_sq = (
                None if t is None else t.unflatten(0, (*batch, a.shape[-2]))
                for t in (mu, hi, lo, reference, rabs, c_sum, c_abs, c_sq))
    else:
        if k:
            mu, hi, lo = _row_moments(a)
        else:
            mu = hi = lo = torch.zeros((*a.shape[:-1], 1), dtype=torch.float32, device=a.device)
        c_sum, c_abs, c_sq = c_sums(_weighted(c, checksum_weight), squares)
        fa = a if a.dtype == torch.float32 else a.float()
        if ws.br.shape[-1] == 1 and fa.dim() > 2 and fa.numel() <= _CHUNK:
            # batched GEMV (attention with N <= 256): MKL's bmm with one column costs 4x
            # an elementwise product and a row sum (32 x 128 x 128: 200 against 42 us)
            reference = (fa * ws.br.mT).sum(-1, keepdim=True)
            rabs = (fa.abs() * ws.babs.mT).sum(-1, keepdim=True)
        else:
            reference = _times_br(fa, ws.br)
            rabs = _times_br(fa.abs(), ws.babs)
    if alpha != 1.0:
        reference = reference * alpha
    bias_sum = bias_abs = None
    if bias is not None and beta != 0.0:
        bias_sum, bias_abs = bias_sums(bias, n, checksum_weight, beta)
        reference = reference + beta * bias_sum
    csums = CSums(c_sum, c_abs, c_sq)
    threshold = to_threshold32(threshold64(mu, hi, lo, rabs, ws, e_max, alpha, c.dtype, bias_abs, terms, csums))
    diff = (c_sum - reference).abs_()
    ok = diff <= threshold
    if c.device.type == "cpu" and diff.numel():
        # T - D >= 0 everywhere: every segment passed; finite everywhere: no T is infinite,
        # so no input was non-finite (a non-finite A row or B segment makes T inf or nan)
        # and no D is. The masks that explain failures are then all False.
        lowest, highest = torch.aminmax(threshold - diff)
        if float(lowest) >= 0.0 and math.isfinite(float(highest)):
            none = torch.zeros(ok.shape, dtype=torch.bool, device=c.device)  # read-only, like every mask
            return AbftCheck(ok, none, none, diff, threshold, clear=True)
    ok &= torch.isfinite(diff) & torch.isfinite(threshold)  # T reads C: infinite only where C's sums are
    return explain_failures(ok, diff, threshold, k, mu, hi, lo, ws, alpha, c.dtype, bias_sum, bias_abs)


def explain_failures(
    ok: Tensor, diff: Tensor, threshold: Tensor, k: int, mu: Tensor, hi: Tensor, lo: Tensor,
    ws: WeightSide, alpha: float, c_dtype: torch.dtype, bias_sum: Tensor | None = None,
    bias_abs: Tensor | None = None,
) -> AbftCheck:
    """The ``AbftCheck`` of a check where some segment failed or something is non-finite:
    the masks that say why a failed bit is not corruption (``inputs_bad``,
    ``possible_overflow``), from A's row mean, max and min (``[..., M, 1]``), the weight
    side and the bias sums. ``ok`` must already be ``D <= T`` and finite. Shared by every
    backend that reports these statistics (the torch path above, ``sdc_guard.backends.native``),
    so that they classify non-finite inputs identically."""
    rows = _finish_rows(k, mu, hi, lo)
    inputs_bad = rows.bad.unsqueeze(-1) | ws.bad.unsqueeze(-2)
    bound = abs(alpha) * rows.norm.unsqueeze(-1) * ws.col_norm.unsqueeze(-2)
    if bias_sum is not None and bias_abs is not None:
        inputs_bad = inputs_bad | ~torch.isfinite(bias_sum)
        bound = bound + bias_abs
    possible_overflow = ~torch.isfinite(diff) & ~inputs_bad & (bound >= overflow_limit(c_dtype))
    shape = torch.broadcast_shapes(diff.shape, inputs_bad.shape)
    return AbftCheck(ok, inputs_bad.expand(shape), possible_overflow, diff, threshold)
