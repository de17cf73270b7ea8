"""The ``cpu`` backend: V-ABFT (VABFT.md) in one native call per verification.

Why: the portable torch path (``abft.vabft_check``) costs 30-40 torch ops per check, each
a few microseconds plus a fork / join of the intra-op threads, and reads the operands in
several passes; on CPU that is 0.5-1.2 ms per training-sized GEMM where reading the
operands takes 0.1 ms, and 15 % of a 1 ms decode matmul. The C kernels of ``csrc/``
(``csrc/vabft_cpu.h`` maps its files; built at install time as ``sdc_guard._vabft_cpu``,
optional) read ``A`` and ``C`` once, and ``B`` once for the weight side, in any layout,
with bf16 / fp16 converted a block at a time, and compute D, T and the verdict of every
(row, segment) in the same call. What stays in Python is the argument marshalling below, kept to a few
microseconds (``tests/test_native.py`` and ``sdc-guard bench overhead`` measure it).

Contract: the same ``AbftCheck`` as the torch backend up to float rounding (the tests
assert the Triton kernel's agreement criteria: identical verdicts, T within 1e-4
relative, D within 5 % of T), and a ``WeightSide`` that every backend and the cache
accept. Per-row results are bit-identical whatever M, the batch and the thread count
(batch invariance). Non-finite inputs: where any segment fails or anything is non-finite,
the explanation masks are built by ``abft.explain_failures`` from the row statistics the
kernel returns, the same code the torch backend runs.

Not covered (``rejects`` says so and the dispatcher falls to ``torch``): non-CPU
tensors, dtypes other than bf16 / fp16 / fp32, empty operands, a checksum weight that is
not a vector of N, batch dims that need more than two strides to walk without a copy.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import Tensor

from .batching import batch_strides, collapse_batch, contiguous_strides
from .abft import AbftCheck, WeightSide, _bias_sums, effective_e_max, explain_failures, weight_side
from .precision import SEGMENT, TINY, bias_rounding
from .segments import _segment_constants

__all__ = ["available", "native_check", "native_weight_side", "rejects", "thread_runtime", "unavailable_reason"]

#: dtype -> the kernel's dtype code
_DT: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: constants per C dtype: (TINY, bias_rounding)
_C_CONST: dict[torch.dtype, tuple[float, float]] = {dt: (TINY[dt], bias_rounding(dt)) for dt in _DT}

@functools.cache
def _import() -> tuple[types.ModuleType | None, str | None]:
    """The extension, imported once, or why it is missing."""
    try:
        from . import _vabft_cpu  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, (f"native extension sdc_guard._vabft_cpu is not built ({exc}); "
                      "reinstall with a C compiler (pip install -e .)")
    return _vabft_cpu, None


def _load() -> types.ModuleType | None:
    return _import()[0]


def unavailable_reason() -> str | None:
    """``None`` when the native kernels are importable, else why not (one line)."""
    return _import()[1]


def available() -> bool:
    """Whether the native kernels are importable in this process."""
    return _load() is not None


def thread_runtime() -> str | None:
    """The OpenMP runtime the kernels split large calls on: torch's own pool, borrowed so
    that its spinning workers take the work instead of competing with new threads
    (``csrc/parallel.c``). ``""`` when they use pthreads (no OpenMP runtime is loaded, or
    ``SDC_GUARD_NATIVE_OPENMP=0``), ``None`` without the extension."""
    ext = _load()
    return None if ext is None else ext.runtime()


# --- weight side -----------------------------------------------------------------------

def _weight_reason(b: Tensor, checksum_weight: Tensor | None) -> str | None:
    if b.device.type != "cpu":
        return f"b is on {b.device.type}, the native kernels run on cpu"
    if b.dtype not in _DT:
        return f"b: dtype {b.dtype} is not bfloat16, float16 or float32"
    if b.dim() < 2 or b.numel() == 0:
        return "b: empty or not a matrix"
    if checksum_weight is not None and (checksum_weight.device.type != "cpu" or checksum_weight.shape != b.shape[-1:]):
        return "checksum_weight: not a CPU vector of N"
    if b.dim() > 3 and collapse_batch(b.shape[:-2], [list(b.stride()[:-2])]) is None:
        return "b: batch dims that one stride cannot walk"
    return None


def _checksum32(checksum_weight: Tensor | None) -> Tensor | None:
    if checksum_weight is None:
        return None
    return checksum_weight.detach().to(torch.float32).contiguous()


def native_weight_side(b: Tensor, checksum_weight: Tensor | None = None, threads: int | None = None,
                       force_threads: bool = False) -> WeightSide:
    """``abft.weight_side`` in one native call: one read of ``b`` (``[..., K, N]``, any
    strides), split over ``threads`` (default ``torch.get_num_threads()``) threads when
    large (``OMP_MIN`` / ``PAR_MIN`` elements, see ``native_check``), or always when ``force_threads`` (tests).

    Returns a ``WeightSide`` with ``br`` segment-major (as ``abft`` stores it) and its
    threshold factors precomputed; inputs the kernels do not cover are encoded by
    ``abft.weight_side``. Never writes to ``b``.
    """
    ext = _load()
    if ext is None or _weight_reason(b, checksum_weight) is not None:
        return weight_side(b, checksum_weight)
    enc = _encode(ext, b, _checksum32(checksum_weight), _threads(threads, force_threads))
    if enc is None:
        return weight_side(b, checksum_weight)
    return _weight_side_of(b, *enc)


def _ws_batch(b: Tensor) -> tuple[int, int] | None:
    """(batch count, batch stride) of ``b`` for the kernel, or ``None`` (two strides)."""
    bshape = b.shape[:-2]
    if len(bshape) <= 1:
        return (bshape[0], b.stride(0)) if bshape else (1, 0)
    collapsed = collapse_batch(bshape, [list(b.stride()[:-2])])
    assert collapsed is not None
    (size0, size1), ((s0, s1),) = collapsed
    if size0 != 1:  # two strides: encode each leading slice by itself would cost more code than it saves
        return None
    return size1 * size0, s1


def _encode(ext: types.ModuleType, b: Tensor, r: Tensor | None, threads: int) -> tuple[Tensor, float] | None:
    """The weight side of ``b`` into one new buffer (``_weight_side_of`` takes it apart):
    ``Br`` [bt, nseg, K], max and min [2, bt, nseg, K], the 8 aggregate planes
    [8, bt, nseg] (fp32) and ``bad`` [bt, nseg] (bytes); with ``mu_scale``."""
    bb = _ws_batch(b)
    if bb is None:
        return None
    bt, sbb = bb
    k, n = b.shape[-2], b.shape[-1]
    nseg = -(-n // SEGMENT)
    big, small = bt * nseg * k, bt * nseg
    buf = torch.empty(4 * (3 * big + 8 * small) + small, dtype=torch.uint8)
    p = buf.data_ptr()
    mu_scale = ext.weight_side(
        b.data_ptr(), _DT[b.dtype], bt, k, n, sbb, b.stride(-2), b.stride(-1),
        r.data_ptr() if r is not None else 0, p, p + 4 * big, p + 8 * big,
        p + 12 * big, p + 4 * (3 * big + 8 * small), threads,
    )
    return buf, mu_scale


def _weight_side_of(b: Tensor, buf: Tensor, mu_scale: float) -> WeightSide:
    """The ``WeightSide`` of an ``_encode`` buffer: ``br`` segment-major (as ``abft``
    stores it) and its threshold factors precomputed."""
    k, n = b.shape[-2], b.shape[-1]
    nseg = -(-n // SEGMENT)
    bshape = tuple(b.shape[:-2])
    big = nseg * k
    for size in bshape:
        big *= size
    small = big // k
    # few torch calls (each costs a microsecond or two; this runs once per encoding):
    # one unbind for the eight aggregate planes, one for the four factor views
    nfloat = 3 * big + 8 * small
    floats = buf[: 4 * nfloat].view(torch.float32)
    br = floats[:big].view(*bshape, nseg, k)
    agg = floats[3 * big:].view(8, *bshape, nseg)
    p1, p2, v, col_norm = agg[:4].unbind(0)
    bad = buf[4 * nfloat:].view(torch.bool).view(*bshape, nseg)
    widths = _segment_constants(n, b.device)[0]
    ws = WeightSide(br.mT, p1, p2, v, col_norm, bad, widths, k, n)
    # the factors of the threshold's bracket, computed by the kernel exactly as
    # WeightSide._factors computes them (a cached_property: its slot is the instance dict)
    ws.__dict__["_factors"] = (*agg[4:].unsqueeze(-2).unbind(0), float(mu_scale))
    return ws


class _Prepared:
    """What the check needs of a ``WeightSide``, taken once per encoding (its tensors stay
    alive with it): pointers, shapes and strides of ``Br`` and of the four factors."""

    __slots__ = ("br", "br_ptr", "br_shape", "br_strides", "sbrs", "factors", "f_ptrs", "f_shape",
                 "f_strides", "mu_scale", "flat")

    def __init__(self, ws: WeightSide) -> None:
        br = ws.br
        if br.shape[-2] > 1 and br.stride(-2) != 1:
            br = br.mT.contiguous().mT  # segment-major, as the kernel reads it
        f_mean, f_cross_mu, f_cross_sd, f_spread, mu_scale = ws._factors
        factors = [f.contiguous() for f in torch.broadcast_tensors(f_mean, f_cross_mu, f_cross_sd, f_spread)]
        self.br, self.factors = br, factors
        self.br_ptr = br.data_ptr()
        self.br_shape, self.br_strides = tuple(br.shape), tuple(br.stride())
        self.sbrs = br.stride(-1)
        self.f_ptrs = tuple(f.data_ptr() for f in factors)
        self.f_shape, self.f_strides = tuple(factors[0].shape), tuple(factors[0].stride())
        self.mu_scale = float(mu_scale)
        self.flat = br.dim() == 2 and factors[0].dim() == 2  #: no batch dims


def _prepared(ws: WeightSide) -> _Prepared:
    prep = ws.__dict__.get("_native")
    if prep is None:
        prep = ws.__dict__["_native"] = _Prepared(ws)
    return prep


# --- check -----------------------------------------------------------------------------

def rejects(req: object) -> str | None:
    """``None`` when the native kernels cover ``req`` (a ``backends.GemmRequest``), else
    why not (one line). Pure Python: nothing is allocated or read."""
    a, b, c = req.a, req.b, req.c  # type: ignore[attr-defined]
    for name, t in (("a", a), ("b", b), ("c", c)):
        if t.device.type != "cpu":
            return f"{name} is on {t.device.type}, the native kernels run on cpu"
        if t.dtype not in _DT:
            return f"{name}: dtype {t.dtype} is not bfloat16, float16 or float32"
    if a.numel() == 0 or b.numel() == 0 or c.numel() == 0:
        return "empty operand: nothing for the kernels to verify"
    bias = req.bias  # type: ignore[attr-defined]
    if bias is not None and req.beta != 0.0:  # type: ignore[attr-defined]
        if bias.device.type != "cpu" or bias.dtype not in _DT:
            return f"bias: {bias.dtype} on {bias.device.type} is not a CPU bf16 / fp16 / fp32 tensor"
    r = req.checksum_weight  # type: ignore[attr-defined]
    if r is not None and (r.device.type != "cpu" or r.shape != c.shape[-1:]):
        return "checksum_weight: not a CPU vector of N"
    if c.dim() > 2 and _layout(req, req.weight) is None:  # type: ignore[attr-defined]
        return "batch dims that need more than two strides to walk without a copy"
    return None


def _layout(req: object, ws: WeightSide | None) -> tuple[list[int], list[list[int]]] | None:
    """Batch sizes and strides (A, C, bias, Br, factors) of a batched call, or ``None``."""
    a, c, bias = req.a, req.c, req.bias  # type: ignore[attr-defined]
    batch = c.shape[:-2]
    if ws is not None:
        prep = _prepared(ws)
        br_shape, br_strides, f_shape, f_strides = prep.br_shape, prep.br_strides, prep.f_shape, prep.f_strides
    else:  # what native_weight_side produces for b
        b = req.b  # type: ignore[attr-defined]
        bb = tuple(b.shape[:-2])
        nseg = -(-b.shape[-1] // SEGMENT)
        br_shape, f_shape = (*bb, b.shape[-2], nseg), (*bb, 1, nseg)
        *outer, seg_stride, k_stride = contiguous_strides((*bb, nseg, b.shape[-2]))
        br_strides = (*outer, k_stride, seg_stride)
        f_strides = contiguous_strides(f_shape)
    per = [
        batch_strides(a.shape, a.stride(), batch, 2),
        batch_strides(c.shape, c.stride(), batch, 2),
        batch_strides(bias.shape, bias.stride(), batch, 2) if bias is not None and bias.dim() > 2 else [0] * len(batch),
        batch_strides(br_shape, br_strides, batch, 2),
        batch_strides(f_shape, f_strides, batch, 2),
    ]
    return collapse_batch(batch, per)


def _bias_args(bias: Tensor | None) -> tuple[int, int, int, int]:
    """Pointer, dtype code and (row, column) strides of the bias as the kernel reads it:
    0 strides where it broadcasts; all 0 without a bias."""
    if bias is None:
        return 0, 0, 0, 0
    bias_v = bias.reshape(1) if bias.dim() == 0 else bias
    if bias_v.dim() == 1:
        sbm, sbn = 0, (bias_v.stride(0) if bias_v.shape[0] != 1 else 0)
    else:
        sbm = bias_v.stride(-2) if bias_v.shape[-2] != 1 else 0
        sbn = bias_v.stride(-1) if bias_v.shape[-1] != 1 else 0
    return bias_v.data_ptr(), _DT[bias_v.dtype], sbm, sbn


def _threads(threads: int | None, force: bool) -> int:
    """The kernel's thread argument: at most ``threads``; negative forces the split."""
    n = max(1, torch.get_num_threads() if threads is None else threads)
    return -n if force else n


def native_check(req: object, threads: int | None = None, force_threads: bool = False) -> AbftCheck | None:
    """Verify ``req`` (a ``backends.GemmRequest``) in one native call; ``None`` where the
    kernels do not cover it (the caller then runs the torch path).

    Uses ``req.weight`` when given (any backend's encoding), else encodes ``b`` in a
    scratch buffer first (the same kernel as ``native_weight_side``, without building
    a ``WeightSide`` unless a segment fails).
    ``threads``: at most this many (default ``torch.get_num_threads()``); the kernel
    uses one below ``OMP_MIN`` elements read on torch's OpenMP pool (``PAR_MIN`` with
    pthreads) unless ``force_threads`` (tests). Never
    writes to an input.
    """
    ext = _load()
    if ext is None:
        return None
    a, c = req.a, req.c  # type: ignore[attr-defined]
    ws = req.weight  # type: ignore[attr-defined]
    r = _checksum32(req.checksum_weight)  # type: ignore[attr-defined]
    m, n, k = c.shape[-2], c.shape[-1], a.shape[-1]
    nseg = -(-n // SEGMENT)
    enc = None
    if ws is None:
        # cold: the weight side into one scratch buffer, no WeightSide unless a segment
        # fails (explain_failures needs one)
        b = req.b  # type: ignore[attr-defined]
        if _weight_reason(b, req.checksum_weight) is None:  # type: ignore[attr-defined]
            enc = _encode(ext, b, r, _threads(threads, force_threads))
        if enc is None:
            ws = native_weight_side(b, req.checksum_weight)  # type: ignore[attr-defined]
    if enc is not None:
        buf, mu_scale = enc
        kw = b.shape[-2]
        big = kw * nseg * (b.numel() // (kw * b.shape[-1]))
        small = big // kw
        p = buf.data_ptr()
        br_ptr, sbrs, flat = p, kw, b.dim() == 2
        f_mean, f_cross_mu, f_cross_sd, f_spread = (p + 4 * (3 * big + j * small) for j in range(4, 8))
    else:
        prep = _prepared(ws)
        br_ptr, sbrs, flat, mu_scale, kw = prep.br_ptr, prep.sbrs, prep.flat, prep.mu_scale, ws.k
        f_mean, f_cross_mu, f_cross_sd, f_spread = prep.f_ptrs
    alpha, beta = req.alpha, req.beta  # type: ignore[attr-defined]
    bias = req.bias if req.beta != 0.0 else None  # type: ignore[attr-defined]
    sa, sc = a.stride(), c.stride()
    if c.dim() == 2 and flat:
        batch: tuple[int, ...] = ()
        nb0 = nb1 = 1
        sa0 = sa1 = sc0 = sc1 = sb0 = sb1 = sbr0 = sbr1 = sf0 = sf1 = 0
    else:
        batch = tuple(c.shape[:-2])
        layout = _layout(req, ws)
        if layout is None:
            return None
        (nb0, nb1), ((sa0, sa1), (sc0, sc1), (sb0, sb1), (sbr0, sbr1), (sf0, sf1)) = layout
    bias_ptr, bias_dt, sbm, sbn = _bias_args(bias)
    shape = (*batch, m, nseg)
    vals = torch.empty((2, *shape), dtype=torch.float32)
    rows = torch.empty((3, *batch, m), dtype=torch.float32)
    flags = torch.empty((2, *shape), dtype=torch.bool)
    c_dtype = c.dtype
    tiny, bias_round = _C_CONST[c_dtype]
    all_ok, worst = ext.check(
        m, n, k, nb0, nb1,
        a.data_ptr(), _DT[a.dtype], sa0, sa1, sa[-2], sa[-1],
        c.data_ptr(), _DT[c_dtype], sc0, sc1, sc[-2], sc[-1],
        bias_ptr, bias_dt, sb0, sb1, sbm, sbn,
        r.data_ptr() if r is not None else 0,
        br_ptr, sbr0, sbr1, sbrs,
        f_mean, f_cross_mu, f_cross_sd, f_spread, sf0, sf1,
        mu_scale, abs(alpha) * effective_e_max(req.e_max, kw, c_dtype),  # type: ignore[attr-defined]
        alpha, beta, tiny, bias_round,
        vals.data_ptr(), rows.data_ptr(), flags.data_ptr(),
        _threads(threads, force_threads),
    )
    diff, threshold = vals
    if all_ok:  # every segment passed and everything is finite: nothing to explain
        return AbftCheck(flags[0], flags[1], flags[1], diff, threshold, clear=True, worst_ratio=worst)
    bias_sum = bias_abs = None
    if bias is not None:
        bias_sum, bias_abs = _bias_sums(bias, n, r, beta)
    mu, hi, lo = (t.unsqueeze(-1) for t in rows)
    if ws is None:
        ws = _weight_side_of(b, *enc)
    return explain_failures(flags[0], diff, threshold, k, mu, hi, lo, ws, alpha, c_dtype, bias_sum, bias_abs)
