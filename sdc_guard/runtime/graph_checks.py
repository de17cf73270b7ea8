"""What the compiled route's in-graph checks share (docs/COMPILE.md).

The compiled route puts custom ops into ``torch.compile``'s graphs: ``check_gemm``
(``function_mode``) and ``check_attention`` (``function_attention``). Their bodies run at
run time, outside anything dynamo traced, and need three things that only the running
thread knows: the guard to report to (its *sink*), the fault drills that may corrupt an
output just before it is checked, and, at trace time, the module path of the call. They
live here, below both check ops, so that neither imports the other.

A custom op that returns nothing and writes nothing is dead code to dynamo, AOT autograd
and inductor. The check ops are registered as side effects instead (``keep_in_graph``:
``torch.fx.node.has_side_effect``), which every one of them honours, and declare no write:
an op that wrote a shared tensor (a counter) had that tensor saved for its backward, and the
next graph's checks rewrote it before that backward ran, so a graph break inside a compiled
model made its backward fail. Their order in a graph is their data's.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from .attention import AttentionCall
from .module_names import ModuleNames, run_time_site
from .ops import Gemm


class CheckSink(Protocol):
    """What the check ops report to (the ``Guard`` of this thread)."""

    def on_gemm(self, gemm: Gemm, site: str | None = None, phase: str | None = None) -> None: ...
    def on_attention(self, call: AttentionCall, site: str | None = None, phase: str | None = None) -> None: ...
    def on_unverified(self, op: str) -> None: ...
    def on_write(self, tensors: list[Tensor]) -> None: ...
    @property
    def module_names(self) -> ModuleNames: ...


#: ``drill(op, out, site, phase)``: may corrupt ``out`` (a tensor; for ``sdpa_backward``
#: the tuple ``(grad_query, grad_key, grad_value)``) in place before it is checked
Drill = Callable[[str, Any, str, str], None]


class _Local(threading.local):
    sink: CheckSink | None = None
    drills: tuple = ()  #: fault drills (``sdc_guard.runtime.inject``)


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


class _Count:
    """Checks run so far in this process, every thread and device (``checks_run``)."""

    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()  # backward checks may run on autograd's worker threads


_count = _Count()


def count_check() -> None:
    """Count one check run (called by a check op's body)."""
    with _count.lock:
        _count.value += 1


def checks_run() -> int:
    """Checks the check ops have run in this process (the in-graph checks ran: tests)."""
    return _count.value


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
            torch.fx.node._side_effectful_functions.add(target)


def inductor_keeps(op: Any) -> bool | None:
    """Whether this torch's inductor keeps ``op`` (registered by ``keep_in_graph``) in its
    graphs: ``FallbackKernel.has_side_effects`` asked about it. Inductor versions that only
    keep ops with a mutable schema would drop the checks; ``None`` when it cannot be told."""
    try:
        from types import SimpleNamespace

        from torch._inductor.ir import FallbackKernel
        return bool(FallbackKernel.has_side_effects(SimpleNamespace(op_overload=op.default)))  # type: ignore[arg-type]
    except Exception:
        return None


#: what ``note_unverified`` is handed: an op without a tensor argument would run its real
#: body at trace time, where no fake mode can see it (never written, so never versioned)
ANCHOR = torch.zeros(1)


@torch.library.custom_op("sdc_guard::note_unverified", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def note_unverified(anchor: Tensor, op: str) -> None:
    """Count a GEMM-bearing call the route cannot verify (``StepReport.unverified_ops``)."""
    sink = _local.sink
    if sink is not None:
        sink.on_unverified(op)


@note_unverified.register_fake
def _note_unverified_fake(anchor: Tensor, op: str) -> None:
    return None


keep_in_graph(torch.ops.sdc_guard.note_unverified)


def unverified(op: str) -> None:
    """Count ``op`` as unverified from traced code (an op in the graph, run per call)."""
    torch.ops.sdc_guard.note_unverified(ANCHOR, op)


@torch._dynamo.assume_constant_result
def trace_site() -> str:
    """The module path of the call being traced, read from dynamo's module stack at trace
    time (a constant of the graph); ``""`` outside dynamo. The stack's paths start at the
    variable that holds the root of the frame dynamo compiles; when that root is one of
    the protected model's modules but not the model (a submodule's ``forward`` compiled on
    its own after a graph break), the path is completed with that module's name. Private
    dynamo state: if it is not where this expects, the site is ``""`` (the guard then says
    ``"global"``)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        if tx is None:
            return ""
        stack = tx.output.current_tx.nn_module_stack
        path = list(stack.values())[-1][0] if stack else "L['self']"
        root = _frame_root(tx.output.root_tx, path)
        sink = _local.sink
        prefix = sink.module_names.of_module(root) if sink is not None and root is not None else None
    except Exception:
        return ""
    return ".".join(p for p in (prefix, module_path(path)) if p)


def _frame_root(root_tx: Any, path: str) -> Any:
    """The object behind the root variable of a module-stack path (``L['self']`` ...),
    looked up in the compiled frame's locals or globals; ``None`` if there is none."""
    match = re.match(r"([LG])\[['\"]([^'\"]+)['\"]\]", path)
    if match is None:
        return None
    scope = root_tx.f_locals if match.group(1) == "L" else root_tx.f_globals
    return scope.get(match.group(2))


def resolve_site(site: str, anchor: Tensor | list[Tensor] | None) -> str:
    """The run-time site of a check traced at ``site``: where the GEMM has a parameter
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
