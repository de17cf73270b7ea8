"""``GemmRequest``: one validated verification call, what every backend and kernel reads.

It lives in ``core/`` (below ``backends/`` and ``kernels/``) so that the Triton kernel
module and the backends share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .abft import WeightSide
from .precision import ScreenTerms, screen_terms


@dataclass(frozen=True)
class GemmRequest:
    """One validated verification call: ``c == alpha * a @ b + beta * bias``."""

    a: Tensor
    b: Tensor
    c: Tensor
    e_max: float
    checksum_weight: Tensor | None = None
    bias: Tensor | None = None
    alpha: float = 1.0
    beta: float = 1.0
    weight: WeightSide | None = None  #: cached weight-side encoding of ``b``, if any
    #: the screen's terms besides the bracket (``precision.resolve_screen``); ``None``: the
    #: default screen for this request's dtype and device (``terms``)
    rounding: ScreenTerms | None = None

    @property
    def device(self) -> torch.device:
        return self.c.device

    @property
    def terms(self) -> ScreenTerms:
        """``rounding``, or the default screen's terms for ``a``'s dtype on ``c``'s device."""
        if self.rounding is not None:
            return self.rounding
        return screen_terms("default", self.a.dtype, self.c.device)
