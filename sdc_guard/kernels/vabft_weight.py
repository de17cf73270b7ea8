"""Weight-side V-ABFT encoding of ``B`` as Triton kernels, and the strided-batch helper.

``triton_weight_side(b)`` computes exactly what ``sdc_guard.core.abft.weight_side`` defines
(docs/ALGORITHM.md, "Weight side"): ``Br[k, s]`` and ``Babs[k, s]``, the per-segment
aggregates ``P1``, ``P2``, ``V`` of the per-(k, segment) mean and Bhatia-Davis extrema
variance, the largest column 2-norm bound ``col_norm`` and the non-finite mask ``bad``, in
two launches (the aggregates in fp64: squares and products of fp32 statistics leave
fp32's range, attention's probabilities and gradients among them):

1. ``_weight_partials_kernel``, grid ``(batch * nseg, k_chunks)``: each program reads a
   ``[k_chunk, 256]`` slab of ``B`` once, in ``[BLOCK_K, 256]`` tiles, writes the ``Br`` and
   ``Babs`` rows of its slab and its partial sums of ``P1``, ``P2``, ``V`` and ``col_norm^2`` (``sum_k``
   of the squared per-(k, segment) extremum) to a small scratch buffer. Splitting K keeps the GPU busy when ``batch * nseg`` is small (a
   4096-wide weight has only 16 segments) without atomics, so the result is deterministic.
2. ``_weight_finish_kernel``, grid ``(batch * nseg,)``: adds the partials of the K chunks
   in a fixed order, takes the square root for ``col_norm`` and derives ``bad``.

``B`` is read through its strides (``W.t()`` of an ``nn.Linear`` weight needs no copy); an
integer stride equal to 1 is specialised by Triton, so loads coalesce along whichever of
k or n is contiguous (for ``W.t()`` in runs of ``WEIGHT_BLOCK_K`` elements: 16 bytes in
bf16, half a sector; a wider K tile would need more registers, see below). ``Br`` is
written segment-major (a ``[..., nseg, K]`` buffer returned as its ``[..., K, nseg]``
transpose) so that the check kernel reads a segment's ``Br`` contiguously.
Sums along N are fp32, the aggregates over K fp64; no host synchronisation, ``B`` is only read.

The result differs from the torch reference only by float summation order (see
``sdc_guard.kernels.vabft_triton`` for the tolerance this implies).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from sdc_guard.core.abft import WeightSide, num_segments
from sdc_guard.core.batching import collapse_batch
from sdc_guard.core.precision import SEGMENT

#: Rows of B per tile of the partials kernel, and its warps: a ``[8, 256]`` tile is 8
#: values per thread, 63-99 registers and no spills on sm_90 (read from the cubin); 16
#: rows took 112-177 registers, 32 rows at four warps 255 and spilled.
WEIGHT_BLOCK_K = 8
WEIGHT_NUM_WARPS = 8

#: Programs the partials kernel aims for, so that K is split only when ``batch * nseg``
#: alone cannot fill a large GPU (an H200 has 132 SMs). Not tuned on hardware.
TARGET_PROGRAMS = 512

#: Floating dtypes Triton loads that an operand of a check may have (bias, weight).
TRITON_FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)


def weight_rejects(b: Tensor, checksum_weight: Tensor | None = None) -> str | None:
    """``None`` if ``triton_weight_side`` can encode ``b``, else why not (one line)."""
    batch = list(b.shape[:-2])
    if collapse_batch(batch, [b.stride()[:-2]]) is None:
        return f"b: batch dims {tuple(b.shape[:-2])} with strides {b.stride()[:-2]} need a copy"
    if checksum_weight is not None and checksum_weight.dtype not in TRITON_FLOAT_DTYPES:
        return f"checksum_weight: dtype {checksum_weight.dtype} is not one Triton loads"
    if b.numel() == 0:
        return "b is empty: nothing to encode"
    return None


def on_device(dev: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(dev)`` for CUDA tensors (Triton launches on the current
    device, which need not be the tensors'), a no-op for CPU tensors (interpreter)."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _k_chunk(k: int, programs: int, k_chunk: int | None) -> int:
    """Rows of K per program of the partials kernel: a multiple of ``WEIGHT_BLOCK_K``."""
    if k_chunk is None:
        chunks = max(1, min(triton.cdiv(k, WEIGHT_BLOCK_K), triton.cdiv(TARGET_PROGRAMS, programs)))
        k_chunk = triton.cdiv(k, chunks)
    return max(WEIGHT_BLOCK_K, triton.cdiv(k_chunk, WEIGHT_BLOCK_K) * WEIGHT_BLOCK_K)


#: Per-(batch, K chunk, segment) partial sums the partials kernel writes: P1, P2, V and
#: ``sum_k max_n (r B[k, n])^2`` (the square of ``col_norm``).
N_PARTIALS = 4


@triton.jit
def _weight_partials_kernel(
    b_ptr, r_ptr, br_ptr, babs_ptr, part_ptr,
    K, N, nseg, k_chunk, n_chunks, n_batch, batch1, stride_r,
    stride_b0, stride_b1, stride_bk, stride_bn, stride_brb, stride_brk, stride_brs,
    HAS_WEIGHT: tl.constexpr, SEG: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One ``[k_chunk, SEG]`` slab of B: its Br rows and its partial aggregates."""
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    batch = pid // nseg
    seg = pid % nseg
    base = (batch // batch1).to(tl.int64) * stride_b0 + (batch % batch1).to(tl.int64) * stride_b1
    cols = seg * SEG + tl.arange(0, SEG)
    col_ok = cols < N
    col_off = cols.to(tl.int64) * stride_bn
    width = tl.minimum(N - seg * SEG, SEG).to(tl.float32)
    if HAS_WEIGHT:
        r = tl.load(r_ptr + cols.to(tl.int64) * stride_r, mask=col_ok, other=0.0).to(tl.float32)
    p1 = tl.zeros((BLOCK_K,), tl.float64)
    p2 = tl.zeros((BLOCK_K,), tl.float64)
    v = tl.zeros((BLOCK_K,), tl.float64)
    norm_sq = tl.zeros((BLOCK_K,), tl.float64)
    k_start = chunk * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    br_base = br_ptr + batch.to(tl.int64) * stride_brb + seg * stride_brs
    babs_base = babs_ptr + batch.to(tl.int64) * stride_brb + seg * stride_brs
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        mask = k_ok[:, None] & col_ok[None, :]
        x = tl.load(b_ptr + base + ks.to(tl.int64)[:, None] * stride_bk + col_off[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            x = x * r[None, :]
        row_sum = tl.sum(x, axis=1)
        abs_sum = tl.sum(tl.abs(x), axis=1)
        mu = tl.div_rn(row_sum, width)
        hi = tl.where(k_ok, tl.max(tl.where(mask, x, -float("inf")), axis=1), 0.0)
        lo = tl.where(k_ok, tl.min(tl.where(mask, x, float("inf")), axis=1), 0.0)
        peak = tl.maximum(tl.abs(hi), tl.abs(lo)).to(tl.float64)
        tl.store(br_base + ks.to(tl.int64) * stride_brk, row_sum, mask=k_ok)
        tl.store(babs_base + ks.to(tl.int64) * stride_brk, abs_sum, mask=k_ok)
        mu64, hi64, lo64 = mu.to(tl.float64), hi.to(tl.float64), lo.to(tl.float64)
        p1 += tl.where(k_ok, tl.abs(mu64), 0.0)
        p2 += tl.where(k_ok, mu64 * mu64, 0.0)
        v += tl.where(k_ok, tl.abs((hi64 - mu64) * (mu64 - lo64)), 0.0)
        norm_sq += peak * peak
    part = part_ptr + (batch * n_chunks + chunk).to(tl.int64) * nseg + seg
    plane = n_batch * n_chunks * nseg
    tl.store(part, tl.sum(p1, axis=0))
    tl.store(part + plane, tl.sum(p2, axis=0))
    tl.store(part + 2 * plane, tl.sum(v, axis=0))
    tl.store(part + 3 * plane, tl.sum(norm_sq, axis=0))


@triton.jit
def _weight_finish_kernel(
    part_ptr, p1_ptr, p2_ptr, v_ptr, norm_ptr, bad_ptr, widths_ptr,
    N, nseg, n_chunks, n_batch,
    SEG: tl.constexpr,
):
    """Add one segment's K-chunk partials in a fixed order; ``col_norm`` and ``bad``.

    The segment widths are written here too, so the encoding needs no host-to-device copy.
    """
    pid = tl.program_id(0)
    batch = pid // nseg
    seg = pid % nseg
    plane = n_batch * n_chunks * nseg
    p1 = tl.zeros((), tl.float64)
    p2 = tl.zeros((), tl.float64)
    v = tl.zeros((), tl.float64)
    norm_sq = tl.zeros((), tl.float64)
    for chunk in range(0, n_chunks):
        part = part_ptr + (batch * n_chunks + chunk).to(tl.int64) * nseg + seg
        p1 += tl.load(part)
        p2 += tl.load(part + plane)
        v += tl.load(part + 2 * plane)
        norm_sq += tl.load(part + 3 * plane)
    finite = (tl.abs(p1) < float("inf")) & (tl.abs(v) < float("inf"))
    tl.store(p1_ptr + pid, p1)
    tl.store(p2_ptr + pid, p2)
    tl.store(v_ptr + pid, v)
    tl.store(norm_ptr + pid, tl.sqrt(norm_sq))
    tl.store(bad_ptr + pid, (~finite).to(tl.uint8))
    width = tl.minimum(N - seg * SEG, SEG).to(tl.float32)
    tl.store(widths_ptr + seg, width, mask=batch == 0)


def triton_weight_side(
    b: Tensor, checksum_weight: Tensor | None = None, *, k_chunk: int | None = None
) -> WeightSide:
    """``abft.weight_side(b, checksum_weight)`` computed by two Triton launches.

    ``b`` is ``[..., K, N]`` with any strides (batch dims that cannot be walked with two
    strides raise ``ValueError``; ``weight_rejects`` says so beforehand). ``k_chunk``
    overrides how many rows of K one program reduces (tests use it to exercise the
    split-K path on small shapes). No host synchronisation; ``b`` is only read.

    >>> ws = triton_weight_side(torch.ones(4, 300))  # doctest: +SKIP
    >>> ws.br[0].tolist()  # doctest: +SKIP
    [256.0, 44.0]
    """
    reason = weight_rejects(b, checksum_weight)
    if reason is not None:
        raise ValueError(reason)
    k, n = b.shape[-2], b.shape[-1]
    bshape = list(b.shape[:-2])
    (_, batch1), (strides,) = collapse_batch(bshape, [b.stride()[:-2]])
    n_batch = math.prod(bshape)
    nseg = num_segments(n)
    chunk = _k_chunk(k, n_batch * nseg, k_chunk)
    n_chunks = triton.cdiv(k, chunk)
    dev = b.device
    # Br is [..., K, nseg] stored segment-major, so that a segment's column is contiguous:
    # the check kernel's loads of Br along K then coalesce, and so do the stores here.
    br = torch.empty((*bshape, nseg, k), dtype=torch.float32, device=dev).transpose(-1, -2)
    babs = torch.empty((*bshape, nseg, k), dtype=torch.float32, device=dev).transpose(-1, -2)
    part = torch.empty((N_PARTIALS, n_batch, n_chunks, nseg), dtype=torch.float64, device=dev)
    p1, p2, v, col_norm = (
        torch.empty((*bshape, nseg), dtype=torch.float64, device=dev) for _ in range(4)
    )
    bad = torch.empty((*bshape, nseg), dtype=torch.bool, device=dev)
    widths = torch.empty((nseg,), dtype=torch.float32, device=dev)
    r = checksum_weight if checksum_weight is not None else b  # dummy pointer when unused
    with on_device(dev):
        _weight_partials_kernel[(n_batch * nseg, n_chunks)](
            b, r, br, babs, part,
            k, n, nseg, chunk, n_chunks, n_batch, batch1,
            checksum_weight.stride(0) if checksum_weight is not None else 0,
            strides[0], strides[1], b.stride(-2), b.stride(-1), k * nseg, br.stride(-2), br.stride(-1),
            HAS_WEIGHT=checksum_weight is not None, SEG=SEGMENT, BLOCK_K=WEIGHT_BLOCK_K,
            num_warps=WEIGHT_NUM_WARPS,
        )
        _weight_finish_kernel[(n_batch * nseg,)](
            part, p1, p2, v, col_norm, bad.view(torch.uint8), widths,
            n, nseg, n_chunks, n_batch, SEG=SEGMENT,
        )
    return WeightSide(br, babs, p1, p2, v, col_norm, bad, widths, k, n)
