"""The ``cpu`` backend: the native C kernels of ``csrc/`` (``sdc_guard.backends.native``)."""

from __future__ import annotations

from torch import Tensor

from . import native
from ..core.abft import AbftCheck, WeightSide
from ..core.precision import ScreenTerms
from .base import Backend, GemmRequest
from .native_plan import Plans
from .torch_backend import TorchBackend


class CpuBackend(Backend):
    """Native C kernels for CPU tensors (``sdc_guard.backends.native``, ``csrc/``): one
    call per verification where the torch path runs dozens of ops.

    Available when the optional extension was built at install time. A call it does not
    cover (``native.rejects``) falls to ``torch``; so does one that reaches ``check``
    anyway (a caller that cached its choice of backend for a coarser key).
    """

    name = "cpu"

    def __init__(self) -> None:
        self._scratch = native.Scratch()
        self._plans = Plans()

    def unavailable_reason(self) -> str | None:
        return native.unavailable_reason()

    def rejects(self, req: GemmRequest) -> str | None:
        return native.rejects(req)

    def check(self, req: GemmRequest) -> AbftCheck:
        got = native.native_check(req) if native.rejects(req) is None else None
        if got is None:
            return TorchBackend.check(self, req)  # type: ignore[arg-type]
        return got

    def encode(self, b: Tensor, checksum_weight: Tensor | None = None) -> WeightSide:
        return native.native_weight_side(b, checksum_weight)

    def clear_worst(self, req: GemmRequest) -> float | None:
        """A clear check's outputs go to scratch memory (``native.native_clear``); anything
        else is checked again in full by the caller (failures are rare)."""
        return native.native_clear(req, self._scratch)  # None where not covered, too

    def clear_gemm(self, a: Tensor, b: Tensor, c: Tensor, e_max: float, *, bias: Tensor | None = None,
                   alpha: float = 1.0, beta: float = 1.0, weight: WeightSide | None = None,
                   rounding: ScreenTerms | None = None) -> float | None:
        """``clear_worst`` through a plan of the call's layout (``native_plan``): the
        kernels' arguments worked out once per layout, not once per call."""
        ext = native.extension()
        plans = self._plans
        key = plans.key(a, b, c, bias, alpha, beta, weight, e_max, rounding) if ext is not None else None
        if key is not None:
            plan = plans.get(key, ext, a, b, c, bias, alpha, beta, weight, e_max, rounding, native.rejects)
            if plan is not None:
                all_ok, worst = plan.run(ext, self._scratch.pointer(plan.nbytes), a, b, c,
                                         bias if beta != 0.0 else None, weight, native.default_threads())
                return worst if all_ok else None
        req = GemmRequest(a, b, c, e_max, bias=bias, alpha=alpha, beta=beta, weight=weight, rounding=rounding)
        return self.clear_worst(req)
