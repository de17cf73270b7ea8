"""What the compiled route's in-graph checks share (docs/COMPILE.md).

The compiled route puts custom ops into ``torch.compile``'s graphs: ``check_gemm``
(``function_mode``) and ``check_attention`` (``function_attention``). Their bodies run at
run time, outside anything dynamo traced, and need three things that only the running
thread knows: the guard to report to (its *sink*), the fault drills that may corrupt an
output just before it is checked, and, at trace time, the module path of the call. They
live here, below both check ops, so that neither imports the other.

``CHECKS`` is the tensor every check op mutates (``mutates_args=("flags",)``): a custom op
that returns nothing and writes nothing is dead code to AOT autograd and inductor, and the
declared write keeps it in the graph, in order.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from .attention import AttentionCall
from .ops import Gemm


class CheckSink(Protocol):
    """What the check ops report to (the ``Guard`` of this thread)."""

    def on_gemm(self, gemm: Gemm, site: str | None = None, phase: str | None = None) -> None: ...
    def on_attention(self, call: AttentionCall, site: str | None = None, phase: str | None = None) -> None: ...
    def on_unverified(self, op: str) -> None: ...
    def on_write(self, tensors: list[Tensor]) -> None: ...


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


#: Checks run so far in this process, every thread and device (int64 ``[1]``, on the host:
#: the checks' own flags stay on the device of what they check, in the guard's ledger).
CHECKS = torch.zeros(1, dtype=torch.int64)


@torch.library.custom_op("sdc_guard::note_unverified", mutates_args=("flags",),
                         tags=(torch.Tag.cudagraph_unsafe,))
def note_unverified(flags: Tensor, op: str) -> None:
    """Count a GEMM-bearing call the route cannot verify (``StepReport.unverified_ops``)."""
    sink = _local.sink
    if sink is not None:
        sink.on_unverified(op)


@note_unverified.register_fake
def _note_unverified_fake(flags: Tensor, op: str) -> None:
    return None


def unverified(op: str) -> None:
    """Count ``op`` as unverified from traced code (an op in the graph, run per call)."""
    torch.ops.sdc_guard.note_unverified(CHECKS, op)


@torch._dynamo.assume_constant_result
def trace_site() -> str:
    """The module path of the call being traced, read from dynamo's module stack at trace
    time (a constant of the graph); ``""`` outside dynamo. Private dynamo state: if it is
    not where this expects, the site is ``""`` (the guard then says ``"global"``)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        if tx is None:
            return ""
        stack = tx.output.current_tx.nn_module_stack
    except Exception:
        return ""
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return module_path(path)


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
