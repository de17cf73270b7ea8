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
import threading
import types

import torch
from torch import Tensor

from .batching import batch_strides, collapse_batch, contiguous_strides
from .abft import AbftCheck, WeightSide, _bias_sums, effective_e_max, explain_failures, weight_side
from .precision import SEGMENT, TINY, bias_rounding
from .segments import _segment_constants

__all__ = ["Scratch", "available", "native_check", "native_clear", "native_weight_side", "rejects", "thread_runtime", "unavailable_reason"]

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


def _encoding_bytes(bt: int, k: int, nseg: int) -> int:
    """Bytes of an encoding buffer (see ``_encode``)."""
    big, small = bt * nseg * k, bt * nseg
    return 4 * (3 * big + 8 * small) + small


def _encode_at(ext: types.ModuleType, b: Tensor, r: Tensor | None, threads: int, bb: tuple[int, int],
               p: int) -> float:
    """The weight side of ``b`` (batch count and stride ``bb``) into the buffer at ``p``;
    returns ``mu_scale``."""
    bt, sbb = bb
    k, n = b.shape[-2], b.shape[-1]
    nseg = -(-n // SEGMENT)
    big, small = bt * nseg * k, bt * nseg
    return ext.weight_side(
        b.data_ptr(), _DT[b.dtype], bt, k, n, sbb, b.stride(-2), b.stride(-1),
        r.data_ptr() if r is not None else 0, p, p + 4 * big, p + 8 * big,
        p + 12 * big, p + 4 * (3 * big + 8 * small), threads,
    )


def _encode(ext: types.ModuleType, b: Tensor, r: Tensor | None, threads: int) -> tuple[Tensor, float] | None:
    """The weight side of ``b`` into one new buffer (``_weight_side_of`` takes it apart):
    ``Br`` [bt, nseg, K], max and min [2, bt, nseg, K], the 8 aggregate planes
    [8, bt, nseg] (fp32) and ``bad`` [bt, nseg] (bytes); with ``mu_scale``."""
    bb = _ws_batch(b)
    if bb is None:
        return None
    buf = torch.empty(_encoding_bytes(bb[0], b.shape[-2], -(-b.shape[-1] // SEGMENT)), dtype=torch.uint8)
    return buf, _encode_at(ext, b, r, threads, bb, buf.data_ptr())


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
    pthreads) unless ``force_threads`` (tests). Never writes to an input.
    """
    ext = _load()
    if ext is None:
        return None
    call = _Call.of(ext, req, _threads(threads, force_threads))
    if call is None:
        return None
    enc = torch.empty(call.enc_bytes, dtype=torch.uint8) if call.enc_bytes else None
    shape = (*call.batch, call.m, call.nseg)
    vals = torch.empty((2, *shape), dtype=torch.float32)
    rows = torch.empty((3, *call.batch, call.m), dtype=torch.float32)
    flags = torch.empty((2, *shape), dtype=torch.bool)
    all_ok, worst = call.run(enc.data_ptr() if enc is not None else 0, vals.data_ptr(), rows.data_ptr(),
                             flags.data_ptr())
    diff, threshold = vals.unbind(0)
    ok, bad = flags.unbind(0)
    if all_ok:  # every segment passed and everything is finite: nothing to explain
        return AbftCheck(ok, bad, bad, diff, threshold, clear=True, worst_ratio=worst)
    bias_sum = bias_abs = None
    if call.bias is not None:
        bias_sum, bias_abs = _bias_sums(call.bias, call.n, _checksum32(req.checksum_weight),  # type: ignore[attr-defined]
                                        req.beta)  # type: ignore[attr-defined]
    mu, hi, lo = (t.unsqueeze(-1) for t in rows)
    ws = call.ws if enc is None else _weight_side_of(req.b, enc, call.mu_scale)  # type: ignore[attr-defined]
    return explain_failures(ok, diff, threshold, call.k, mu, hi, lo, ws, req.alpha, req.c.dtype,  # type: ignore[attr-defined]
                            bias_sum, bias_abs)


class Scratch:
    """Memory reused from one ``native_clear`` to the next, per thread (the kernels run
    with the GIL released: two threads may verify at once)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def pointer(self, nbytes: int) -> int:
        """The address of at least ``nbytes`` bytes, 64-byte aligned, valid until the next
        call from this thread."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes + 64:
            buf = self._local.buf = torch.empty(max(nbytes + 64, 1 << 20), dtype=torch.uint8)
        p = buf.data_ptr()
        return p + (-p % 64)


def native_clear(req: object, scratch: Scratch) -> float | None:
    """The worst ``D / T`` of ``req`` when its check comes out clear (every segment passed,
    everything finite), else ``None``; ``None`` too where the kernels do not cover it.

    The guard's hot path: a clear check's masks and D / T are never looked at, so they
    go to ``scratch``, and so does a cold ``b``'s encoding, instead of new tensors. That
    saves the Python of up to four allocations and of the ``AbftCheck``, about a quarter
    of a small GEMM's verification. On ``None`` the caller runs ``native_check`` for the
    whole story (failures are rare: the check runs twice then).
    """
    ext = _load()
    if ext is None:
        return None
    call = _Call.of(ext, req, _threads(None, False))
    if call is None:
        return None
    enc = call.enc_bytes + (-call.enc_bytes % 64)
    segs, rows = call.nb * call.m * call.nseg, call.nb * call.m
    p = scratch.pointer(enc + 10 * segs + 12 * rows)
    all_ok, worst = call.run(p, p + enc, p + enc + 8 * segs, p + enc + 8 * segs + 12 * rows)
    return worst if all_ok else None


class _Call:
    """One check's arguments for ``ext.check``, but for where its outputs (and a cold
    ``b``'s encoding) go: ``native_check`` gives new tensors, ``native_clear`` scratch."""

    __slots__ = ("ext", "threads", "head", "tail", "batch", "nb", "m", "n", "nseg", "k", "bias",
                 "enc_bytes", "encode", "ws", "warm", "sf", "mu_scale")

    @classmethod
    def of(cls, ext: types.ModuleType, req: object, threads: int) -> "_Call | None":
        """The call for ``req``, or ``None`` where the kernels cannot walk its layout."""
        call = cls()
        return call if call._build(ext, req, threads) else None

    def _build(self, ext: types.ModuleType, req: object, threads: int) -> bool:
        a, b, c = req.a, req.b, req.c  # type: ignore[attr-defined]
        self.ext, self.threads = ext, threads
        ws = req.weight  # type: ignore[attr-defined]
        r = _checksum32(req.checksum_weight)  # type: ignore[attr-defined]
        m, n, k = c.shape[-2], c.shape[-1], a.shape[-1]
        self.m, self.n, self.k, self.nseg = m, n, k, -(-n // SEGMENT)
        self.enc_bytes, self.encode = 0, None
        if ws is None:
            bb = _ws_batch(b) if _weight_reason(b, req.checksum_weight) is None else None  # type: ignore[attr-defined]
            if bb is None:  # the kernels cannot encode b in one buffer: torch's encoding, kept
                ws = native_weight_side(b, req.checksum_weight)  # type: ignore[attr-defined]
            else:  # cold: encoded by run() into the caller's buffer
                self.enc_bytes = _encoding_bytes(bb[0], b.shape[-2], self.nseg)
                self.encode = (b, r, bb)
        self.ws = ws
        if ws is not None:
            prep = _prepared(ws)
            self.warm = (prep.br_ptr, prep.sbrs, *prep.f_ptrs)
            flat, self.mu_scale, kw = prep.flat, prep.mu_scale, ws.k
        else:
            self.warm, flat, self.mu_scale, kw = None, b.dim() == 2, 0.0, b.shape[-2]
        if c.dim() == 2 and flat:
            self.batch, self.nb = (), 1
            nb0 = nb1 = 1
            sa0 = sa1 = sc0 = sc1 = sb0 = sb1 = sbr0 = sbr1 = sf0 = sf1 = 0
        else:
            self.batch = tuple(c.shape[:-2])
            layout = _layout(req, ws)
            if layout is None:
                return False
            (nb0, nb1), ((sa0, sa1), (sc0, sc1), (sb0, sb1), (sbr0, sbr1), (sf0, sf1)) = layout
            self.nb = nb0 * nb1
        alpha, beta = req.alpha, req.beta  # type: ignore[attr-defined]
        self.bias = bias = req.bias if beta != 0.0 else None  # type: ignore[attr-defined]
        bias_ptr, bias_dt, sbm, sbn = _bias_args(bias)
        sa, sc = a.stride(), c.stride()
        tiny, bias_round = _C_CONST[c.dtype]
        self.head = (
            m, n, k, nb0, nb1,
            a.data_ptr(), _DT[a.dtype], sa0, sa1, sa[-2], sa[-1],
            c.data_ptr(), _DT[c.dtype], sc0, sc1, sc[-2], sc[-1],
            bias_ptr, bias_dt, sb0, sb1, sbm, sbn,
            r.data_ptr() if r is not None else 0,
        )
        self.sf = (sbr0, sbr1, sf0, sf1)
        self.tail = (abs(alpha) * effective_e_max(req.e_max, kw, c.dtype),  # type: ignore[attr-defined]
                     alpha, beta, tiny, bias_round)
        return True

    def run(self, enc: int, vals: int, rows: int, flags: int) -> tuple[bool, float]:
        """Encode a cold ``b`` at ``enc`` (``enc_bytes``), then check into ``vals`` (D, T:
        fp32 [2, nb, M, nseg]), ``rows`` (mean, max, min of A's rows: fp32 [3, nb, M])
        and ``flags`` (ok, inputs bad: bool [2, nb, M, nseg]). Returns (every segment
        passed with D and T finite, the largest D / T)."""
        if self.encode is not None:
            b, r, bb = self.encode
            self.mu_scale = _encode_at(self.ext, b, r, self.threads, bb, enc)
            big = b.shape[-2] * self.nseg * bb[0]
            small = big // b.shape[-2]
            br_ptr, sbrs, factors = enc, b.shape[-2], [enc + 4 * (3 * big + j * small) for j in range(4, 8)]
        else:
            br_ptr, sbrs, *factors = self.warm
        sbr0, sbr1, sf0, sf1 = self.sf
        return self.ext.check(*self.head, br_ptr, sbr0, sbr1, sbrs, *factors, sf0, sf1, self.mu_scale, *self.tail,
                              vals, rows, flags, self.threads)
