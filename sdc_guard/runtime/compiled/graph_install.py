"""Where the graph pass runs: the compilers' post-partition graphs, while a compiled-route
guard is active (docs/COMPILE.md, "Where the pass runs").

The pass (``runtime/compiled/graph_pass.py``) must see the forward and backward graphs as AOT
autograd hands them to the compiler, after partitioning: only there are activation
checkpointing's recomputed GEMMs nodes of the backward graph. Two compilers are covered:

- inductor: ``torch._inductor.config.post_grad_custom_pre_pass``, its documented hook
  (a ``CustomGraphPass`` whose ``uuid`` enters the FX graph cache's key). It runs on every
  forward, backward and inference graph before inductor's own post-grad passes, so the
  GEMMs checked are the graph's whatever inductor later fuses or templates. A pass the
  user set there runs first, unchanged.
- ``aot_eager`` (and ``aot_eager_decomp_partition``): AOT autograd calls the backend's
  forward and backward compilers with the partitioned graphs; those backends look their
  compiler (``torch._dynamo.backends.debugging.boxed_nop``) up when they compile, and
  that name is bound to a wrapper that instruments the graph first. (AOT autograd's only
  other hook, ``torch._functorch.config.joint_custom_pass``, runs on the joint graph
  before partitioning: a check put there stays with the forward GEMM, and the
  partitioner's recomputation in the backward, built by
  ``partitioners.reordering_to_mimic_autograd_engine`` from what the gradients need,
  drops it. Measured on three checkpointed blocks: 7 forward checks, 14 of the 18
  backward GEMMs checked, the 4 recomputed ones not.)

Both are installed when the first compiled-route guard of the process activates and put
back as they were when the last one deactivates, so no compile outside a ``protect()``
block meets them (and inductor's cache keys outside are the ones without them). While
installed, the pass checks only graphs compiled on a thread whose compiled-route guard
collects checks (``graph_checks.current_sink``); the uuid says which, so that a graph
compiled without checks is never served from the cache to a guarded thread or the other
way round.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import fx

from . import graph_ops  # noqa: F401  (registers check_node: a cached compiled graph calls it)
from .graph_checks import current_sink

_lock = threading.Lock()
_active = 0
#: what was installed before (restored when the last guard deactivates)
_saved: dict[str, Any] = {}

_VERSION = "sdc_guard-graph-checks-1"


def _instrument(graph: fx.Graph, runs_in_python: bool = False) -> int:
    from .graph_pass import instrument  # graph_pass imports the check ops; loaded on first use
    sink = current_sink()
    return 0 if sink is None else instrument(graph, sink, runs_in_python)


def _source_hash() -> str:
    from pathlib import Path

    from ...core.torch_private import get_hash_for_files
    from ..dispatch import ops
    here = Path(__file__).parent
    files = tuple(str(here / name) for name in ("graph_pass.py", "graph_ops.py", "graph_checks.py")) + (ops.__file__,)
    return get_hash_for_files(files).hex()


def _inductor_pass() -> Any:
    from ...core.torch_private import CustomGraphPass

    class GraphChecks(CustomGraphPass):
        """Inductor's post-grad pre-pass: the graph pass, on a guarded thread."""

        def __call__(self, graph: fx.Graph) -> None:
            _instrument(graph)

        def uuid(self) -> Any:
            return f"{_VERSION}:{_source_hash()}:{'on' if current_sink() is not None else 'off'}"

    return GraphChecks()


def _wrap_nop(nop: Callable[..., Any]) -> Callable[..., Any]:
    def boxed_nop(fx_g: fx.GraphModule, example_inputs: Any) -> Any:
        if _instrument(fx_g.graph, runs_in_python=True):
            fx_g.recompile()
        return nop(fx_g, example_inputs)

    boxed_nop.__wrapped__ = nop  # type: ignore[attr-defined]
    boxed_nop.sdc_guard = True  # type: ignore[attr-defined]
    return boxed_nop


def install() -> None:
    """Install the pass where the compilers run it (once for all active guards)."""
    global _active
    with _lock:
        _active += 1
        if _active > 1:
            return
        from ...core.torch_private import dynamo_debugging_backends as debugging, inductor_config

        previous = inductor_config.post_grad_custom_pre_pass
        _saved["inductor"] = previous
        passes = () if previous is None else tuple(previous) if isinstance(previous, (list, tuple)) else (previous,)
        inductor_config.post_grad_custom_pre_pass = (*passes, _inductor_pass())
        nop = getattr(debugging, "boxed_nop", None)
        if callable(nop) and not getattr(nop, "sdc_guard", False):
            _saved["boxed_nop"] = nop
            debugging.boxed_nop = _wrap_nop(nop)


def uninstall() -> None:
    """Undo one ``install``; the last puts everything back as it was."""
    global _active
    with _lock:
        if _active == 0:
            return
        _active -= 1
        if _active:
            return
        from ...core.torch_private import dynamo_debugging_backends as debugging, inductor_config

        inductor_config.post_grad_custom_pre_pass = _saved.pop("inductor", None)
        nop = _saved.pop("boxed_nop", None)
        if nop is not None:
            debugging.boxed_nop = nop


def installed() -> bool:
    """Whether the pass is installed now (a compiled-route guard is active somewhere)."""
    return _active > 0
