"""Higher-order ops (HOPs) under sdc_guard's dispatch modes: run, never stopped, their
GEMMs seen (docs/DESIGN.md, "Higher-order ops").

Eager ``torch.cond``, ``while_loop`` and ``flex_attention`` are not plain kernels: each
compiles a small wrapper around its HOP with ``torch.compile(fullgraph=True)`` and calls
it. Dynamo refuses to compile while a dispatch mode is on the stack; the wrapper then runs
uncompiled, which flex attention turns into an error ("found no compiled frames") and
``cond`` under autograd into a wrong trace (the branches' parameters are closure
variables, not operands, and cond's backward traces them as fake tensors). What makes
them run under the guard and the drill as they run without them:

1. **Dynamo compiles such a wrapper under the mode, and no other new frame**
   (:func:`hidden_from_dynamo`, what ``RoutingMode.ignore_compile_internals`` answers).
   Dynamo asks a mode that question twice. When a frame is about to be compiled, the
   answer is yes only while torch compiles a HOP's wrapper (``in_hop_compile``, torch's
   own thread-local flag, set by ``setup_compilation_env`` around exactly these
   compiles): dynamo captures the body, lifts the closure parameters into operands, and
   the captured HOP runs with the mode on; any other frame dynamo has not compiled yet
   still runs eagerly under the mode. When the mode is entered, the answer is yes: dynamo
   then leaves the mode's dispatch keys out of its guards, so a wrapper compiled once is
   reused at every later call, guarded or not (otherwise every call would fail its guards
   and compile again, without bound). A consequence: code dynamo compiled before the
   block (outside it) also passes its guards inside it and runs compiled, the mode seeing
   the aten ops it calls (docs/COMPILE.md).
2. **The site trackers' module hooks do nothing while dynamo traces**
   (``intercept.SiteTracker``): a hook that writes the tracker's stack inside a traced
   branch is a side effect dynamo refuses in a HOP body. They keep their keys from step
   to step (``runtime/dispatch/site_hooks.py``): dynamo guards on them.
3. **The bodies run with the mode on** (:data:`HOP_BODIES`): ``cond``'s taken branch, the
   eager kernel of the others. A body dynamo captured is a ``GraphModule`` whose nodes
   remember the module each came from (``nn_module_stack``, keyed by the module's
   ``id``): it is run node by node (:class:`SitedRun`), publishing those modules
   (:func:`branch_modules`) so that each site tracker names the GEMM after the module of
   its own model that ran it, as its hooks would have. The outputs of a ``cond`` under
   autograd are labelled with the calling module's site, so the GEMMs of its backward
   (which runs the branch's backward graph, not modules) carry that site.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import Tensor
from ...core.torch_private import (
    TorchDispatchMode, get_current_dispatch_mode_stack, DispatchKey, HigherOrderOperator,
    current_graph_task_id, tree_leaves,
)

try:  # set while torch compiles a HOP's eager wrapper (torch 2.13 has it; older releases unchecked)
    from ...core.torch_private import in_hop_compile as _in_hop_compile
    _KNOWS_HOP_COMPILES = True
except ImportError:  # an older torch: the modes stay visible to dynamo, as they were
    _KNOWS_HOP_COMPILES = False

    def _in_hop_compile() -> bool:
        return False

#: A module recorded for a graph node: (``id`` of the module, its class or ``None``).
ModuleRef = tuple[int, "type | None"]


class _Local(threading.local):
    def __init__(self) -> None:
        self.modules: list[tuple[ModuleRef, ...]] = []  #: per running captured node
        self.entering = 0  #: a mode of sdc_guard is being entered (``entering``)


_local = _Local()


def in_hop_compile() -> bool:
    """Whether torch is compiling (or running) the eager wrapper of a HOP on this thread."""
    return _in_hop_compile()


def hidden_from_dynamo() -> bool:
    """What ``RoutingMode.ignore_compile_internals`` answers (the module doc, item 1):
    yes while the mode is being entered (dynamo's guards then leave its dispatch keys
    out) and while torch compiles a HOP's eager wrapper; no otherwise (a new frame runs
    eagerly under the mode). Always no on a torch that does not mark HOP compiles."""
    return _KNOWS_HOP_COMPILES and (_local.entering > 0 or _in_hop_compile())


@contextmanager
def entering() -> Iterator[None]:
    """Mark a dispatch mode of sdc_guard as being entered on this thread
    (:func:`hidden_from_dynamo`)."""
    _local.entering += 1
    try:
        yield
    finally:
        _local.entering -= 1


class BranchSites(Protocol):
    """What a site tracker offers the HOP bodies (``intercept.SiteTracker``)."""

    def label_outputs(self, outputs: Any) -> None: ...


def branch_modules() -> tuple[ModuleRef, ...]:
    """The modules (outermost first) of the captured HOP-body node running now on this
    thread; ``()`` outside one. Site trackers resolve them against their own model."""
    stack = _local.modules
    return stack[-1] if stack else ()


def node_modules(node: torch.fx.Node) -> tuple[ModuleRef, ...]:
    """The modules dynamo recorded for ``node`` (its ``nn_module_stack``: keys
    ``"<id>"`` or ``"<id>@<n>"`` for the n-th call of one module, values
    ``(source, class)``), outermost first; ``()`` when it recorded none."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ()
    refs = []
    for key, value in stack.items():
        try:
            ident = int(str(key).split("@")[0])
        except ValueError:  # a key of another form (an export root, a name): not a module id
            continue
        cls = value[1] if isinstance(value, tuple) and len(value) > 1 and isinstance(value[1], type) else None
        refs.append((ident, cls))
    return tuple(refs)


class SitedRun(torch.fx.Interpreter):
    """Runs a captured HOP body node by node, the same calls in the same order as its
    ``forward`` (so the same results, bit for bit), with each node's modules published
    (:func:`branch_modules`) while it runs."""

    def run_node(self, n: torch.fx.Node) -> Any:
        modules = node_modules(n)
        if not modules:
            return super().run_node(n)
        _local.modules.append(modules)
        try:
            return super().run_node(n)
        finally:
            _local.modules.pop()


def sited(fn: Any) -> Any:
    """``fn`` itself, or, for a captured body whose nodes remember their modules, a
    function that runs it with :class:`SitedRun`."""
    if not isinstance(fn, torch.fx.GraphModule) or not any(node_modules(n) for n in fn.graph.nodes):
        return fn

    def run(*args: Any) -> Any:
        return SitedRun(fn).run(*args)
    return run


@contextmanager
def reentered(mode: TorchDispatchMode) -> Iterator[None]:
    """Push ``mode`` again while its own ``__torch_dispatch__`` runs (PyTorch pops a mode
    for its handler), without the subclass's ``__enter__``/``__exit__`` (a drill's starts and
    stops its site hooks)."""
    with entering():
        TorchDispatchMode.__enter__(mode)
    try:
        yield
    finally:
        TorchDispatchMode.__exit__(mode, None, None, None)


def _trackers(mode: TorchDispatchMode) -> list[BranchSites]:
    """The site trackers of ``mode`` and of the modes below it on this thread (a drill
    under the guard): each labels with its own key."""
    found: list[BranchSites] = []
    for m in (mode, *get_current_dispatch_mode_stack()):
        sites = getattr(m, "sites", None)  # another library's mode may have none, or another kind
        if callable(getattr(sites, "label_outputs", None)) and all(sites is not s for s in found):
            found.append(sites)
    return found


def _cond_body(mode: TorchDispatchMode, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
    """``torch.cond``: run the branch taken, with the mode on (its dense kernel refuses to
    run under a mode; ``FlopCounterMode`` runs the branches itself too). The predicate is
    read on the host, as the dense kernel does. Under autograd (cond's autograd function
    calls this below autograd, forward), the outputs are labelled for the backward."""
    pred, true_fn, false_fn, operands = args
    with reentered(mode):
        out = sited(true_fn if pred else false_fn)(*operands)
    _label_for_backward(mode, operands, out)
    return out


def _label_for_backward(mode: TorchDispatchMode, inputs: Any, out: Any) -> None:
    """``cond``'s autograd function runs its forward below autograd and returns these
    outputs, and its backward runs a graph, not modules: label the outputs (their node,
    once the function attaches it) with the running module's site, for the GEMMs of
    that backward."""
    if current_graph_task_id() != -1:
        return
    if any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(inputs)):
        for tracker in _trackers(mode):
            tracker.label_outputs(out)


def _dense_body(mode: TorchDispatchMode, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
    """A HOP whose eager (``CompositeExplicitAutograd``) kernel runs its body in Python:
    run that kernel with the mode on."""
    kernel = func.py_kernels[DispatchKey.CompositeExplicitAutograd]
    with reentered(mode):
        return kernel(*args, **kwargs)


def _while_loop_body(mode: TorchDispatchMode, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
    """``while_loop`` (and ``while_loop_stack_output``, what it runs under autograd): its
    eager kernel with the mode on, ``cond_fn`` and ``body_fn`` run with their modules
    published when dynamo captured them. Its autograd function returns views of these
    outputs, not the outputs themselves, so nothing labels its backward: the GEMMs there
    are ``"global"``."""
    cond_fn, body_fn, *rest = args
    return _dense_body(mode, func, (sited(cond_fn), sited(body_fn), *rest), kwargs)


#: HOP name -> how its body is run with the mode on. The eager kernels of the others
#: (``scan``, ``invoke_subgraph``, ...) refuse a mode, or run compiled code: they are run
#: with the mode off and counted.
HOP_BODIES: dict[str, Callable[[TorchDispatchMode, HigherOrderOperator, tuple, dict], Any]] = {
    "cond": _cond_body,
    "while_loop": _while_loop_body,
    "while_loop_stack_output": _while_loop_body,  # what while_loop runs under autograd
    "flex_attention": _dense_body,
    "flex_attention_backward": _dense_body,
}
