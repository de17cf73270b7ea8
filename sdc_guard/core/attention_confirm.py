"""Exact confirmation of the attention screen's suspects (``sdc_guard.core.attention``).

Like ``sdc_guard.core.confirm`` for GEMMs: a flagged row is recomputed in fp64 from the
op's inputs (every product of two bf16 / fp16 / fp32 values is exact in fp64) and each of
its elements is compared with a rigorous bound of what a correct kernel could have
produced; only an element outside its bound (or a non-finite element no legitimate
overflow explains) confirms a corruption. A suspect that is cleared is a screen miss:
counted, never acted on. docs/ATTENTION.md, "Confirmation", gives the bound.

The unit of work is a stacked head (one batch element and key/value head with its group
of query heads): ``O`` / ``dQ`` rows need their own softmax row, but a ``dK`` / ``dV`` row
sums over every query row, so the head's ``P`` and ``dS`` are recomputed whole, in fp64,
and the flagged rows read from them. Up to ``HOST_HEADS`` heads per call where the flags
are on the host (worst ratio first), ``DEVICE_HEADS`` on an accelerator chosen with
``torch.topk`` (no host synchronisation); a suspect in a head beyond the limit is
unconfirmed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import (AttentionOperands, BackwardCheck, RowCheck, chunk_mask, grad_terms, rounding_model,
                        softmax_rows)
from .confirm import gamma
from .precision import TINY

HOST_HEADS = 16
DEVICE_HEADS = 4
_U32 = 2.0**-24
_U64 = 2.0**-53
_FTZ = 2.0**-126
_SLACK = 1.0 + 2.0**-20


@dataclass(frozen=True)
class RowConfirmation:
    """Per row of one output (the screen's layout): ``sdc`` confirmed corrupted,
    ``overflow`` non-finite where a legitimate overflow is possible, ``examined``."""

    sdc: Tensor
    overflow: Tensor
    examined: Tensor


def _stack(x: Tensor, hkv: int) -> Tensor:
    b, h, n, d = x.shape
    return x.reshape(b * hkv, (h // hkv) * n, d)


def _pick(cands: list[Tensor], scores: list[Tensor], n: int, on_host: bool,
          limit: int | None) -> tuple[Tensor, Tensor]:
    """Stacked heads to examine (``[n]`` candidate rows reduced per head), and whether
    each picked one holds a suspect; on the host at most ``limit`` (``None``: all)."""
    flagged = torch.stack([c.reshape(n, -1).any(-1) for c in cands]).any(0)
    score = torch.stack([torch.where(c, s.nan_to_num(nan=float("inf")), -1.0).reshape(n, -1).amax(-1)
                         for c, s in zip(cands, scores)]).amax(0)
    if on_host:
        picked = torch.nonzero(flagged).flatten()
        if limit is not None and picked.numel() > limit:
            picked = picked[score[picked].argsort(descending=True)[:limit]]
        return picked, torch.ones(picked.shape, dtype=torch.bool, device=flagged.device)
    picked = torch.topk(score, min(DEVICE_HEADS, n)).indices
    return picked, flagged[picked]


def _verdict(got: Tensor, exact: Tensor, bound: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per row: (some element is wrong, some element is a legitimate overflow)."""
    finite = torch.isfinite(got)
    may_overflow = (exact.abs() + bound) > torch.finfo(dtype).max
    wrong = torch.where(finite, (got - exact).abs() > bound, ~may_overflow)
    return wrong.any(-1), (~finite & may_overflow).any(-1)


def _scatter(n_rows: tuple[int, ...], picked: Tensor, live: Tensor, values: Tensor, cand: Tensor,
             n: int) -> Tensor:
    """Rows of the picked heads (``[F, R]``) back into the screen's layout, kept only
    where the screen had a suspect."""
    out = torch.zeros((n, values.shape[-1]), dtype=torch.bool, device=values.device)
    out[picked] = values & live.unsqueeze(-1)
    return out.reshape(n_rows) & cand


def _result(shape: tuple[int, ...], picked: Tensor, live: Tensor, wrong: Tensor, over: Tensor, cand: Tensor,
            n: int) -> RowConfirmation:
    examined = _scatter(shape, picked, live, torch.ones_like(wrong), cand, n)
    sdc = _scatter(shape, picked, live, wrong, cand, n)
    return RowConfirmation(sdc, _scatter(shape, picked, live, over & ~wrong, cand, n), examined)


def _empty(cand: Tensor) -> RowConfirmation:
    none = torch.zeros_like(cand)
    return RowConfirmation(none, none, none)


def _tail(err: Tensor, magnitude: Tensor, terms: int, out_rounding: float, floor: Tensor | float) -> Tensor:
    """The kernel's fp32 accumulation over ``terms`` and its scaling (``gamma + u32``),
    the output's rounding(s) (``out_rounding`` of ``magnitude``, the element's sum of
    absolute terms, plus the errors so far), the underflow floor, the bound's slack."""
    err = err * (1 + gamma(terms, _U32)) * (1 + _U32)
    return (err + (magnitude + err) * out_rounding + floor) * _SLACK


def confirm_forward(ops: AttentionOperands, out: Tensor, check: RowCheck, on_host: bool | None = None,
                    limit: int | None = HOST_HEADS) -> RowConfirmation:
    """Settle the forward screen's suspects of ``out`` exactly (never writes an input).
    ``limit``: at most this many stacked heads examined on the host, worst first
    (``None``: every one, as ``sdc-guard bench detect --attention`` asks)."""
    b, hq, hkv, l, s, d, dv = ops.dims
    n = b * hkv
    on_host = out.device.type == "cpu" if on_host is None else on_host
    cand = ~check.ok & ~check.inputs_bad
    picked, live = _pick([cand], [check.ratio], n, on_host, limit)
    if picked.numel() == 0:
        return _empty(cand)
    rnd = rounding_model(ops.q.dtype, ops.q.device)
    q = _stack(ops.q, hkv).index_select(0, picked).double()
    k = ops.k.reshape(n, s, d).index_select(0, picked).double()
    v = ops.v.reshape(n, s, dv).index_select(0, picked).double()
    got = _stack(out, hkv).index_select(0, picked).double()
    sm = softmax_rows(q, k, chunk_mask(ops, picked, torch.float64), ops.scale, rnd, copies=1)
    exact, absum = torch.bmm(sm.p, v), torch.bmm(sm.p, v.abs())
    rel = (sm.rho + rnd.p * (1 + sm.rho)).unsqueeze(-1)
    own = gamma(2 * (d + s) + 64, _U64) * absum
    floor = TINY[out.dtype] + (2 * s + 2) * _FTZ + rnd.tiny * v.abs().sum(-2, keepdim=True)
    bound = _tail(rel * absum, absum, s, rnd.out, floor) + own
    wrong, over = _verdict(got, exact, bound, out.dtype)
    wrong = wrong & ~sm.bad
    shape = (b, hq, l)
    return _result(shape, picked, live, wrong, over, cand.reshape(shape), n)


def confirm_backward(ops: AttentionOperands, grad_out: Tensor, out: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
                     check: BackwardCheck, on_host: bool | None = None,
                     limit: int | None = HOST_HEADS) -> tuple[RowConfirmation, ...]:
    """Settle the backward screen's suspects exactly: (dq, dk, dv) confirmations;
    ``limit`` as in ``confirm_forward``."""
    b, hq, hkv, l, s, d, dvd = ops.dims
    n = b * hkv
    on_host = dq.device.type == "cpu" if on_host is None else on_host
    cands = [~c.ok & ~c.inputs_bad for c in (check.dq, check.dk, check.dv)]
    picked, live = _pick(cands, [c.ratio for c in (check.dq, check.dk, check.dv)], n, on_host, limit)
    if picked.numel() == 0:
        return tuple(_empty(c) for c in cands)
    rnd = rounding_model(ops.q.dtype, ops.q.device)
    q, do, o, gq = (_stack(t, hkv).index_select(0, picked).double() for t in (ops.q, grad_out, out, dq))
    k, v, gk, gv = (t.reshape(n, s, t.shape[-1]).index_select(0, picked).double() for t in (ops.k, ops.v, dk, dv))
    gl = q.shape[1]
    sm = softmax_rows(q, k, chunk_mask(ops, picked, torch.float64), ops.scale, rnd, copies=1)
    p = sm.p
    delta = (do * o).sum(-1, keepdim=True)
    ds = torch.bmm(do, v.transpose(-1, -2)).sub_(delta).mul_(p)
    ds_abs = ds.abs()
    vmax = v.norm(dim=-1).amax(-1, keepdim=True)
    kappa, beta, flush = grad_terms(do, o, vmax, sm, rnd, dvd, copies=1)
    w = (do.norm(dim=-1) * (vmax + o.norm(dim=-1))).unsqueeze(-1)
    own = gamma(2 * (d + dvd + s + gl) + 64, _U64)
    sc = abs(ops.scale)
    qa, ka, doa = q.abs(), k.abs(), do.abs()
    # dQ = scale dS K
    exact_q = torch.bmm(ds, k) * ops.scale
    ds_k, p_k = torch.bmm(ds_abs, ka), torch.bmm(p, ka)
    err_q = sc * (kappa.unsqueeze(-1) * ds_k + beta.unsqueeze(-1) * p_k + flush.unsqueeze(-1) * ka.sum(-2, keepdim=True))
    bound_q = _tail(err_q, sc * ds_k, s, rnd.grad_rounding(s), TINY[dq.dtype] + (2 * s + 2) * _FTZ) + own * sc * (ds_k + w * p_k)
    # dK = scale dS^T Q, dV = P^T dO (the group's rows summed)
    exact_k = torch.bmm(ds.transpose(-1, -2), q) * ops.scale
    dst_q = torch.bmm(ds_abs.transpose(-1, -2), qa)
    err_k = sc * (torch.bmm(ds_abs.transpose(-1, -2), kappa.unsqueeze(-1) * qa)
                  + torch.bmm(p.transpose(-1, -2), beta.unsqueeze(-1) * qa) + (flush.unsqueeze(-1) * qa).sum(-2, keepdim=True))
    bound_k = _tail(err_k, sc * dst_q, gl, rnd.grad_rounding(gl), TINY[dk.dtype] + (2 * gl + 2) * _FTZ) \
        + own * sc * (dst_q + torch.bmm(p.transpose(-1, -2), w * qa))
    exact_v = torch.bmm(p.transpose(-1, -2), do)
    pt_do = torch.bmm(p.transpose(-1, -2), doa)
    rel = (sm.rho + rnd.p * (1 + sm.rho)).unsqueeze(-1)
    err_v = torch.bmm(p.transpose(-1, -2), rel * doa)
    bound_v = _tail(err_v, pt_do, gl, rnd.grad_rounding(gl), TINY[dv.dtype] + (2 * gl + 2) * _FTZ + rnd.tiny * doa.sum(-2, keepdim=True)) \
        + own * pt_do
    bad_rows = sm.bad | ~torch.isfinite(do).all(-1) | ~torch.isfinite(o).all(-1)
    group_bad = bad_rows.any(-1, keepdim=True)
    wq, oq = _verdict(gq, exact_q, bound_q, dq.dtype)
    wk, ok_ = _verdict(gk, exact_k, bound_k, dk.dtype)
    wv, ov = _verdict(gv, exact_v, bound_v, dv.dtype)
    return (_result((b, hq, l), picked, live, wq & ~bad_rows, oq, cands[0].reshape(b, hq, l), n),
            _result((b, hkv, s), picked, live, wk & ~group_bad, ok_, cands[1], n),
            _result((b, hkv, s), picked, live, wv & ~group_bad, ov, cands[2], n))
