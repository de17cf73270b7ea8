"""What the framework integrations share: one guarded training run, whoever drives it.

``SDCGuard`` (Lightning) and ``SDCGuardCallback`` (Hugging Face) differ only in how they
reach their framework's training step. Everything else is here, once, and both inherit
it: the constructor's arguments, the metrics endpoint, the guard and the validation
guard, one snapshot store per optimizer, the guarded optimizer step and the loss it hands
back, the per-step values for the framework's loggers and when they must be logged, the
counters, the end-of-run summary, and the state a checkpoint keeps (``state_dict`` /
``load_state_dict``, which accepts what earlier versions wrote).

Nothing here imports a training framework.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import torch
from torch import nn

from sdc_guard.runtime.lifecycle.calibration import DEFAULT_EVERY as DEFAULT_CALIBRATE_EVERY  # noqa: F401  (importable here)
from sdc_guard.runtime.lifecycle.config import GuardConfig
from sdc_guard.runtime.lifecycle.guard import Guard
from sdc_guard.runtime.sampling.schedule import current_step, set_current_step
from sdc_guard.metrics import GuardMetrics
from sdc_guard.respond.policy import Policy, SDCError, SDCExit, StepOutcome
from sdc_guard.report import StepReport
from sdc_guard.runtime.sampling import Full, Sampler, check_sampler
from sdc_guard.respond.snapshot import SnapshotStore, check_checkpoint_dir

DEFAULT_METRICS_PORT = 9464
#: Version of ``state_dict``'s layout (step, totals, classifications, responses, sampler,
#: policy); the first callbacks wrote the same keys without a version.
STATE_VERSION = 1

_TOTALS = ("steps", "gemms_verified", "detections")


def replace_method(obj: Any, name: str, function: Callable[..., Any]) -> Callable[[], None]:
    """Bind ``function`` as ``obj.<name>`` on this instance only; returns the undo.

    ``function`` takes on the replaced method's name, docstring and attributes (as
    ``functools.wraps`` does), so marks that others left on it stay visible (an LR
    scheduler's on ``optimizer.step``). The undo removes the instance attribute again (or
    puts back one that was there), so the object is left as it was found.

    >>> class A:
    ...     def f(self): return 1
    >>> a = A(); undo = replace_method(a, "f", lambda self: 2); a.f()
    2
    >>> undo(); a.f(), "f" in vars(a)
    (1, False)
    """
    had, previous = name in vars(obj), vars(obj).get(name)
    functools.update_wrapper(function, getattr(obj, name))
    setattr(obj, name, types.MethodType(function, obj))

    def undo() -> None:
        if had:
            setattr(obj, name, previous)
        else:
            vars(obj).pop(name, None)

    return undo


def overhead_line(reports: list[StepReport]) -> str:
    """What the guard cost the recent steps (re-executions and calibration replays
    included), as one line: its time over the steps' time without it, and whether that
    is measured (every report calibrated) or, in part, the per-op estimate of
    interception, a lower bound.

    >>> r = StepReport(0, 0, 0, 0, [], {}, 0.0, 1.2, 0.2, guard_seconds=0.2, overhead_calibrated=True)
    >>> overhead_line([r, r])
    '20.0 % of the step time without the guard (measured: interception calibrated by paired replays)'
    """
    guard = sum(r.guard_seconds for r in reports)
    rest = sum(r.step_seconds - r.guard_seconds for r in reports)
    ratio = guard / rest if rest > 0 else 0.0
    if not reports:
        how = "no step reported"
    elif all(r.overhead_calibrated for r in reports):
        how = "measured: interception calibrated by paired replays"
    else:
        estimated = sum(1 for r in reports if not r.overhead_calibrated)
        how = f"interception estimated per op, a lower bound, in {estimated} of {len(reports)} steps"
    return f"{100 * ratio:.1f} % of the step time without the guard ({how})"


class GuardedTraining:
    """Verify every training GEMM; respond to silent data corruption; export metrics.

    The base of the framework callbacks; its arguments are theirs.

    Args:
        sampler: which GEMMs to verify. Default ``Full()``: every one. For very large
            runs, ``Budget(0.05)`` bounds the cost at 5 % of the step time.
        policy: how to respond. Default ``Policy()``: re-execute the step; roll back if
            the fault reproduces; exit with ``EXIT_PERSISTENT`` (17) if it reproduces
            again within 100 steps. Where nothing can be re-executed the step is skipped
            instead (see the integration).
        snapshot_every: steps between in-memory known-good snapshots (rollback targets).
        checkpoint_dir: if set, known-good snapshots are also written there atomically,
            by global rank 0 only (a folder every rank can read).
        e_max: threshold coefficient override (default: per dtype).
        backend: force a verification backend (default: best available).
        verify_validation: also verify validation batches (reported, never acted on).
        metrics_port: port of the Prometheus endpoint; ``port + local rank`` per process.
            Default 9464; ``None`` disables the endpoint. A port in use warns once and
            training continues.
        metrics_address: address to bind (default loopback).
        pushgateway: push metrics there at the end of training (for short or batch jobs).
        log_every_n_steps: how often routine per-step values go to the trainer's
            loggers. Default ``None``: at the trainer's own interval. A step with a
            detection (and so with a response) is always logged.
        calibrate_every: watched steps between calibration replays, which measure
            what interception really costs (``protect``'s argument of that name;
            default 100, about 1 % of those steps' time; ``None``: never, and
            ``sdc/overhead`` stays an estimate, a lower bound).
        history, cache_bytes, stats, screen, compiled, events, collectives: as
            ``protect()`` takes them.
        config: all of ``protect()``'s settings (``sampler`` to ``collectives``) as one
            ``sdc_guard.GuardConfig``, instead of their keywords.
    """

    def __init__(
        self,
        *,
        config: GuardConfig | None = None,
        snapshot_every: int = 50,
        checkpoint_dir: str | None = None,
        verify_validation: bool = False,
        metrics_port: int | None = DEFAULT_METRICS_PORT,
        metrics_address: str = "127.0.0.1",
        pushgateway: str | None = None,
        log_every_n_steps: int | None = None,
        **options: Any,
    ) -> None:
        config = GuardConfig.of(config, **options)
        if config.sampler is not None:
            check_sampler(config.sampler, stateful=True)  # its state goes into the framework's checkpoints
        if metrics_port is not None and (isinstance(metrics_port, bool) or not isinstance(metrics_port, int)
                                         or not 0 <= metrics_port < 65536):
            raise ValueError(f"metrics_port: expected an int in 0..65535 or None, got {metrics_port!r}")
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(f"snapshot_every: expected a positive int, got {snapshot_every!r}")
        if log_every_n_steps is not None and (isinstance(log_every_n_steps, bool)
                                              or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps: expected a positive int or None, got {log_every_n_steps!r}")
        if checkpoint_dir is not None:
            check_checkpoint_dir(checkpoint_dir)
        if not isinstance(verify_validation, bool):
            raise TypeError(f"verify_validation: expected a bool, got {type(verify_validation).__name__} "
                            f"{verify_validation!r}")
        if not isinstance(metrics_address, str) or not metrics_address:
            raise ValueError(f"metrics_address: expected a host name or IP address such as '127.0.0.1', "
                             f"got {metrics_address!r}")
        if pushgateway is not None and (not isinstance(pushgateway, str) or not pushgateway):
            raise TypeError(f"pushgateway: expected a Pushgateway address such as 'http://host:9091' or None, "
                            f"got {type(pushgateway).__name__} {pushgateway!r}")
        #: one sampler and one policy for the whole run: their state goes into checkpoints
        self.sampler: Sampler = config.sampler if config.sampler is not None else Full()
        self.policy: Policy = config.policy if config.policy is not None else Policy()
        #: the guard's settings (``sdc_guard.GuardConfig``), with this run's sampler and policy
        self.config = dataclasses.replace(config, sampler=self.sampler, policy=self.policy)
        self.snapshot_every = snapshot_every
        self.checkpoint_dir = checkpoint_dir
        self.verify_validation = verify_validation
        self.metrics_port = metrics_port
        self.metrics_address = metrics_address
        self.pushgateway = pushgateway
        self.log_every_n_steps = log_every_n_steps
        self.metrics: GuardMetrics | None = None
        self.metrics_url: str | None = None
        self.guard: Guard | None = None
        #: the guard of validation batches (``verify_validation``): reports only
        self.val_guard: Guard | None = None
        self.totals: dict[str, int] = dict.fromkeys(_TOTALS, 0)
        self.classifications: dict[str, int] = {}
        self.responses: dict[str, int] = {}
        self._next_step: int | None = None  #: the guard's next step; None: the trainer's
        self._last_good_loss: torch.Tensor | float | None = None

    # --- set-up ------------------------------------------------------------------------------

    def start_metrics(self, rank: int, local_rank: int) -> None:
        """The metrics sink of this process, and its endpoint on ``metrics_port + local_rank``."""
        self.metrics = GuardMetrics(rank=rank, budget=getattr(self.sampler, "max_overhead", None))
        if self.metrics_port is not None:
            self.metrics_url = self.metrics.serve(self.metrics_address, self.metrics_port + local_rank)

    def start_guard(self, model: nn.Module, rank: int, trainer_step: int) -> Guard:
        """The guard of the training steps. Its step count continues a resumed run's, or
        an earlier fit's; where no state said it (a fresh run, a checkpoint without it),
        it starts at ``trainer_step``, the trainer's count of optimizer steps done."""
        self.guard = Guard(model, self.config, metrics=self.metrics, rank=rank)
        set_current_step(model, self._next_step if self._next_step is not None else trainer_step)
        if self.verify_validation:
            # reports only: validation steps are not training steps, so no metrics sink, and
            # every GEMM verified (a sampler's schedule is the training steps')
            self.val_guard = Guard(model, dataclasses.replace(self.config, sampler=None, policy=None), rank=rank)
        return self.guard

    def snapshot_store(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> SnapshotStore:
        """Known-good snapshots of ``model`` and ``optimizer`` (one store per optimizer)."""
        return SnapshotStore(model, optimizer, every=self.snapshot_every, checkpoint_dir=self.checkpoint_dir)

    # --- the step ----------------------------------------------------------------------------

    def guarded_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None, *,
                     step_fn: Callable[[], Any], snapshots: SnapshotStore, replay: bool = False,
                     loss: Any = None, replay_started: float | None = None) -> StepOutcome:
        """``Guard.optimizer_step`` with this run's snapshots; every outcome is counted,
        that of a ``raise`` or ``exit`` response too."""
        guard = self.guard
        if guard is None:
            raise RuntimeError("the guard is not started (the framework did not begin training)")
        guard.snapshots = snapshots
        try:
            outcome = guard.optimizer_step(optimizer, closure, step_fn=step_fn,
                                           replay=replay, loss=loss, replay_started=replay_started)
        except (SDCError, SDCExit) as exc:
            self.record(exc.outcome)
            raise
        self.record(outcome)
        return outcome

    def record(self, outcome: StepOutcome) -> None:
        """Count one guarded optimizer step and remember its loss if it was good."""
        self.totals["steps"] += 1
        self.totals["gemms_verified"] += outcome.report.verified + sum(r.verified for r in outcome.reruns)
        if outcome.detected:
            self.totals["detections"] += 1
            key = outcome.classification or "unconfirmed"
            self.classifications[key] = self.classifications.get(key, 0) + 1
            if outcome.action:
                self.responses[outcome.action] = self.responses.get(outcome.action, 0) + 1
        if (not outcome.detected or outcome.action == "recompute") and outcome.loss is not None:
            loss = outcome.loss
            self._last_good_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    def handed_back_loss(self, outcome: StepOutcome) -> Any:
        """The loss to report for a step: its own where the parameters were updated from
        it (a clean step, a clean re-execution: the re-run's loss; the ``log`` response:
        the corrupted run's, which did reach the model); else (skipped, rolled back) the
        last good step's, so that a handled fault never looks like a diverged run. Before
        any good step there is none to hand back, and the step's own is kept."""
        if not outcome.detected or outcome.action in ("recompute", "log") or self._last_good_loss is None:
            return outcome.loss
        return self._last_good_loss

    def step_values(self, outcome: StepOutcome) -> dict[str, float]:
        """The per-step values for the loggers: ``sdc/flag``, ``sdc/gemms_verified``,
        ``sdc/overhead`` (``StepReport.overhead``: the guard's cost in the step, a
        calibration replay included on the steps that ran one), ``sdc/overhead_calibrated``
        (1: that is the whole cost, measured; 0: its interception part is the per-op
        estimate, a lower bound), and on a step with a detection ``sdc/loss``, the loss
        handed back (a host read of a device tensor, on those steps only)."""
        report = outcome.report
        values = {
            "sdc/flag": float(outcome.detected),
            "sdc/gemms_verified": float(report.verified),
            "sdc/overhead": float(report.overhead),
            "sdc/overhead_calibrated": float(report.overhead_calibrated),
        }
        if outcome.detected:
            loss = self.handed_back_loss(outcome)
            if loss is not None:
                values["sdc/loss"] = float(loss)
        return values

    def should_log(self, outcome: StepOutcome, trainer_logs_this_step: bool) -> bool:
        """Whether ``outcome``'s step goes to the loggers: always on a detection, else
        every ``log_every_n_steps`` steps, or with the trainer when that is ``None``."""
        if outcome.detected:
            return True
        if self.log_every_n_steps is None:
            return trainer_logs_this_step
        return (outcome.step + 1) % self.log_every_n_steps == 0

    # --- validation ----------------------------------------------------------------------

    def begin_validation_batch(self) -> None:
        if self.val_guard is not None:
            self.val_guard.__enter__()

    def end_validation_batch(self) -> StepReport | None:
        """Close a validation batch; its report if it flagged (never acted on)."""
        if self.val_guard is None:
            return None
        self.val_guard.__exit__(None, None, None)
        report = self.val_guard.last_report
        return report if report is not None and report.flagged else None

    # --- the end -------------------------------------------------------------------------

    def finish(self) -> None:
        """End of training: stop intercepting, remember the step count, push metrics."""
        if self.guard is not None:
            self.guard.deactivate()
            self._next_step = current_step(self.guard.model)
        if self.metrics is not None and self.pushgateway:
            self.metrics.push(self.pushgateway, job="sdc_guard")

    def close_metrics(self) -> None:
        """Stop the metrics endpoint and free its port (the values stay readable)."""
        if self.metrics is not None:
            self.metrics.close()

    @property
    def outcomes(self) -> list[StepOutcome]:
        """What the last guarded optimizer steps did (the guard keeps the last 100)."""
        return list(self.guard.outcomes) if self.guard is not None else []

    @property
    def reports(self) -> list[StepReport]:
        """The last step reports, re-executions included (``attempt > 0``; the last 100)."""
        return list(self.guard.reports) if self.guard is not None else []

    def summary(self) -> str:
        """A few lines a person reads at a glance."""
        guard = self.guard
        lines = [
            "sdc-guard summary",
            f"  steps guarded      {self.totals['steps']}",
            f"  GEMMs verified     {self.totals['gemms_verified']}",
            f"  detections         {self.totals['detections']}"
            + (f"  ({', '.join(f'{k}: {v}' for k, v in sorted(self.classifications.items()))})"
               if self.classifications else ""),
            f"  responses          {', '.join(f'{k}: {v}' for k, v in sorted(self.responses.items())) or 'none'}",
            f"  overhead (recent)  {overhead_line(list(guard.reports) if guard else [])}",
        ]
        if guard is not None:
            for outcome in guard.outcomes:
                for d in outcome.report.detections:
                    lines.append(f"    step {d.step}: {d.site} ({d.phase} {d.op}) rank {d.rank} "
                                 f"rows {d.rows[:4]} -> {outcome.classification}, {outcome.action}")
        if self.metrics_url:
            lines.append(f"  metrics            {self.metrics_url}")
        return "\n".join(lines)

    # --- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters, the step count, the sampler's and policy's state: plain numbers,
        strings, lists and dicts with string keys (fit for JSON as well as ``torch.save``;
        no device tensor is read, so saving it every step costs no host sync)."""
        step = current_step(self.guard.model) if self.guard is not None else (self._next_step or 0)
        return {
            "version": STATE_VERSION, "step": step, "totals": dict(self.totals),
            "classifications": dict(self.classifications), "responses": dict(self.responses),
            "sampler": self.sampler.state_dict(), "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s values; a key an earlier version did not write keeps
        its default (a fresh run's value)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict: expected a dict, got {type(state_dict).__name__}")
        self._next_step = int(state_dict["step"]) if "step" in state_dict else None
        self.totals = dict.fromkeys(_TOTALS, 0) | {k: int(v) for k, v in state_dict.get("totals", {}).items()}
        self.classifications = {k: int(v) for k, v in state_dict.get("classifications", {}).items()}
        self.responses = {k: int(v) for k, v in state_dict.get("responses", {}).items()}
        if "sampler" in state_dict:
            self.sampler.load_state_dict(state_dict["sampler"])
        if "policy" in state_dict:
            self.policy.load_state_dict(state_dict["policy"])
