"""Backend registry and dispatch: one entry point, the best implementation per call.

Order of preference (docs/ALGORITHM.md, opening and "The NPU operator"): the Ascend operator
where it exists,
the fused Triton kernel on CUDA, the native C kernels on CPU (when built), portable
PyTorch everywhere. Each backend says whether
this process can use it (``unavailable_reason``) and whether it accepts a given call
(``rejects``); a call is served by an explicit ``backend=`` / ``SDC_GUARD_BACKEND``, else
by the first backend that is available and accepts it. A call nobody can serve fails with
every backend's reason, never silently.

>>> from sdc_guard import backends
>>> "torch" in backends.available()
True
"""

from .base import Backend, GemmRequest
from .cpu_backend import CpuBackend
from .registry import (
    ENV_BACKEND,
    available,
    get,
    register,
    registered,
    reprobe,
    select,
    status,
    unregister,
)
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

__all__ = [
    "ENV_BACKEND",
    "Backend",
    "CpuBackend",
    "GemmRequest",
    "TorchBackend",
    "TritonBackend",
    "available",
    "get",
    "register",
    "registered",
    "reprobe",
    "select",
    "status",
    "unregister",
]
