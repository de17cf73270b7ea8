"""The ``triton`` backend: the fused kernel of ``sdc_guard.kernels`` on CUDA."""

from __future__ import annotations

import functools

import torch

from ..core.abft import AbftCheck
from .base import Backend, GemmRequest
from .torch_backend import TorchBackend


@functools.cache
def _triton_import() -> str | None:
    """Why the Triton kernel module cannot be imported, or ``None``: tried once per process
    (a failed import is not cached by Python, and compiling the module's source again cost
    2 ms on every call; ``reprobe`` forgets it)."""
    try:
        from ..kernels import vabft_triton  # noqa: F401  (imports triton)
    except ImportError as exc:
        return f"triton kernel not importable: {exc}"
    return None


class TritonBackend(Backend):
    """The fused Triton kernel of ``sdc_guard.kernels`` for CUDA tensors.

    ``device_type`` exists so that tests can drive the kernel on CPU tensors under
    ``TRITON_INTERPRET=1``; production use is the default, ``"cuda"``.
    """

    name = "triton"

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type

    def unavailable_reason(self) -> str | None:
        reason = _triton_import()
        if reason is None and self.device_type == "cuda" and not torch.cuda.is_available():
            return "no CUDA device"
        return reason

    def rejects(self, req: GemmRequest) -> str | None:
        if req.device.type != self.device_type:
            return f"tensors are on {req.device.type}, the kernel runs on {self.device_type}"
        from ..kernels import vabft_triton

        return vabft_triton.rejects(req)

    def check(self, req: GemmRequest) -> AbftCheck:
        from ..kernels import vabft_triton

        if vabft_triton.rejects(req) is not None:  # a caller that chose for a coarser key
            return TorchBackend.check(self, req)  # type: ignore[arg-type]
        return vabft_triton.triton_check(req)
