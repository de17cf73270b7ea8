"""The guard's clear checks on the native kernels, planned once per layout.

Why: a training step runs the same GEMMs, with the same shapes, strides and dtypes, step
after step; only the data pointers change. ``native.native_clear`` works out the ~50
integers of ``ext.check`` from a ``GemmRequest`` on every call (``native_call.Call``:
batch strides, dtype codes, threshold constants, an encoding's offsets), and right after
a large product, when the caches hold none of that Python, this marshalling cost about
as much as the kernel on small GEMMs (40 to 150 us a GEMM on a d_model 256 GPT, most of
the guard's Python there). A ``Plan`` is that work done once per layout: the argument
tuple of ``Call.args`` with the pointers left out, which each call fills in (the
tensors' ``data_ptr`` and the weight encoding's, or the scratch memory a cold ``b`` is
encoded into). Built from ``Call`` itself, so a planned call passes the kernels exactly
the arguments ``Call`` would (``tests/unit/backends/test_native.py`` compares them).

Covered: what ``native_clear`` covers without a checksum weight, where ``b`` is
encoded in place (a warm ``b`` from the weight cache, or a cold one the kernel walks
without a copy). Anything else (``None`` from ``plan_of``) takes ``native_clear``.
"""

from __future__ import annotations

import types
from typing import Any

from torch import Tensor

from ..core.abft import WeightSide
from ..core.precision import ScreenTerms
from ..core.request import GemmRequest
from .native_call import DTYPE_CODE, Call, buffer_offsets, factor_offsets, prepared

__all__ = ["Plan", "Plans"]

#: Plans kept per backend before the table is cleared (a run of many distinct shapes,
#: variable sequence lengths, must not grow it without bound).
MAX_PLANS = 4096
_MISSING = object()


class Plan:
    """``Call.args`` of one layout, split around its pointers (see the module doc)."""

    __slots__ = ("p0", "p1", "p2", "p3", "sbr", "sf", "tail", "cold", "ws_pre", "enc", "outputs", "nbytes")

    @classmethod
    def of(cls, call: Call, b: Tensor) -> "Plan | None":
        """The plan of ``call`` (made for a request of this layout), or ``None`` when its
        ``b`` would be copied before encoding (``native_call.walkable``)."""
        if call.r is not None:
            return None
        plan = cls()
        head = call.head
        plan.p0, plan.p1, plan.p2, plan.p3 = head[0:5], head[6:11], head[12:17], head[18:23]
        plan.sf = call.sf[2:]
        plan.sbr = call.sf[:2]
        plan.tail = call.tail
        plan.cold = call.encode is not None
        enc = 0
        if plan.cold:
            encoded, _, (bt, sbb) = call.encode  # type: ignore[misc]
            if encoded is not b:
                return None
            k, n = b.shape[-2], b.shape[-1]
            big = bt * call.nseg * k
            small = big // k
            offsets = buffer_offsets(big, small)
            plan.ws_pre = (DTYPE_CODE[b.dtype], bt, k, n, sbb, b.stride(-2), b.stride(-1), 0)
            # br, babs, hi, lo, agg, bad; then babs, sbrs and the four factors as the check reads them
            plan.enc = (offsets, offsets[1], k, factor_offsets(big, small))
            enc = call.enc_bytes + (-call.enc_bytes % 64)
        rows = call.nb * call.m
        segs = rows * call.nseg
        plan.outputs = (enc, enc + 8 * segs, enc + 8 * segs + 12 * rows)
        plan.nbytes = enc + 10 * segs + 12 * rows
        return plan

    def run(self, ext: types.ModuleType, p: int, a: Tensor, b: Tensor, c: Tensor, bias: Tensor | None,
            ws: WeightSide | None, threads: int) -> tuple[bool, float]:
        """Check, with the outputs (and a cold ``b``'s encoding) at ``p`` (``nbytes``):
        ``ext.check``'s (all passed and finite, worst D / T)."""
        if self.cold:
            (o_br, o_babs, o_hi, o_lo, o_agg, o_bad), babs, sbrs, (f0, f1, f2, f3) = self.enc
            ext.weight_side(b.data_ptr(), *self.ws_pre, p + o_br, p + o_babs, p + o_hi, p + o_lo, p + o_agg,
                            p + o_bad, threads)
            br, babs, fs = p, p + babs, (p + f0, p + f1, p + f2, p + f3)
        else:
            prep = ws.attached["native"]  # type: ignore[union-attr]
            br, babs, sbrs, fs = prep.br_ptr, prep.babs_ptr, prep.sbrs, prep.f_ptrs
        o_vals, o_rows, o_flags = self.outputs
        return ext.check(*self.p0, a.data_ptr(), *self.p1, c.data_ptr(), *self.p2,
                         bias.data_ptr() if bias is not None else 0, *self.p3, 0, br, babs, *self.sbr, sbrs, *fs,
                         *self.sf, *self.tail, p + o_vals, p + o_rows, p + o_flags, threads)


class Plans:
    """A backend's plans, by layout (``key``)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Plan | None] = {}

    def key(self, a: Tensor, b: Tensor, c: Tensor, bias: Tensor | None, alpha: float, beta: float,
            ws: WeightSide | None, e_max: float, rounding: ScreenTerms | None) -> tuple | None:
        """What a call's arguments depend on besides its pointers, or ``None`` for a call
        off the CPU (the kernels' device)."""
        if not (a.is_cpu and b.is_cpu and c.is_cpu):
            return None
        if bias is not None and beta != 0.0:
            if not bias.is_cpu:
                return None
            bias_key: Any = (bias.shape, bias.stride(), bias.dtype)
        else:
            bias_key = None
        if ws is None:  # cold: b's layout is walked
            return (a.shape, a.stride(), c.shape, c.stride(), a.dtype, c.dtype, bias_key, alpha, beta, e_max,
                    rounding, b.shape, b.stride(), b.dtype)
        prep = prepared(ws)  # warm: the encoding's layout is walked, b is not read
        return (a.shape, a.stride(), c.shape, c.stride(), a.dtype, c.dtype, bias_key, alpha, beta, e_max,
                rounding, b.dtype, prep.geometry, ws.k)

    def get(self, key: tuple, ext: types.ModuleType, a: Tensor, b: Tensor, c: Tensor, bias: Tensor | None,
            alpha: float, beta: float, ws: WeightSide | None, e_max: float, rounding: ScreenTerms | None,
            rejects: Any) -> Plan | None:
        """The plan for ``key`` (made from this call on a miss), or ``None`` where there
        is none (``rejects``, ``native.rejects``, refuses the call, or ``Plan.of``)."""
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            req = GemmRequest(a, b, c, e_max, bias=bias, alpha=alpha, beta=beta, weight=ws, rounding=rounding)
            call = Call.of(ext, req, 1) if rejects(req) is None else None
            plan = Plan.of(call, b) if call is not None else None
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan  # type: ignore[return-value]

