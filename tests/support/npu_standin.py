"""A stand-in ``torch_npu`` exposing ``_npu_matmul_abft_verify`` as the RFC documents it.

Why: ``torch_npu`` needs Ascend hardware and CANN, so ``sdc_guard.backends.npu`` could otherwise
only be tested for its "unavailable" branch. This module follows the operator's contract
(RFC section 3.5.2.1) including the parts a careless bridge trips over:

- fail-fast ``RuntimeError`` on non-2-D operands, mismatched shapes, illegal dtype
  combinations (``a``/``b`` one dtype of fp16/bf16/fp32, ``c`` always float32,
  ``checksum_weight`` ``[N]`` in ``a``'s dtype), ``e_max < 0`` and non-contiguous inputs;
- output uint8 ``[ceil(M/8) * ceil(N/256)]``, byte ``s * ceil(M/8) + m // 8``, bit
  ``m % 8`` (segment-major, LSB first), 1 = OK, and padding bits that are garbage
  (random here, so a decoder that forgets to mask them fails often);
- the check itself is the float64 reference of docs/ALGORITHM.md ("The NPU operator"), with ``T_abs`` from the tiny of
  ``c``'s dtype (float32 by contract) and without sdc_guard's own round-off floor.

Every call is recorded (the tensors as passed, their contiguity, ``e_max``, the stream
returned) so that tests can see what the bridge really handed to the operator.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from vabft_reference import SEGMENT, reference_check  # noqa: E402

OP_NAME = "_npu_matmul_abft_verify"
#: Input dtypes the operator accepts (FP16 is supported at the operator level).
OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Call:
    """One call of the stand-in operator, as the caller made it."""

    a: Tensor
    b: Tensor
    c: Tensor
    checksum_weight: Tensor
    e_max: float
    contiguous: tuple[bool, bool, bool, bool]  #: of a, b, c, checksum_weight at call time
    stream: Tensor | None = None  #: the raw comp_row returned (None if the call raised)
    zero_padding_bits: int = 0  #: padding bits left 0 in ``stream`` (garbage a decoder must mask)

    @property
    def c_dtype(self) -> torch.dtype:
        """dtype of the ``c`` the caller passed (the contract says float32)."""
        return self.c.dtype

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of a, b, c and the weight, to tell the probe from real calls."""
        return tuple(tuple(t.shape) for t in (self.a, self.b, self.c, self.checksum_weight))


def _fail(message: str) -> None:
    """Raise as the kernel's ``TORCH_CHECK`` does."""
    raise RuntimeError(f"{OP_NAME}: {message}")


def check_contract(a: object, b: object, c: object, checksum_weight: object, e_max: object) -> None:
    """Fail fast, like the C++ kernel, unless the arguments meet the documented contract."""
    named = (("a", a), ("b", b), ("c", c), ("checksum_weight", checksum_weight))
    for name, t in named:
        if not isinstance(t, Tensor):
            _fail(f"{name} must be a Tensor, got {type(t).__name__}")
    for name, t in named[:3]:
        if t.dim() != 2:
            _fail(f"{name} must be 2-D, got {t.dim()}-D")
    if checksum_weight.dim() != 1:
        _fail(f"checksum_weight must be 1-D, got {checksum_weight.dim()}-D")
    (m, k), (k2, n) = a.shape, b.shape
    if k2 != k or tuple(c.shape) != (m, n) or tuple(checksum_weight.shape) != (n,):
        _fail(f"shape mismatch: a {tuple(a.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}, "
              f"checksum_weight {tuple(checksum_weight.shape)}")
    if a.dtype not in OP_DTYPES or b.dtype != a.dtype:
        _fail(f"a and b must share one of fp16/bf16/fp32, got {a.dtype} and {b.dtype}")
    if c.dtype != torch.float32:
        _fail(f"c must be float32, got {c.dtype}")
    if checksum_weight.dtype != a.dtype:
        _fail(f"checksum_weight must have a's dtype {a.dtype}, got {checksum_weight.dtype}")
    if len({t.device for _, t in named}) != 1:
        _fail("all tensors must be on one device")
    if isinstance(e_max, bool) or not isinstance(e_max, (int, float)) or not e_max >= 0:
        _fail(f"e_max must be >= 0, got {e_max!r}")
    for name, t in named:
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous")


def pack_comp_row(ok: np.ndarray, garbage: np.ndarray) -> tuple[np.ndarray, int]:
    """Pack bool ``[M, nseg]`` into the operator's stream, padding bits from ``garbage``.

    Written from the RFC's layout, independently of ``sdc_guard.core.abft.encode_comp_row``, so
    that the bridge's decoder is checked against a second reading of the layout. Returns
    the stream and how many padding bits ended up 0.
    """
    m, nseg = ok.shape
    groups = -(-m // 8)
    stream = np.zeros(groups * nseg, dtype=np.uint8)
    valid = np.zeros(groups * nseg, dtype=np.uint8)
    rows = np.arange(m)
    for s in range(nseg):
        index = s * groups + rows // 8
        bits = (1 << (rows % 8)).astype(np.uint8)
        np.bitwise_or.at(valid, index, bits)
        np.bitwise_or.at(stream, index, np.where(ok[:, s], bits, 0).astype(np.uint8))
    padding = ~valid
    stream |= garbage.astype(np.uint8) & padding
    return stream, int(np.unpackbits(padding & ~stream).sum())


class NpuOperator:
    """The callable installed as ``torch_npu._npu_matmul_abft_verify``.

    ``fail_from_call``: every call with index >= it raises ``RuntimeError(failure)``
    before looking at its arguments (0 fails the probe; 1 lets the probe pass and fails
    the first real call). ``padding``: ``"random"`` (seeded), ``"zeros"`` or ``"ones"``.
    """

    def __init__(self, *, seed: int = 0, fail_from_call: int | None = None,
                 failure: str = "aclnnMatmulAbftVerify failed: ACL error 507015",
                 padding: str = "random") -> None:
        if padding not in ("random", "zeros", "ones"):
            raise ValueError(f"padding: expected 'random', 'zeros' or 'ones', got {padding!r}")
        self.calls: list[Call] = []
        self.fail_from_call = fail_from_call
        self.failure = failure
        self.padding = padding
        self._rng = np.random.default_rng(seed)

    def __call__(self, a: Tensor, b: Tensor, c: Tensor, checksum_weight: Tensor, *,
                 e_max: float = 0.001) -> Tensor:
        record = Call(a, b, c, checksum_weight, e_max, _contiguity(a, b, c, checksum_weight))
        self.calls.append(record)
        if self.fail_from_call is not None and len(self.calls) - 1 >= self.fail_from_call:
            raise RuntimeError(self.failure)
        check_contract(a, b, c, checksum_weight, e_max)
        ok = reference_check(a, b, c, checksum_weight, e_max=float(e_max), c_dtype=c.dtype).ok
        groups, nseg = -(-a.shape[0] // 8), -(-b.shape[1] // SEGMENT)
        stream, record.zero_padding_bits = pack_comp_row(ok, self._garbage(groups * nseg))
        record.stream = torch.from_numpy(stream).to(a.device)
        return record.stream

    def _garbage(self, size: int) -> np.ndarray:
        if self.padding == "zeros":
            return np.zeros(size, dtype=np.uint8)
        if self.padding == "ones":
            return np.full(size, 0xFF, dtype=np.uint8)
        return self._rng.integers(0, 256, size=size, dtype=np.uint8)

    def real_calls(self, probe_shape: tuple[int, int] = (8, 16)) -> list[Call]:
        """Calls other than the probe (whose ``a`` is the probe's tiny ``[8, 16]``)."""
        return [call for call in self.calls if tuple(call.a.shape) != probe_shape]


def _contiguity(*tensors: object) -> tuple[bool, ...]:
    return tuple(bool(isinstance(t, Tensor) and t.is_contiguous()) for t in tensors)


def make_module(operator: NpuOperator | None) -> types.ModuleType:
    """A ``torch_npu`` module; ``operator=None`` models stock CANN (no symbol)."""
    module = types.ModuleType("torch_npu")
    module.__doc__ = "sdc_guard test stand-in for torch_npu (no Ascend device)"
    if operator is not None:
        setattr(module, OP_NAME, operator)
    return module


def expected_stream_length(m: int, n: int) -> int:
    """``ceil(M/8) * ceil(N/256)``: bytes of a comp_row."""
    return math.ceil(m / 8) * math.ceil(n / SEGMENT)
