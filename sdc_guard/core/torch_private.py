"""The private torch APIs sdc-guard relies on, all of them, each with why.

torch keeps no compatibility promise for these names (a ``_`` in their path); naming them
in one place says what a torch upgrade must be checked for, and ``tests/unit/core/test_torch_private.py``
fails if a module of the package uses a private torch name other than through here, or if
a name below does not resolve on the installed torch. Checked on the torch versions in
``TESTED_TORCH``.

The names of heavy subsystems (dynamo, inductor, c10d's C bindings, HOP utilities) are
looked up on first use, not at import: ``import sdc_guard`` must not import inductor.
Callers that tolerate a torch without one of them catch ``ImportError`` /
``AttributeError`` as they did before.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.overrides
import torch.utils._pytree
from torch import _C
from torch import _ops
from torch.utils import _python_dispatch

#: torch releases every name here was checked on (the CI's torch is the first)
TESTED_TORCH: tuple[str, ...] = ("2.13.0",)

# --- dispatch and function modes (runtime/dispatch/intercept.py, interception.py, hops.py, ops.py)

#: base of the dispatch modes that see every GEMM (``__torch_dispatch__``); the public
#: class of a private module, which PyTorch's own subclasses and docs use
TorchDispatchMode = _python_dispatch.TorchDispatchMode
#: a dispatch mode that only runs each op (what a mode's Python round trip costs)
BaseTorchDispatchMode = _python_dispatch.BaseTorchDispatchMode
#: switch off every dispatch mode on the thread while the guard runs its own ops
disable_current_modes = _python_dispatch._disable_current_modes
#: the innermost dispatch mode (whether the guard's mode is the thread's only one)
get_current_dispatch_mode = _python_dispatch._get_current_dispatch_mode
#: the thread's dispatch modes, innermost last (find a mode of ours under others)
get_current_dispatch_mode_stack = _python_dispatch._get_current_dispatch_mode_stack
#: the innermost function mode (the compiled route's ``GemmFunctionMode``, or another's)
get_current_function_mode = torch.overrides._get_current_function_mode
#: the thread's function modes (whether ours is on it)
get_current_function_mode_stack = torch.overrides._get_current_function_mode_stack
#: how many dispatch modes are on the thread (0: nothing to switch off)
dispatch_stack_depth = _C._len_torch_dispatch_stack
#: verification's own ops run with ``__torch_function__`` off (not seen as the model's)
DisableTorchFunction = _C.DisableTorchFunction

# --- the dispatcher (runtime/dispatch/ops.py, hops.py)

#: dispatch keys: redispatching below Python, composite kernels of HOPs and overloads
DispatchKey = _C.DispatchKey
#: whether an overload decomposes (a composite implicit kernel: its GEMMs are seen inside)
dispatch_has_kernel_for_dispatch_key = _C._dispatch_has_kernel_for_dispatch_key
#: a tensor's dispatch key set (redispatching an op below the Python key)
dispatch_keys = _C._dispatch_keys
#: the key set after a key (redispatching an op below the Python key)
dispatch_keyset_full_after = _C._dispatch_keyset_full_after
#: higher-order operators (flex attention, checkpoint wrappers): their bodies are traced
HigherOrderOperator = _ops.HigherOrderOperator
#: an ATen overload, as graph nodes name their targets (the compiled route's pass)
OpOverload = _ops.OpOverload
#: the module whose ``FakeTensor`` calls compute nothing (``DTensor``'s sharding propagation)
FAKE_TENSOR_MODULE = "torch._subclasses.fake_tensor"

# --- autograd (runtime/dispatch/intercept.py, intake.py, hops.py)

#: the running backward's id (-1 outside one): whether a GEMM is forward or backward
current_graph_task_id = _C._current_graph_task_id
#: the autograd node being run: which module a backward GEMM belongs to
current_autograd_node = _C._current_autograd_node
#: the innermost saved-tensor hooks, ``(pack, unpack)`` or ``None``: whether an eager GEMM
#: runs in a non-reentrant activation checkpoint's forward (runtime/compiled/function_gemm.py)
top_saved_tensors_default_hooks = _C._autograd._top_saved_tensors_default_hooks

# --- kernels and utilities

#: one kernel for every gradient's norm (the gradient screen, runtime/sampling/screened.py)
foreach_norm = torch._foreach_norm
#: which fused attention kernel the dispatcher would choose (metadata only, no host sync)
fused_sdp_choice = torch._fused_sdp_choice
#: a nested structure's leaves (a HOP's inputs that require grad; a closure's result)
tree_leaves = torch.utils._pytree.tree_leaves
#: the same structure with every leaf mapped (a closure's result without its autograd graph)
tree_map = torch.utils._pytree.tree_map

#: looked up on first use: name -> ``"module:attribute"``, or ``"module"`` for the module itself
_LAZY: dict[str, str] = {
    # torch.fx: where ``has_side_effect`` is missing, the set it adds to keeps the check ops
    "side_effectful_functions": "torch.fx.node:_side_effectful_functions",
    # HOPs: set while torch compiles a HOP's eager wrapper (modes stay out of its way)
    "in_hop_compile": "torch._higher_order_ops.utils:_in_hop_compile",
    # dynamo: run the function mode's handler eagerly when eager code calls it
    "set_code_exec_strategy": "torch._C._dynamo.eval_frame:set_code_exec_strategy",
    "FrameAction": "torch._dynamo.types:FrameAction",
    "FrameExecStrategy": "torch._dynamo.types:FrameExecStrategy",
    # dynamo: ``torch.compile(model)``'s wrapper (a compiled model takes the compiled route)
    "OptimizedModule": "torch._dynamo.eval_frame:OptimizedModule",
    # dynamo: the ``aot_eager`` backends' compiler, where the compiled route's pass goes
    "dynamo_debugging_backends": "torch._dynamo.backends.debugging",
    # inductor: its documented hook for a post-grad pass, and the pass's cache key
    "inductor_config": "torch._inductor.config",
    "CustomGraphPass": "torch._inductor.custom_graph_pass:CustomGraphPass",
    "get_hash_for_files": "torch._inductor.custom_graph_pass:get_hash_for_files",
    # inductor: whether it keeps an op without outputs in its graphs
    "FallbackKernel": "torch._inductor.ir:FallbackKernel",
    # c10d: a functional collective's group from its name; the work a checked collective returns
    "resolve_process_group": "torch.distributed.distributed_c10d:_resolve_process_group",
    "PythonCallbackWork": "torch._C._distributed_c10d:PythonCallbackWork",
    "create_work_from_future": "torch._C._distributed_c10d:_create_work_from_future",
}


def __getattr__(name: str) -> Any:
    """A ``_LAZY`` name, imported now and kept (``ImportError`` / ``AttributeError``
    where this torch lacks it)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, attribute = _LAZY[name].partition(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attribute) if attribute else module
    globals()[name] = value
    return value


__all__ = [
    "TESTED_TORCH", "TorchDispatchMode", "BaseTorchDispatchMode", "disable_current_modes", "get_current_dispatch_mode",
    "get_current_dispatch_mode_stack", "get_current_function_mode", "get_current_function_mode_stack",
    "dispatch_stack_depth", "DisableTorchFunction", "DispatchKey", "dispatch_has_kernel_for_dispatch_key",
    "dispatch_keys", "dispatch_keyset_full_after", "HigherOrderOperator", "OpOverload", "FAKE_TENSOR_MODULE",
    "current_graph_task_id", "current_autograd_node", "foreach_norm", "fused_sdp_choice", "tree_leaves",
    *_LAZY,
]
