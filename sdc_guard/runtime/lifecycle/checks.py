"""Argument checks ``protect()`` and the integrations share: a metrics sink, a forced
backend, a guard's per-run arguments (its settings: ``runtime/lifecycle/config.py``).

Bad input gets a clear error at the call that received it, naming the argument, what was
expected and what was received.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ... import backends
from ...backends import GemmRequest
from ...core.precision import SUPPORTED_DTYPES

from ...respond.snapshot import SnapshotStore

if TYPE_CHECKING:
    from ...respond.outcome import StepOutcome
    from ...report import StepReport


class MetricsSink(Protocol):
    """Where reports and outcomes go (``sdc_guard.metrics.GuardMetrics``)."""

    def observe_report(self, report: "StepReport") -> None: ...
    def observe_outcome(self, outcome: StepOutcome) -> None: ...


METRICS_SINK_METHODS = ("observe_report", "observe_outcome")


def check_metrics_sink(metrics: Any, name: str = "metrics") -> None:
    """Raise ``TypeError`` naming ``name`` unless ``metrics`` is a sink object: one with
    ``observe_report`` and ``observe_outcome`` (``sdc_guard.metrics.GuardMetrics``).

    >>> check_metrics_sink("prometheus")
    Traceback (most recent call last):
    ...
    TypeError: metrics: expected a metrics sink (an object with observe_report and observe_outcome, such as sdc_guard.metrics.GuardMetrics()), got str 'prometheus'
    """
    if isinstance(metrics, type) or not all(callable(getattr(metrics, m, None)) for m in METRICS_SINK_METHODS):
        what = f"the class {metrics.__name__} (pass an instance)" if isinstance(metrics, type) else \
            f"{type(metrics).__name__} {metrics!r}"
        raise TypeError(f"{name}: expected a metrics sink (an object with {' and '.join(METRICS_SINK_METHODS)}, "
                        f"such as sdc_guard.metrics.GuardMetrics()), got {what}")


def check_backend(backend: Any, model: nn.Module | None = None, name: str = "backend") -> None:
    """Raise ``ValueError`` unless the forced backend (``backend``, else
    ``$SDC_GUARD_BACKEND``) exists, is usable in this process and, given ``model``,
    accepts GEMMs on the devices and dtypes of its parameters: a forced backend that
    cannot serve the tensors it will see is an error before training, not a warning per
    GEMM during it. ``None`` with no variable set (the dispatcher chooses) always passes.

    >>> check_backend("torch", torch.nn.Linear(2, 2))
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"{name}: expected a backend name ({', '.join(backends.registered())}) or None, "
                        f"got {type(backend).__name__} {backend!r}")
    source, value = (name, backend) if backend is not None else (backends.ENV_BACKEND, os.environ.get(backends.ENV_BACKEND))
    if not value:
        return
    if value not in backends.registered():
        raise ValueError(f"{source}: expected one of {', '.join(map(repr, backends.registered()))}, got {value!r}")
    chosen = backends.get(value)
    reason = chosen.unavailable_reason()
    if reason is not None:
        raise ValueError(f"{source}: expected a backend usable in this process, got {value!r}, which is not: {reason}")
    kinds = {(p.device, p.dtype) for p in (model.parameters() if model is not None else ())
             if p.dtype in SUPPORTED_DTYPES and p.device.type != "meta"}
    for device, dtype in sorted(kinds, key=str):
        probe = torch.empty((2, 2), dtype=dtype, device=device)
        reason = chosen.rejects(GemmRequest(probe, probe, probe, 1e-3))
        if reason is not None:
            raise ValueError(f"{source}: expected a backend that can verify the model's GEMMs ({dtype} on {device}), "
                             f"got {value!r}, which cannot: {reason}")


def check_guard_arguments(model: Any, *, backend: Any, rank: Any, snapshots: Any, metrics: Any) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the first of a guard's per-run arguments
    that is not what it takes, and a forced ``backend`` that cannot serve ``model``'s
    tensors (the settings themselves are checked by ``runtime.lifecycle.config.GuardConfig``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_backend(backend, model)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank: expected a non-negative int or None, got {rank!r}")
    if snapshots is not None and not isinstance(snapshots, SnapshotStore):
        raise TypeError(f"snapshots: expected a sdc_guard.SnapshotStore, got {type(snapshots).__name__}")
    if metrics is not None:
        check_metrics_sink(metrics)


def check_optimizer_step_arguments(optimizer: Any, closure: Any, replay_started: Any) -> None:
    """Raise ``TypeError`` naming the argument of ``Guard.optimizer_step`` that is not what
    it takes: a ``torch.optim.Optimizer``, a callable closure or ``None``, a
    ``time.perf_counter()`` value or ``None``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if closure is not None and not callable(closure):
        raise TypeError(f"closure: expected a callable or None, got {type(closure).__name__}")
    if replay_started is not None and (isinstance(replay_started, bool) or not isinstance(replay_started, (int, float))):
        raise TypeError(f"replay_started: expected a time.perf_counter() value or None, "
                        f"got {type(replay_started).__name__} {replay_started!r}")
