"""What a compiled step runs, counted from outside the guard (the compile suites' oracle)."""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from sdc_guard.runtime.dispatch.ops import Route, route_of


class GemmCount(TorchDispatchMode):
    """Counts the aten ops the op registry routes as a GEMM or fused attention, as the
    compiled code calls them: dynamo compiles through this mode, which then sees what the
    compiled artifact runs (``aot_eager`` every op of its graphs; inductor on CPU its
    GEMMs, extern kernels, and its attention fallbacks)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if isinstance(func, OpOverload) and route_of(func) in (Route.GEMM, Route.ATTENTION):
            self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def fresh() -> None:
    """Dynamo's caches and counters emptied."""
    torch._dynamo.reset()
    counters.clear()


def compiled_gemms(make: Callable[[], torch.nn.Module], step: Callable[[Any], None], backend: str) -> int:
    """GEMM and attention calls of one compiled, unguarded step of ``make()`` (dynamo
    fresh before and after)."""
    fresh()
    compiled = torch.compile(make(), backend=backend)
    step(compiled)  # compiled here, outside the count
    with GemmCount() as count:
        step(compiled)
    fresh()
    return sum(count.calls.values())
