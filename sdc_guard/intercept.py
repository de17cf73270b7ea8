"""See every GEMM: a ``TorchDispatchMode`` plus a registry from aten op to a small handler.

Like ``torch.utils.flop_counter.FlopCounterMode``: each handler turns one aten call into
the GEMM it computed, ``out = beta * bias + alpha * (a @ b)``; adding an op is adding one
handler. ``mm``/``addmm``/``bmm``/``baddbmm`` are what ``nn.Linear`` and ``torch.matmul``
decompose into when autograd records; ``linear`` and ``matmul`` arrive undecomposed under
``torch.inference_mode()``.

The mode runs the op first and hands the untouched output to the guard: verification
reads the GEMM's tensors and never writes them, and, since PyTorch disables a dispatch
mode while its handler runs, verification's own ops are never intercepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import Tensor
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

aten = torch.ops.aten

GLOBAL_SITE = "global"


@dataclass(frozen=True)
class Gemm:
    """One intercepted GEMM: ``out = beta * bias + alpha * (a @ b)``, batch dims broadcast."""

    op: str
    a: Tensor
    b: Tensor
    out: Tensor
    bias: Tensor | None = None
    alpha: float = 1.0
    beta: float = 1.0


Handler = Callable[[tuple, dict, Any], "Gemm | None"]


def _mm(args: tuple, kwargs: dict, out: Tensor) -> Gemm:
    return Gemm("mm", args[0], args[1], out)


def _bmm(args: tuple, kwargs: dict, out: Tensor) -> Gemm:
    return Gemm("bmm", args[0], args[1], out)


def _addmm_like(name: str) -> Handler:
    def handler(args: tuple, kwargs: dict, out: Tensor) -> Gemm:
        beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
        alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
        return Gemm(name, args[1], args[2], out, args[0], float(alpha), float(beta))

    return handler


def _linear(args: tuple, kwargs: dict, out: Tensor) -> Gemm | None:
    x, w = args[0], args[1]
    bias = kwargs.get("bias", args[2] if len(args) > 2 else None)
    if w.dim() != 2:
        return None
    if x.dim() == 1:
        return Gemm("linear", x.unsqueeze(0), w.t(), out.unsqueeze(0), bias)
    return Gemm("linear", x, w.t(), out, bias)


def _matmul(args: tuple, kwargs: dict, out: Tensor) -> Gemm | None:
    x, y = args[0], args[1]
    if x.dim() == 1 and y.dim() == 1:
        return None  # a dot product: no GEMM to checksum
    if x.dim() == 1:
        return Gemm("matmul", x.unsqueeze(0), y, out.unsqueeze(-2))
    if y.dim() == 1:
        return Gemm("matmul", x, y.unsqueeze(-1), out.unsqueeze(-1))
    return Gemm("matmul", x, y, out)


#: aten overload packet -> handler. Adding an op is adding one line here.
GEMM_HANDLERS: dict[Any, Handler] = {
    aten.mm: _mm,
    aten.addmm: _addmm_like("addmm"),
    aten.bmm: _bmm,
    aten.baddbmm: _addmm_like("baddbmm"),
    aten.linear: _linear,
    aten.matmul: _matmul,
}

#: Ops that carry GEMMs sdc_guard cannot verify: counted in reports, passed through.
UNVERIFIED_GEMM_OPS: frozenset[Any] = frozenset(
    getattr(aten, name)
    for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention_backward", "_addmm_activation", "convolution",
        "convolution_backward", "_scaled_mm", "_int_mm", "addmv", "mv", "addbmm", "dot", "vdot",
    )
    if hasattr(aten, name)
)


def current_phase() -> str:
    """``"backward"`` while the autograd engine runs a backward pass, else ``"forward"``."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


class SiteTracker:
    """Which module of ``model`` is running: ``ModuleTracker``, with paths made relative.

    A site is the path of the deepest running module relative to ``model``
    ("blocks.0.attn.proj", as in ``model.named_modules()``), the model's class name for
    the model itself, and ``"global"`` outside any module. ``ModuleTracker`` names
    modules after whichever root it saw first (a DDP wrapper, or a submodule that a
    ``training_step`` calls directly), so its names are mapped back to module objects
    (its private ``_known_modules``) and from there to ``model``'s own names.
    Re-entered once per step (its hooks accumulate while active).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._tracker: ModuleTracker | None = None
        self._relative: dict[int, str] = {}
        self._by_tracker_name: dict[str, nn.Module] = {}

    def start(self) -> None:
        self.stop()
        self._relative = {id(m): name for name, m in self.model.named_modules()}
        self._by_tracker_name = {}
        self._tracker = ModuleTracker().__enter__()

    def stop(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None

    def _module(self, tracker_name: str) -> nn.Module | None:
        known = getattr(self._tracker, "_known_modules", None)
        if known is None:
            return None
        if tracker_name not in self._by_tracker_name and len(self._by_tracker_name) != len(known):
            self._by_tracker_name = {name: module for module, name in known.items()}
        return self._by_tracker_name.get(tracker_name)

    def site(self) -> str:
        """The current site (see the class docstring)."""
        parents = self._tracker.parents if self._tracker is not None else set()
        names = [p for p in parents if p != "Global"]
        if not names:
            return GLOBAL_SITE
        deepest = max(names, key=lambda n: (n.count("."), n))
        module = self._module(deepest)
        relative = self._relative.get(id(module)) if module is not None else None
        if relative is None:
            return deepest  # a module outside the protected model
        return relative or type(self.model).__name__


class GemmSink(Protocol):
    """What the mode reports to (the ``Guard``)."""

    def on_gemm(self, gemm: Gemm) -> None: ...
    def on_unverified(self, op: str) -> None: ...


class GemmInterceptor(TorchDispatchMode):
    """Dispatch mode that reports every GEMM (and every unverifiable GEMM-bearing op).

    >>> seen = []
    >>> class Sink:
    ...     def on_gemm(self, g): seen.append(g.op)
    ...     def on_unverified(self, op): pass
    >>> with GemmInterceptor(Sink()):
    ...     _ = torch.randn(2, 3) @ torch.randn(3, 4)
    >>> seen
    ['mm']
    """

    def __init__(self, sink: GemmSink) -> None:
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        handler = GEMM_HANDLERS.get(packet)
        if handler is not None:
            if func is packet.default:
                gemm = handler(args, kwargs, out)
                if gemm is not None:
                    self.sink.on_gemm(gemm)
                    return out
            self.sink.on_unverified(str(packet))
        elif packet in UNVERIFIED_GEMM_OPS:
            self.sink.on_unverified(str(packet))
        return out
