"""sdc-guard: catch silent data corruption in PyTorch matmuls, keep training correct.

>>> import torch, sdc_guard
>>> a, b = torch.randn(4, 64), torch.randn(64, 32)
>>> sdc_guard.verify_matmul(a, b, a @ b).ok
True
"""

from __future__ import annotations

from . import backends, legacy
from . import sampling
from .comp_row import decode_comp_row, encode_comp_row
from .guard import Guard, protect
from .report import Detection, StepReport
from .inject import GemmFault, drill, flip_parameter_bit
from .policy import (
    EXIT_NONDETERMINISTIC,
    EXIT_PERSISTENT,
    EXIT_TRANSIENT,
    Policy,
    SDCError,
    SDCExit,
    StepOutcome,
)
from .snapshot import SnapshotStore, load_checkpoint, save_checkpoint
from .precision import default_e_max, set_default_e_max
from .verify import Verdict, abft_verify, matmul_checksum, verify_matmul

__version__ = "0.1.0"


def __getattr__(name: str):
    """``sdc_guard.SDCGuard`` without importing Lightning until it is used."""
    if name == "SDCGuard":
        from .integrations.lightning import SDCGuard

        return SDCGuard
    raise AttributeError(f"module 'sdc_guard' has no attribute {name!r}")

__all__ = [
    "SDCGuard",
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
