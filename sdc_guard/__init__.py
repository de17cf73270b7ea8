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
from .runtime.config import GuardConfig
from .runtime.guard import Guard, protect
from .report import Detection, StepReport
from .runtime.inject import GemmFault, drill, flip_parameter_bit
from .runtime.collective_faults import CollectiveFault
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
    "guard": "runtime.guard",
    "inject": "runtime.inject",
    "sampling": "runtime.sampling",
    "policy": "respond.policy",
    "snapshot": "respond.snapshot",
    "legacy": "core.legacy",
    "toy_gpt": "tools.toy_gpt",
    "core.verify": "verify",
    "runtime.report": "report",
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
