"""sdc-guard: catch silent data corruption in PyTorch matmuls, keep training correct.

>>> import torch, sdc_guard
>>> a, b = torch.randn(4, 64), torch.randn(64, 32)
>>> sdc_guard.verify_matmul(a, b, a @ b).ok
True
"""

from __future__ import annotations

from . import backends
from .core import legacy
from .runtime import sampling
from .core.comp_row import decode_comp_row, encode_comp_row
from .runtime.lifecycle.config import GuardConfig
from .runtime.lifecycle.guard import Guard, protect
from .report import Detection, StepReport
from .runtime.drills.inject import GemmFault, drill, flip_parameter_bit
from .runtime.collectives.collective_faults import CollectiveFault
from .respond.policy import (
    EXIT_COLLECTIVE,
    EXIT_NONDETERMINISTIC,
    EXIT_PERSISTENT,
    EXIT_TRANSIENT,
    Policy,
    SDCError,
    SDCExit,
    StepOutcome,
)
from .respond.snapshot import SnapshotStore, load_checkpoint, save_checkpoint
from .core.precision import default_e_max, set_default_e_max
from .verify import Verdict, abft_verify, matmul_checksum, verify_matmul

__version__ = "0.1.0"

# The modules' former public paths (before the subpackages): ``sdc_guard.sampling``,
# ``sdc_guard.policy``, ... are the same module objects as their new homes, so that
# ``from sdc_guard.sampling import Budget`` and ``import sdc_guard.toy_gpt`` keep working.
_FORMER_PATHS = {
    "guard": "runtime.lifecycle.guard",
    "inject": "runtime.drills.inject",
    "sampling": "runtime.sampling",
    "policy": "respond.policy",
    "snapshot": "respond.snapshot",
    "legacy": "core.legacy",
    "toy_gpt": "tools.toy_gpt",
    "core.verify": "verify",
    "runtime.report": "report",
    # runtime/ by concern (2026-12-05): the flat modules' paths
    "runtime.attention": "runtime.dispatch.attention",
    "runtime.budget": "runtime.sampling.budget",
    "runtime.cache": "runtime.checking.cache",
    "runtime.calibration": "runtime.lifecycle.calibration",
    "runtime.checker": "runtime.checking.checker",
    "runtime.checks": "runtime.lifecycle.checks",
    "runtime.collective_checks": "runtime.collectives.collective_checks",
    "runtime.collective_faults": "runtime.collectives.collective_faults",
    "runtime.collective_ops": "runtime.dispatch.collective_ops",
    "runtime.config": "runtime.lifecycle.config",
    "runtime.fault_models": "runtime.drills.fault_models",
    "runtime.function_attention": "runtime.compiled.function_attention",
    "runtime.function_gemm": "runtime.compiled.function_gemm",
    "runtime.function_mode": "runtime.compiled.function_mode",
    "runtime.gradient_stats": "runtime.sampling.gradient_stats",
    "runtime.graph_checks": "runtime.compiled.graph_checks",
    "runtime.graph_install": "runtime.compiled.graph_install",
    "runtime.graph_ops": "runtime.compiled.graph_ops",
    "runtime.graph_pass": "runtime.compiled.graph_pass",
    "runtime.guard": "runtime.lifecycle.guard",
    "runtime.guarded_step": "runtime.lifecycle.guarded_step",
    "runtime.hops": "runtime.dispatch.hops",
    "runtime.inject": "runtime.drills.inject",
    "runtime.intake": "runtime.lifecycle.intake",
    "runtime.intercept": "runtime.dispatch.intercept",
    "runtime.interception": "runtime.lifecycle.interception",
    "runtime.ledger": "runtime.lifecycle.ledger",
    "runtime.module_names": "runtime.compiled.module_names",
    "runtime.ops": "runtime.dispatch.ops",
    "runtime.optimizer_steps": "runtime.lifecycle.optimizer_steps",
    "runtime.sampler_base": "runtime.sampling.sampler_base",
    "runtime.schedule": "runtime.sampling.schedule",
    "runtime.screened": "runtime.sampling.screened",
    "runtime.site_hooks": "runtime.dispatch.site_hooks",
    "runtime.stats": "runtime.lifecycle.stats",
    "runtime.warn_once": "runtime.lifecycle.warn_once",
}


def _alias_former_paths() -> None:
    import importlib
    import sys

    for old, new in _FORMER_PATHS.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules[f"{__name__}.{old}"] = module
        parent, _, leaf = f"{__name__}.{old}".rpartition(".")
        setattr(sys.modules[parent], leaf, module)


_alias_former_paths()


def __getattr__(name: str):
    """``sdc_guard.SDCGuard`` without importing Lightning until it is used."""
    if name == "SDCGuard":
        from .integrations.lightning import SDCGuard

        return SDCGuard
    raise AttributeError(f"module 'sdc_guard' has no attribute {name!r}")

__all__ = [
    "SDCGuard",
    "CollectiveFault",
    "EXIT_COLLECTIVE",
    "EXIT_NONDETERMINISTIC",
    "EXIT_PERSISTENT",
    "EXIT_TRANSIENT",
    "GemmFault",
    "Policy",
    "SDCError",
    "SDCExit",
    "SnapshotStore",
    "StepOutcome",
    "flip_parameter_bit",
    "drill",
    "inject",
    "load_checkpoint",
    "save_checkpoint",
    "Detection",
    "Guard",
    "GuardConfig",
    "StepReport",
    "protect",
    "sampling",
    "Verdict",
    "abft_verify",
    "backends",
    "decode_comp_row",
    "default_e_max",
    "encode_comp_row",
    "legacy",
    "matmul_checksum",
    "set_default_e_max",
    "verify_matmul",
]
