"""The compiled route's function mode: the block's mark for dynamo, and the eager frames'
GEMMs (docs/COMPILE.md).

On the compiled route the GEMMs of compiled code are checked by nodes the graph pass puts
into the graphs AOT autograd partitions (``runtime/compiled/graph_pass.py``). This mode does the
rest, and nothing where dynamo traces (there it passes every function through, so the
graphs are the user's own):

- It marks the ``protect()`` block. Dynamo guards on the function-mode stack, so a frame
  compiled while the mode is on gets a cache entry of its own (compiled with the checks,
  the pass being installed then), and outside the block the entry without them runs, or
  is compiled: no ``torch._dynamo.reset()``, no recompilation per step. On the dispatch
  route the guard enters it too, as a mark only (``compiled=False`` of the mode), so
  that compiled code met in the block compiles apart from the same code outside it
  (``Guard.compiled_code_met``).
- In eager frames (a loss head outside the compiled module, the code between graph
  breaks) it sends ``F.linear``, ``torch.matmul`` / ``@``, ``mm``, ``bmm``, ``addmm`` and
  ``baddbmm`` through the eager taps (``runtime/compiled/function_gemm.py``: the user's own call,
  checked forward and backward with ``check_gemm``) and ``F.scaled_dot_product_attention``
  through the attention taps (``runtime/compiled/function_attention.py``); functions that multiply
  matrices inside one call (``einsum``, convolutions, ...) are counted in
  ``unverified_ops``. Calls with ``out=`` (what inductor's generated code calls at run
  time, its extern GEMM kernels) and aten overloads (what an ``aot_eager`` graph calls)
  pass through: their checks are nodes of their graphs.

Adding a torch function for eager frames is one entry in ``ROUTES``. What the check ops
share (this thread's guard and drills, the count of checks run) is in
``sdc_guard.runtime.compiled.graph_checks``.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...core.torch_private import OpOverload
from ..dispatch.intercept import extra_call_seconds

from .function_attention import route_sdpa
from .function_gemm import (
    CheckedGemm, autocast_cast, autocast_dtype, in_checkpoint_forward, linear_call, parameter_of, tapped,
)
from .graph_checks import (  # noqa: F401  (set_sink ... module_path: also importable from here)
    CheckSink, add_drill, checks_run, count_check, current_sink, inductor_keeps, keep_in_graph, module_path,
    remove_drill, run_drills, set_sink, unverified,
)

#: the site a tap in an eager frame passes: none known; the module owning the GEMM's
#: parameter operand names it at run time, else ``"global"`` (``graph_checks.resolve_site``)
EAGER_SITE = ""

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


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
    if len(args) < 2 or len(args) > 3 or set(kwargs) - {"bias"} or (len(args) == 3 and kwargs):
        return _unrouted(func, args, kwargs, "linear")
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not (isinstance(x, Tensor) and isinstance(w, Tensor) and w.dim() == 2 and x.dim() >= 1):
        return _unrouted(func, args, kwargs, "linear")
    anchor = parameter_of(w, x)
    dtype = autocast_dtype(x)
    x, w, bias = autocast_cast(x, dtype), autocast_cast(w, dtype), autocast_cast(bias, dtype)
    if not _checkable(x, w, bias):
        return _unrouted(func, (x, w, bias), {}, "linear")
    op = "addmm" if bias is not None else "mm"  # what the eager route and the graphs call it
    return tapped(linear_call(bias), x, w, "linear", op, EAGER_SITE, bias=bias, anchor=anchor)


def _route_matmul(kind: str) -> Callable:
    call = {"matmul": torch.matmul, "mm": torch.mm, "bmm": torch.bmm}[kind]

    def route(func: Callable, args: tuple, kwargs: dict) -> Any:
        if len(args) != 2 or kwargs:
            return _unrouted(func, args, kwargs, kind)
        a, b = args
        if func is Tensor.__rmatmul__:
            a, b = b, a
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dim() == 0 or b.dim() == 0 \
                or (a.dim() == 1 and b.dim() == 1):
            return _unrouted(func, args, kwargs, kind)
        anchor = parameter_of(b, a)
        dtype = autocast_dtype(a)
        a, b = autocast_cast(a, dtype), autocast_cast(b, dtype)
        if not _checkable(a, b):
            return _unrouted(call, (a, b), {}, kind)
        site = EAGER_SITE
        if b.dim() == 2:
            return tapped(call, a, b, "fold", "mm", site, anchor=anchor)
        if a.dim() == b.dim() and a.shape[:-2] == b.shape[:-2]:
            if a.dim() > 3:  # as torch.matmul computes it: the batch dims reshaped into one, bmm
                return _batched_matmul(a, b, site, anchor)
            return tapped(call, a, b, "batch", "bmm" if a.dim() > 2 else "mm", site, anchor=anchor)
        if kind != "matmul":  # shapes mm / bmm refuse: the call raises as called
            return call(a, b)
        if in_checkpoint_forward() and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            return _unrouted(call, (a, b), {}, kind)  # CheckedGemm would save what the recomputation does not
        if b.dim() == 1:  # a matrix or a batch times a vector
            return CheckedGemm.apply(a, b.unsqueeze(-1), site).squeeze(-1)
        if a.dim() == 1:  # a vector times a batch
            return CheckedGemm.apply(a.unsqueeze(0), b, site).squeeze(-2)
        return CheckedGemm.apply(a, b, site)  # batch dims that broadcast
    return route


def _batched_matmul(a: Tensor, b: Tensor, site: str, anchor: Tensor | None) -> Tensor:
    """``torch.matmul`` of two batches of one shape with more than one batch dim, made as
    ``torch.matmul`` makes it (its batched path: each operand reshaped to ``[batch, rows,
    cols]``, one ``bmm``, the result viewed back), the same values bit for bit. The check
    then reads the operands the ``bmm`` reads, laid out as the eager route sees them: the
    heads of an attention's ``q @ k^T``, views into one projection, are copied once by that
    reshape (as they are unguarded) instead of a second time for the check."""
    batch, m, n = a.shape[:-2], a.shape[-2], b.shape[-1]
    out = tapped(torch.bmm, a.reshape(-1, m, a.shape[-1]), b.reshape(-1, b.shape[-2], n), "batch", "bmm",
                 site, anchor=anchor)
    return out.view(*batch, m, n)


def _route_addmm(kind: str) -> Callable:
    call = torch.addmm if kind == "addmm" else torch.baddbmm

    def route(func: Callable, args: tuple, kwargs: dict) -> Any:
        if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
            return _unrouted(func, args, kwargs, kind)
        bias, a, b = args
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(bias, Tensor)
                and isinstance(beta, (int, float)) and isinstance(alpha, (int, float))
                and a.dim() == b.dim() and a.shape[:-2] == b.shape[:-2]):
            return _unrouted(func, args, kwargs, kind)
        anchor = parameter_of(b, a)
        dtype = autocast_dtype(a)
        a, b, bias = autocast_cast(a, dtype), autocast_cast(b, dtype), autocast_cast(bias, dtype)
        if not _checkable(a, b, bias):
            return _unrouted(call, (bias, a, b), kwargs, kind)
        return tapped(lambda x, y: call(bias, x, y, **kwargs), a, b, "batch", kind, EAGER_SITE, float(alpha),
                      bias, float(beta), anchor)
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
    """The guard's function mode (see the module doc). Entered by the guard for its
    ``protect()`` block on its own thread (mode stacks are thread-local) and left when the
    block exits or a step is not watched.

    Dynamo guards on the function-mode stack, so a frame compiled while this mode is on
    gets a cache entry of its own, compiled with the graph checks, and the entry it had
    (or gets) outside the block has none. Where dynamo traces, the mode passes every
    function through: the graphs are the user's own, and the checks are put into them
    after partitioning (``runtime/compiled/graph_pass.py``). In eager code it is what ``compiled``
    says: on the compiled route (``True``) it sends GEMM functions through the eager taps
    (``ROUTES``); on the dispatch route (``False``) it only marks the block, and the
    dispatch mode verifies eager code.
    """

    ops = 0  #: never counted: a count kept in traced code would be a side effect per call

    def __init__(self, compiled: bool = True) -> None:
        super().__init__()
        self.compiled = compiled
        #: calls this mode passed on as the compiled route's, at run time (never while dynamo
        #: traces: see ``ops``); each paid a function mode's Python round trip, which the
        #: guard charges to the step (``function_round_trip_seconds``). The dispatch route's
        #: mark is not counted: its cost is in that route's calibration replays.
        self.calls = 0

    def __enter__(self) -> "GemmFunctionMode":
        warn_if_inductor_drops_checks()
        return super().__enter__()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or not self.compiled:  # in this order: dynamo reads no attribute
            return func(*args, **kwargs)
        self.calls += 1
        # What compiled code calls at run time passes first, looked up no further (a few
        # hundred calls a step, each a GEMM's check or kernel): an aten overload (an
        # ``aot_eager`` graph's op, a check op: no route or count is keyed by one) and a
        # call with ``out=`` (inductor's extern GEMM kernels, which ``_unrouted`` passes).
        if type(func) is OpOverload:
            return func(*args, **kwargs)
        route = ROUTES.get(func)
        if route is not None:
            if "out" in kwargs:
                return func(*args, **kwargs)
            return route(func, args, kwargs)
        name = UNVERIFIED_FUNCTIONS.get(func)
        if name is not None:
            unverified(name)
        return func(*args, **kwargs)


_function_round_trip: list[float] = []


def function_round_trip_seconds() -> float:
    """What the compiled route's function mode adds to one torch function call on this
    machine, in seconds: measured once per process (a 16-element ``add``, bare and under a
    ``GemmFunctionMode`` in turn, ``intercept.extra_call_seconds``), on a thread
    of its own, whose mode stacks are empty (the guard's mode is on the calling thread's
    when a step closes). Why: most of the calls the mode sees on that route are not GEMMs
    but the tensor methods AOT autograd's runtime wrappers call (``_is_view``,
    ``untyped_storage``, attribute reads), 374 a step on the compiled GPT of ``bench
    train``; each pays the round trip, which no check times. A lower bound: in situ a call
    costs more than on the tiny one (benchmarks/interception-costs_xeon-2vcpu_2026-12-07.md)."""
    if not _function_round_trip:
        result: list[float] = []
        thread = threading.Thread(target=lambda: result.append(_measure_function_round_trip()),
                                  name="sdc-guard-round-trip")
        thread.start()
        thread.join()
        _function_round_trip.append(result[0] if result else 0.0)
    return _function_round_trip[0]


def _measure_function_round_trip() -> float:
    x = torch.ones(16)
    return extra_call_seconds(lambda: torch.add(x, 1.0), lambda: GemmFunctionMode(compiled=True))


def _eager_when_called_eagerly(code: Any) -> bool:
    """Have dynamo run ``code`` eagerly, and every frame it calls, when it runs as a frame
    of its own: the mode's handler called by eager code inside a compiled region (a frame
    dynamo fell back to eager for, say a graph break in a loop). Compiling the handler and
    what it calls as frames of their own compiles one graph per call pattern, up to the
    recompile limit, and mis-traced calls; where dynamo traces a user's frame it still
    inlines the handler into that frame's graph. Private dynamo API (torch 2.6 on); returns
    whether it was there."""
    try:
        from ...core.torch_private import FrameAction, FrameExecStrategy, set_code_exec_strategy
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError, TypeError):
        return False
    return True


_eager_when_called_eagerly(GemmFunctionMode.__torch_function__.__code__)


@functools.cache
def warn_if_inductor_drops_checks() -> bool | None:
    """Warn, once per process, where this torch's inductor would drop the check ops from
    its graphs (an inductor that keeps only ops with a mutable schema): its compiled
    models' GEMMs would then go unseen. Returns what inductor says (``None``: unknown)."""
    kept = inductor_keeps(torch.ops.sdc_guard.check_gemm)
    if kept is False:
        warnings.warn(f"sdc_guard: torch {torch.__version__}'s inductor removes the compiled route's check ops "
                      "(they write nothing and this inductor keeps only ops that do): GEMMs in graphs compiled "
                      "with inductor are not verified and not counted; use a newer torch, another backend "
                      "(aot_eager) or protect(model, compiled=False)", RuntimeWarning, stacklevel=3)
    return kept


def function_mode_active() -> bool:
    """Whether a ``GemmFunctionMode`` is on this thread's function-mode stack."""
    from ...core.torch_private import get_current_function_mode_stack
    return any(isinstance(m, GemmFunctionMode) for m in get_current_function_mode_stack())


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` or one of its modules is compiled (``torch.compile(model)``,
    ``model.compile()``), or ran compiled code under an earlier guard (``note_compiled``):
    then ``protect()`` takes the compiled route from the start."""
    if model in _ran_compiled:
        return True
    from ...core.torch_private import OptimizedModule
    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


#: models whose guarded steps ran compiled code (``torch.compile(model)`` called under
#: ``protect(model)``, a compiled training step): their next guards start compiled
_ran_compiled: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def note_compiled(model: torch.nn.Module) -> None:
    """Remember that ``model``'s guarded steps run compiled code (``is_compiled``)."""
    _ran_compiled.add(model)
