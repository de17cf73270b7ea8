"""The graph pass: a check node after every GEMM of the graphs a compiler is handed
(docs/COMPILE.md).

It runs on the forward and the backward graph AOT autograd hands its compilers after
partitioning (``runtime/compiled/graph_install.py`` says where: inductor's post-grad custom pass,
``aot_eager``'s compiler), so the graphs it sees are the ones that run: activation
checkpointing's recomputed forward GEMMs are ordinary aten nodes of the backward graph,
decomposed composites (``einsum``, ``tensordot``, a math-kernel attention)
are ``mm`` / ``bmm`` nodes, and the bodies of ``torch.cond`` and ``while_loop`` are
subgraphs it walks into. Whatever the compiler then does with a GEMM (an extern kernel, a
fused template, an epilogue), the check node reads the tensors the GEMM reads and the one
it writes.

Each aten node is routed by the op registry (``ops.route_of``), as the dispatch mode
routes a call: a GEMM or a fused attention kernel gets ``sdc_guard::check_node``
(``runtime/compiled/graph_ops.py``), a GEMM-bearing op the registry cannot verify (a convolution,
a matrix-vector product) gets ``note_unverified``, so it is counted. An op whose GEMMs
are inside its own kernel (``Route.REDISPATCH``: ``_trilinear``, what ``bilinear`` runs)
is replaced by ``sdc_guard::run_checked``, the same kernel run with its inner GEMMs
checked; so is flex attention's HOP in a graph run node by node (``aot_eager``'s:
``graph_ops.run_hop_checked``, its dense kernel, the one that graph runs). A
higher-order op whose bodies are not walked into and that is not replaced (flex
attention under inductor, which lowers it to a fused kernel of its own) is counted
under its name. Everything the check needs
that only the graph knows is put into the node's arguments as constants:

- the phase: ``backward`` in a graph with tangent inputs (recomputations included, as on
  the eager route, where they run inside the backward), else ``forward``;
- the site: the innermost module of the node's ``nn_module_stack`` (in a backward graph
  ``fwd_nn_module_stack``, the stack of the forward op the gradient belongs to) that is a
  module of the protected model, named by ``ModuleNames`` (dynamo keys the stack by the
  module's ``id``); the model's class name for the model itself, ``"global"`` outside it;
- the anchor: the parameter the GEMM multiplies by, where one of its operands is a graph
  input viewed (a transpose, a cast, ...), or, for a weight gradient, the anchor of a GEMM
  of the same forward op (``seq_nr``). At run time the module owning the anchor names the
  site (``graph_checks.resolve_site``): two instances of a block sharing one graph are
  two sites.
"""

from __future__ import annotations

import operator
from typing import Any, Iterator

import torch
from torch import fx
from ...core.torch_private import HigherOrderOperator, OpOverload

from .graph_checks import CheckSink, module_path
from .graph_ops import Unsupported, encode_call, encode_node, overload_name, run_hop_checked
from ..dispatch.intercept import GLOBAL_SITE
from ..dispatch.ops import Route, route_of

#: higher-order ops whose subgraphs are the bodies that run (and hold the GEMMs): walked into
WALKED = frozenset({"cond", "while_loop", "while_loop_stack_output", "invoke_subgraph",
                    "tag_activation_checkpoint"})
#: higher-order ops whose subgraphs hold no GEMM of the op's own (score and mask functions):
#: the op itself is what multiplies matrices (run by ``run_hop_checked`` in a graph run node
#: by node, counted elsewhere)
OPAQUE = frozenset({"flex_attention", "flex_attention_backward"})
#: ops through which a parameter reaches a GEMM as a view or a cast of itself
_VIEWS = frozenset({"t", "permute", "transpose", "view", "_unsafe_view", "reshape", "expand", "alias",
                    "_to_copy", "convert_element_type", "clone", "contiguous", "squeeze", "unsqueeze",
                    "detach", "as_strided", "slice", "select"})

CHECK_NODE = torch.ops.sdc_guard.check_node.default
NOTE = torch.ops.sdc_guard.note_unverified.default
RUN_CHECKED = torch.ops.sdc_guard.run_checked.default
CHECK_TARGETS = frozenset({CHECK_NODE, NOTE, RUN_CHECKED, run_hop_checked})


def instrument(graph: fx.Graph, sink: CheckSink, runs_in_python: bool = False) -> int:
    """Put a check after every GEMM of ``graph`` and of the bodies it runs (see the module
    doc); returns how many checks were put. A graph that already holds checks (a body
    inductor compiles on its own before the graph that runs it) is left as it is.
    ``runs_in_python``: the graph is run as it is, node by node (``aot_eager``'s), so a
    node may call a Python function: flex attention's HOP, run there by its dense kernel,
    is run by that kernel under ``graph_ops.InnerGemms`` (``graph_ops.run_hop_checked``);
    elsewhere (inductor, which lowers it to a fused kernel of its own) it is counted."""
    if _checked(graph):
        return 0
    return _Instrumenter(sink, graph, runs_in_python).graph(graph)


def _checked(graph: fx.Graph) -> bool:
    return any(n.op == "call_function" and n.target in CHECK_TARGETS for n in graph.nodes)


class _Instrumenter:
    def __init__(self, sink: CheckSink, graph: fx.Graph, runs_in_python: bool = False) -> None:
        self.sink = sink
        self.runs_in_python = runs_in_python
        self.walked: set[int] = set()
        names = sink.module_names
        self.root = type(getattr(names.model, "_orig_mod", names.model)).__name__
        self.fallback = self._frame_site(graph)

    def graph(self, graph: fx.Graph) -> int:
        count = 0
        anchors = self._anchors(graph)
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, OpOverload):
                count += self._op(graph, node, target, anchors)
            elif isinstance(target, HigherOrderOperator):
                count += self._hop(graph, node, target)
        graph.lint()
        return count

    # --- aten ops ------------------------------------------------------------------------

    def _op(self, graph: fx.Graph, node: fx.Node, op: OpOverload, anchors: dict[Any, list[fx.Node]]) -> int:
        route = route_of(op)
        if route is Route.UNVERIFIED:
            self._note(graph, node, str(op.overloadpacket))
            return 1
        if route not in (Route.GEMM, Route.ATTENTION, Route.REDISPATCH):
            return 0
        try:
            spec, tensors = encode_call(node.args, node.kwargs, _is_tensor)
        except Unsupported:  # an argument no literal holds (a symbolic size): counted
            self._note(graph, node, str(op.overloadpacket))
            return 1
        site = self._site(node)
        candidates = self._anchors_of(node)
        if route in (Route.GEMM, Route.REDISPATCH):
            candidates += [a for a in anchors.get(node.meta.get("seq_nr"), []) if a not in candidates]
        if route is Route.REDISPATCH:
            return self._run_checked(graph, node, op, tensors, spec, candidates, site)
        outputs = self._outputs(graph, node)
        args, _ = encode_node(overload_name(op), node.args, node.kwargs, outputs if outputs else [node], candidates,
                              site, self.fallback, _is_tensor)
        with graph.inserting_after(_last_of(node, [o for o in outputs if o is not None])):
            check = graph.call_function(CHECK_NODE, args)
        check.meta["sdc_guard"] = "check"
        return 1

    def _run_checked(self, graph: fx.Graph, node: fx.Node, op: OpOverload, tensors: list[Any], spec: str,
                     candidates: list[fx.Node], site: str) -> int:
        """Put ``sdc_guard::run_checked`` in the place of ``node`` (a ``REDISPATCH`` op,
        ``_trilinear``: its GEMMs are inside its kernel, where no node after it reaches):
        the same kernel on the same arguments, its inner GEMMs checked
        (``graph_ops.run_checked``). Counted, as before, where it returns no single tensor."""
        if not isinstance(node.meta.get("val"), torch.Tensor):
            self._note(graph, node, str(op.overloadpacket))
            return 1
        with graph.inserting_before(node):
            run = graph.call_function(RUN_CHECKED, (overload_name(op), tensors, spec, candidates, site, self.fallback))
        run.meta.update(node.meta)
        run.meta["sdc_guard"] = "run_checked"
        node.replace_all_uses_with(run)
        graph.erase_node(node)
        return 1

    def _outputs(self, graph: fx.Graph, node: fx.Node) -> list[fx.Node | None]:
        """The node's outputs as tensors of the graph: ``[node]`` for one tensor, else one
        ``getitem`` per element (made where the graph has none; ``None`` for an element
        that is no tensor)."""
        value = node.meta.get("val")
        if not isinstance(value, (tuple, list)):
            return []
        items: dict[int, fx.Node] = {}
        for user in node.users:
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                items.setdefault(user.args[1], user)
        outputs: list[fx.Node | None] = []
        for i, v in enumerate(value):
            if i in items:
                outputs.append(items[i])
            elif isinstance(v, torch.Tensor):
                with graph.inserting_after(node):
                    item = graph.call_function(operator.getitem, (node, i))
                item.meta["val"] = v
                outputs.append(item)
            else:
                outputs.append(None)
        return outputs

    def _note(self, graph: fx.Graph, node: fx.Node, name: str) -> None:
        anchor = next((a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)), None)
        if anchor is None:
            return
        with graph.inserting_after(node):
            note = graph.call_function(NOTE, (anchor, name))
        note.meta["sdc_guard"] = "note"

    # --- sites and anchors ---------------------------------------------------------------

    def _site(self, node: fx.Node) -> str:
        """The innermost module of the node's module stack that is the model's; ``""``
        where the stack names none (the check then asks its anchor, else the fallback)."""
        for ident, _ in reversed(_stack(node)):
            path = self.sink.module_names.of_module_id(ident) if ident is not None else None
            if path is not None:
                return path or self.root
        return ""

    def _frame_site(self, graph: fx.Graph) -> str:
        """The site of a GEMM with no module on its stack: the module whose ``forward`` the
        graph was traced from (the protected model or one of its modules, the ``self`` of
        the frame dynamo compiled), or ``"global"`` where the frame is not a module's
        (a compiled function that calls the model: dynamo then puts the model itself on
        the stack of what runs inside it, and what has no module ran outside). Read off
        the nodes whose stack names one of the model's modules: their source
        (``L['self'].blocks[0]``) is that module's path from the frame's root."""
        names = self.sink.module_names
        found: str | None = None
        for node in _all_nodes(graph):
            for ident, source in _stack(node):
                path = names.of_module_id(ident) if ident is not None else None
                if path is None:
                    continue
                suffix = module_path(source)
                if not suffix:  # the frame's root module is called inside the frame
                    return GLOBAL_SITE
                if found is None and path.endswith(suffix):
                    found = path[:len(path) - len(suffix)].rstrip(".")
        if found is None:
            return GLOBAL_SITE
        return found or self.root

    def _anchors_of(self, node: fx.Node) -> list[fx.Node]:
        """The graph inputs that the GEMM's operands are views or casts of (a transpose, a
        cast under autocast, ...): at run time, the first of them that is a parameter
        names the site (``graph_checks.resolve_site``)."""
        found: list[fx.Node] = []
        for arg in node.all_input_nodes:
            base = _through_views(arg)
            if base is not None and base.op == "placeholder" and _is_matrix(base) and base not in found:
                found.append(base)
        return found

    def _anchors(self, graph: fx.Graph) -> dict[Any, list[fx.Node]]:
        """Per forward op (``seq_nr``): the anchors of its GEMMs, for each of them (a weight
        gradient has no parameter operand; the input gradient of the same op has)."""
        found: dict[Any, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_function" and isinstance(node.target, OpOverload) \
                    and route_of(node.target) in (Route.GEMM, Route.REDISPATCH) and node.meta.get("seq_nr") is not None:
                for anchor in self._anchors_of(node):
                    if anchor not in found.setdefault(node.meta["seq_nr"], []):
                        found[node.meta["seq_nr"]].append(anchor)
        return found

    # --- higher-order ops ----------------------------------------------------------------

    def _hop(self, graph: fx.Graph, node: fx.Node, op: HigherOrderOperator) -> int:
        name = op.name()
        bodies = list(_subgraphs(graph, node))
        if name in WALKED:
            count = 0
            for body in bodies:
                if id(body) not in self.walked and not _checked(body.graph):
                    self.walked.add(id(body))
                    count += self.graph(body.graph)
                    body.recompile()
            return count
        if name in OPAQUE and self.runs_in_python:
            # its dense kernel is what this graph runs: run it with its GEMMs checked
            site, anchors = self._site(node), self._anchors_of(node)
            node.args = (name, site, self.fallback, anchors, *node.args)
            node.target = run_hop_checked
            node.meta["sdc_guard"] = "run_checked"
            return 1
        if name in OPAQUE or bodies:
            self._note(graph, node, f"higher_order.{name}")
            return 1
        return 0


def _stack(node: fx.Node) -> list[tuple[int | None, str]]:
    """The node's module stack, outermost first, as (module ``id``, source): dynamo's
    ``nn_module_stack`` (keys ``"<id>"`` or ``"<id>@<n>"``, values ``(source, class)``), or
    in a backward graph ``fwd_nn_module_stack``, that of the forward op."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out: list[tuple[int | None, str]] = []
    for key, value in stack.items():
        try:
            ident: int | None = int(str(key).split("@")[0])
        except ValueError:
            ident = None
        source = value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else ""
        out.append((ident, source))
    return out


def _all_nodes(graph: fx.Graph) -> Iterator[fx.Node]:
    yield from graph.nodes
    root = graph.owning_module
    if root is not None:
        for _, sub in root.named_modules():
            if isinstance(sub, fx.GraphModule) and sub.graph is not graph:
                yield from sub.graph.nodes


def _is_tensor(value: Any) -> bool:
    """A graph node that holds a tensor (a symbolic size is not one: a spec cannot hold it)."""
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _last_of(node: fx.Node, outputs: list[fx.Node]) -> fx.Node:
    """The last of ``node`` and its ``outputs`` (its ``getitem`` s, which follow it) in
    graph order, found by walking forward from ``node``."""
    left = set(outputs)
    last = current = node
    while left and current.next is not current and current.op != "output":
        current = current.next
        if current in left:
            left.discard(current)
            last = current
    return last


def _through_views(node: fx.Node, depth: int = 8) -> fx.Node | None:
    while depth and node.op == "call_function" and isinstance(node.target, OpOverload) \
            and node.target.overloadpacket.__name__ in _VIEWS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        depth -= 1
    return node


def _is_matrix(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() >= 1


def _subgraphs(graph: fx.Graph, node: fx.Node) -> Iterator[fx.GraphModule]:
    """The ``GraphModule`` s a higher-order op node takes (its bodies)."""
    root = graph.owning_module
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and root is not None:
            value = _attr(root, str(arg.target))
            if isinstance(value, fx.GraphModule):
                yield value


def _attr(root: Any, target: str) -> Any:
    value = root
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
