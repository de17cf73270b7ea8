"""See every GEMM: a ``TorchDispatchMode`` plus a registry from aten op to a small handler.

Like ``torch.utils.flop_counter.FlopCounterMode``: each handler turns one aten call into
the GEMM it computed, ``out = beta * bias + alpha * (a @ b)``; adding an op is adding one
handler. ``mm``/``addmm``/``bmm``/``baddbmm`` are what ``nn.Linear`` and ``torch.matmul``
decompose into when autograd records; ``linear`` and ``matmul`` arrive undecomposed under
``torch.inference_mode()``.

The mode runs the op first and hands the untouched output to the guard: verification
reads the GEMM's tensors and never writes them, and, since PyTorch disables a dispatch
mode while its handler runs, verification's own ops are never intercepted. It also tells
the guard which tensors an op wrote (the arguments its schema marks ``Tensor(a!)``), so
that a weight written by the program (``p.data.add_()``, an optimizer step, a
``load_state_dict``) gets its cached encoding remade, while one changed by hardware keeps
the encoding of its good value (``sdc_guard.runtime.cache``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import Tensor
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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
    """Which module of ``model`` a GEMM comes from: its site, in ``model.named_modules()``
    terms ("blocks.0.attn.proj"), the model's class name for the model itself, ``"global"``
    outside any of its modules.

    - Forward (and a checkpointed forward recomputed during backward): the innermost of
      the running modules, kept on a stack by forward pre/post hooks on the model's own
      modules, installed by ``start`` and removed by ``stop``.
    - Backward: the GEMMs of a backward run inside the autograd node of the forward op
      (``AddmmBackward0`` computes both gradients of an ``addmm``). The site of each forward
      GEMM is written into its node's ``metadata`` once autograd has attached the node to
      the output (by the next GEMM seen, or at latest when the backward asks), and read back
      from ``torch._C._current_autograd_node()``. Nothing here holds a node or a saved
      tensor past its use.

    Why not ``torch.utils.module_tracker.ModuleTracker``: its global hooks and per-call
    multi-grad hooks cost about 4 % of a small model's CPU step, as much as the dispatch
    mode itself. A GEMM in the backward of a custom ``autograd.Function`` (no forward GEMM
    of its own) is attributed to ``"global"``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._key = f"sdc_guard.site.{id(self)}"  #: node metadata key (one per tracker)
        self._stack: list[str] = []
        self._hooks: list[Any] = []
        self._pending: list[tuple[Tensor, str]] = []  #: forward outputs awaiting their grad_fn
        self.calls = 0  #: module calls that ran the hooks (each paid ``module_hook_seconds``)

    def start(self) -> None:
        """Install the module hooks (once per step: modules added since are seen too)."""
        self.stop()
        root = type(self.model).__name__
        for name, module in self.model.named_modules():
            self._hooks.append(module.register_forward_pre_hook(self._pusher(name or root)))
            self._hooks.append(module.register_forward_hook(self._pop, always_call=True))

    def stop(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._stack.clear()
        self._pending.clear()

    def _pusher(self, name: str) -> Callable[..., None]:
        def push(module: nn.Module, args: Any) -> None:
            self.calls += 1
            self._stack.append(name)
        return push

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def _label_pending(self) -> None:
        """Write the site of each forward GEMM seen into its (now attached) autograd node."""
        for out, site in self._pending:
            node = out.grad_fn
            if node is not None:
                node.metadata[self._key] = site
        self._pending.clear()

    def site(self, out: Tensor, operands: tuple[Tensor, ...]) -> str:
        """The site of the GEMM that produced ``out`` from ``operands`` (see the class doc)."""
        if self._pending:
            self._label_pending()
        if not self._stack and torch._C._current_graph_task_id() != -1:  # a backward GEMM
            node = torch._C._current_autograd_node()
            return node.metadata.get(self._key, GLOBAL_SITE) if node is not None else GLOBAL_SITE
        # a forward, or one recomputed by activation checkpointing during backward
        site = self._stack[-1] if self._stack else GLOBAL_SITE
        if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
            self._pending.append((out, site))
        return site


class _EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*args, **(kwargs or {}))


_round_trip: list[float] = []


def round_trip_seconds() -> float:
    """What a dispatch mode's Python round trip adds to one aten op on this machine, in
    seconds: measured once per process (a 16-element ``add``, 300 times bare and 300 times
    under an empty mode, the difference of the medians). The guard charges it per op it
    intercepts, so that its reported cost includes interception, not only verification
    (docs/ALGORITHM.md is silent on costs; sdc_guard.runtime.ledger says how they are added)."""
    if not _round_trip:
        x = torch.ones(16)

        def median_call() -> float:
            times = []
            for _ in range(300):
                t0 = time.perf_counter()
                torch.add(x, 1.0)
                times.append(time.perf_counter() - t0)
            times.sort()
            return times[len(times) // 2]

        bare = median_call()
        with _EmptyMode():
            moded = median_call()
        _round_trip.append(max(0.0, moded - bare))
    return _round_trip[0]


_module_hook: list[float] = []


def module_hook_seconds() -> float:
    """What the site tracker's pair of forward hooks adds to one module call on this
    machine, in seconds: measured once per process (an ``nn.Identity`` called 300 times
    bare and 300 times with a pre-hook and an always-called post-hook like the tracker's,
    the difference of the medians). A module with hooks leaves ``nn.Module``'s fast call
    path, which costs more than the hooks' own bodies; the guard charges this per module
    call it tracked (``SiteTracker.calls``)."""
    if not _module_hook:
        module, x = nn.Identity(), torch.ones(16)
        stack: list[str] = []

        def median_call() -> float:
            times = []
            for _ in range(300):
                t0 = time.perf_counter()
                module(x)
                times.append(time.perf_counter() - t0)
            times.sort()
            return times[len(times) // 2]

        bare = median_call()
        handles = [module.register_forward_pre_hook(lambda m, a: stack.append("m")),
                   module.register_forward_hook(lambda m, a, o: stack.pop() if stack else None, always_call=True)]
        try:
            hooked = median_call()
        finally:
            for handle in handles:
                handle.remove()
        _module_hook.append(max(0.0, hooked - bare))
    return _module_hook[0]


class GemmSink(Protocol):
    """What the mode reports to (the ``Guard``)."""

    def on_gemm(self, gemm: Gemm) -> None: ...
    def on_unverified(self, op: str) -> None: ...
    def on_write(self, tensors: list[Tensor]) -> None: ...


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument ``func``'s schema says it writes (``Tensor(a!)``,
    ``Tensor(a!)[]``, ``out=``): empty for a functional op."""
    return tuple((i, arg.name) for i, arg in enumerate(func._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


def _written_tensors(args: tuple, kwargs: dict, where: tuple[tuple[int, str], ...]) -> list[Tensor]:
    out: list[Tensor] = []
    for i, name in where:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(t for t in value if isinstance(t, Tensor))
    return out


def defer_to_dtensor(types: Any) -> bool:
    """Whether a dispatch mode should hand this call to ``DTensor`` (return
    ``NotImplemented``): one of its arguments is a ``DTensor`` (tensor parallelism, FSDP2's
    sharded parameters). ``DTensor.__torch_dispatch__`` then redistributes what it must and
    runs the local op on the local shards, and that local call comes back to the mode with
    plain tensors: the GEMM that really runs, on the data it really reads, is what the mode
    verifies (docs/DISTRIBUTED.md). Cheap for plain tensors (``types`` is empty)."""
    return _any_subclass(types, "torch.distributed.tensor", "DTensor")


def on_fake_tensors(types: Any) -> bool:
    """Whether this call computes on ``FakeTensor`` s (no data: ``DTensor``'s sharding
    propagation runs each new op once on fake tensors, with the mode still on the stack):
    a mode runs it and accounts nothing."""
    return _any_subclass(types, "torch._subclasses.fake_tensor", "FakeTensor")


def _any_subclass(types: Any, module: str, name: str) -> bool:
    if not types:
        return False
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and any(issubclass(t, cls) for t in types)


class GemmInterceptor(TorchDispatchMode):
    """Dispatch mode that reports every GEMM (and every unverifiable GEMM-bearing op).

    A call on ``DTensor`` s is handed to ``DTensor`` (``defer_to_dtensor``): its local
    op, on the local shards, comes back to this mode and is verified. A call on
    ``FakeTensor`` s runs unaccounted (``on_fake_tensors``).

    >>> seen = []
    >>> class Sink:
    ...     def on_gemm(self, g): seen.append(g.op)
    ...     def on_unverified(self, op): pass
    ...     def on_write(self, tensors): pass
    >>> with GemmInterceptor(Sink()):
    ...     _ = torch.randn(2, 3) @ torch.randn(3, 4)
    >>> seen
    ['mm']
    """

    def __init__(self, sink: GemmSink) -> None:
        super().__init__()
        self.sink = sink
        # Looked up by the overload's id: OpOverload and OpOverloadPacket hash in Python,
        # and this lookup runs for every aten op of the model (built per activation, so
        # a handler added to GEMM_HANDLERS since is seen).
        self._handlers = {id(packet.default): handler for packet, handler in GEMM_HANDLERS.items()}
        self._unverified = {
            id(getattr(packet, name))
            for packet in (*GEMM_HANDLERS, *UNVERIFIED_GEMM_OPS)
            for name in packet.overloads()
            if id(getattr(packet, name)) not in self._handlers
        }
        self._writes: dict[int, tuple[tuple[int, str], ...]] = {}  #: per overload, what it writes
        self.ops = 0  #: aten ops seen (each paid the mode's Python round trip)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if types:
            if defer_to_dtensor(types):
                self.ops += 1
                return NotImplemented
            if on_fake_tensors(types):
                return func(*args, **kwargs)
        self.ops += 1
        out = func(*args, **kwargs)
        key = id(func)
        writes = self._writes.get(key)
        if writes is None:
            writes = self._writes[key] = written_arguments(func)
        if writes:
            self.sink.on_write(_written_tensors(args, kwargs, writes))
        handler = self._handlers.get(key)
        if handler is not None:
            gemm = handler(args, kwargs, out)
            if gemm is not None:
                self.sink.on_gemm(gemm)
                return out
            self.sink.on_unverified(str(func.overloadpacket))
        elif key in self._unverified:
            self.sink.on_unverified(str(func.overloadpacket))
        return out
