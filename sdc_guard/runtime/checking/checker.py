"""Verify one GEMM: the screen's threshold for its dtype and device, the backend for its
kind of call, and the weight side's cached encoding, each chosen once and reused.

The guard (``sdc_guard.runtime.lifecycle.guard``) decides which GEMMs to verify and records what
verification returns; this is the part that runs a check.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ... import backends
from ...backends import Backend, GemmRequest
from ...core.precision import SUPPORTED_DTYPES, ScreenTerms, resolve_screen
from ...core.summary import clear_summary, summarize
from .cache import WeightCache
from ..dispatch.ops import Gemm


class Checker:
    """Runs the V-ABFT check of a GEMM through the chosen backend (docs/ALGORITHM.md).

    ``screen`` and ``e_max`` choose the threshold (``sdc_guard.core.precision``),
    ``backend`` forces a backend by name (``None``: the dispatcher chooses), ``cache``
    holds the weight sides' encodings.
    """

    def __init__(self, screen: str, e_max: float | None, backend: str | None, cache: WeightCache) -> None:
        self.screen = screen
        self.e_max = e_max
        self.backend = backend
        self.cache = cache
        self._backend_choice: dict[tuple, Backend] = {}
        self._e_max_choice: dict[tuple, tuple[float, ScreenTerms]] = {}
        #: per kind of call (``choose_backend``'s key): what every check of that kind
        #: reuses, (backend, e_max, rounding, encoder of the cached weight side or None,
        #: whether the backend answers clear checks without a request)
        self._routes: dict[tuple, tuple[Backend, float, ScreenTerms, Any, bool]] = {}

    def verify(self, gemm: Gemm) -> tuple[Tensor | None, Tensor | list[float]]:
        a, b, out, bias, alpha, beta = gemm.a, gemm.b, gemm.out, gemm.bias, gemm.alpha, gemm.beta
        key = (a.device, a.dtype, a.dim(), b.dim(), bias is not None, alpha == 1.0)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._route(gemm)
        backend, e_max, rounding, encode, fast = route
        # the operator re-reads B itself; the others take the cached encoding
        weight = self.cache.get(b, encode=encode) if encode is not None else None
        if fast:  # the guard's hot path: no request object for a clear check
            worst = backend.clear_gemm(a, b, out, e_max, bias=bias, alpha=alpha, beta=beta, weight=weight,
                                       rounding=rounding)
            if worst is not None:
                return None, clear_summary(worst)
        req = GemmRequest(a, b, out, e_max, bias=bias, alpha=alpha, beta=beta, weight=weight, rounding=rounding)
        if fast:  # not clear: the full check, confirmed (its clear_worst already said no)
            return summarize(req, backend.check(req), weight is not None)
        return backend.summarize(req, cached=weight is not None)

    def _route(self, gemm: Gemm) -> tuple[Backend, float, ScreenTerms, Any, bool]:
        a = gemm.a
        choice = self._e_max_choice.get((a.device, a.dtype))
        if choice is None:
            choice = self._e_max_choice[(a.device, a.dtype)] = resolve_screen(self.screen, self.e_max, a.dtype,
                                                                              a.device)
        e_max, rounding = choice
        backend = self.choose_backend(gemm, e_max)
        fast = type(backend).clear_gemm is not Backend.clear_gemm and type(backend).summarize is Backend.summarize
        return backend, e_max, rounding, (backend.encode if backend.name != "npu" else None), fast

    def choose_backend(self, gemm: Gemm, e_max: float) -> Backend:
        """The backend for GEMMs like this one, chosen once per kind of call: device,
        dtype, dims, bias and alpha (what the NPU operator's contract depends on). The
        Triton and native kernels also depend on strides; a call of theirs that their
        ``rejects`` would refuse goes to the torch path inside their ``check``."""
        a = gemm.a
        key = (a.device, a.dtype, a.dim(), gemm.b.dim(), gemm.bias is not None, gemm.alpha == 1.0)
        chosen = self._backend_choice.get(key)
        if chosen is None:
            req = GemmRequest(a, gemm.b, gemm.out, e_max, bias=gemm.bias, alpha=gemm.alpha, beta=gemm.beta)
            chosen = self._backend_choice[key] = backends.select(req, self.backend)
        return chosen


def verifiable(gemm: Gemm) -> bool:
    """A GEMM the check can take: floating operands of one supported dtype, matrices or
    batches of them, a floating bias."""
    a, b, out = gemm.a, gemm.b, gemm.out
    return (
        a.dtype in SUPPORTED_DTYPES and b.dtype == a.dtype and out.dtype in SUPPORTED_DTYPES
        and a.dim() >= 2 and b.dim() >= 2 and out.dim() >= 2
        and (gemm.bias is None or gemm.bias.is_floating_point())
    )
