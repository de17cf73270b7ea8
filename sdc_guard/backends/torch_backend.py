"""The ``torch`` backend: portable PyTorch, any device, any layout; the reference."""

from __future__ import annotations

from ..core.abft import AbftCheck, vabft_check
from .base import Backend, GemmRequest


class TorchBackend(Backend):
    """Portable PyTorch (``sdc_guard.core.abft``): any device, any layout; the reference."""

    name = "torch"

    def check(self, req: GemmRequest) -> AbftCheck:
        return vabft_check(
            req.a, req.b, req.c, req.checksum_weight, e_max=req.e_max, bias=req.bias,
            alpha=req.alpha, beta=req.beta, weight=req.weight, rounding=req.terms,
        )
