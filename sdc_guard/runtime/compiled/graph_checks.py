"""What the compiled route's check ops share (docs/COMPILE.md).

The compiled route's check ops: ``check_node`` (``runtime/compiled/graph_ops.py``, put into the
compiled graphs by the graph pass), ``note_unverified`` (here), and the eager frames'
``check_gemm`` (``function_gemm``) and ``check_attention`` (``function_attention``).
Their bodies run when the code runs and need what only the running thread knows: the
guard to report to (its *sink*), the fault drills that may corrupt an output just before
it is checked, and the model's module names for the site. They live here, below every
check op, so that none imports another.

An op that returns nothing and writes nothing is dead code to dynamo, AOT autograd and
inductor. The check ops are registered as side effects instead (``keep_in_graph``:
``torch.fx.node.has_side_effect``), which every one of them honours, and declare no write
(an op that wrote a shared tensor, a counter, had that tensor saved for its backward, and
the next graph's checks rewrote it before that backward ran: the backward of a model with
a graph break failed). Their order in a graph is their data's.
"""

from __future__ import annotations

import itertools
import re
import threading
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from ..dispatch.attention import AttentionCall
from .module_names import ModuleNames, run_time_site
from ..dispatch.intercept import GemmSink
from ..dispatch.ops import Gemm


class CheckSink(GemmSink, Protocol):
    """What the check ops report to (the ``Guard`` of this thread): the dispatch mode's
    ``GemmSink``, one concept, with the site and phase a graph node already knows, the
    time spent outside the intake, and the module paths of the compiled graphs' sites."""

    def on_gemm(self, gemm: Gemm, site: str | None = None, phase: str | None = None) -> None: ...
    def on_attention(self, call: AttentionCall, site: str | None = None, phase: str | None = None) -> None: ...
    def charge(self, seconds: float) -> None: ...
    @property
    def module_names(self) -> ModuleNames: ...


#: ``drill(op, out, site, phase)``: may corrupt ``out`` (a tensor; for ``sdpa_backward``
#: the tuple ``(grad_query, grad_key, grad_value)``) in place before it is checked
Drill = Callable[[str, Any, str, str], None]


class _Local(threading.local):
    sink: CheckSink | None = None
    drills: tuple = ()  #: fault drills (``sdc_guard.runtime.drills.inject``)


_local = _Local()


def set_sink(sink: CheckSink | None) -> CheckSink | None:
    """Make ``sink`` receive this thread's in-graph checks; returns the previous one."""
    previous, _local.sink = _local.sink, sink
    return previous


def current_sink() -> CheckSink | None:
    """The sink of this thread's checks (``None`` outside a compiled-route ``protect()``)."""
    return _local.sink


def add_drill(drill: Drill) -> None:
    """Let ``drill(op, out, site, phase)`` corrupt each checked output before its check."""
    _local.drills = (*_local.drills, drill)


def remove_drill(drill: Drill) -> None:
    """Stop ``drill``. Compared with ``==``: a bound method is a new object at each access,
    so ``is`` would never match and a finished drill would go on corrupting."""
    _local.drills = tuple(d for d in _local.drills if d != drill)


def active_drills() -> tuple:
    """The drills of this thread (empty when no drill is entered)."""
    return _local.drills


def run_drills(op: str, out: Any, site: str, phase: str) -> None:
    """Let this thread's drills corrupt ``out`` (called by a check op, before its check)."""
    for drill in _local.drills:
        drill(op, out, site, phase)


#: checks run so far in this process, every thread and device (``checks_run``): an
#: ``itertools.count``, whose ``next`` is one atomic step of C (backward checks may run on
#: autograd's worker threads) where a lock cost a ``with`` block per check
_count = itertools.count()
_read = itertools.count()  #: how many times ``checks_run`` advanced ``_count`` to read it
_read_lock = threading.Lock()  #: one reader at a time (the counts run on without it)


def count_check() -> None:
    """Count one check run (called by a check op's body)."""
    next(_count)


def checks_run() -> int:
    """Checks the check ops have run in this process (the in-graph checks ran: tests).
    Read by advancing the count once more, which ``_read`` takes back off."""
    with _read_lock:
        return next(_count) - next(_read)


def keep_in_graph(op: Any) -> None:
    """Keep ``op`` (a custom op that returns nothing and writes nothing) in the graphs:
    registered as a side effect, which dynamo's, AOT autograd's and inductor's dead-code
    elimination respect. ``has_side_effect`` is the public spelling; the set it adds to is
    the fallback where it is missing."""
    register = getattr(torch.fx.node, "has_side_effect", None)
    for target in (op, op.default):
        if register is not None:
            register(target)
        else:
            from ...core.torch_private import side_effectful_functions
            side_effectful_functions.add(target)


#: the library of sdc_guard's check ops (``check_op``)
_LIB = torch.library.Library("sdc_guard", "DEF")


def check_op(schema: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Define ``sdc_guard::<schema>`` (an op that returns nothing and writes nothing) with
    the decorated function as its kernel on every backend, a fake kernel that does nothing,
    the ``cudagraph_unsafe`` tag, and the side-effect registration that keeps it in the
    graphs (``keep_in_graph``). A plain ``torch.library`` definition rather than
    ``torch.library.custom_op``: this op runs once per GEMM in the compiled graphs, and
    ``custom_op``'s autograd wrapper cost about 45 us a call more (54 us against 8.5 us for
    an empty body, measured on this machine)."""
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        name = _define(schema, fn, _nothing)
        keep_in_graph(getattr(torch.ops.sdc_guard, name))
        return fn
    return register


def running_op(schema: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Define ``sdc_guard::<schema>``, an op that returns what the op it stands for in a
    graph returns (``graph_ops.run_checked``: an aten op run with its inner GEMMs
    checked), with the decorated function as its kernel on every backend, ``fake`` as its
    fake kernel and the ``cudagraph_unsafe`` tag. Not a side effect: where its result is
    unused, the op it stands for would have been dropped too."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _define(schema, fn, fake)
        return fn
    return register


def _define(schema: str, kernel: Callable[..., Any], fake: Callable[..., Any]) -> str:
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.cudagraph_unsafe,))
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"sdc_guard::{name}", fake, lib=_LIB)
    return name


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def inductor_keeps(op: Any) -> bool | None:
    """Whether this torch's inductor keeps ``op`` (registered by ``keep_in_graph``) in its
    graphs: ``FallbackKernel.has_side_effects`` asked about it. Inductor versions that only
    keep ops with a mutable schema would drop the checks; ``None`` when it cannot be told."""
    try:
        from types import SimpleNamespace

        from ...core.torch_private import FallbackKernel
        return bool(FallbackKernel.has_side_effects(SimpleNamespace(op_overload=op.default)))  # type: ignore[arg-type]
    except Exception:
        return None


#: what ``note_unverified`` is handed: an op without a tensor argument would run its real
#: body at trace time, where no fake mode can see it (never written, so never versioned)
ANCHOR = torch.zeros(1)


@check_op("note_unverified(Tensor anchor, str op) -> ()")
def note_unverified(anchor: Tensor, op: str) -> None:
    """Count a GEMM-bearing call the route cannot verify (``StepReport.unverified_ops``)."""
    sink = _local.sink
    if sink is not None:
        sink.on_unverified(op)




def unverified(op: str) -> None:
    """Count ``op`` as unverified from traced code (an op in the graph, run per call)."""
    torch.ops.sdc_guard.note_unverified(ANCHOR, op)


def resolve_site(site: str, anchor: Tensor | list[Tensor] | None) -> str:
    """The run-time site of a check made at ``site``: where the GEMM has a parameter
    operand (``anchor``; of a list, the first that is a parameter of the model), the module
    that owns it (``module_names.run_time_site``), so that a graph dynamo shares between
    instances of a module names the instance that ran it; where ``site`` is empty (an
    eager frame, a graph node without a module), that module if it is the only one
    owning it."""
    sink = _local.sink
    if anchor is None or sink is None:
        return site
    owners: tuple[str, ...] = ()
    for candidate in anchor if isinstance(anchor, list) else (anchor,):
        owners = sink.module_names.owners(candidate)
        if owners:
            break
    if not site:
        return owners[0] if len(owners) == 1 else site
    return run_time_site(site, owners)


def module_path(path: str) -> str:
    """Dynamo's source name of a module (``L['self'].blocks[0].attn``,
    ``L['self']._modules['fc1']``) as a ``named_modules`` path (``blocks.0.attn``). The
    root is the variable that holds the model (``self`` in its ``forward``, ``fn`` for a
    compiled ``nn.Sequential``, the argument or global of a compiled function): dropped.

    >>> module_path("L['self'].blocks[0].attn"), module_path("L['self']._modules['fc1']")
    ('blocks.0.attn', 'fc1')
    >>> module_path("L['fn'].0"), module_path("G['model'].encoder.fc")
    ('0', 'encoder.fc')
    """
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    parts = [p for p in path.split(".") if p]
    if parts and parts[0] in ("L", "G"):
        parts = parts[2:]  # the scope and the root variable's name
    elif parts and (parts[0].startswith("L") or parts[0] == "self"):
        parts = parts[1:]
    if parts and parts[0] == "_orig_mod":
        parts = parts[1:]
    return ".".join(parts) if parts else ""
