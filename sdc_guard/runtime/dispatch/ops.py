"""The op registry: what each aten op (or higher-order op) that reaches a dispatch mode of
sdc_guard carries, and how the mode routes it (docs/DESIGN.md, "Interception coverage").

Every op is given one :class:`Route`, once per overload:

- ``GEMM``: a handler in :data:`GEMM_HANDLERS` turns the call into one :class:`Gemm`
  (``out = beta * bias + alpha * (a @ b)``); the guard verifies it.
- ``ATTENTION``: a fused scaled-dot-product-attention kernel (:data:`ATTENTION_OPS`): its two
  GEMMs (``Q K^T``, ``P V``) happen inside one kernel. Handed to the attention verifier
  (``runtime/dispatch/attention.py``, docs/ATTENTION.md) where a handler knows the kernel's schema;
  counted as unverified otherwise.
- ``UNVERIFIED``: a kernel that multiplies matrices inside but has no handler
  (:data:`UNVERIFIED_GEMM_OPS`: convolutions, dot products, quantized and grouped GEMMs,
  fused RNN and transformer layers): run and counted in ``StepReport.unverified_ops``.
- ``REDISPATCH``: a ``CompositeExplicitAutograd`` kernel built from aten GEMMs
  (:data:`REDISPATCH_OPS`, ``_trilinear``): its own kernel is run with the mode on, so its
  inner ``bmm`` calls reach the mode; the result is the kernel's, bit for bit.
- ``DECOMPOSE``: any other op with a ``CompositeImplicitAutograd`` kernel (``einsum``,
  ``tensordot``, ``bilinear``, ``scaled_dot_product_attention``, ``chain_matmul``, ...): it
  reaches a mode undecomposed only where autograd did not decompose it first (under
  ``torch.inference_mode()``, inside a higher-order op's body); ``func.decompose()`` runs
  that same kernel with the mode on, so the mode sees what it sees under autograd.
- ``COLLECTIVE``: a ``torch.distributed`` collective (``c10d`` and ``_c10d_functional`` ops,
  ``collective_ops.collective_packets``): the mode runs it itself (``RoutingMode.collective``),
  so that the guard can take the senders' checksums before it and the receivers' after it
  (``runtime/collectives/collective_checks.py``) and a drill can corrupt its result
  (``runtime/collectives/collective_faults.py``).
- ``PLAIN``: everything else; run and passed through.

Higher-order ops (HOPs) are routed by name (:data:`HOP_BODIES`, ``runtime/dispatch/hops.py``):
``cond`` runs its taken branch, ``while_loop`` and ``flex_attention`` (and its backward)
their eager kernel, with the mode on, so the GEMMs inside are seen; any other HOP is run
with the mode off and counted as ``higher_order.<name>``. No op, known or not, makes the
mode raise; the mode is invisible to dynamo while torch compiles a HOP's eager wrapper
(:meth:`RoutingMode.ignore_compile_internals`).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from ...core.torch_private import (
    TorchDispatchMode, DispatchKey, dispatch_has_kernel_for_dispatch_key, dispatch_keys,
    dispatch_keyset_full_after, HigherOrderOperator, FAKE_TENSOR_MODULE,
)

from .collective_ops import collective_packets
from .hops import (  # noqa: F401  (reentered: its former home is here)
    HOP_BODIES, BranchSites, entering, hidden_from_dynamo, reentered,
)

aten = torch.ops.aten


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


#: aten overload packet -> handler (its ``default`` overload). Adding an op is adding one line.
GEMM_HANDLERS: dict[Any, Handler] = {
    aten.mm: _mm,
    aten.addmm: _addmm_like("addmm"),
    aten.bmm: _bmm,
    aten.baddbmm: _addmm_like("baddbmm"),
    aten.linear: _linear,
    aten.matmul: _matmul,
}


def gemm_overloads(packet: Any) -> tuple[Any, ...]:
    """The overloads of a GEMM packet its handler reads: ``default`` and ``out`` (the
    product written into ``out=``, which the call returns: what a compiled graph's extern
    GEMM kernels call, and a user's ``torch.mm(a, b, out=c)``)."""
    out = getattr(packet, "out", None)
    return (packet.default,) if out is None else (packet.default, out)


def _packets(*names: str) -> frozenset[Any]:
    """The aten packets of ``names`` this torch build has (older builds lack some)."""
    return frozenset(getattr(aten, name) for name in names if hasattr(aten, name))


#: Fused scaled-dot-product attention (forward and backward): the attention verifier's
#: entry point (``Route.ATTENTION``). ``scaled_dot_product_attention`` itself is composite
#: (``Route.DECOMPOSE``): it reaches one of these on every backend.
ATTENTION_OPS: frozenset[Any] = _packets(
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward", "_flash_attention_backward",
    "_efficient_attention_backward",
)

#: Kernels that multiply matrices inside and that sdc_guard cannot verify: counted.
#: Convolutions are here, not verified: their GEMM (im2col, Winograd, direct) is the
#: backend's choice and not visible at the aten level; dot products and matrix-vector
#: products have no 2-D checksum to compare; the rest have no handler yet.
UNVERIFIED_GEMM_OPS: frozenset[Any] = _packets(
    "_addmm_activation", "convolution", "convolution_backward", "_convolution", "mkldnn_convolution",
    "_slow_conv2d_forward", "_slow_conv2d_backward", "slow_conv3d_forward", "slow_conv_transpose2d",
    "slow_conv_transpose3d", "_scaled_mm", "_int_mm", "_scaled_grouped_mm", "_grouped_mm",
    "_weight_int8pack_mm", "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu", "_mixed_dtypes_linear",
    "mkldnn_linear", "addmv", "addmv_", "mv", "addbmm", "addbmm_", "dot", "vdot", "addr", "addr_",
    "_native_multi_head_attention", "_transformer_encoder_layer_fwd", "mkldnn_rnn_layer",
    "mkldnn_rnn_layer_backward", "_cdist_forward", "_cdist_backward",
)

#: ``CompositeExplicitAutograd`` kernels built from aten GEMMs that reach the dispatcher
#: (``_trilinear``, what ``bilinear`` runs: one ``bmm`` per output feature): run with the
#: mode on (``Route.REDISPATCH``).
REDISPATCH_OPS: frozenset[Any] = _packets("_trilinear")

#: ``torch.distributed``'s collectives as the dispatcher sees them (``Route.COLLECTIVE``)
COLLECTIVE_OPS: frozenset[Any] = collective_packets()


class Route(enum.Enum):
    """How a dispatch mode of sdc_guard treats one op (the module doc)."""

    GEMM = "gemm"
    ATTENTION = "attention"
    UNVERIFIED = "unverified"
    REDISPATCH = "redispatch"
    DECOMPOSE = "decompose"
    COLLECTIVE = "collective"
    PLAIN = "plain"


def route_of(func: Any) -> Route:
    """The route of aten overload ``func`` (looked up once per overload by the modes)."""
    packet = func.overloadpacket
    if packet in GEMM_HANDLERS:
        # the ``dtype`` overloads (a product in another dtype than its operands): counted
        return Route.GEMM if any(func is o for o in gemm_overloads(packet)) else Route.UNVERIFIED
    if packet in ATTENTION_OPS:
        return Route.ATTENTION
    if packet in UNVERIFIED_GEMM_OPS:
        return Route.UNVERIFIED
    if packet in REDISPATCH_OPS:
        return Route.REDISPATCH
    if packet in COLLECTIVE_OPS:
        return Route.COLLECTIVE
    if _is_composite_implicit(func):
        return Route.DECOMPOSE
    return Route.PLAIN


def _is_composite_implicit(func: Any) -> bool:
    if DispatchKey.CompositeImplicitAutograd in func.py_kernels:
        return True
    try:
        return dispatch_has_kernel_for_dispatch_key(func.name(), DispatchKey.CompositeImplicitAutograd)
    except RuntimeError:  # an overload only Python knows
        return False


def redispatch_below_python(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func``'s kernel for its arguments' backend directly, skipping the Python key
    (whatever mode is on stays on for the ops that kernel calls): the kernel a mode's
    ``func(*args)`` would have reached, so the result is the same."""
    keys = None
    for value in (*args, *kwargs.values()):
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, Tensor):
                own = dispatch_keys(t)
                keys = own if keys is None else keys | own
    if keys is None:  # no tensor argument: nothing to dispatch on below the mode
        return func(*args, **kwargs)
    return func.redispatch(keys & dispatch_keyset_full_after(DispatchKey.Python), *args, **kwargs)


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
    return _any_subclass(types, FAKE_TENSOR_MODULE, "FakeTensor")


def _any_subclass(types: Any, module: str, name: str) -> bool:
    if not types:
        return False
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and any(issubclass(t, cls) for t in types)


#: Per ``RoutingMode`` subclass: (the registry state they were learnt under, route per
#: overload id, the ids of the quiet overloads, the overloads themselves). See
#: ``RoutingMode.__init__``.
_TABLES: dict[type, tuple[tuple, dict[int, "Route"], set[int], list[Any]]] = {}


class RoutingMode(TorchDispatchMode):
    """The dispatch mode both the guard's interceptor and the fault injector are: routes
    every op by :func:`route_of` and every HOP by :data:`HOP_BODIES`, and hands each op it
    runs itself to :meth:`after` (``Route.GEMM`` and ``Route.ATTENTION`` included).

    ``ops`` counts the ops that paid the mode's Python round trip; ``sites`` is the mode's
    site tracker (``intercept.SiteTracker``), which labels the outputs of a ``cond`` run
    under autograd for its backward (``runtime/dispatch/hops.py``), or ``None``.
    """

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Whether dynamo may look past this mode (``runtime/dispatch/hops.py``, item 1): while
        torch compiles the eager wrapper of a HOP (``torch.cond``, ``while_loop``,
        ``flex_attention``), so that the HOP runs captured with the mode on and its body
        verified, and when the mode is entered, so that dynamo's guards leave its dispatch
        keys out and a compiled wrapper is reused. Any other frame dynamo has not compiled
        yet runs eagerly under the mode, fully verified (docs/COMPILE.md)."""
        return hidden_from_dynamo()

    def __enter__(self) -> "RoutingMode":
        with entering():
            super().__enter__()
        return self

    def __init__(self, sites: BranchSites | None = None) -> None:
        super().__init__()
        self.sites = sites
        # Per overload, keyed by its id (OpOverload hashes in Python, and these lookups run
        # for every aten op of the model): its route, and whether ``after`` has anything
        # to do with it (``quiet``). Shared by every mode of this class while the registry
        # stays as it is (``registry_state``): a per-step ``protect()`` block makes a mode
        # per step, and learning some forty overloads again each time cost about 1 ms.
        state = self.registry_state()
        tables = _TABLES.get(type(self))
        if tables is None or tables[0] != state:
            tables = _TABLES[type(self)] = (state, {}, set(), [])
        _, self._routes, self._quiet, self._known = tables
        self.ops = 0

    @classmethod
    def registry_state(cls) -> tuple:
        """What the per-overload tables depend on: the registry's entries (a handler or a
        HOP body added since, or a table replaced, makes new tables)."""
        return (tuple(GEMM_HANDLERS.items()), id(ATTENTION_OPS), id(UNVERIFIED_GEMM_OPS), id(REDISPATCH_OPS),
                tuple(HOP_BODIES.items()))

    def quiet(self, func: Any, route: Route) -> bool:
        """Whether :meth:`after` does nothing for ``func`` on ``route`` (asked once per
        overload): such an op is run straight away, its Python round trip kept to that of
        an empty mode. None is quiet by default."""
        return False

    def after(self, func: Any, route: Route, args: tuple, kwargs: dict, out: Any) -> None:
        """Called with every op the mode ran (not the decomposed or re-dispatched ones,
        whose inner ops come one by one)."""

    def on_opaque(self, name: str) -> None:
        """Called for a HOP run with the mode off (its body unseen)."""

    def collective(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a collective (``Route.COLLECTIVE``) and return its result; a mode that
        checks or corrupts collectives wraps the call (``run_then``)."""
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if types:
            if defer_to_dtensor(types):  # its local op, on the local shards, comes back here
                self.ops += 1
                return NotImplemented
            if on_fake_tensors(types):  # DTensor's sharding propagation: no data, nothing to account
                return func(*args, **(kwargs or {}))
        self.ops += 1
        key = id(func)
        if key in self._quiet:  # most ops: nothing to route, nothing to report
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        route = self._routes.get(key)
        if route is None:
            route = self._learn(func, route_of(func))
            if route is Route.PLAIN and key in self._quiet:
                return func(*args, **kwargs)
        if route is Route.DECOMPOSE:
            with reentered(self):
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
            route = self._learn(func, Route.PLAIN)
        elif route is Route.REDISPATCH:
            with reentered(self):
                return redispatch_below_python(func, args, kwargs)
        elif route is Route.COLLECTIVE:
            out = self.collective(func, args, kwargs)
            self.after(func, route, args, kwargs, out)
            return out
        out = func(*args, **kwargs)
        self.after(func, route, args, kwargs, out)
        return out

    def _learn(self, func: Any, route: Route) -> Route:
        """Record ``func``'s route (and whether it is quiet) in the shared tables."""
        if id(func) not in self._routes:
            self._known.append(func)  # kept alive, so that its id is never another op's
        if route is Route.PLAIN and self.quiet(func, route):
            self._quiet.add(id(func))
        self._routes[id(func)] = route
        return route

    def _higher_order(self, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
        body = HOP_BODIES.get(func.name())
        if body is not None:
            return body(self, func, args, kwargs)
        self.on_opaque(f"higher_order.{func.name()}")
        return func(*args, **kwargs)  # the mode is off here: the next mode, or the kernel
