"""Exact confirmation of the screen's flags: recompute the flagged segments, bound every element.

The screen (``sdc_guard.core.abft`` and the backends) is cheap and statistical: it compares one
checksum per (row, 256-column segment) against a threshold, and a clean product may
exceed it (structured operands it does not model). Nothing may act on that alone, so
every flagged (row, segment) is settled here, from ``A`` and ``B`` only:

- its ``n_s`` elements are recomputed in fp64 (every product of two bf16 / fp16 / fp32
  values is exact in fp64; the sum of K of them is off by at most ``gamma_K(2^-53)``);
- each element of ``C`` is tested against a rigorous bound of the error a correct
  device could have made (``element_bounds``: accumulation in the precision the device
  used, C's own rounding, a flushed underflow, the epilogue of ``alpha``, ``beta`` and the
  bias), with a non-finite element accepted only where a legitimate overflow is possible;
- the segment is *confirmed* corrupted if any element lies outside its bound, *cleared*
  (a screen miss) otherwise.

When the screen used a cached weight encoding, a cleared segment is also tested against
that encoding (``stale_encoding``): a weight that differs from the encoding made after its
last observed update changed at rest (a bit flipped in memory), which is confirmed as a
corruption of the weight.

Cost: proportional to the flagged segments, ``O(K n_s)`` each. Where the flags are on the
host (CPU), up to ``HOST_LIMIT`` segments per GEMM are examined, worst ``D / T`` first;
on an accelerator, without a host synchronisation, a fixed ``DEVICE_LIMIT`` of them
chosen on the device (``torch.topk``). A flag beyond the limit is counted as unconfirmed,
never acted on. docs/ALGORITHM.md, "Confirmation", gives the bound term by term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .accumulation import REDUCED_SPLITS, Accumulation, accumulation_model  # noqa: F401  (re-exported)
from .precision import SEGMENT, UNIT_ROUNDOFF, element_floor

#: Most flagged segments examined per GEMM when the flags are on the host.
HOST_LIMIT = 64
#: Flagged segments examined per GEMM on an accelerator (a fixed amount of work, no sync).
DEVICE_LIMIT = 8
#: fp64 elements gathered per block of candidates (bounds the memory of a confirmation).
_BLOCK_ELEMENTS = 1 << 22
#: Relative slack on every bound: the bound's own arithmetic is fp64.
_SLACK = 1.0 + 2.0**-20
_U32 = 2.0**-24
_U64 = 2.0**-53


def gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of a recursive sum
    (or dot product) of ``n`` terms in a format of unit roundoff ``u``; infinite when
    ``n u >= 1`` (no bound)."""
    nu = n * u
    return nu / (1.0 - nu) if nu < 1.0 else float("inf")


def element_bounds(exact: Tensor, absprod: Tensor, bias_abs: Tensor | None, k: int, c_dtype: torch.dtype,
                   model: Accumulation, epilogue: bool) -> Tensor:
    """The largest ``|C - exact|`` (fp64, elementwise) a correct device can produce.

    ``exact``: ``alpha A @ B + beta bias`` in fp64; ``absprod``: ``|alpha| |A| @ |B|``;
    ``bias_abs``: ``|beta bias|``; ``epilogue``: alpha != 1 or a bias (two more fp32
    roundings). Term by term (docs/ALGORITHM.md, "Confirmation"):

    - operand rounding before the products: ``(2 u_in + u_in^2) |A||B|``;
    - the accumulation of K products: ``gamma_K(u_acc) |A||B|``, plus, with reduced-precision
      reduction, ``gamma_splits(u_C)`` of everything accumulated so far;
    - the epilogue: ``3 u_fp32 (|A||B| + |beta bias| + errors so far)``;
    - C's final rounding: ``u_C`` of the value before it (``|exact|`` plus the errors so far);
    - underflow with flush-to-zero: ``element_floor(K)``;
    - this recomputation's own fp64 error: ``gamma_{K+2}(2^-53) (|A||B| + |beta bias|)``.
    """
    u_c = UNIT_ROUNDOFF[c_dtype]
    magnitude = absprod if bias_abs is None else absprod + bias_abs
    u_in = model.input_roundoff
    err = absprod * (2 * u_in + u_in * u_in + gamma(k, model.roundoff))
    if model.reduced_splits:
        err = err + (absprod + err) * gamma(model.reduced_splits, u_c)
    if epilogue:
        err = err + (magnitude + err) * (3 * _U32)
    err = err + (exact.abs() + err) * u_c
    err = err + magnitude * gamma(k + 2, _U64) + element_floor(k, c_dtype)
    return err * _SLACK


@dataclass(frozen=True)
class Confirmation:
    """What the exact recomputation found, bool ``[..., M, nseg]`` each.

    ``sdc``: a flagged segment with an element outside its bound, or a non-finite element
    no legitimate overflow explains: corruption of the GEMM. ``stale``: a flagged segment
    whose product is right for the weight in memory, but that weight differs from its
    cached encoding: corruption of the weight at rest. ``overflow``: every non-finite
    element is a legitimate overflow (and nothing else is wrong). ``examined``: the
    segments recomputed; a flagged segment outside ``examined`` is unconfirmed.
    """

    sdc: Tensor
    stale: Tensor
    overflow: Tensor
    examined: Tensor

    @property
    def corrupted(self) -> Tensor:
        """Confirmed corruption of either kind."""
        return self.sdc | self.stale


def candidates(ok: Tensor, inputs_bad: Tensor) -> Tensor:
    """The segments a confirmation must settle: failed the screen with finite inputs."""
    return ~ok & ~inputs_bad


def confirm(req: object, ok: Tensor, inputs_bad: Tensor, score: Tensor | None = None, *,
            cached: bool = False, on_host: bool | None = None, limit: int | None = HOST_LIMIT) -> Confirmation:
    """Settle the screen's flags of ``req`` (a ``backends.GemmRequest``) exactly.

    ``ok`` / ``inputs_bad``: the screen's masks; ``score``: ``D / T`` per segment, to
    examine the worst first (``None``: in index order); ``cached``: ``req.weight`` came
    from the weight cache, so a cleared segment is also tested for a stale encoding.
    ``on_host``: examine the flags chosen on the host (up to ``limit`` of them, worst
    first; ``None``: all; default: when the tensors are on the CPU) or on the device
    (``DEVICE_LIMIT``, no synchronisation). Never writes to an input.

    >>> from sdc_guard.backends import GemmRequest
    >>> a, b = torch.randn(4, 64), torch.randn(64, 8); c = a @ b; c[1, 2] += 1.0
    >>> flagged_everywhere = torch.zeros(4, 1, dtype=torch.bool)  # as if the screen failed every row
    >>> conf = confirm(GemmRequest(a, b, c, 2e-5), flagged_everywhere, torch.zeros_like(flagged_everywhere))
    >>> conf.sdc.flatten().tolist(), conf.examined.flatten().tolist()
    ([False, True, False, False], [True, True, True, True])
    """
    cand = candidates(ok, inputs_bad)
    c = req.c  # type: ignore[attr-defined]
    if on_host is None:
        on_host = c.device.type == "cpu"
    flat = cand.reshape(-1)
    empty = torch.zeros_like(cand)
    if on_host:
        picked = torch.nonzero(flat).flatten()
        if picked.numel() == 0:
            return Confirmation(empty, empty, empty, empty)
        if limit is not None and picked.numel() > limit:
            order = score.reshape(-1)[picked].nan_to_num(nan=float("inf")).argsort(descending=True) \
                if score is not None else torch.arange(picked.numel(), device=picked.device)
            picked = picked[order[:limit]]
        live = torch.ones(picked.shape, dtype=torch.bool, device=c.device)
    else:
        limit = min(DEVICE_LIMIT, flat.numel())
        if limit == 0:
            return Confirmation(empty, empty, empty, empty)
        rank = torch.where(flat, score.reshape(-1).nan_to_num(nan=float("inf")) if score is not None
                           else torch.ones(flat.shape, device=c.device), -1.0)
        picked = torch.topk(rank, limit).indices
        live = flat[picked]
    bad, stale, overflow = _examine(req, picked, cand.shape, cached)
    out = []
    for values in (bad & live, stale & live & ~bad, overflow & live & ~bad):
        mask = torch.zeros(flat.shape, dtype=torch.bool, device=c.device)
        mask[picked] = values
        out.append(mask.view(cand.shape))
    examined = torch.zeros(flat.shape, dtype=torch.bool, device=c.device)
    examined[picked] = live
    return Confirmation(out[0], out[1], out[2], examined.view(cand.shape))


def _examine(req: object, picked: Tensor, shape: torch.Size, cached: bool) -> tuple[Tensor, Tensor, Tensor]:
    """For each picked segment (flat index into ``shape`` = ``[*batch, M, nseg]``):
    (an element is wrong, the cached encoding is stale, the non-finite elements are all
    legitimate overflows), in blocks that bound the gathered fp64 memory."""
    a, b, c = req.a, req.b, req.c  # type: ignore[attr-defined]
    k = a.shape[-1]
    block = max(1, _BLOCK_ELEMENTS // max(1, SEGMENT * max(k, 1)))
    parts = [_examine_block(req, picked[i:i + block], shape, cached) for i in range(0, picked.numel(), block)]
    if not parts:
        none = torch.zeros(0, dtype=torch.bool, device=c.device)
        return none, none, none
    return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]


def _examine_block(req: object, picked: Tensor, shape: torch.Size, cached: bool) -> tuple[Tensor, Tensor, Tensor]:
    a, b, c = req.a, req.b, req.c  # type: ignore[attr-defined]
    bias, alpha, beta = req.bias, req.alpha, req.beta  # type: ignore[attr-defined]
    r = req.checksum_weight  # type: ignore[attr-defined]
    batch = tuple(c.shape[:-2])
    m_dim, k, n = c.shape[-2], a.shape[-1], c.shape[-1]
    nseg = shape[-1]
    idx = torch.unravel_index(picked, tuple(shape))
    bidx, rows, segs = idx[:-2], idx[-2], idx[-1]
    cols = segs.unsqueeze(-1) * SEGMENT + torch.arange(SEGMENT, device=c.device)  # [F, 256]
    valid = cols < n
    cols = cols.clamp(max=n - 1)
    a_e = a.expand(*batch, m_dim, k)
    b_e = b.expand(*batch, k, n)
    a_rows = a_e[(*bidx, rows)].double()  # [F, K]
    bsel = tuple(t.unsqueeze(-1) for t in bidx)
    b_seg = b_e[(*bsel, slice(None), cols)] if bidx else b_e[:, cols].permute(1, 2, 0)  # [F, 256, K]
    b_seg = b_seg.double()
    exact = torch.einsum("fk,fnk->fn", a_rows, b_seg) * alpha
    absprod = torch.einsum("fk,fnk->fn", a_rows.abs(), b_seg.abs()) * abs(alpha)
    bias_abs = None
    if bias is not None and beta != 0.0:
        bias_e = bias.expand(c.shape)
        bias_vals = bias_e[(*bsel, rows.unsqueeze(-1), cols)].double() * beta
        exact = exact + bias_vals
        bias_abs = bias_vals.abs()
    c_vals = c[(*bsel, rows.unsqueeze(-1), cols)].double()
    model = accumulation_model(c.device, a.dtype)
    bounds = element_bounds(exact, absprod, bias_abs, k, c.dtype, model,
                            epilogue=alpha != 1.0 or bias_abs is not None)
    finite = torch.isfinite(c_vals)
    limit = torch.finfo(c.dtype).max
    # a non-finite result is legitimate where the correct value may exceed C's range, or
    # where the fp32 accumulator itself may have overflowed on the way
    may_overflow = ((exact.abs() + bounds) > limit) | (absprod > torch.finfo(torch.float32).max)
    wrong = torch.where(finite, (c_vals - exact).abs() > bounds, ~may_overflow) & valid
    bad = wrong.any(-1)
    overflow = (~finite & valid).any(-1) & ~bad
    stale = torch.zeros_like(bad)
    ws = req.weight  # type: ignore[attr-defined]
    if cached and ws is not None:
        stale = _stale(ws, b_seg, valid, batch, bidx, segs, r, cols)
    return bad, stale, overflow


def _stale(ws: object, b_seg: Tensor, valid: Tensor, batch: tuple[int, ...], bidx: tuple[Tensor, ...],
           segs: Tensor, r: Tensor | None, cols: Tensor) -> Tensor:
    """Whether the cached ``Br[:, s]`` of each picked segment disagrees with the weight in
    memory by more than the fp32 rounding of its own sum (``2 gamma_256(2^-24)`` of the
    segment's ``sum |r B|``, plus the underflow floor): the weight changed since it was
    encoded."""
    w = b_seg if r is None else b_seg * r.double()[cols].unsqueeze(-1)
    w = torch.where(valid.unsqueeze(-1), w, 0.0)
    fresh = w.sum(-2)  # [F, K]
    scale = w.abs().sum(-2)
    br = ws.br  # type: ignore[attr-defined]
    if bidx:
        cached_br = br.expand(*batch, *br.shape[-2:])[(*bidx, slice(None), segs)].double()  # [F, K]
    else:
        cached_br = br[:, segs].T.double()
    tol = scale * (2 * gamma(SEGMENT, _U32)) + SEGMENT * 2.0**-126
    return ((cached_br - fresh).abs() > tol).any(-1)
