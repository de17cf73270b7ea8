"""The attention screen (``sdc_guard.core.attention``) in native code, for CPU tensors.

Why: the torch screen builds ``S = Q K^T`` in fp32 for chunks of whole heads (up to 64
MB, far outside the caches) and passes over it several times (mask, row maximum, exp,
sums, products), while the CPU flash kernel it checks works in cache-sized blocks: on
CPU the screen cost 2-10 times the op. The C kernels of ``csrc/attn*`` (``csrc/attn.h``
says how) compute, per block of 16 query rows, the strip ``S[16, keys]`` with a
register-blocked micro-kernel (causal rows stop at the diagonal), then the row maxima,
the exps and every sum the identities and the thresholds need, in cache, on the ISA the
CPU has (AVX-512, AVX2, plain C: chosen at run time, identical bits). Nothing of size
``L x S`` is ever written.

Contract: the same ``RowCheck`` / ``BackwardCheck`` as ``forward_screen`` /
``backward_screen`` up to fp32 rounding (the per-row formulas are the same, evaluated
in fp64 from the same per-call constants, ``core.attention.threshold_constants``; the sums
are fp32 in another order): thresholds within 1e-4 relative, identical verdicts away
from the boundary (tests/unit/backends/test_native_attention.py). The torch screen remains the
reference and the fallback: ``rejects`` says what the kernels do not cover.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.attention import AttentionOperands, BackwardCheck, RowCheck, threshold_constants
from . import native
from .native import available, unavailable_reason
from .native_call import DTYPE_CODE

__all__ = ["ISA", "attention_isa", "available", "native_backward_screen", "native_exp", "native_forward_screen",
           "rejects", "unavailable_reason"]

#: ISA names -> the kernels' codes (``"auto"``: the best this CPU runs)
ISA: dict[str, int] = {"auto": 0, "generic": 1, "avx2": 2, "avx512": 3}
#: mask dtype -> the kernels' code (float64 masks are read as fp32, as the torch screen does)
_MASK_CODE: dict[torch.dtype, int] = {**DTYPE_CODE, torch.bool: 3}
#: the order of ``csrc/attn.h``'s AC_ constants
_CONSTANTS = ("scale", "ecoef", "g2s", "p", "tiny", "tail", "floor", "out", "uprod", "gdv", "tail_q", "tail_kv",
              "tail_v", "fq", "fk", "fv", "out_q", "out_k", "out_v", "blk_q", "blk_kv")


def _ext() -> object | None:
    """The extension (looked up on each call: the ISA test swaps in another build)."""
    return native._import()[0]


def attention_isa(isa: str = "auto") -> str | None:
    """The name of the kernels ``isa`` selects on this CPU (``"auto"``: the best it runs),
    ``None`` when it cannot run them or the extension is missing."""
    ext = _ext()
    if ext is None:
        return None
    if isa not in ISA:
        raise ValueError(f"isa: expected one of {sorted(ISA)}, received {isa!r}")
    return ext.attn_isa(ISA[isa])


def rejects(ops: AttentionOperands, *tensors: Tensor) -> str | None:
    """``None`` when the kernels cover ``ops`` with ``tensors`` (the outputs and, in the
    backward, ``grad_out``), else why not (one line). Pure Python."""
    for name, t in (("q", ops.q), ("k", ops.k), ("v", ops.v), *((f"tensor {i}", t) for i, t in enumerate(tensors))):
        if t.device.type != "cpu":
            return f"{name} is on {t.device.type}, the native kernels run on cpu"
        if t.dtype not in DTYPE_CODE:
            return f"{name}: dtype {t.dtype} is not bfloat16, float16 or float32"
    if any(n == 0 for n in ops.dims):
        return "an empty dimension: nothing for the kernels to verify"
    m = ops.mask
    if m is not None and (m.device.type != "cpu" or (m.dtype not in _MASK_CODE and m.dtype != torch.float64)):
        return f"mask: {m.dtype} on {m.device.type} is not a CPU bool or float mask"
    return None


def _args(t: Tensor | None) -> tuple[Tensor | None, list[int]]:
    """A ``[B, H, R, C]`` tensor's kernel arguments (data, dtype, three strides), its rows
    made contiguous first where they are not."""
    if t is None:
        return None, [0, 0, 0, 0, 0]
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t, [t.data_ptr(), DTYPE_CODE[t.dtype], t.stride(0), t.stride(1), t.stride(2)]


def _mask_args(ops: AttentionOperands) -> tuple[Tensor | None, list[int]]:
    """The mask broadcast to ``[B, Hq, L, S]`` with key stride 1 (only a mask broadcast
    along the keys, or strided there, is copied: its other dims stay broadcast)."""
    m = ops.mask
    if m is None:
        return None, [0, 0, 0, 0, 0]
    b, hq, _, l, s, _, _ = ops.dims
    if m.dtype == torch.float64:
        m = m.float()
    if m.shape[-1] != s or (m.stride(-1) != 1 and s > 1):
        m = m.expand(*m.shape[:-1], s).contiguous()
    m = m.expand(b, hq, l, s)
    return m, [m.data_ptr(), _MASK_CODE[m.dtype], m.stride(0), m.stride(1), m.stride(2)]


def _run(ext: object, bwd: bool, ops: AttentionOperands, tensors: list[Tensor | None], consts: dict[str, float],
         out: Tensor, flags: Tensor, isa: int, threads: int | None) -> bool:
    b, hq, hkv, l, s, d, dv = ops.dims
    keep, flat = [], []
    for t in tensors:
        t, a = _args(t)
        keep.append(t)
        flat += a
    mask, margs = _mask_args(ops)
    n = max(1, torch.get_num_threads() if threads is None else threads)
    return ext.attn(int(bwd), isa, n, b, hq, hkv, l, s, d, dv, int(ops.causal), *flat, *margs, out.data_ptr(),  # type: ignore[attr-defined]
                    flags.data_ptr(), *(float(consts.get(k, 0.0)) for k in _CONSTANTS))


def native_forward_screen(ops: AttentionOperands, out: Tensor, isa: str = "auto",
                          threads: int | None = None) -> RowCheck | None:
    """``core.attention.forward_screen(ops, out)`` in one native call; ``None`` where the
    kernels do not cover the call (``rejects``) or the extension is missing. ``isa``
    forces the kernels of one ISA (tests; ``ValueError`` when this CPU lacks it),
    ``threads`` caps the threads (default ``torch.get_num_threads()``)."""
    ext = _ext()
    if ext is None or rejects(ops, out) is not None:
        return None
    b, hq, _, l, _, _, _ = ops.dims
    n = b * hq * l
    vals = torch.empty(2 * n, dtype=torch.float32)
    flags = torch.empty(2 * n, dtype=torch.uint8)
    _run(ext, False, ops, [ops.q, ops.k, ops.v, out, None, None, None, None], threshold_constants(ops, out.dtype),
         vals, flags, _isa_code(isa), threads)
    diff, thr = (t.view(b, hq, l) for t in vals.view(2, n))
    ok, bad = (t.view(b, hq, l) for t in flags.view(torch.bool).view(2, n))
    return RowCheck(diff, thr, ok, bad)


def native_backward_screen(ops: AttentionOperands, grad_out: Tensor, out: Tensor, dq: Tensor, dk: Tensor,
                           dv: Tensor, isa: str = "auto", threads: int | None = None) -> BackwardCheck | None:
    """``core.attention.backward_screen`` in one native call (two parallel passes); ``None``
    where the kernels do not cover the call. ``isa`` and ``threads`` as in
    ``native_forward_screen``."""
    ext = _ext()
    if ext is None or rejects(ops, grad_out, out, dq, dk, dv) is not None:
        return None
    b, hq, hkv, l, s, _, _ = ops.dims
    nq, nk = b * hq * l, b * hkv * s
    vals = torch.empty(2 * nq + 4 * nk, dtype=torch.float32)
    flags = torch.empty(2 * nq + 3 * nk, dtype=torch.uint8)
    consts = threshold_constants(ops, out.dtype, (dq.dtype, dk.dtype, dv.dtype))
    _run(ext, True, ops, [ops.q, ops.k, ops.v, out, grad_out, dq, dk, dv], consts, vals, flags, _isa_code(isa),
         threads)
    qd, qt = (t.view(b, hq, l) for t in vals[: 2 * nq].view(2, nq))
    kd, kt, vd, vt = (t.view(b, hkv, s) for t in vals[2 * nq:].view(4, nk))
    fl = flags.view(torch.bool)
    qok, qbad = (t.view(b, hq, l) for t in fl[: 2 * nq].view(2, nq))
    kok, vok, kvbad = (t.view(b, hkv, s) for t in fl[2 * nq:].view(3, nk))
    return BackwardCheck(RowCheck(qd, qt, qok, qbad), RowCheck(kd, kt, kok, kvbad), RowCheck(vd, vt, vok, kvbad))


def native_exp(x: Tensor, isa: str = "auto") -> Tensor | None:
    """``exp`` of a contiguous fp32 CPU tensor as the kernels of ``isa`` compute it (what
    the accuracy test and measurement check); ``None`` without the extension."""
    ext = _ext()
    if ext is None:
        return None
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x: expected a float32 CPU tensor, received {x.dtype} on {x.device.type}")
    x = x.contiguous()
    y = torch.empty_like(x)
    ext.attn_exp(x.data_ptr(), y.data_ptr(), x.numel(), _isa_code(isa))  # type: ignore[attr-defined]
    return y


def _isa_code(isa: str) -> int:
    if isa not in ISA:
        raise ValueError(f"isa: expected one of {sorted(ISA)}, received {isa!r}")
    return ISA[isa]
