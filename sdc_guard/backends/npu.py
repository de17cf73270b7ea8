"""Bridge to the Ascend operator ``torch_npu._npu_matmul_abft_verify`` (aclnnMatmulAbftVerify).

The operator's contract (RFC, section 3.5.2.1): ``(a, b, c, checksum_weight, *, e_max)``
with 2-D, contiguous, ND ``a [M, K]`` and ``b [K, N]`` of one dtype, ``c [M, N]`` always
float32, ``checksum_weight [N]`` in ``a``'s dtype; it returns the ``comp_row`` bitstream
whose padding bits are undefined, and raises ``RuntimeError`` on anything else.

The bridge does what the RFC's dispatcher does: cast ``c`` to fp32, make operands
contiguous, cache the all-ones weight per (N, dtype, device), pass the bracket's
``e_max``. Availability is probed once with a tiny legal call: a probe failure means the
operator is unavailable (stock CANN lacks the symbol); an error in a real call is the
operator's and is raised, never swallowed into a silent fallback.

What the operator's formula can and cannot be (docs/ALGORITHM.md, "The NPU operator"):
it computes ``e_eff * bracket + n_s tiny`` from A and B alone, with no term that reads C.
sdc_guard's screen bounds C's own rounding from C (``u_C / (1 - u_C) sum |r C|``), which
no ``e_max`` reproduces. So the bridge takes only what the operator can screen at least
as tightly as the portable screen, and lets the confirmation settle the rest:

- fp32 at the accumulation-level ``e_max``: the operator's T is the portable T minus
  fp32-level terms (``u_fp32 |A| @ |B| r``, ``u_fp32 sum |r C|``, the flush floor), so
  every segment the portable screen flags, the operator flags too; the few it flags
  beyond (structured operands) are suspects the exact confirmation clears. The
  confirmed verdicts are the same.
- bf16: at that ``e_max`` the operator would flag most clean segments (C's rounding is
  64 times the bracket there), and at the operator's recommended 1e-3 it would miss what
  the portable screen sees: neither gives the same verdicts, so bf16 is declined and the
  portable screen serves it on the NPU (torch ops on the device). An operator whose
  threshold added ``c_abs * sum |r C|`` (one more reduction in its pass over C) would
  take bf16 back.

torch_npu cannot be imported off Ascend hardware; the tests exercise this module through a
stand-in that follows the contract above, installed as ``sys.modules["torch_npu"]``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

from ..core.abft import AbftCheck, row_stats, weight_side
from ..core.comp_row import decode_comp_row
from ..core.segments import segment_reduce
from .base import Backend, GemmRequest
from ..core.precision import overflow_limit

OP_NAME = "_npu_matmul_abft_verify"
#: dtypes the bridge hands the operator: fp32 only (see the module docstring; fp16 has
#: no recommended e_max on the operator, RFC non-goals; bf16's screen reads C).
NPU_DTYPES = (torch.float32,)


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of the one-time availability probe."""

    available: bool
    reason: str  #: why not, or what answered


def _rows_nonfinite(a: Tensor) -> Tensor:
    return ~torch.isfinite(a.sum(-1, dtype=torch.float32))


def _segments_nonfinite(x: Tensor) -> Tensor:
    """bool ``[..., rows, nseg]``: a non-finite value lies in the (row, segment)."""
    return segment_reduce(~torch.isfinite(x), lambda t, d: t.any(d))


class NpuBackend(Backend):
    """``torch_npu``'s V-ABFT operator for 2-D bf16/fp32 GEMMs on Ascend NPUs."""

    name = "npu"

    def __init__(self, device_type: str = "npu") -> None:
        self.device_type = device_type
        self._probe: ProbeResult | None = None
        self._ones: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    def _operator(self) -> Callable[..., Tensor] | None:
        try:
            module: ModuleType = importlib.import_module("torch_npu")
        except ImportError:
            return None
        return getattr(module, OP_NAME, None)

    def probe(self) -> ProbeResult:
        """Probe once with a tiny legal call and cache the answer (queryable).

        >>> NpuBackend().probe().available
        False
        """
        if self._probe is None:
            self._probe = self._run_probe()
        return self._probe

    def reset_probe(self) -> None:
        """Forget the cached probe (after installing or removing torch_npu)."""
        self._probe = None
        self._ones.clear()

    def _run_probe(self) -> ProbeResult:
        op = self._operator()
        if op is None:
            return ProbeResult(False, f"torch_npu.{OP_NAME} not found (torch_npu missing or stock CANN)")
        try:
            a = torch.ones(8, 16, device=self.device_type)
            b = torch.ones(16, 256, device=self.device_type)
            out = op(a, b, a @ b, torch.ones(256, device=self.device_type), e_max=2e-5)
            ok = bool(decode_comp_row(out, 8, 256).all())
        except Exception as exc:  # a probe failure is the definition of unavailable
            return ProbeResult(False, f"probe call failed: {type(exc).__name__}: {exc}")
        if not ok:
            return ProbeResult(False, "probe call flagged a correct product")
        return ProbeResult(True, f"torch_npu.{OP_NAME} answered the probe")

    def unavailable_reason(self) -> str | None:
        result = self.probe()
        return None if result.available else result.reason

    def rejects(self, req: GemmRequest) -> str | None:
        if req.device.type != self.device_type:
            return f"tensors are on {req.device.type}, not {self.device_type}"
        if req.a.dim() != 2 or req.b.dim() != 2:
            return "the operator takes 2-D operands only"
        if req.a.dtype == torch.bfloat16 or req.c.dtype == torch.bfloat16:
            return ("bfloat16: the screen bounds C's rounding from C, a term the operator's threshold "
                    "does not have (the portable screen serves it)")
        if req.a.dtype not in NPU_DTYPES:
            return f"no recommended e_max for {req.a.dtype} on the operator"
        if req.bias is not None or req.alpha != 1.0:
            return "the operator verifies a plain a @ b (no bias, alpha = 1)"
        return None

    def _checksum_weight(self, req: GemmRequest) -> Tensor:
        if req.checksum_weight is not None:
            return req.checksum_weight.to(req.a.dtype).contiguous()
        key = (req.b.shape[-1], req.a.dtype, req.device)
        if key not in self._ones:
            self._ones[key] = torch.ones(key[0], dtype=key[1], device=key[2])
        return self._ones[key]

    def check(self, req: GemmRequest) -> AbftCheck:
        op = self._operator()
        assert op is not None, "check() called on an unavailable npu backend"
        a, b = req.a.contiguous(), req.b.contiguous()
        c = req.c.to(torch.float32).contiguous()
        stream = op(a, b, c, self._checksum_weight(req), e_max=operator_e_max(req.e_max, a.shape[1], req.c.dtype))
        ok = decode_comp_row(stream, a.shape[0], b.shape[1])
        inputs_bad = _rows_nonfinite(a).unsqueeze(-1) | _segments_nonfinite(b).any(-2).unsqueeze(-2)
        # No D from the operator: a failed bit over non-finite C is a possible overflow
        # only where the magnitudes allow one (the torch backend's bound, O(MK + KN)).
        bound = row_stats(a).norm.unsqueeze(-1) * weight_side(b).col_norm.unsqueeze(-2)
        possible_overflow = ~ok & ~inputs_bad & _segments_nonfinite(req.c) & (bound >= overflow_limit(req.c.dtype))
        return AbftCheck(ok, inputs_bad, possible_overflow)


def operator_e_max(e_max: float, k: int, c_dtype: torch.dtype) -> float:
    """The ``e_max`` to pass: the portable screen's own, so that the operator's
    ``e_eff * bracket`` is exactly the portable screen's bracket term and its T never
    exceeds the portable T (which adds terms the operator lacks). ``k`` and ``c_dtype``
    are accepted for the callers of the earlier signature, which raised ``e_max`` to
    carry a floor at C's unit roundoff (now a term of its own that reads C).

    >>> operator_e_max(2e-5, 64, torch.float32)
    2e-05
    """
    return e_max
