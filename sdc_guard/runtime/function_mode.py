"""The compiled route: GEMMs verified inside ``torch.compile`` graphs (docs/COMPILE.md).

Dynamo skips every frame while a (non-infra) ``TorchDispatchMode`` is active, so the
dispatch mode of ``sdc_guard.runtime.intercept`` turns the compiler off. This route
intercepts one level up, where dynamo traces: a ``TorchFunctionMode`` that sends
``F.linear``, ``torch.matmul`` / ``@``, ``mm``, ``bmm``, ``addmm`` and ``baddbmm`` through
``CheckedGemm``, an ``autograd.Function`` whose forward computes the GEMM as the user's
call would and hands it to ``sdc_guard::check_gemm``, and whose backward computes the two
gradient GEMMs and hands each to ``check_gemm`` too. Dynamo traces the mode, the function
and both passes into the graphs (no graph break); ``check_gemm`` is a
``torch.library.custom_op`` that ``mutates_args=("flags",)`` (a one-element counter of the
checks run), which keeps it in the graph, in order, through AOT autograd and inductor.

What ``check_gemm`` runs is the eager guard's own verification (``Guard.on_gemm``): the
same screen on the same backends, the same exact confirmation, the same ledger whose
flags stay on the device until the step's one host read. Dynamo never looks inside a
custom op, so nothing of it is traced; the op's arguments carry what the graph knows at
trace time (the op name, the phase, the module path of the call), and the guard of this
thread is found at run time. Outside ``protect()`` the mode is off and dynamo, whose
guards include the function-mode stack, runs the graph it compiled without checks: a
model compiled under ``protect()`` compiles normally outside it (two cache entries, no
recompilation after the first of each).

Fused attention (``F.scaled_dot_product_attention``) takes the same way with a check op of
its own, ``sdc_guard::check_attention`` (``sdc_guard.runtime.function_attention``). Adding a
torch function is one entry in ``ROUTES``: a function from the call's ``(func, args,
kwargs)`` to its result that calls ``check_gemm`` (or a check op of its own) on what it
computed, and that is traceable by dynamo. What the check ops share (this thread's guard
and drills, the ``CHECKS`` counter, the site of a traced call) is in
``sdc_guard.runtime.graph_checks``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .function_attention import route_sdpa
from .graph_checks import (  # noqa: F401  (set_sink ... module_path: also importable from here)
    CHECKS, CheckSink, add_drill, current_sink, module_path, remove_drill, run_drills, set_sink, trace_site,
    unverified,
)
from .ops import Gemm

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


@torch.library.custom_op("sdc_guard::check_gemm", mutates_args=("flags",), tags=(torch.Tag.cudagraph_unsafe,))
def check_gemm(a: Tensor, b: Tensor, out: Tensor, bias: Optional[Tensor], alpha: float, beta: float,
               flags: Tensor, op: str, site: str, phase: str) -> None:
    """Verify ``out == beta * bias + alpha * a @ b`` with this thread's guard, count it in
    ``flags``. Reads its tensors, writes none of them (a drill may corrupt ``out`` first,
    as a faulty unit would). ``site`` empty: not known at trace time (eager frames)."""
    with torch._C.DisableTorchFunction():  # verification's own ops are not the model's
        run_drills(op, out, site, phase)
        sink = current_sink()
        if sink is not None:
            sink.on_gemm(Gemm(op, a, b, out, bias, alpha, beta), site or None, phase)
        flags.add_(1)


@check_gemm.register_fake
def _check_gemm_fake(a: Tensor, b: Tensor, out: Tensor, bias: Optional[Tensor], alpha: float, beta: float,
                     flags: Tensor, op: str, site: str, phase: str) -> None:
    return None


def _check(a: Tensor, b: Tensor, out: Tensor, op: str, site: str, phase: str, bias: Tensor | None = None,
           alpha: float = 1.0, beta: float = 1.0) -> None:
    torch.ops.sdc_guard.check_gemm(a, b, out, bias, alpha, beta, CHECKS, op, site, phase)


def _grad_op(x: Tensor, y: Tensor) -> str:
    if x.dim() == 2 and y.dim() == 2:
        return "mm"
    return "bmm" if x.dim() > 2 and y.dim() > 2 else "matmul"


def _grad_left(g: Tensor, b: Tensor, site: str) -> Tensor:
    """``g @ b^T`` (the gradient of ``a`` in ``a @ b``), checked."""
    bt = b.mT
    out = torch.matmul(g, bt)
    _check(g, bt, out, _grad_op(g, bt), site, "backward")
    return out


def _grad_right(a: Tensor, g: Tensor, site: str, b_dim: int) -> Tensor:
    """``a^T @ g`` (the gradient of ``b`` in ``a @ b``), checked; a 2-D ``b`` against a
    batched ``a`` folds the batch into one GEMM, as autograd's own backward does."""
    if b_dim == 2 and a.dim() > 2:
        at = a.reshape(-1, a.shape[-1]).t()
        g2 = g.reshape(-1, g.shape[-1])
        out = torch.mm(at, g2)
        _check(at, g2, out, "mm", site, "backward")
        return out
    at = a.mT
    out = torch.matmul(at, g)
    _check(at, g, out, _grad_op(at, g), site, "backward")
    return out


class CheckedGemm(torch.autograd.Function):
    """``out = beta * bias + alpha * (a @ b)`` computed by the user's own call, checked in
    the forward, with both gradient GEMMs checked in the backward. ``kind`` says which
    call: ``"linear"`` (``b`` is the weight ``[N, K]``), ``"matmul"``/``"mm"``/``"bmm"``,
    ``"addmm"``/``"baddbmm"``. Operands are at least 2-D (the routes unsqueeze vectors)."""

    @staticmethod
    def forward(a: Tensor, b: Tensor, bias: Tensor | None, alpha: float, beta: float, kind: str,
                site: str) -> Tensor:
        if kind == "linear":
            out = F.linear(a, b, bias)
            _check(a, b.t(), out, "linear", site, "forward", bias)
        elif kind == "addmm":
            out = torch.addmm(bias, a, b, beta=beta, alpha=alpha)
            _check(a, b, out, kind, site, "forward", bias, alpha, beta)
        elif kind == "baddbmm":
            out = torch.baddbmm(bias, a, b, beta=beta, alpha=alpha)
            _check(a, b, out, kind, site, "forward", bias, alpha, beta)
        else:
            out = torch.mm(a, b) if kind == "mm" else torch.bmm(a, b) if kind == "bmm" else torch.matmul(a, b)
            _check(a, b, out, kind, site, "forward")
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        a, b, bias, alpha, beta, kind, site = inputs
        ctx.save_for_backward(a, b)
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.alpha, ctx.beta, ctx.kind, ctx.site = alpha, beta, kind, site

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        a, b = ctx.saved_tensors
        site, kind = ctx.site, ctx.kind
        ga = gb = gbias = None
        if kind == "linear":  # out = a @ b.t() + bias
            if ctx.needs_input_grad[0]:
                ga = _grad_left(g, b.t(), site)
            if ctx.needs_input_grad[1]:
                gb = _grad_right(a, g, site, 2).t()
            if ctx.needs_input_grad[2]:
                gbias = g.reshape(-1, g.shape[-1]).sum(0) if g.dim() > 1 else g
            return ga, gb, gbias, None, None, None, None
        if ctx.needs_input_grad[0]:
            ga = _grad_left(g, b, site)
            ga = (ga * ctx.alpha if ctx.alpha != 1.0 else ga).sum_to_size(a.shape)
        if ctx.needs_input_grad[1]:
            gb = _grad_right(a, g, site, b.dim())
            gb = (gb * ctx.alpha if ctx.alpha != 1.0 else gb).sum_to_size(b.shape)
        if ctx.needs_input_grad[2] and ctx.bias_shape is not None:
            gbias = (g * ctx.beta if ctx.beta != 1.0 else g).sum_to_size(ctx.bias_shape)
        return ga, gb, gbias, None, None, None, None


def _checkable(*tensors: Tensor | None) -> bool:
    """Floating operands of one supported dtype, none a subclass (a DTensor or a fake
    quantised tensor keeps its own semantics: it goes to the op unchanged)."""
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
            return False
        if t.dtype not in _FLOAT or (dtype is not None and t.dtype != dtype):
            return False
        dtype = t.dtype
    return True


def _route_linear(func: Callable, args: tuple, kwargs: dict) -> Any:
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not (isinstance(x, Tensor) and isinstance(w, Tensor) and w.dim() == 2 and x.dim() >= 1
            and _checkable(x, w, bias)):
        return _unrouted(func, args, kwargs, "linear")
    site = trace_site()
    if x.dim() == 1:
        return CheckedGemm.apply(x.unsqueeze(0), w, bias, 1.0, 1.0, "linear", site).squeeze(0)
    return CheckedGemm.apply(x, w, bias, 1.0, 1.0, "linear", site)


def _route_matmul(kind: str) -> Callable:
    def route(func: Callable, args: tuple, kwargs: dict) -> Any:
        if len(args) != 2 or kwargs:
            return _unrouted(func, args, kwargs, kind)
        a, b = args
        if func is Tensor.__rmatmul__:
            a, b = b, a
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and _checkable(a, b)) or a.dim() == 0 \
                or b.dim() == 0 or (a.dim() == 1 and b.dim() == 1):
            return _unrouted(func, args, kwargs, kind)
        site = trace_site()
        if a.dim() == 1:
            return CheckedGemm.apply(a.unsqueeze(0), b, None, 1.0, 1.0, kind, site).squeeze(-2)
        if b.dim() == 1:
            return CheckedGemm.apply(a, b.unsqueeze(-1), None, 1.0, 1.0, kind, site).squeeze(-1)
        return CheckedGemm.apply(a, b, None, 1.0, 1.0, kind, site)
    return route


def _route_addmm(kind: str) -> Callable:
    def route(func: Callable, args: tuple, kwargs: dict) -> Any:
        if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
            return _unrouted(func, args, kwargs, kind)
        bias, a, b = args
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(bias, Tensor)
                and _checkable(a, b, bias) and isinstance(beta, (int, float)) and isinstance(alpha, (int, float))):
            return _unrouted(func, args, kwargs, kind)
        return CheckedGemm.apply(a, b, bias, float(alpha), float(beta), kind, trace_site())
    return route


def _unrouted(func: Callable, args: tuple, kwargs: dict, op: str) -> Any:
    """A GEMM call the route does not take (integer operands, a subclass): run as called,
    counted as unverified when it is a floating GEMM. An ``out=`` call passes uncounted:
    it is what inductor's generated code calls at run time for the GEMMs of a graph that
    already holds their checks (the mode is on while the compiled code runs)."""
    if "out" in kwargs:
        return func(*args, **kwargs)
    floating = any(isinstance(t, Tensor) and t.is_floating_point() for t in args[:3])
    if floating:
        unverified(op)
    return func(*args, **kwargs)


#: torch function -> route: ``(func, args, kwargs) -> result``, traceable by dynamo, calling
#: ``check_gemm`` on what it computed. Adding a function is adding one entry.
ROUTES: dict[Callable, Callable[[Callable, tuple, dict], Any]] = {
    F.linear: _route_linear,
    torch.matmul: _route_matmul("matmul"),
    Tensor.matmul: _route_matmul("matmul"),
    Tensor.__matmul__: _route_matmul("matmul"),
    Tensor.__rmatmul__: _route_matmul("matmul"),
    torch.mm: _route_matmul("mm"),
    Tensor.mm: _route_matmul("mm"),
    torch.bmm: _route_matmul("bmm"),
    Tensor.bmm: _route_matmul("bmm"),
    torch.addmm: _route_addmm("addmm"),
    Tensor.addmm: _route_addmm("addmm"),
    torch.baddbmm: _route_addmm("baddbmm"),
    Tensor.baddbmm: _route_addmm("baddbmm"),
    F.scaled_dot_product_attention: route_sdpa,  # = torch._C._nn.scaled_dot_product_attention
}

#: torch functions that multiply matrices and that the route does not verify: counted in
#: ``unverified_ops`` under these names (their GEMMs run inside one fused call).
UNVERIFIED_FUNCTIONS: dict[Callable, str] = {
    f: name for name, f in (
        ("einsum", torch.einsum), ("tensordot", torch.tensordot), ("bilinear", F.bilinear), ("conv1d", F.conv1d),
        ("conv2d", F.conv2d), ("conv3d", F.conv3d), ("addmv", torch.addmv), ("mv", torch.mv),
        ("addbmm", torch.addbmm), ("dot", torch.dot), ("vdot", torch.vdot),
        ("multi_dot", torch.linalg.multi_dot), ("chain_matmul", torch.chain_matmul),
    )
}


class GemmFunctionMode(TorchFunctionMode):
    """Routes GEMM-level torch functions through ``CheckedGemm`` (see the module doc).

    Entered by the guard for its ``protect()`` block on its own thread (mode stacks are
    thread-local) and left when the block exits or a step is not watched. Every other
    function passes through unchanged: once at trace time in a compiled frame, on every
    call in an eager one.
    """

    ops = 0  #: never counted: a count kept in traced code would be a side effect per call

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        route = ROUTES.get(func)
        if route is not None:
            return route(func, args, kwargs)
        name = UNVERIFIED_FUNCTIONS.get(func)
        if name is not None:
            unverified(name)
        return func(*args, **kwargs)


def function_mode_active() -> bool:
    """Whether a ``GemmFunctionMode`` is on this thread's function-mode stack."""
    from torch.overrides import _get_current_function_mode_stack
    return any(isinstance(m, GemmFunctionMode) for m in _get_current_function_mode_stack())


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` or one of its modules is compiled (``torch.compile(model)``,
    ``model.compile()``): then ``protect()`` takes the compiled route."""
    from torch._dynamo.eval_frame import OptimizedModule
    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())
