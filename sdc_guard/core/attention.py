"""Checksum screen of fused attention (SDPA), forward and backward; docs/ATTENTION.md.

A fused attention kernel never writes its attention matrix, so there is no GEMM output to
checksum. What can be checked is each output row against a checksum identity, with the
head dimension summed (checksum weight all ones):

- forward ``O = softmax(S) V`` with ``S = scale Q K^T + mask``: ``O 1 = P (V 1)``;
- backward, with ``dP = dO V^T``, ``Delta = rowsum(dO * O)``, ``dS = P * (dP - Delta)``:
  ``dV 1 = P^T (dO 1)``, ``dQ 1 = scale dS (K 1)``, ``dK 1 = scale dS^T (Q 1)``.

``P`` (and ``dS``) are recomputed here in fp32 from the op's *inputs* (``Q``, ``K``,
``V``, the mask, ``scale``; in the backward also ``dO`` and the saved ``O``, which the
kernel reads too), never from its possibly corrupted outputs (not even ``logsumexp``),
one chunk of heads at a time; their products with the checksum vectors are matrix-vector
products. The threshold of each row is a worst-case bound of what a correct kernel and
this recomputation may differ by (rounding of ``S``, of ``P`` before the ``PV`` product,
fp32 accumulation, the outputs' rounding to their dtype), computed from the inputs only;
``docs/ATTENTION.md`` derives it term by term. A row over its threshold is a *suspect*;
``sdc_guard.core.attention_confirm`` settles it exactly before anything counts.

Everything here is a pure function of tensors (no host synchronisation, no Python state),
so a compiled route can call ``forward_screen`` / ``backward_screen`` on the op's
operands as the eager dispatch mode does. On CPU the guard runs the same screen in native
code (``sdc_guard.backends.native_attention``: blocked, in cache), which evaluates these
per-row formulas with the per-call constants of ``threshold_constants``; this module is
its reference and its fallback.

Layout: queries of the ``G = Hq / Hkv`` heads sharing a key/value head (grouped-query
attention; ``G = 1`` otherwise) are stacked into one ``[G L, D]`` row block per
(batch, key/value head), so a key/value head's gradient sums its group's rows as the
kernel does. Rows are returned in the op's layout: ``[B, Hq, L]`` for ``O`` and ``dQ``,
``[B, Hkv, S]`` for ``dK`` and ``dV``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .confirm import gamma
from .precision import TINY, UNIT_ROUNDOFF

_U32 = 2.0**-24
_FTZ = 2.0**-126
_SLACK = 1.0 + 2.0**-20
#: fp32 elements of one ``[chunk, G L, S]`` matrix per chunk (bounds the screen's memory)
CHUNK_ELEMENTS = 1 << 24
#: Rows per partial sum the CPU flash backward rounds to a bf16 / fp16 gradient (its
#: blocks are 64 rows; measured bit-exact on torch 2.13: dV = sum over 64-query blocks of an
#: fp32 product, each added to the bf16 gradient). Assumed 32, which counts more roundings.
CPU_GRAD_BLOCK = 32
#: exp(x) underflows fp32 below this: entries of S further than it below the row max have
#: P = 0 in every correct kernel (their S's own rounding does not matter)
_EXP_RANGE = 104.0
#: Relative error of one fp32 exp, in units of u32 = 2^-24, that each copy of P may carry:
#: 1 ulp (libm's expf, torch's vectorised exp). The native screen's polynomial exp
#: (csrc/attn_simd.h) measures at most 1.39 u32 over every fp32 argument it takes
#: (docs/ATTENTION.md, "exp"; tests/unit/backends/test_native_attention.py checks a sample).
EXP_U32 = 2


@dataclass(frozen=True)
class AttentionOperands:
    """One SDPA call, in the op's layout: ``q [B, Hq, L, D]``, ``k [B, Hkv, S, D]``,
    ``v [B, Hkv, S, Dv]``; ``mask`` additive (float) or boolean (True = attend),
    broadcastable to ``[B, Hq, L, S]``; ``causal``: top-left ``j <= i`` (PyTorch's
    convention); ``scale``: resolved (``1/sqrt(D)`` when the call gave none)."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    causal: bool
    scale: float

    @property
    def dims(self) -> tuple[int, int, int, int, int, int, int]:
        """(B, Hq, Hkv, L, S, D, Dv)."""
        b, hq, l, d = self.q.shape
        return b, hq, self.k.shape[1], l, self.k.shape[2], d, self.v.shape[-1]


@dataclass(frozen=True)
class Rounding:
    """What a correct kernel may round, as unit roundoffs: ``product`` of the operands
    before the fp32 products of ``Q K^T`` and ``dO V^T`` (0: exact, bf16 / fp16 inputs and
    fp32 on CPU; 2^-11: TF32 on CUDA), ``p`` of ``P`` / ``dS`` cast before the ``P V``,
    ``P^T dO``, ``dS K``, ``dS^T Q`` products (the input dtype; TF32 for fp32 on CUDA),
    ``out`` of the outputs' dtype; ``tiny``: smallest magnitude ``P`` / ``dS`` keep in
    their cast dtype (``precision.TINY``)."""

    product: float
    p: float
    out: float
    tiny: float
    #: rows (or keys) per partial sum a backward kernel rounds to the gradient's dtype and
    #: adds in it (CPU: blocks of 64, assumed 32; CUDA kernels keep fp32 accumulators: 0)
    grad_block: int = 0

    def grad_rounding(self, n: int) -> float:
        """Relative error of a gradient summed over ``n`` terms from its rounding(s) to
        its dtype: ``u`` once, or ``gamma_{ceil(n / grad_block)}(u)`` when partial sums
        are rounded and added in that dtype (the confirmation's worst case)."""
        if not self.grad_block:
            return self.out
        return gamma(max(1, -(-n // self.grad_block)), self.out)

    def intermediate(self, n: int) -> int:
        """Roundings of partial sums before the final one, for a gradient summed over
        ``n`` terms: ``ceil(n / grad_block) - 1``, 0 without blocks."""
        return max(0, -(-n // self.grad_block) - 1) if self.grad_block else 0


def rounding_model(dtype: torch.dtype, device: torch.device) -> Rounding:
    """The kernel rounding the screen and the confirmation assume for inputs of ``dtype``
    on ``device``: fp32 on CUDA may use TF32 tensor cores inside the fused kernels (no
    global flag governs them), so it is assumed; elsewhere products are exact."""
    u = UNIT_ROUNDOFF[dtype]
    if dtype == torch.float32 and device.type == "cuda":
        return Rounding(product=2.0**-11, p=2.0**-11, out=u, tiny=TINY[dtype])
    return Rounding(product=0.0, p=u, out=u, tiny=TINY[dtype],
                    grad_block=CPU_GRAD_BLOCK if device.type == "cpu" and dtype != torch.float32 else 0)


@dataclass(frozen=True)
class RowCheck:
    """Per-row screen of one output: ``diff = |checksum(out) - reference|``, ``threshold``;
    ``ok``: within it (and finite); ``inputs_bad``: the row's reference is not finite
    (NaN / Inf inputs, or every key masked out): unverifiable, never corruption."""

    diff: Tensor
    threshold: Tensor
    ok: Tensor
    inputs_bad: Tensor

    @property
    def ratio(self) -> Tensor:
        return self.diff / self.threshold


def _check(diff: Tensor, threshold: Tensor, bad: Tensor) -> RowCheck:
    """The row verdicts: within a finite threshold (a threshold that reads the output is
    infinite only where the output is, or its sums leave fp32's range: a suspect then,
    which the confirmation settles), and judged (``bad``: unverifiable)."""
    diff = torch.where(bad, 0.0, diff)
    return RowCheck(diff, threshold, (diff <= threshold) & torch.isfinite(threshold) & ~bad, bad)


def _stack_rows(x: Tensor, hkv: int) -> Tensor:
    """``[B, Hq, L, D]`` -> ``[B Hkv, G L, D]`` fp32 (a group's query rows stacked)."""
    b, hq, l, d = x.shape
    return x.reshape(b * hkv, (hq // hkv) * l, d).float()


def _chunks(n: int, rows: int, cols: int, device: torch.device) -> list[tuple[int, int, Tensor]]:
    """Ranges of stacked heads whose ``[rows, cols]`` matrices fit ``CHUNK_ELEMENTS``."""
    step = max(1, CHUNK_ELEMENTS // max(1, rows * cols))
    return [(i, min(n, i + step), torch.arange(i, min(n, i + step), device=device)) for i in range(0, n, step)]


def chunk_mask(ops: AttentionOperands, n: Tensor, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """The additive mask of the stacked heads ``n`` (indices into ``B Hkv``; a
    ``[len(n), G L, S]`` tensor, -inf where a boolean mask or causality forbids),
    ``None`` without either."""
    b, hq, hkv, l, s, _, _ = ops.dims
    g = hq // hkv
    device = ops.q.device
    out = None
    c = n.numel()
    if ops.mask is not None:
        m = ops.mask.expand(b, hq, l, s)
        heads = (n % hkv).unsqueeze(-1) * g + torch.arange(g, device=device)
        m = m[(n // hkv).unsqueeze(-1), heads]  # [c, G, L, S]
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, float("-inf"))
        out = m.to(dtype).reshape(c, g * l, s)
    if ops.causal:
        i = torch.arange(l, device=device).repeat(g).unsqueeze(-1)
        forbid = torch.arange(s, device=device) > i  # [G L, S]
        causal = torch.zeros(forbid.shape, dtype=dtype, device=device).masked_fill_(forbid, float("-inf"))
        out = causal.expand(c, g * l, s) if out is None else out + causal
    return out


@dataclass(frozen=True)
class Softmax:
    """``P`` of stacked heads (normalised, fp32, 0 on unverifiable rows) and, per row,
    the relative bound ``rho`` of ``|P_kernel - P_here| / P_here`` and ``bad``."""

    p: Tensor
    rho: Tensor
    bad: Tensor


def p_error(eta: Tensor, s: int, copies: int) -> Tensor:
    """Relative error bound of ``P`` rows whose ``S`` is off by at most ``eta`` (per
    row), computed ``copies`` times (kernel and this recomputation: 2; the kernel against
    an exact fp64 reference: 1): ``exp(2 eta) - 1`` (the numerator and the normaliser
    move), plus ``gamma_{2S+16}(u32)``: ``S`` for the normaliser's fp32 sum, ``S`` for an
    online-softmax kernel's running rescalings (at most one per key), ``2 EXP_U32`` for
    the entry's exp and its share of the normaliser's, 12 for the subtraction of the row
    maximum, the normalisation (a division, or a reciprocal and a product) and the rest."""
    return copies * (torch.expm1(2 * eta) + gamma(2 * s + 12 + 2 * EXP_U32, _U32))


def s_error(qnorm: Tensor, kmax: Tensor, rowmax: Tensor, scale: float, d: int, rnd: Rounding) -> Tensor:
    """Bound of ``|S_kernel - S_exact|`` per row over the entries that can carry weight:
    the ``D``-term fp32 dot product (``gamma_D``, TF32 input rounding ``2 u + u^2``) and
    its scaling, ``|scale| |q_i| max_j |k_j|`` by Cauchy-Schwarz, plus the mask's addition
    and the exponent's argument, ``16 u32 (|max_j S_ij| + 104 + ...)`` (an entry further
    below the row maximum has ``P = 0`` in every correct kernel)."""
    u_p = rnd.product
    dot = abs(scale) * qnorm * kmax
    return dot * (gamma(d, _U32) + 2 * u_p + u_p * u_p + 4 * _U32) + 16 * _U32 * (rowmax.abs() + _EXP_RANGE + dot)


def softmax_rows(q: Tensor, k: Tensor, mask: Tensor | None, scale: float, rnd: Rounding, copies: int = 2) -> Softmax:
    """``P = softmax(scale q k^T + mask)`` for stacked heads (any float dtype: fp32 for the
    screen, fp64 for the confirmation) and its error model (``s_error``, ``p_error``)."""
    s = torch.baddbmm(mask, q, k.transpose(-1, -2), alpha=scale) if mask is not None else \
        torch.bmm(q, k.transpose(-1, -2)).mul_(scale)
    rowmax = s.amax(-1, keepdim=True)
    bad = ~torch.isfinite(rowmax.squeeze(-1))
    p = s.sub_(rowmax.nan_to_num(0.0, posinf=0.0, neginf=0.0)).exp_()
    total = p.sum(-1, keepdim=True)
    bad = bad | ~torch.isfinite(total.squeeze(-1)) | (total.squeeze(-1) == 0)
    p = p.div_(total).nan_to_num_(0.0, posinf=0.0, neginf=0.0)
    p = torch.where(bad.unsqueeze(-1), 0.0, p)
    kmax = k.norm(dim=-1).amax(-1, keepdim=True) if k.shape[-2] else k.new_zeros(k.shape[0], 1)
    eta = s_error(q.norm(dim=-1), kmax, rowmax.squeeze(-1).nan_to_num(0.0), scale, q.shape[-1], rnd)
    return Softmax(p, p_error(eta, k.shape[-2], copies), bad)


def _tail(n: int, d: int, out_rounding: float) -> float:
    """Factor of the rest of a row's error: the kernel's and this recomputation's fp32
    accumulation over ``n`` terms (``gamma_n`` each), the scale's multiplication, the
    output's rounding (``out_rounding``: ``u`` of its dtype, or ``Rounding.grad_rounding``),
    and the three fp32 sums over the head dim (the checksum vectors and the output's
    checksum)."""
    return (1 + gamma(n, _U32)) ** 2 * (1 + 2 * _U32) * (1 + out_rounding) * (1 + gamma(d, _U32)) ** 3


def _acc_tail(n: int, d: int) -> float:
    """``_tail`` without the output's rounding: the fp32 arithmetic's share, which the
    screen applies to the worst-case magnitude (the output's own rounding is read from the
    output: ``_out_rounding``)."""
    return _tail(n, d, 0.0)


def _out_rounding(u: float, d: int) -> float:
    """Factor of ``sum_d |out_d|`` for an output's final rounding to its dtype, read from
    the output itself (docs/ALGORITHM.md, "Reading C": a corrupted element raises it by
    ``u`` of its error): ``u / (1 - u)``, plus ``gamma_d(u_fp32)`` for this fp32 sum."""
    return u / (1.0 - u) + gamma(d, _U32)


def _blocks(u: float, rounds: int) -> float:
    """Factor of ``sqrt(E)`` for ``rounds`` partial sums ``r_b = sum_{i <= b} x_i`` rounded
    to the output's dtype before its final rounding (CPU backward blocks): six standard
    deviations of as many independent roundings, ``6 u sqrt(rounds / 3)``; 0 without.
    ``E`` models a partial sum's energy ``|r_b|^2``: at most ``sum_i |x_i|^2`` where the
    terms add like a random walk, at most ``|out|^2`` where they add coherently, so their
    sum, each bounded range-safely by a maximum times a sum (``energy``; docs/ATTENTION.md,
    "Partial sums")."""
    return 6.0 * u * math.sqrt(rounds / 3.0) if rounds else 0.0


def energy(top: Tensor, total: Tensor) -> Tensor:
    """``top * total`` in fp64: a bound of ``sum x^2`` from ``max |x|`` and ``sum |x|`` that
    never leaves the range (squares of fp32 values leave fp32's range below 1e-19 and
    above 1e19; their fp64 product of two fp32 values cannot)."""
    return top.double() * total.double()


def threshold_constants(ops: AttentionOperands, out_dtype: torch.dtype,
                        grad_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] | None = None) -> dict[str, float]:
    """The per-call constants of the per-row thresholds below (forward; with
    ``grad_dtypes`` = the dtypes of ``dq, dk, dv``, the backward's too): what a screen that
    evaluates the per-row formulas elsewhere needs (the native one,
    ``sdc_guard.backends.native_attention``). ``ecoef``: ``s_error``'s factor of
    ``|scale| |q| max|k|``; ``g2s``: ``p_error``'s rounding term; ``tail*``: ``_acc_tail``
    of each output; ``out*``: ``_out_rounding`` of each output; ``blk_*``: ``_blocks`` of
    the gradients summed over the keys (``dq``) and over the query rows (``dk``, ``dv``);
    ``floor`` / ``f*``: the outputs' underflow floors."""
    b, hq, hkv, l, s, d, dv = ops.dims
    rnd = rounding_model(ops.q.dtype, ops.q.device)
    u_p = rnd.product
    out = {"scale": ops.scale, "ecoef": gamma(d, _U32) + 2 * u_p + u_p * u_p + 4 * _U32,
           "g2s": gamma(2 * s + 12 + 2 * EXP_U32, _U32), "p": rnd.p, "tiny": rnd.tiny,
           "tail": _acc_tail(s, dv), "out": _out_rounding(rnd.out, dv),
           "floor": dv * (TINY[out_dtype] + (2 * s + 2) * _FTZ)}
    if grad_dtypes is not None:
        gl = (hq // hkv) * l
        tq, tk, tv = grad_dtypes
        out.update(uprod=u_p, gdv=gamma(dv + 2, _U32), tail_q=_acc_tail(s, d), tail_kv=_acc_tail(gl, d),
                   tail_v=_acc_tail(gl, dv), out_q=_out_rounding(rnd.out, d), out_k=_out_rounding(rnd.out, d),
                   out_v=_out_rounding(rnd.out, dv), blk_q=_blocks(rnd.out, rnd.intermediate(s)),
                   blk_kv=_blocks(rnd.out, rnd.intermediate(gl)),
                   fq=d * (TINY[tq] + (2 * s + 2) * _FTZ), fk=d * (TINY[tk] + (2 * gl + 2) * _FTZ),
                   fv=dv * (TINY[tv] + (2 * gl + 2) * _FTZ))
    return out


def forward_screen(ops: AttentionOperands, out: Tensor) -> RowCheck:
    """Screen the forward output ``out [B, Hq, L, Dv]`` of ``ops``, per row (``[B, Hq, L]``).

    ``T_i = psi_i A1_i + (1 + psi_i)(tacc - 1) A2_i + c_out sum_d |O_id| + floor`` with
    ``psi_i = (1 + rho_i)(1 + u_p) - 1`` (``P``'s relative error: both copies, the cast
    before ``P V``), ``A1_i = sum_j P_ij |V_j . 1|`` (an error of ``P_ij`` moves the
    checksum by ``|V_j . 1|``, not by ``|V_j| . 1``), ``A2_i = sum_j P_ij |V_j| . 1`` (the
    fp32 accumulation's worst case) and the output's own rounding read from it
    (docs/ATTENTION.md, "Forward"). The floor's ``(TINY + 2^-126) sum_j |V_j|.1``: a ``P``
    flushed in the kernel's cast and an exp flushed below 2^-126 in the recomputation
    (the native one's does)."""
    b, hq, hkv, l, s, d, dv = ops.dims
    rnd = rounding_model(ops.q.dtype, ops.q.device)
    q, o = _stack_rows(ops.q, hkv), _stack_rows(out, hkv)
    k = ops.k.reshape(b * hkv, s, d).float()
    v = ops.v.reshape(b * hkv, s, dv).float()
    vsum, vabs = v.sum(-1), v.abs().sum(-1)
    weights = torch.stack([vsum, vsum.abs(), vabs], -1)
    tacc, c_out = _acc_tail(s, dv), _out_rounding(rnd.out, dv)
    diffs, thresholds, bads = [], [], []
    for lo, hi, idx in _chunks(b * hkv, q.shape[1], s, q.device):
        sm = softmax_rows(q[lo:hi], k[lo:hi], chunk_mask(ops, idx), ops.scale, rnd)
        x = torch.bmm(sm.p, weights[lo:hi])  # [c, GL, 3]
        ref, a1, a2 = x[..., 0], x[..., 1], x[..., 2]
        psi = (1 + sm.rho) * (1 + rnd.p) - 1
        floor = dv * (TINY[out.dtype] + (2 * s + 2) * _FTZ) + (rnd.tiny + _FTZ) * vabs[lo:hi].sum(-1, keepdim=True)
        own = c_out * o[lo:hi].abs().sum(-1)
        thresholds.append((psi * a1 + (1 + psi) * (tacc - 1) * a2 + own + floor) * _SLACK)
        diffs.append((o[lo:hi].sum(-1) - ref).abs())
        bads.append(sm.bad)
    shape = (b, hq, l)
    diff, threshold, bad = (torch.cat(t).reshape(shape) for t in (diffs, thresholds, bads))
    bad = bad | ~torch.isfinite(ops.v.reshape(b, hkv, 1, -1)).all(-1).expand(b, hkv, hq // hkv).reshape(b, hq, 1)
    return _check(torch.nan_to_num(diff, nan=float("inf")), threshold, bad)


@dataclass(frozen=True)
class BackwardCheck:
    """The backward screen: one ``RowCheck`` per gradient (``dq [B, Hq, L]``,
    ``dk`` and ``dv [B, Hkv, S]``)."""

    dq: RowCheck
    dk: RowCheck
    dv: RowCheck


def grad_terms(do: Tensor, o: Tensor, vmax: Tensor, sm: Softmax, rnd: Rounding, dv: int,
               copies: int = 2) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row parts of ``dS``'s error (docs/ATTENTION.md, "Backward"): ``kappa`` (relative,
    on ``|dS|``: ``P``'s error, ``dS``'s fp32 product and its cast), ``beta`` (on ``P``:
    ``dP - Delta``'s fp32 error, ``gamma_{Dv+2} |dO_i| (max |v_j| + |O_i|)``, both
    computations) and the absolute ``flush`` of an underflowing ``P`` times
    ``|dP - Delta|``, plus ``dS``'s own tiny in its cast dtype."""
    w = do.norm(dim=-1) * (vmax + o.norm(dim=-1))
    grow = (1 + sm.rho) * (1 + rnd.p) * (1 + _U32)
    beta = copies * (gamma(dv + 2, _U32) + 2 * rnd.product) * w * grow
    flush = 2 * _FTZ * w + rnd.tiny
    return grow - 1, beta, flush


def backward_screen(ops: AttentionOperands, grad_out: Tensor, out: Tensor,
                    dq: Tensor, dk: Tensor, dv: Tensor) -> BackwardCheck:
    """Screen the three input gradients of ``ops`` given ``grad_out`` and the forward's
    ``out`` (both inputs of the backward kernel), per row.

    Each threshold has four parts (docs/ATTENTION.md, "Backward"): the errors of ``P`` /
    ``dS`` entries, which move the checksum by ``|dO_i . 1|``, ``|Q_i . 1|`` or
    ``|K_j . 1|``; the fp32 arithmetic on the worst-case magnitude; the gradient's own
    final rounding, read from it; and, where a CPU kernel rounds partial sums to the
    gradient's dtype (``Rounding.grad_block``), six standard deviations of those
    roundings (``_blocks``: the energy of a partial sum ``sum_i w_ij x_i`` modelled by
    ``sum_i w_ij^2 |x_i|^2 + |out_j|^2``)."""
    b, hq, hkv, l, s, d, dvd = ops.dims
    rnd = rounding_model(ops.q.dtype, ops.q.device)
    q, do, o, dqs = (_stack_rows(t, hkv) for t in (ops.q, grad_out, out, dq))
    k = ops.k.reshape(b * hkv, s, d).float()
    v = ops.v.reshape(b * hkv, s, dvd).float()
    dks, dvs = dk.reshape(b * hkv, s, d).float(), dv.reshape(b * hkv, s, dvd).float()
    gl = q.shape[1]
    vmax = (v.norm(dim=-1).amax(-1, keepdim=True) if s else v.new_zeros(b * hkv, 1))
    qsum, qabs, ksum, kabs = q.sum(-1), q.abs().sum(-1), k.sum(-1), k.abs().sum(-1)
    dosum, doabs = do.sum(-1), do.abs().sum(-1)
    acc_q, acc_kv, acc_v = _acc_tail(s, d), _acc_tail(gl, d), _acc_tail(gl, dvd)
    out_q, out_k, out_v = (_out_rounding(rnd.out, d), _out_rounding(rnd.out, d), _out_rounding(rnd.out, dvd))
    blk_q, blk_kv = _blocks(rnd.out, rnd.intermediate(s)), _blocks(rnd.out, rnd.intermediate(gl))
    kweights = torch.stack([ksum, ksum.abs(), kabs], -1)  # [n, S, 3]
    qn, kn, dn = q.norm(dim=-1), k.norm(dim=-1), do.norm(dim=-1)
    sc = abs(ops.scale)
    parts: dict[str, list[Tensor]] = {key: [] for key in ("dq", "tq", "dk", "tk", "dv", "tv", "bq")}
    for lo, hi, idx in _chunks(b * hkv, gl, s, q.device):
        sm = softmax_rows(q[lo:hi], k[lo:hi], chunk_mask(ops, idx), ops.scale, rnd)
        p = sm.p
        delta = (do[lo:hi] * o[lo:hi]).sum(-1, keepdim=True)
        bad = sm.bad | ~torch.isfinite(do[lo:hi]).all(-1) | ~torch.isfinite(o[lo:hi]).all(-1)
        ds = torch.bmm(do[lo:hi], v[lo:hi].transpose(-1, -2)).sub_(delta).mul_(p)  # dS, [c, GL, S]
        kappa, beta, flush = grad_terms(do[lo:hi], o[lo:hi], vmax[lo:hi], sm, rnd, dvd)
        psi = (1 + sm.rho) * (1 + rnd.p) - 1
        ds_abs = ds.abs()
        # dQ 1 = scale dS (K 1): per row, sums over the keys
        dsk = torch.bmm(ds, kweights[lo:hi, :, :1]).squeeze(-1)
        adsk = torch.bmm(ds_abs, kweights[lo:hi])  # [c, GL, 3]: |dS| ksum (unused), |dS| |ksum|, |dS| kabs
        pk = torch.bmm(p, kweights[lo:hi, :, 1:3])  # P |ksum|, P kabs
        ref_q = dsk * ops.scale
        t_q = sc * (kappa * adsk[..., 1] + (1 + kappa) * (acc_q - 1) * adsk[..., 2]
                    + beta * (pk[..., 0] + (acc_q - 1) * pk[..., 1])
                    + acc_q * flush * kabs[lo:hi].sum(-1, keepdim=True))
        if blk_q:
            terms = ds_abs * kn[lo:hi].unsqueeze(-2)  # |dS_ij| |K_j|
            e_in = energy(terms.amax(-1), terms.sum(-1)) * (sc * sc)
            e_out = energy(dqs[lo:hi].abs().amax(-1), dqs[lo:hi].abs().sum(-1))
            t_q = t_q + blk_q * (e_in + e_out).sqrt()
        t_q = t_q + out_q * dqs[lo:hi].abs().sum(-1) + d * (TINY[dq.dtype] + (2 * s + 2) * _FTZ)
        # dK 1 = scale dS^T (Q 1), dV 1 = P^T (dO 1): per key, sums over the query rows
        w_v = psi * dosum[lo:hi].abs() + (1 + psi) * (acc_v - 1) * doabs[lo:hi]
        w_kb = beta * (qsum[lo:hi].abs() + (acc_kv - 1) * qabs[lo:hi])
        pt = torch.bmm(p.transpose(-1, -2), torch.stack([dosum[lo:hi], w_v, w_kb], -1))  # [c, S, 3]
        w_ka = kappa * qsum[lo:hi].abs() + (1 + kappa) * (acc_kv - 1) * qabs[lo:hi]
        dst = torch.bmm(ds.transpose(-1, -2), qsum[lo:hi].unsqueeze(-1)).squeeze(-1)
        dsat = torch.bmm(ds_abs.transpose(-1, -2), w_ka.unsqueeze(-1)).squeeze(-1)
        t_k = sc * (dsat + pt[..., 2] + acc_kv * (flush * qabs[lo:hi]).sum(-1, keepdim=True))
        t_k = t_k + out_k * dks[lo:hi].abs().sum(-1) + d * (TINY[dk.dtype] + (2 * gl + 2) * _FTZ)
        t_v = pt[..., 1] + (rnd.tiny + _FTZ) * doabs[lo:hi].sum(-1, keepdim=True) + dvd * (TINY[dv.dtype] + (2 * gl + 2) * _FTZ)
        t_v = t_v + out_v * dvs[lo:hi].abs().sum(-1)
        if blk_kv:
            terms_v = p * dn[lo:hi].unsqueeze(-1)  # P_ij |dO_i|
            terms_k = ds_abs * qn[lo:hi].unsqueeze(-1)  # |dS_ij| |Q_i|
            e_v = energy(terms_v.amax(-2), terms_v.sum(-2)) + energy(dvs[lo:hi].abs().amax(-1), dvs[lo:hi].abs().sum(-1))
            e_k = energy(terms_k.amax(-2), terms_k.sum(-2)) * (sc * sc) \
                + energy(dks[lo:hi].abs().amax(-1), dks[lo:hi].abs().sum(-1))
            t_k = t_k + blk_kv * e_k.sqrt()
            t_v = t_v + blk_kv * e_v.sqrt()
        parts["dq"].append((dqs[lo:hi].sum(-1) - ref_q).abs())
        parts["tq"].append(t_q * _SLACK)
        parts["dk"].append((dks[lo:hi].sum(-1) - dst * ops.scale).abs())
        parts["tk"].append(t_k * _SLACK)
        parts["dv"].append((dvs[lo:hi].sum(-1) - pt[..., 0]).abs())
        parts["tv"].append(t_v * _SLACK)
        parts["bq"].append(bad)
    cat = {key: torch.cat(val) for key, val in parts.items()}
    bad_q = cat["bq"].reshape(b, hq, l)
    inputs_finite = torch.stack([torch.isfinite(t.reshape(b, hkv, -1)).all(-1) for t in (ops.k, ops.v)]).all(0)
    # a key/value row is unverifiable when any query row of its group is (its gradient sums them)
    bad_kv = bad_q.reshape(b, hkv, -1).any(-1, keepdim=True).expand(b, hkv, s) | ~inputs_finite.unsqueeze(-1)
    bad_q = bad_q | ~inputs_finite.repeat_interleave(hq // hkv, 1).unsqueeze(-1)
    kv = (b, hkv, s)
    return BackwardCheck(
        _check(cat["dq"].reshape(b, hq, l).nan_to_num(nan=float("inf")), cat["tq"].reshape(b, hq, l), bad_q),
        _check(cat["dk"].reshape(kv).nan_to_num(nan=float("inf")), cat["tk"].reshape(kv), bad_kv),
        _check(cat["dv"].reshape(kv).nan_to_num(nan=float("inf")), cat["tv"].reshape(kv), bad_kv),
    )


def default_scale(d: int, scale: float | None) -> float:
    """SDPA's scale: ``1 / sqrt(D)`` unless the call gave one."""
    return 1.0 / math.sqrt(d) if scale is None else float(scale)
