"""The ``cpu`` backend: V-ABFT (docs/ALGORITHM.md) in one native call per verification.

Why: the portable torch path (``abft.vabft_check``) costs 30-40 torch ops per check, each
a few microseconds plus a fork / join of the intra-op threads, and reads the operands in
several passes; on CPU that is 0.5-1.2 ms per training-sized GEMM where reading the
operands takes 0.1 ms, and 15 % of a 1 ms decode matmul. The C kernels of ``csrc/``
(``csrc/vabft_cpu.h`` maps its files; built at install time as ``sdc_guard._vabft_cpu``,
optional) read ``A`` and ``C`` once, and ``B`` once for the weight side, in any layout,
with bf16 / fp16 converted a block at a time, and compute D, T and the verdict of every
(row, segment) in the same call. What stays in Python is the argument marshalling
(``sdc_guard.backends.native_call``), kept to a few microseconds (``tests/unit/backends/test_native.py`` and
``sdc-guard bench overhead`` measure it).

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
from typing import Any

import torch
from torch import Tensor

from ..core.abft import AbftCheck, WeightSide, bias_sums, explain_failures, weight_side
from .native_call import (
    DTYPE_CODE, BufferWeightSide, Call, checksum32, encode_at, encoding_bytes, flat_args, layout, walkable,
    weight_reason, weight_side_of, ws_batch,
)
from ..core import collective as _collective_core
from ..core.precision import SEGMENT

__all__ = [
    "Scratch", "available", "collective_bits_into", "collective_sums_into", "extension", "native_check", "native_clear", "native_weight_side", "rejects",
    "thread_runtime", "default_threads", "unavailable_reason",
]

@functools.cache
def _import() -> tuple[types.ModuleType | None, str | None]:
    """The extension, imported once, or why it is missing."""
    try:
        from .. import _vabft_cpu  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, (f"native extension sdc_guard._vabft_cpu is not built ({exc}); "
                      "reinstall with a C compiler (pip install -e .)")
    return _vabft_cpu, None


def _load() -> types.ModuleType | None:
    return _import()[0]


def extension() -> types.ModuleType | None:
    """The extension module, or ``None`` when it is not built."""
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

def native_weight_side(b: Tensor, checksum_weight: Tensor | None = None, threads: int | None = None,
                       force_threads: bool = False) -> WeightSide:
    """``abft.weight_side`` in one native call: one read of ``b`` (``[..., K, N]``, any
    strides), split over ``threads`` (default ``torch.get_num_threads()``) threads when
    large (``OMP_MIN`` / ``PAR_MIN`` elements of ``csrc/vabft_cpu.h``, see
    ``native_check``), or always when ``force_threads`` (tests).

    Returns a ``native_call.BufferWeightSide`` (``br`` segment-major, as ``abft`` stores
    it, and its threshold factors precomputed, as views of one buffer made on first
    use); inputs the kernels do not cover are encoded by ``abft.weight_side``. Never
    writes to ``b``.
    """
    ext = _load()
    if ext is None or weight_reason(b, checksum_weight) is not None:
        return weight_side(b, checksum_weight)
    enc = _encode(ext, walkable(b), checksum32(checksum_weight), _threads(threads, force_threads))
    if enc is None:
        return weight_side(b, checksum_weight)
    return BufferWeightSide(b, enc)


def _encode(ext: types.ModuleType, b: Tensor, r: Tensor | None, threads: int) -> Tensor | None:
    """The weight side of ``b`` into one new buffer (``weight_side_of`` takes it apart):
    ``Br`` and ``Babs`` [bt, nseg, K], max and min [2, bt, nseg, K] (fp32), the 8 aggregate
    planes [8, bt, nseg] (fp64) and ``bad`` [bt, nseg] (bytes)."""
    bb = ws_batch(b)
    if bb is None:
        return None
    buf = torch.empty(encoding_bytes(bb[0], b.shape[-2], -(-b.shape[-1] // SEGMENT)), dtype=torch.uint8)
    encode_at(ext, b, r, threads, bb, buf.data_ptr())
    return buf


# --- check -----------------------------------------------------------------------------

def rejects(req: object) -> str | None:
    """``None`` when the native kernels cover ``req`` (a ``backends.GemmRequest``), else
    why not (one line). Pure Python: nothing is allocated or read."""
    a, b, c = req.a, req.b, req.c  # type: ignore[attr-defined]
    for name, t in (("a", a), ("b", b), ("c", c)):
        if t.device.type != "cpu":
            return f"{name} is on {t.device.type}, the native kernels run on cpu"
        if t.dtype not in DTYPE_CODE:
            return f"{name}: dtype {t.dtype} is not bfloat16, float16 or float32"
    if a.numel() == 0 or b.numel() == 0 or c.numel() == 0:
        return "empty operand: nothing for the kernels to verify"
    bias = req.bias  # type: ignore[attr-defined]
    if bias is not None and req.beta != 0.0:  # type: ignore[attr-defined]
        if bias.device.type != "cpu" or bias.dtype not in DTYPE_CODE:
            return f"bias: {bias.dtype} on {bias.device.type} is not a CPU bf16 / fp16 / fp32 tensor"
    r = req.checksum_weight  # type: ignore[attr-defined]
    if r is not None and (r.device.type != "cpu" or r.shape != c.shape[-1:]):
        return "checksum_weight: not a CPU vector of N"
    if c.dim() > 2 and layout(req, req.weight) is None:  # type: ignore[attr-defined]
        return "batch dims that need more than two strides to walk without a copy"
    return None


def default_threads() -> int:
    """The thread count a check runs with by default: ``torch.get_num_threads()``."""
    return max(1, torch.get_num_threads())


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
    call = Call.of(ext, req, _threads(threads, force_threads))
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
        bias_sum, bias_abs = bias_sums(call.bias, call.n, call.r, req.beta)  # type: ignore[attr-defined]
    mu, hi, lo = (t.unsqueeze(-1) for t in rows)
    ws = call.ws if enc is None else weight_side_of(tuple(req.b.shape), enc)  # type: ignore[attr-defined]
    return explain_failures(ok, diff, threshold, call.k, mu, hi, lo, ws,
                            req.alpha, req.c.dtype, bias_sum, bias_abs)  # type: ignore[attr-defined]


class Scratch:
    """Memory reused from one ``native_clear`` to the next, per thread (the kernels run
    with the GIL released: two threads may verify at once)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def pointer(self, nbytes: int) -> int:
        """The address of at least ``nbytes`` bytes, 64-byte aligned, valid until the next
        call from this thread. The address and the room are kept beside the buffer: no
        tensor call on the way (each is a cache miss or two right after a large product)."""
        mem = getattr(self._local, "mem", None)
        if mem is None or mem[1] < nbytes:
            buf = torch.empty(max(nbytes + 64, 1 << 20), dtype=torch.uint8)
            p = buf.data_ptr()
            mem = self._local.mem = (p + (-p % 64), buf.numel() - 64, buf)
        return mem[0]


def native_clear(req: object, scratch: Scratch) -> float | None:
    """The worst ``D / T`` of ``req`` when its check comes out clear (every segment passed,
    everything finite), else ``None``; ``None`` too where the kernels do not cover it
    (``rejects``).

    The guard's hot path: a clear check's masks and D / T are never looked at, so they
    go to ``scratch``, and so does a cold ``b``'s encoding, instead of new tensors. That
    saves the Python of up to four allocations and of the ``AbftCheck`` and its summary:
    on tiny GEMMs, where Python is all there is, a verified GEMM under ``protect()`` went
    from 100 to 40 us. The commonest call (``flat_args``) skips ``rejects`` and ``Call``.
    On ``None`` the caller runs ``native_check`` for the whole story (failures are rare:
    the check runs twice then).
    """
    ext = _load()
    if ext is None:
        return None
    args = flat_args(req)
    if args is not None:
        m = args[0]
        _, *outputs = _scratch_outputs(scratch, 0, m * -(-args[1] // SEGMENT), m)
        all_ok, worst = ext.check(*args, *outputs, _threads(None, False))
        return worst if all_ok else None
    if rejects(req) is not None:
        return None
    call = Call.of(ext, req, _threads(None, False))
    if call is None:
        return None
    rows = call.nb * call.m
    all_ok, worst = call.run(*_scratch_outputs(scratch, call.enc_bytes, rows * call.nseg, rows))
    return worst if all_ok else None


def _scratch_outputs(scratch: Scratch, enc_bytes: int, segs: int, rows: int) -> tuple[int, int, int, int]:
    """Addresses in ``scratch`` for a cold ``b``'s encoding (``enc_bytes``, 64-byte
    aligned; 0 bytes for a warm one) and ``ext.check``'s three outputs: D and T (fp32
    [2, segs]), A's row statistics (fp32 [3, rows]) and the flags (bool [2, segs])."""
    enc = enc_bytes + (-enc_bytes % 64)
    p = scratch.pointer(enc + 10 * segs + 12 * rows)
    return p, p + enc, p + enc + 8 * segs, p + enc + 8 * segs + 12 * rows




# --- a collective's checksums ----------------------------------------------------------

#: what ``csrc/coll_sums.c`` is written for: core.collective's segment and partial widths
_COLLECTIVE_LAYOUT = (2048, 64)
_SUMS_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _collective_kernel(name: str) -> Any:
    """The extension's entry point ``name``, or ``None``: an extension built before
    ``csrc/coll_sums.c`` lacks it (the checks then use torch's checksums, not fail)."""
    ext = extension()
    return None if ext is None else getattr(ext, name, None)


def _collective_output(out: Tensor, numel: int) -> bool:
    return (out.device.type == "cpu" and out.dtype == torch.float64 and out.is_contiguous()
            and out.numel() == numel)


def collective_sums_into(x: Tensor, out: Tensor, *, with_abs: bool, rows: int = 1) -> bool:
    """``core.collective.segment_sums(x, with_abs=with_abs, rows=rows)`` written into
    ``out`` (fp64, contiguous, CPU) in one native call, laid out as the collective checks
    send it: the even / odd sums ``[rows, segments, 2]``, then (``with_abs``) the
    magnitudes ``[rows, segments]``. ``False`` (``out`` untouched) where the kernel does
    not cover ``x`` (not a contiguous fp32 / bf16 CPU tensor, empty, not ``rows`` equal
    parts, no extension): the caller then uses ``segment_sums``.

    Why: one read instead of three and no torch operation, so that the receiver's
    checksums on the backend's thread never give the GIL back mid-way (``csrc/coll_sums.c``
    keeps it). The sums are added in another order than torch's, with fewer fp32
    roundings; ``core.collective.reduction_bound`` covers both (csrc/coll_sums.c says why).
    """
    kernel = _collective_kernel("coll_sums")
    code = _SUMS_DTYPES.get(x.dtype)
    if kernel is None or code is None or (_collective_core.SEGMENT, _collective_core.PARTIAL) != _COLLECTIVE_LAYOUT:
        return False
    numel = x.numel()
    if x.device.type != "cpu" or not x.is_contiguous() or numel == 0 or rows < 1 or numel % rows:
        return False
    n = numel // rows
    segs = _collective_core.segments(n)
    if not _collective_output(out, rows * segs * (3 if with_abs else 2)):
        return False
    kernel(x.data_ptr(), code, n, rows, int(with_abs), out.data_ptr())
    return True


def collective_bits_into(x: Tensor, wide: bool, out: Tensor, rows: int = 1) -> bool:
    """``core.collective.bit_checksums(x, wide, rows)`` written into ``out`` (fp64 ``[rows,
    2]``, contiguous, CPU; exact: every value is below 2^32) in one native call that keeps
    the GIL (``collective_sums_into`` says why). ``False`` (``out`` untouched) where it
    does not cover ``x`` (not contiguous on the CPU, words that do not split into
    ``rows`` equal rows, no extension): the caller then uses ``bit_checksums``."""
    kernel = _collective_kernel("coll_bits")
    if kernel is None or _collective_core.SEGMENT != _COLLECTIVE_LAYOUT[0]:
        return False
    if x.device.type != "cpu" or not x.is_contiguous() or rows < 1 or not _collective_output(out, 2 * rows):
        return False
    word = 4 if wide or x.element_size() != 2 else 2
    nbytes = x.numel() * x.element_size()
    if nbytes % (word * rows):
        return False
    kernel(x.data_ptr(), int(word == 4), nbytes // (word * rows), rows, out.data_ptr())
    return True
