"""The check op the graph pass puts into compiled graphs: an aten call replayed through the
eager route's own handlers (docs/COMPILE.md).

``runtime/compiled/graph_pass.py`` finds, in the forward and backward graphs AOT autograd hands its
compilers, every node whose aten op the op registry (``runtime/dispatch/ops.py``) routes as a GEMM
or as fused attention, and puts one ``sdc_guard::check_node`` after it. The node carries
the call as the graph has it: its tensors (inputs, then the outputs), and a ``spec`` that
says where each tensor goes among the call's arguments and holds the other arguments as
literals. At run time the op rebuilds ``(args, kwargs, out)`` and hands them to the same
handler the dispatch mode would (``ops.GEMM_HANDLERS``, ``attention.ATTENTION_HANDLERS``),
so a compiled GEMM is described, sampled, screened, confirmed and reported exactly as an
eager one: one registry, one intake (``Guard.on_gemm`` / ``on_attention``). Ops that carry
a GEMM the registry cannot verify get ``note_unverified`` (``graph_checks``) instead.

An op whose kernel is built from aten GEMMs (``Route.REDISPATCH``: ``_trilinear``, what
``bilinear`` runs) has its GEMMs inside that kernel, out of a check node's reach: the pass
puts ``sdc_guard::run_checked`` in its place, which runs the same kernel, with the same
arguments, under a dispatch mode that checks each GEMM it calls (``InnerGemms``), as the
eager route's mode does. The result is the kernel's, bit for bit.

Like the other check ops it returns nothing and writes nothing, and is registered as a
side effect (``graph_checks.keep_in_graph``) so that dead-code elimination keeps it. A
drill may corrupt the output first (``graph_checks.run_drills``), as a faulty unit would
have written it.
"""

from __future__ import annotations

import ast
import functools
import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ...core.torch_private import DisableTorchFunction
from ..dispatch.attention import ATTENTION_HANDLERS, AttentionCall, BACKWARD_OP
from .graph_checks import (
    CheckSink, active_drills, check_op, count_check, current_sink, resolve_site, run_drills, running_op,
)
from ..dispatch.intercept import current_phase
from ..dispatch.ops import GEMM_HANDLERS, Gemm, Route, RoutingMode, route_of

#: how a tensor is named inside a ``spec`` (``("@", i)``: the i-th of ``tensors``)
TENSOR = "@"


class Unsupported(ValueError):
    """An argument a spec cannot hold as a literal (a symbolic size, a dtype, ...)."""


def encode(value: Any, tensors: list[Any], is_tensor: Callable[[Any], bool]) -> Any:
    """``value`` (an argument of a graph node) as a literal, each tensor replaced by
    ``(TENSOR, index)`` and appended to ``tensors``. Raises ``Unsupported`` for anything
    ``ast.literal_eval`` could not read back exactly."""
    if is_tensor(value):
        tensors.append(value)
        return (TENSOR, len(tensors) - 1)
    if isinstance(value, (list, tuple)):
        items = [encode(v, tensors, is_tensor) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode(v, tensors, is_tensor) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and value == value and value not in (float("inf"), float("-inf")):
        return value
    raise Unsupported(f"{type(value).__name__} {value!r}")


def encode_call(args: tuple, kwargs: dict, is_tensor: Callable[[Any], bool]) -> tuple[str, list[Any]]:
    """The ``spec`` of a call and the tensors it refers to, in order."""
    tensors: list[Any] = []
    spec = repr((encode(tuple(args), tensors, is_tensor), encode(dict(kwargs), tensors, is_tensor)))
    return spec, tensors


@functools.lru_cache(maxsize=4096)
def _template(spec: str) -> tuple[Any, Any]:
    return ast.literal_eval(spec)


@functools.lru_cache(maxsize=4096)
def _positions(spec: str) -> tuple[int, ...] | None:
    """For a spec whose arguments are tensors only, in order, and no keyword (a GEMM's
    usual case): their indices, so that the call is rebuilt without walking the template."""
    args, kwargs = _template(spec)
    if kwargs or not all(isinstance(a, tuple) and len(a) == 2 and a[0] == TENSOR for a in args):
        return None
    return tuple(a[1] for a in args)


def _fill(template: Any, tensors: list[Optional[Tensor]]) -> Any:
    if isinstance(template, tuple):
        if len(template) == 2 and template[0] == TENSOR and isinstance(template[1], int):
            return tensors[template[1]]
        return tuple(_fill(t, tensors) for t in template)
    if isinstance(template, list):
        return [_fill(t, tensors) for t in template]
    if isinstance(template, dict):
        return {k: _fill(v, tensors) for k, v in template.items()}
    return template


def decode_call(spec: str, tensors: list[Optional[Tensor]]) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` that ``spec`` and ``tensors`` describe (``encode_call``'s inverse)."""
    positions = _positions(spec)
    if positions is not None:
        return tuple([tensors[i] for i in positions]), {}
    args, kwargs = _template(spec)
    return _fill(args, tensors), _fill(kwargs, tensors)


@functools.lru_cache(maxsize=None)
def overload(name: str) -> Any:
    """The aten overload named ``name`` (``"aten.mm.default"``)."""
    namespace, packet, which = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), which)


def overload_name(op: Any) -> str:
    """``overload``'s inverse: ``"aten.mm.default"``."""
    return f"{op.namespace}.{op._schema.name.split('::')[-1]}.{op._overloadname}"


def encode_node(op: str, args: tuple, kwargs: dict, outputs: list[Any], anchors: list[Any], site: str,
                fallback: str, is_tensor: Callable[[Any], bool]) -> tuple[tuple, dict]:
    """The arguments of the ``check_node`` that checks the call ``op(*args, **kwargs)``
    (see ``check_node``): ``(op, tensors, plan)``, where ``tensors`` is the call's tensors,
    then its ``outputs``, then the ``anchors``, and ``plan`` the literal that says which
    is which, with the call's ``spec``, the ``site`` and the ``fallback``. Raises
    ``Unsupported`` where ``encode_call`` does."""
    spec, tensors = encode_call(args, kwargs, is_tensor)
    plan = repr((spec, len(tensors), len(outputs), site, fallback))
    return (op, [*tensors, *outputs, *anchors], plan), {}


class NodePlan:
    """What a ``check_node`` needs that its constant arguments determine, worked out once
    per process for each distinct node (``node_plan``), not once per call: the overload
    and its route, how the call is rebuilt from the node's tensors, where its outputs and
    anchors are among them, its site and fallback. The handler is looked up per call, in
    the registry as it is then (``ops.GEMM_HANDLERS``, ``attention.ATTENTION_HANDLERS``)."""

    __slots__ = ("func", "route", "packet", "default", "spec", "positions", "n_in", "n_out", "site", "fallback")

    def __init__(self, op: str, plan: str) -> None:
        spec, n_in, n_out, site, fallback = ast.literal_eval(plan)
        self.func = func = overload(op)
        self.route = route_of(func)
        self.packet = func.overloadpacket
        self.default = func is self.packet.default  #: attention handlers know default overloads only
        self.spec = spec
        self.positions = _positions(spec)
        self.n_in, self.n_out, self.site, self.fallback = n_in, n_out, site, fallback

    def call(self, tensors: list[Optional[Tensor]]) -> tuple[tuple, dict, Any, list[Tensor]]:
        """``(args, kwargs, out, anchors)`` of one run of the node (``tensors``: its tensors)."""
        n_in, n_out = self.n_in, self.n_out
        positions = self.positions
        if positions is not None:
            args: tuple = tuple([tensors[i] for i in positions])
            kwargs: dict = {}
        else:
            inputs = tensors[:n_in]
            template_args, template_kwargs = _template(self.spec)
            args, kwargs = _fill(template_args, inputs), _fill(template_kwargs, inputs)
        out = tensors[n_in] if n_out == 1 else tuple(tensors[n_in:n_in + n_out])
        return args, kwargs, out, tensors[n_in + n_out:]  # type: ignore[return-value]


@functools.lru_cache(maxsize=4096)
def node_plan(op: str, plan: str) -> NodePlan:
    """The ``NodePlan`` of a node with these constant arguments (made on its first run)."""
    return NodePlan(op, plan)


def hand_gemm(sink: CheckSink, packet: Any, gemm: Any, site: str, phase: str, started: float) -> bool:
    """Hand the GEMM a handler described (``gemm``) to the drills, then to ``sink`` at
    ``site`` in ``phase``, charging the time since ``started`` that ``on_gemm`` does not
    time itself; where the handler described none (a layout it does not cover), count
    ``packet`` as unverified. Whether it was handed on. One path for ``check_node`` and
    ``InnerGemms``, so that a compiled GEMM is handed on as an eager one is."""
    if not isinstance(gemm, Gemm):
        sink.on_unverified(str(packet))
        return False
    if active_drills():
        run_drills(gemm.op, gemm.out, site, phase)
    sink.charge(time.perf_counter() - started)
    sink.on_gemm(gemm, site or None, phase)
    return True


@check_op("check_node(str op, Tensor?[] tensors, str plan) -> ()")
def check_node(op: str, tensors: list[Optional[Tensor]], plan: str) -> None:
    """Verify the aten call ``op`` a graph node made, with this thread's guard.
    ``tensors``: the tensors of the call's arguments, then what it returned (one tensor,
    or the elements of a tuple; ``None`` for one the graph does not keep), then its
    anchors; ``plan`` (``encode_node``): where each tensor goes among the call's
    arguments (the other arguments as literals), how many outputs and anchors there are,
    the site and the fallback site. ``site``: the module the graph names for the call
    (``""``: none; the module owning the first anchor that is a parameter, the one it
    multiplies by, names it at run time, else ``fallback``). One tensor list and one
    string, not seven arguments: the dispatcher converts every argument of every call, and
    the plan is decoded once per node (``node_plan``). The phase is the run's:
    ``backward`` inside autograd's backward (recomputations included), else ``forward``.
    Reads its tensors, writes none of them; its own time is charged to the guard
    (``Guard.charge``), as the time of the verification it runs is."""
    sink = current_sink()
    if sink is None:  # a graph compiled inside protect() and run outside it: nothing to do
        return
    started = time.perf_counter()
    with DisableTorchFunction():  # verification's own ops are not the model's
        node = node_plan(op, plan)
        args, kwargs, out, anchors = node.call(tensors)
        site = resolve_site(node.site, anchors) or node.fallback
        phase = current_phase()
        if node.route is Route.GEMM:
            handler = GEMM_HANDLERS.get(node.packet)
            if not hand_gemm(sink, node.packet, handler(args, kwargs, out) if handler is not None else None,
                             site, phase, started):
                return
        elif node.route is Route.ATTENTION:
            handler = ATTENTION_HANDLERS.get(node.packet)
            call = handler(args, kwargs, out) if handler is not None and node.default else None
            if not isinstance(call, AttentionCall):
                sink.on_unverified(str(node.packet))
                return
            if call.op == BACKWARD_OP and call.grads is not None:
                run_drills(call.op, call.grads, site, phase)
            elif call.out is not None:
                run_drills(call.op, call.out, site, phase)
            sink.charge(time.perf_counter() - started)
            sink.on_attention(call, site or None, phase)
        count_check()


class InnerGemms(RoutingMode):
    """The dispatch mode ``run_checked`` runs an op's kernel under: each GEMM the kernel
    calls (``Route.GEMM``) is handed, once it has run, to the drills and then to the sink
    (``Guard.on_gemm``) at the node's site and the run's phase, as the dispatch mode
    hands it on the eager route; a GEMM-bearing op it cannot verify is counted. Every
    other op runs straight through (``quiet``)."""

    def __init__(self, sink: CheckSink, site: str, phase: str) -> None:
        super().__init__()
        self.sink, self.site, self.phase = sink, site, phase

    def quiet(self, func: Any, route: Route) -> bool:
        return True

    def after(self, func: Any, route: Route, args: tuple, kwargs: dict, out: Any) -> None:
        started = time.perf_counter()
        if route is Route.GEMM:
            gemm = GEMM_HANDLERS[func.overloadpacket](args, kwargs, out)
            if hand_gemm(self.sink, func.overloadpacket, gemm, self.site, self.phase, started):
                count_check()
        elif route in (Route.UNVERIFIED, Route.ATTENTION):
            self.sink.on_unverified(str(func.overloadpacket))


def _run_fake(op: str, tensors: list[Optional[Tensor]], spec: str, anchors: list[Tensor], site: str,
              fallback: str) -> Any:
    """``run_checked``'s fake kernel: the op itself, on the fake tensors it is handed."""
    args, kwargs = decode_call(spec, tensors)
    return overload(op)(*args, **kwargs)


@running_op("run_checked(str op, Tensor?[] tensors, str spec, Tensor[] anchors, str site, str fallback) -> Tensor",
            _run_fake)
def run_checked(op: str, tensors: list[Optional[Tensor]], spec: str, anchors: list[Tensor], site: str,
                fallback: str) -> Tensor:
    """Run the aten op ``op`` (one returning a tensor) with the arguments ``spec`` and
    ``tensors`` describe and return its result, each GEMM its kernel calls checked with
    this thread's guard (``InnerGemms``), at ``site`` (resolved as ``check_node``
    resolves it) in the run's phase. Without a guard on this thread (a graph compiled
    inside ``protect()`` run after it) the op just runs. Either way the same kernel runs
    on the same arguments: the result is the one the op would have returned."""
    func = overload(op)
    args, kwargs = decode_call(spec, tensors)
    sink = current_sink()
    if sink is None:
        return func(*args, **kwargs)
    with DisableTorchFunction():  # the kernel's own ops are the model's, checked below
        site = resolve_site(site, anchors) or fallback
        with InnerGemms(sink, site, current_phase()):
            return func(*args, **kwargs)


def run_hop_checked(name: str, site: str, fallback: str, anchors: list[Tensor], *args: Any, **kwargs: Any) -> Any:
    """Run the higher-order op ``name`` (``flex_attention``, ``flex_attention_backward``)
    with ``args`` as a graph that runs node by node runs it, its dense kernel, and return
    its result; each GEMM of that kernel checked with this thread's guard
    (``InnerGemms``, which runs a HOP by ``hops.HOP_BODIES``: the kernel the eager route
    runs), at ``site`` (resolved as ``check_node`` resolves it) in the run's phase. Put
    by the graph pass in place of the HOP in ``aot_eager``'s graphs only (a plain Python
    function: no compiler lowers it). Without a guard on this thread the HOP just runs."""
    hop = getattr(torch.ops.higher_order, name)
    sink = current_sink()
    if sink is None:
        return hop(*args, **kwargs)
    with DisableTorchFunction():
        site = resolve_site(site, anchors) or fallback
        with InnerGemms(sink, site, current_phase()):
            return hop(*args, **kwargs)
