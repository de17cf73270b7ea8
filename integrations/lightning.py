"""``Trainer(callbacks=[SDCGuard()])``: sdc-guard for Lightning, in one line.

The callback verifies the GEMMs of every training batch (and, if asked, of validation
batches), answers detections through ``Guard.optimizer_step`` before the optimizer update
(Lightning runs ``training_step`` and ``backward`` inside the closure it hands to
``optimizer.step``, which is exactly what re-execution needs), exports metrics to
Prometheus, logs per-step values through the trainer's loggers and keeps its own state in
checkpoints.
"""

from __future__ import annotations

import types
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from sdc_guard.guard import Guard, check_backend, current_step, set_current_step
from sdc_guard.metrics import GuardMetrics
from sdc_guard.policy import Policy, StepOutcome
from sdc_guard.precision import check_e_max
from sdc_guard.sampling import Full, Sampler, check_sampler
from sdc_guard.snapshot import SnapshotStore, check_checkpoint_dir

DEFAULT_METRICS_PORT = 9464


class SDCGuard(Callback):
    """Verify every training GEMM; respond to silent data corruption; export metrics.

    Args:
        sampler: which GEMMs to verify. Default ``Full()``: every one. For very large
            runs, ``Budget(0.05)`` bounds the cost at 5 % of the step time.
        policy: how to respond. Default ``Policy()``: re-execute the step; roll back if
            the fault reproduces; exit with ``EXIT_PERSISTENT`` (17) if it reproduces
            again within 100 steps. With manual optimisation, or a detection in an
            earlier micro-batch of gradient accumulation, nothing can be re-executed and
            the step is skipped instead.
        snapshot_every: steps between in-memory known-good snapshots (rollback targets).
        checkpoint_dir: if set, known-good snapshots are also written there atomically
            (created if missing; one that cannot be written is an error here).
        e_max: threshold coefficient override in (0, 1] (default: per dtype, see ``VABFT.md``).
        backend: force a verification backend (default: best available); one that is
            unusable here is an error here, one that cannot serve the model's tensors an
            error at fit start.
        verify_validation: also verify validation batches (reported, never acted on).
        metrics_port: port of the Prometheus endpoint on 127.0.0.1; ``port + local
            rank`` per process. Default 9464; ``None`` disables the endpoint. A port in use
            warns once and training continues.
        metrics_address: address to bind (default loopback).
        pushgateway: push metrics there at the end of fit (for short or batch jobs).
        log_every_n_steps: how often to log per-step values to the trainer's loggers.

    Every argument is checked here: a bad one raises ``TypeError`` / ``ValueError``
    naming it, before any training step.

    Example::

        trainer = Trainer(callbacks=[SDCGuard()])
    """

    def __init__(
        self,
        *,
        sampler: Sampler | None = None,
        policy: Policy | None = None,
        snapshot_every: int = 50,
        checkpoint_dir: str | None = None,
        e_max: float | None = None,
        backend: str | None = None,
        verify_validation: bool = False,
        metrics_port: int | None = DEFAULT_METRICS_PORT,
        metrics_address: str = "127.0.0.1",
        pushgateway: str | None = None,
        log_every_n_steps: int = 1,
    ) -> None:
        super().__init__()
        if sampler is not None:
            check_sampler(sampler, stateful=True)  # its state goes into Lightning checkpoints
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy: expected a sdc_guard.Policy or None, got {type(policy).__name__} {policy!r}")
        if metrics_port is not None and (isinstance(metrics_port, bool) or not isinstance(metrics_port, int)
                                         or not 0 <= metrics_port < 65536):
            raise ValueError(f"metrics_port: expected an int in 0..65535 or None, got {metrics_port!r}")
        for name, value in (("snapshot_every", snapshot_every), ("log_every_n_steps", log_every_n_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if checkpoint_dir is not None:
            check_checkpoint_dir(checkpoint_dir)
        if e_max is not None:
            check_e_max(e_max)
        check_backend(backend)  # the model's devices are checked again at fit start
        if not isinstance(verify_validation, bool):
            raise TypeError(f"verify_validation: expected a bool, got {type(verify_validation).__name__} "
                            f"{verify_validation!r}")
        if not isinstance(metrics_address, str) or not metrics_address:
            raise ValueError(f"metrics_address: expected a host name or IP address such as '127.0.0.1', "
                             f"got {metrics_address!r}")
        if pushgateway is not None and (not isinstance(pushgateway, str) or not pushgateway):
            raise TypeError(f"pushgateway: expected a Pushgateway address such as 'http://host:9091' or None, "
                            f"got {type(pushgateway).__name__} {pushgateway!r}")
        self.sampler = sampler if sampler is not None else Full()
        self.policy = policy if policy is not None else Policy()
        self.snapshot_every = snapshot_every
        self.checkpoint_dir = checkpoint_dir
        self.e_max = e_max
        self.backend = backend
        self.verify_validation = verify_validation
        self.metrics_port = metrics_port
        self.metrics_address = metrics_address
        self.pushgateway = pushgateway
        self.log_every_n_steps = log_every_n_steps
        self.metrics: GuardMetrics | None = None
        self.metrics_url: str | None = None
        self.guard: Guard | None = None
        self.totals: dict[str, int] = {"steps": 0, "gemms_verified": 0, "detections": 0}
        self.classifications: dict[str, int] = {}
        self.responses: dict[str, int] = {}
        self._next_step = 0
        self._patched: list[tuple[torch.optim.Optimizer, Any]] = []
        self._val_guard: Guard | None = None
        self._steps_at_batch_start = 0

    # --- fit lifecycle ---------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self.metrics = GuardMetrics(rank=trainer.global_rank,
                                    budget=getattr(self.sampler, "max_overhead", None))
        if self.metrics_port is not None:
            self.metrics_url = self.metrics.serve(self.metrics_address, self.metrics_port + trainer.local_rank)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.guard = Guard(pl_module, sampler=self.sampler, e_max=self.e_max, backend=self.backend,
                           policy=self.policy, metrics=self.metrics, rank=trainer.global_rank)
        set_current_step(pl_module, self._next_step)
        for optimizer in trainer.optimizers:
            self._patch(optimizer, pl_module)
        if self.verify_validation:
            # reports only: validation steps are not training steps, so no metrics sink
            self._val_guard = Guard(pl_module, e_max=self.e_max, backend=self.backend,
                                    rank=trainer.global_rank)

    def _patch(self, optimizer: torch.optim.Optimizer, pl_module: "pl.LightningModule") -> None:
        """Route ``optimizer.step(closure)`` through the guard (closure = training_step +
        backward), keeping the original step for the update itself."""
        original = optimizer.step
        snapshots = SnapshotStore(pl_module, optimizer, every=self.snapshot_every,
                                  checkpoint_dir=self.checkpoint_dir)
        callback = self

        def guarded_step(opt: torch.optim.Optimizer, closure: Any = None, **kwargs: Any) -> Any:
            guard = callback.guard
            assert guard is not None
            guard.snapshots = snapshots
            step_fn = (lambda: original(**kwargs)) if kwargs else original
            outcome = guard.optimizer_step(opt, closure, step_fn=step_fn)
            callback._record(outcome)
            return outcome.loss

        optimizer.step = types.MethodType(guarded_step, optimizer)  # type: ignore[method-assign]
        self._patched.append((optimizer, original))

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        assert self.guard is not None
        if not self.guard.step_open:
            self.guard.begin_step()
        self._steps_at_batch_start = self.totals["steps"]
        self.guard.activate()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        assert self.guard is not None
        self.guard.deactivate()
        if self.totals["steps"] == self._steps_at_batch_start:
            return  # an accumulation micro-batch: no optimizer step yet
        outcome = self.guard.outcomes[-1]
        if trainer.loggers and trainer.global_step % self.log_every_n_steps == 0:
            report = outcome.report
            pl_module.log_dict({
                "sdc/flag": float(bool(outcome.flagged_ranks)),
                "sdc/gemms_verified": float(report.verified),
                "sdc/overhead": float(report.overhead),
            }, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    def on_validation_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._val_guard is not None:
            self._val_guard.__enter__()

    def on_validation_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._val_guard is not None:
            self._val_guard.__exit__(None, None, None)
            report = self._val_guard.last_report
            if report is not None and report.flagged:
                rank_zero_info(f"sdc_guard: corruption in a validation batch: {report.detections}")

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        for optimizer, original in self._patched:
            optimizer.step = original  # type: ignore[method-assign]
        self._patched.clear()
        if self.guard is not None:
            self.guard.deactivate()
            self._next_step = current_step(pl_module)
        if self.metrics is not None and self.pushgateway:
            self.metrics.push(self.pushgateway, job="sdc_guard")
        if trainer.is_global_zero:
            print(self.summary())

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self.guard is not None:
            self.guard.deactivate()
        for optimizer, original in self._patched:
            optimizer.step = original  # type: ignore[method-assign]
        self._patched.clear()
        # Lightning skips the callbacks' teardown after an exception: free the port here
        close = getattr(self.metrics, "close", None)
        if close is not None:
            close()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        close = getattr(self.metrics, "close", None)
        if close is not None and stage == "fit":
            close()

    # --- bookkeeping -----------------------------------------------------------------------

    def _record(self, outcome: StepOutcome) -> None:
        self.totals["steps"] += 1
        self.totals["gemms_verified"] += outcome.report.verified + sum(r.verified for r in outcome.reruns)
        if outcome.flagged_ranks:
            self.totals["detections"] += 1
            key = outcome.classification or "unconfirmed"
            self.classifications[key] = self.classifications.get(key, 0) + 1
            if outcome.action:
                self.responses[outcome.action] = self.responses.get(outcome.action, 0) + 1

    def summary(self) -> str:
        """A few lines a person reads at a glance."""
        guard = self.guard
        overheads = [r.overhead for r in guard.reports if r.attempt == 0] if guard else []
        mean_overhead = sum(overheads) / len(overheads) if overheads else 0.0
        lines = [
            "sdc-guard summary",
            f"  steps guarded      {self.totals['steps']}",
            f"  GEMMs verified     {self.totals['gemms_verified']}",
            f"  detections         {self.totals['detections']}"
            + (f"  ({', '.join(f'{k}: {v}' for k, v in sorted(self.classifications.items()))})"
               if self.classifications else ""),
            f"  responses          {', '.join(f'{k}: {v}' for k, v in sorted(self.responses.items())) or 'none'}",
            f"  overhead (recent)  {100 * mean_overhead:.1f} % of step time",
        ]
        if guard is not None:
            for outcome in guard.outcomes:
                for d in outcome.report.detections:
                    lines.append(f"    step {d.step}: {d.site} ({d.phase} {d.op}) rank {d.rank} "
                                 f"rows {d.rows[:4]} -> {outcome.classification}, {outcome.action}")
        if self.metrics_url:
            lines.append(f"  metrics            {self.metrics_url}")
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        step = current_step(self.guard.model) if self.guard is not None else self._next_step
        return {
            "step": step, "totals": dict(self.totals), "classifications": dict(self.classifications),
            "responses": dict(self.responses), "sampler": self.sampler.state_dict(),
            "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._next_step = int(state_dict["step"])
        self.totals = dict(state_dict["totals"])
        self.classifications = dict(state_dict["classifications"])
        self.responses = dict(state_dict["responses"])
        self.sampler.load_state_dict(state_dict["sampler"])
        self.policy.load_state_dict(state_dict["policy"])
