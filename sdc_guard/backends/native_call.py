"""How the native kernels' arguments are laid out: dtype codes, pointers and strides of a
check (``Call``) or an encoding, the buffer an encoding is written to, and the batch dims
collapsed into the kernels' two strides.

Why a module of its own: ``sdc_guard.backends.native`` says what the ``cpu`` backend does (which
calls it covers, the check, its clear fast path, the weight side); this is the
bookkeeping that turns a ``GemmRequest`` into the ~50 integers the C entry points take,
and a kernel's output buffer back into tensors. Every function here is pure Python on
shapes, strides and addresses, apart from ``encode_at`` and ``Call.run``, which call the
extension they are given.
"""

from __future__ import annotations

import types
from functools import cached_property, lru_cache

import torch
from torch import Tensor

from ..core.abft import WeightSide, effective_e_max, weight_side
from ..core.batching import batch_strides, collapse_batch, contiguous_strides
from ..core.precision import SEGMENT, UNIT_ROUNDOFF, ScreenTerms, bias_rounding, element_floor
from ..core.segments import segment_constants

__all__ = [
    "BufferWeightSide", "C_CONSTANTS", "Call", "DTYPE_CODE", "Prepared", "bias_args", "buffer_geometry", "buffer_offsets",
    "checksum32", "encode_at", "encoding_bytes", "factor_offsets", "flat_args", "layout", "prepared",
    "threshold_args", "walkable", "weight_reason", "weight_side_of", "ws_batch",
]

#: dtype -> the kernel's dtype code
DTYPE_CODE: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: constants per C dtype: (unit roundoff, bias_rounding)
C_CONSTANTS: dict[torch.dtype, tuple[float, float]] = {dt: (UNIT_ROUNDOFF[dt], bias_rounding(dt)) for dt in DTYPE_CODE}


def threshold_args(e_max: float, k: int, alpha: float, c_dtype: torch.dtype, rounding: ScreenTerms | None = None,
                   epilogue: bool = False) -> tuple[float, ...]:
    """The kernel's threshold constants besides the bias's (abft.threshold64): ``|alpha|
    e_eff``, the factor of ``|A| @ Babs``, ``element_floor(K)``, and the factors of C's
    ``sum |r C|``, ``sqrt(sum (r C)^2)`` and ``|sum r C|`` (``precision.ScreenTerms``;
    ``epilogue``: alpha != 1 or a bias)."""
    a_round, c_abs, c_sq, c_coh = (rounding or ScreenTerms()).coefficients(c_dtype, alpha, epilogue)
    return abs(alpha) * effective_e_max(e_max, k), a_round, element_floor(k, c_dtype), c_abs, c_sq, c_coh


def weight_reason(b: Tensor, checksum_weight: Tensor | None) -> str | None:
    if b.device.type != "cpu":
        return f"b is on {b.device.type}, the native kernels run on cpu"
    if b.dtype not in DTYPE_CODE:
        return f"b: dtype {b.dtype} is not bfloat16, float16 or float32"
    if b.dim() < 2 or b.numel() == 0:
        return "b: empty or not a matrix"
    if checksum_weight is not None and (checksum_weight.device.type != "cpu" or checksum_weight.shape != b.shape[-1:]):
        return "checksum_weight: not a CPU vector of N"
    return None


def walkable(b: Tensor) -> Tensor:
    """``b`` itself when the weight-side kernel can walk its batch with one stride, else a
    contiguous copy of it: a batch of views into a larger tensor (attention's heads, ``k``
    and ``v`` sliced out of one projection, under a function-level ``matmul``) costs one
    read and one write of ``b`` that way, where the torch encoding costs dozens of passes."""
    if b.dim() <= 3:
        return b
    collapsed = collapse_batch(b.shape[:-2], [list(b.stride()[:-2])])
    if collapsed is not None and collapsed[0][0] == 1:
        return b
    return b.contiguous()


def checksum32(checksum_weight: Tensor | None) -> Tensor | None:
    if checksum_weight is None:
        return None
    return checksum_weight.detach().to(torch.float32).contiguous()


def ws_batch(b: Tensor) -> tuple[int, int] | None:
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


def encoding_bytes(bt: int, k: int, nseg: int) -> int:
    """Bytes of an encoding buffer (its layout: ``native._encode``)."""
    big, small = bt * nseg * k, bt * nseg
    return 16 * big + 64 * small + small


@lru_cache(maxsize=1024)  # pure, and asked for every encoding
def buffer_offsets(big: int, small: int) -> tuple[int, int, int, int, int, int]:
    """Byte offsets in an encoding buffer of ``Br``, ``Babs``, max, min (fp32 [bt, nseg, K]
    each), the 8 fp64 aggregate planes [8, bt, nseg] and ``bad`` [bt, nseg]."""
    return 0, 4 * big, 8 * big, 12 * big, 16 * big, 16 * big + 64 * small


@lru_cache(maxsize=1024)  # pure, and asked for every encoding
def factor_offsets(big: int, small: int) -> tuple[int, ...]:
    """Byte offsets of the four fp64 factor planes (aggregate planes 4-7)."""
    agg = buffer_offsets(big, small)[4]
    return tuple(agg + 8 * small * j for j in range(4, 8))


def encode_at(ext: types.ModuleType, b: Tensor, r: Tensor | None, threads: int, bb: tuple[int, int],
              p: int) -> None:
    """The weight side of ``b`` (batch count and stride ``bb``) into the buffer at ``p``."""
    bt, sbb = bb
    k, n = b.shape[-2], b.shape[-1]
    nseg = -(-n // SEGMENT)
    o_br, o_babs, o_hi, o_lo, o_agg, o_bad = buffer_offsets(bt * nseg * k, bt * nseg)
    ext.weight_side(
        b.data_ptr(), DTYPE_CODE[b.dtype], bt, k, n, sbb, b.stride(-2), b.stride(-1),
        r.data_ptr() if r is not None else 0, p + o_br, p + o_babs, p + o_hi, p + o_lo, p + o_agg, p + o_bad,
        threads,
    )


def weight_side_of(shape: tuple[int, ...], buf: Tensor) -> WeightSide:
    """The ``WeightSide`` of an encoding buffer (``native._encode``) of a ``b`` of
    ``shape``: ``br`` and ``babs`` segment-major (as ``abft`` stores them) and the
    threshold factors precomputed."""
    k, n = shape[-2], shape[-1]
    nseg = -(-n // SEGMENT)
    bshape = tuple(shape[:-2])
    big = nseg * k
    for size in bshape:
        big *= size
    small = big // k
    # few torch calls (each costs a microsecond or two; this runs once per encoding):
    # one unbind for the eight aggregate planes, one for the four factor views
    o_br, o_babs, _, _, o_agg, o_bad = buffer_offsets(big, small)
    floats = buf[: o_agg].view(torch.float32)
    br = floats[:big].view(*bshape, nseg, k)
    babs = floats[big: 2 * big].view(*bshape, nseg, k)
    agg = buf[o_agg: o_bad].view(torch.float64).view(8, *bshape, nseg)
    p1, p2, v, col_norm = agg[:4].unbind(0)
    bad = buf[o_bad:].view(torch.bool).view(*bshape, nseg)
    widths = segment_constants(n, buf.device)[0]
    ws = WeightSide(br.mT, babs.mT, p1, p2, v, col_norm, bad, widths, k, n)
    # the factors of the threshold's bracket, computed by the kernel exactly as
    # WeightSide.factors computes them
    ws.set_factors(tuple(agg[4:].unsqueeze(-2).unbind(0)))
    return ws


@lru_cache(maxsize=1024)  # pure, and asked for every encoding
def buffer_geometry(bshape: tuple[int, ...], k: int, n: int) -> tuple[tuple[int, ...], ...]:
    """Shapes and strides of ``Br`` ([..., K, nseg], segment-major) and of a factor
    ([..., 1, nseg]) in an encoding buffer (``native._encode``)."""
    nseg = -(-n // SEGMENT)
    *outer, seg_stride, k_stride = contiguous_strides((*bshape, nseg, k))
    f_shape = (*bshape, 1, nseg)
    return (*bshape, k, nseg), (*outer, k_stride, seg_stride), f_shape, tuple(contiguous_strides(f_shape))


class Prepared:
    """What the check needs of a ``WeightSide``, taken once per encoding (``keep`` holds
    the memory the pointers point into): pointers, shapes and strides of ``Br`` and of
    the four factors."""

    __slots__ = ("keep", "br_ptr", "babs_ptr", "br_shape", "br_strides", "sbrs", "f_ptrs", "f_shape",
                 "f_strides", "flat", "geometry")

    @classmethod
    def of(cls, ws: WeightSide) -> "Prepared":
        """From any backend's encoding: ``Br`` and ``Babs`` made segment-major with one
        layout (the kernel reads both at the same offsets) and the fp64 factors broadcast
        to one shape, where they are not already."""
        br, babs = ws.br, ws.babs
        if br.shape[-2] > 1 and br.stride(-2) != 1:
            br = br.mT.contiguous().mT  # segment-major, as the kernel reads it
        if babs.stride() != br.stride():
            babs = babs.mT.contiguous().mT
            if babs.stride() != br.stride():
                br, babs = br.mT.contiguous().mT, babs.mT.contiguous().mT
        factors = [f.double().contiguous() for f in torch.broadcast_tensors(*ws.factors)]
        return cls._make((br, babs, factors), br.data_ptr(), babs.data_ptr(), tuple(br.shape), tuple(br.stride()),
                         tuple(f.data_ptr() for f in factors), tuple(factors[0].shape), tuple(factors[0].stride()))

    @classmethod
    def of_buffer(cls, buf: Tensor, bshape: tuple[int, ...], k: int, n: int) -> "Prepared":
        """From a native encoding buffer: its addresses, no tensor made."""
        br_shape, br_strides, f_shape, f_strides = buffer_geometry(bshape, k, n)
        big = k * -(-n // SEGMENT)
        for size in bshape:
            big *= size
        small, p = big // k, buf.data_ptr()
        f_ptrs = tuple(p + o for o in factor_offsets(big, small))
        return cls._make(buf, p, p + buffer_offsets(big, small)[1], br_shape, br_strides, f_ptrs, f_shape, f_strides)

    @classmethod
    def _make(cls, keep: object, br_ptr: int, babs_ptr: int, br_shape: tuple[int, ...], br_strides: tuple[int, ...],
              f_ptrs: tuple[int, ...], f_shape: tuple[int, ...], f_strides: tuple[int, ...]) -> "Prepared":
        prep = cls()
        prep.keep, prep.br_ptr, prep.babs_ptr, prep.br_shape, prep.br_strides = keep, br_ptr, babs_ptr, br_shape, br_strides
        prep.sbrs = br_strides[-1]
        prep.f_ptrs, prep.f_shape, prep.f_strides = f_ptrs, f_shape, f_strides
        prep.flat = len(br_shape) == 2 and len(f_shape) == 2  #: no batch dims
        #: the layout a check walks (``native_plan``: what a planned call depends on)
        prep.geometry = (br_shape, br_strides, f_shape, f_strides)
        return prep


def prepared(ws: WeightSide) -> Prepared:
    attached = ws.attached
    prep = attached.get("native")
    if prep is None:
        prep = attached["native"] = Prepared.of(ws)
    return prep


def _field(name: str) -> property:
    return property(lambda self: getattr(self._views, name), doc=f"``WeightSide.{name}``, a view of the buffer")


class BufferWeightSide(WeightSide):
    """A native encoding buffer as a ``WeightSide`` whose tensors are made on first use.

    Why: the native check reads only the buffer's addresses (``Prepared.of_buffer``);
    taking a buffer apart into the dozen views of a ``WeightSide`` costs about 30 us
    (more right after a large product, with the caches cold), once per weight and
    orientation every training step. The torch and Triton backends, and the explanation
    of a failed check, read the fields, which then become the views ``weight_side_of``
    makes, once. ``nbytes`` is the buffer's size (all of it stays alive).
    """

    def __init__(self, b: Tensor, buf: Tensor) -> None:
        shape, k, n = tuple(b.shape), b.shape[-2], b.shape[-1]
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "n", n)
        self.__dict__.update(_buf=buf, _shape=shape)  # this class's own lazily built state
        self.attached["native"] = Prepared.of_buffer(buf, shape[:-2], k, n)

    @cached_property
    def _views(self) -> WeightSide:
        return weight_side_of(self._shape, self._buf)

    br, babs, p1, p2, v, col_norm, bad, widths = (_field(name) for name in ("br", "babs", "p1", "p2", "v",
                                                                            "col_norm", "bad", "widths"))

    @cached_property
    def factors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self._views.factors

    @property
    def nbytes(self) -> int:
        return self._buf.numel()


def layout(req: object, ws: WeightSide | None) -> tuple[list[int], list[list[int]]] | None:
    """Batch sizes and strides (A, C, bias, Br, factors) of a batched call, or ``None``."""
    a, c, bias = req.a, req.c, req.bias  # type: ignore[attr-defined]
    batch = c.shape[:-2]
    if ws is not None:
        prep = prepared(ws)
        br_shape, br_strides, f_shape, f_strides = prep.br_shape, prep.br_strides, prep.f_shape, prep.f_strides
    else:  # what native_weight_side produces for b
        b = req.b  # type: ignore[attr-defined]
        br_shape, br_strides, f_shape, f_strides = buffer_geometry(tuple(b.shape[:-2]), b.shape[-2], b.shape[-1])
    per = [
        batch_strides(a.shape, a.stride(), batch, 2),
        batch_strides(c.shape, c.stride(), batch, 2),
        batch_strides(bias.shape, bias.stride(), batch, 2) if bias is not None and bias.dim() > 2 else [0] * len(batch),
        batch_strides(br_shape, br_strides, batch, 2),
        batch_strides(f_shape, f_strides, batch, 2),
    ]
    return collapse_batch(batch, per)


def bias_args(bias: Tensor | None) -> tuple[int, int, int, int]:
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
    return bias_v.data_ptr(), DTYPE_CODE[bias_v.dtype], sbm, sbn


def flat_args(req: object) -> tuple | None:
    """``ext.check``'s arguments but the three outputs and the thread count, for the
    commonest call, or ``None`` (``Call`` and ``rejects`` take everything else): 2-D A and
    C, a warm 2-D weight side, no checksum weight, CPU tensors of the kernels' dtypes,
    nothing empty. The same tuple ``Call`` builds (``tests/unit/backends/test_native.py`` compares them).

    Why a path of its own: right after a large product the caches hold none of this
    Python, and each line, each distinct tensor getter above all, costs its cache misses:
    there the Python around a decode matmul's check cost more than the kernel (over 100
    against 65-90 us), and ``rejects`` and ``Call``'s general bookkeeping read the same
    attributes twice over.
    """
    a, c, ws = req.a, req.c, req.weight  # type: ignore[attr-defined]
    if ws is None or req.checksum_weight is not None:  # type: ignore[attr-defined]
        return None
    sa, sc = a.stride(), c.stride()  # their lengths are the dims: one getter fewer per tensor
    if len(sa) != 2 or len(sc) != 2:
        return None
    b = req.b  # type: ignore[attr-defined]
    adt, cdt = DTYPE_CODE.get(a.dtype), DTYPE_CODE.get(c.dtype)
    if adt is None or cdt is None or b.dtype not in DTYPE_CODE:
        return None
    if not (a.is_cpu and c.is_cpu and b.is_cpu):  # not device.type: that makes a torch.device
        return None
    beta = req.beta  # type: ignore[attr-defined]
    bias = req.bias if beta != 0.0 else None  # type: ignore[attr-defined]
    if bias is not None and (not bias.is_cpu or bias.dtype not in DTYPE_CODE):
        return None
    prep = prepared(ws)
    m, n = c.shape
    k = a.shape[1]
    if not prep.flat or m == 0 or n == 0 or k == 0:
        return None
    bias_ptr, bias_dt, sbm, sbn = bias_args(bias)
    alpha = req.alpha  # type: ignore[attr-defined]
    return (m, n, k, 1, 1, a.data_ptr(), adt, 0, 0, sa[0], sa[1], c.data_ptr(), cdt, 0, 0, sc[0], sc[1],
            bias_ptr, bias_dt, 0, 0, sbm, sbn, 0, prep.br_ptr, prep.babs_ptr, 0, 0, prep.sbrs, *prep.f_ptrs, 0, 0,
            *threshold_args(req.e_max, ws.k, alpha, c.dtype, req.terms,  # type: ignore[attr-defined]
                            alpha != 1.0 or bias is not None), alpha, beta,
            C_CONSTANTS[c.dtype][1])


class Call:
    """One check's arguments for ``ext.check``, but for where its outputs (and a cold
    ``b``'s encoding) go: ``native_check`` gives new tensors, ``native_clear`` scratch."""

    __slots__ = ("ext", "threads", "head", "tail", "batch", "nb", "m", "n", "nseg", "k", "bias", "r",
                 "enc_bytes", "encode", "ws", "warm", "sf")

    @classmethod
    def of(cls, ext: types.ModuleType, req: object, threads: int) -> "Call | None":
        """The call for ``req``, or ``None`` where the kernels cannot walk its layout."""
        call = cls()
        return call if call._build(ext, req, threads) else None

    def _build(self, ext: types.ModuleType, req: object, threads: int) -> bool:
        a, b, c = req.a, req.b, req.c  # type: ignore[attr-defined]
        self.ext, self.threads = ext, threads
        ws = req.weight  # type: ignore[attr-defined]
        # kept on self: head holds its address, and a converted copy has no other owner
        self.r = r = checksum32(req.checksum_weight)  # type: ignore[attr-defined]
        m, n, k = c.shape[-2], c.shape[-1], a.shape[-1]
        self.m, self.n, self.k, self.nseg = m, n, k, -(-n // SEGMENT)
        self.enc_bytes, self.encode = 0, None
        if ws is None:
            if weight_reason(b, req.checksum_weight) is None:  # type: ignore[attr-defined]
                b = walkable(b)
                bb = ws_batch(b)
            else:
                bb = None
            if bb is None:  # the kernels cannot encode b in one buffer: torch's encoding, kept
                ws = weight_side(b, req.checksum_weight)  # type: ignore[attr-defined]
            else:  # cold: encoded by run() into the caller's buffer
                self.enc_bytes = encoding_bytes(bb[0], b.shape[-2], self.nseg)
                self.encode = (b, r, bb)
        self.ws = ws
        if ws is not None:
            prep = prepared(ws)
            self.warm = (prep.br_ptr, prep.babs_ptr, prep.sbrs, *prep.f_ptrs)
            flat, kw = prep.flat, ws.k
        else:
            self.warm, flat, kw = None, b.dim() == 2, b.shape[-2]
        if c.dim() == 2 and flat:
            self.batch, self.nb = (), 1
            nb0 = nb1 = 1
            sa0 = sa1 = sc0 = sc1 = sb0 = sb1 = sbr0 = sbr1 = sf0 = sf1 = 0
        else:
            self.batch = tuple(c.shape[:-2])
            walk = layout(req, ws)
            if walk is None:
                return False
            (nb0, nb1), ((sa0, sa1), (sc0, sc1), (sb0, sb1), (sbr0, sbr1), (sf0, sf1)) = walk
            self.nb = nb0 * nb1
        alpha, beta = req.alpha, req.beta  # type: ignore[attr-defined]
        self.bias = bias = req.bias if beta != 0.0 else None  # type: ignore[attr-defined]
        bias_ptr, bias_dt, sbm, sbn = bias_args(bias)
        sa, sc = a.stride(), c.stride()
        self.head = (
            m, n, k, nb0, nb1,
            a.data_ptr(), DTYPE_CODE[a.dtype], sa0, sa1, sa[-2], sa[-1],
            c.data_ptr(), DTYPE_CODE[c.dtype], sc0, sc1, sc[-2], sc[-1],
            bias_ptr, bias_dt, sb0, sb1, sbm, sbn,
            r.data_ptr() if r is not None else 0,
        )
        self.sf = (sbr0, sbr1, sf0, sf1)
        self.tail = (*threshold_args(req.e_max, kw, alpha, c.dtype, req.terms,  # type: ignore[attr-defined]
                                     alpha != 1.0 or bias is not None), alpha, beta,
                     C_CONSTANTS[c.dtype][1])
        return True

    def args(self, enc: int) -> tuple:
        """``ext.check``'s arguments but the three outputs and the thread count (a cold
        ``b`` is encoded at ``enc`` first)."""
        if self.encode is not None:
            b, r, bb = self.encode
            encode_at(self.ext, b, r, self.threads, bb, enc)
            big = b.shape[-2] * self.nseg * bb[0]
            small = big // b.shape[-2]
            br_ptr, babs_ptr, sbrs = enc, enc + buffer_offsets(big, small)[1], b.shape[-2]
            factors = [enc + o for o in factor_offsets(big, small)]
        else:
            br_ptr, babs_ptr, sbrs, *factors = self.warm
        sbr0, sbr1, sf0, sf1 = self.sf
        return (*self.head, br_ptr, babs_ptr, sbr0, sbr1, sbrs, *factors, sf0, sf1, *self.tail)

    def run(self, enc: int, vals: int, rows: int, flags: int) -> tuple[bool, float]:
        """Encode a cold ``b`` at ``enc`` (``enc_bytes``), then check into ``vals`` (D, T:
        fp32 [2, nb, M, nseg]), ``rows`` (mean, max, min of A's rows: fp32 [3, nb, M])
        and ``flags`` (ok, inputs bad: bool [2, nb, M, nseg]). Returns (every segment
        passed with D and T finite, the largest D / T)."""
        return self.ext.check(*self.args(enc), vals, rows, flags, self.threads)
