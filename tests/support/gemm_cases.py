"""Operands and requests for the tests that compare a kernel backend with the torch one
(``test_native``, ``test_triton_kernel``): seeded data and a request at the dtype's
default ``e_max``."""

from __future__ import annotations

import torch

from sdc_guard.backends import GemmRequest
from sdc_guard.core.precision import DEFAULT_E_MAX


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def request(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, **kw) -> GemmRequest:
    kw.setdefault("e_max", DEFAULT_E_MAX[a.dtype])
    return GemmRequest(a, b, c, **kw)
