"""What the guard keeps of one check: ``summarize`` confirms its flags
(``core/confirm.py``) and reduces it on the device to a few numbers (``SUMMARY``).

Here, below ``backends/`` and ``runtime/``, because both use it: every backend's
``Backend.summarize`` and the step ledger (``runtime/lifecycle/ledger.py``) that reads summaries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .abft import AbftCheck
from .confirm import candidates, confirm


#: What ``summarize`` keeps of a check, in order: any confirmed corruption, worst D/T, any
#: legitimate overflow, any unverifiable failure, the screen's unconfirmed flags (misses),
#: any corruption of the GEMM itself (not only of a weight at rest)
SUMMARY = ("corrupted", "worst", "overflow", "unverifiable", "misses", "gemm")


def clear_summary(worst: float) -> list[float]:
    """The summary of a clear check with worst ratio ``worst``."""
    return [0.0, worst, 0.0, 0.0, 0.0, 0.0]


def summarize(req: object, check: AbftCheck, cached: bool = False) -> tuple[Tensor | None, Tensor | list[float]]:
    """Device-side reduction of one check of ``req``, after confirming its flags
    (``sdc_guard.core.confirm``): (confirmed-corruption mask, ``SUMMARY`` numbers).

    A ``clear`` check (CPU: every segment passed, all finite) has nothing to confirm or
    reduce but its worst ratio (given by the native backend, else read on the host, where
    that costs nothing), and no mask (``None``: all False); its summary stays on the
    host. ``cached``: the check used a cached weight encoding (a cleared flag is then
    tested for a stale one: a weight corrupted at rest).
    """
    if check.clear and check.diff is not None and check.threshold is not None:
        worst = check.worst_ratio
        if worst is None:
            worst = float((check.diff / check.threshold).amax()) if check.diff.numel() else 0.0
        return None, clear_summary(worst)
    ratio = check.ratio
    conf = confirm(req, check.ok, check.inputs_bad, ratio, cached=cached)
    corrupted = conf.corrupted
    misses = candidates(check.ok, check.inputs_bad) & ~corrupted & ~conf.overflow
    if ratio is None:
        worst = torch.full((), float("nan"), device=corrupted.device)
    else:
        # Non-finite D (corruption to Inf/NaN) counts as an infinite ratio; segments that
        # are unverifiable or legitimately overflowed do not count.
        valid = ~check.inputs_bad & ~conf.overflow
        ratio = torch.nan_to_num(ratio, nan=float("inf"))
        worst = torch.where(valid, ratio, 0.0).amax() if ratio.numel() else ratio.new_zeros(())
    summary = torch.stack([corrupted.any().float(), worst.float(), conf.overflow.any().float(),
                           (~check.ok & check.inputs_bad).any().float(), misses.sum().float(),
                           conf.sdc.any().float()])
    return corrupted, summary
