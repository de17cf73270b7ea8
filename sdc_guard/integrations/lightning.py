"""``Trainer(callbacks=[SDCGuard()])``: sdc-guard for Lightning, in one line.

The callback verifies the GEMMs of every training batch (and, if asked, of validation
batches), answers detections through ``Guard.optimizer_step`` before the optimizer update
(Lightning runs ``training_step`` and ``backward`` inside the closure it hands to
``optimizer.step``, which is exactly what re-execution needs), exports metrics to
Prometheus, logs per-step values and keeps its own state in checkpoints. What it shares
with the Hugging Face callback (arguments, responses, counters, summary, state) is
``sdc_guard.integrations.guarded_training.GuardedTraining``.

Lightning's conventions, and how the callback follows them:

- Values land in ``trainer.callback_metrics`` on every optimizer step
  (``pl_module.log_dict(..., logger=False)``), with or without loggers, so that
  ``EarlyStopping``, ``ModelCheckpoint(monitor="sdc/flag")`` and progress bars can use
  them. The callback hands them to the loggers itself (``logger.log_metrics`` at the
  step's number, as Lightning's own logging does): routine steps at the Trainer's
  ``log_every_n_steps`` (or the callback's own), a step with a detection always. Left to
  Lightning, a detection at step 30 of a default Trainer (interval 50) never reached a
  logger.
- The loss handed back to Lightning for a step (its ``outputs["loss"]``): the re-run's for
  a clean re-execution; for a skipped or rolled-back step, the last good step's, written
  into the tensor the closure returned, so that a handled fault never shows as a diverged
  run. Values a module logs with ``self.log`` inside ``training_step`` are whatever that
  (corrupted) run computed; log the loss from ``on_train_batch_end``'s ``outputs`` to show
  the handed-back one.
- ``state_key`` is ``"SDCGuard"``, the key earlier versions' checkpoints have, and
  ``load_state_dict`` fills keys an earlier version did not write with their defaults.
- Snapshot checkpoints (``checkpoint_dir``) are written and pruned on global rank 0 only,
  like ``ModelCheckpoint``; a rank restoring from one waits for rank 0 at a barrier.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from sdc_guard.integrations.guarded_training import (DEFAULT_CALIBRATE_EVERY, DEFAULT_METRICS_PORT, GuardedTraining,
                                                     replace_method)
from sdc_guard.respond.policy import Policy
from sdc_guard.runtime.lifecycle.config import GuardConfig
from sdc_guard.runtime.sampling import Sampler

__all__ = ["DEFAULT_METRICS_PORT", "SDCGuard"]


class SDCGuard(GuardedTraining, Callback):
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
            (by global rank 0; a folder every rank can read).
        e_max: threshold coefficient override in (0, 1] (default: per dtype, see
            ``docs/ALGORITHM.md``).
        backend: force a verification backend (default: best available); one that is
            unusable here is an error here, one that cannot serve the model's tensors an
            error at fit start.
        verify_validation: also verify validation batches (reported, never acted on).
        metrics_port: port of the Prometheus endpoint on 127.0.0.1; ``port + local
            rank`` per process. Default 9464; ``None`` disables the endpoint. A port in use
            warns once and training continues.
        metrics_address: address to bind (default loopback).
        pushgateway: push metrics there at the end of fit (for short or batch jobs).
        log_every_n_steps: how often routine per-step values go to the trainer's
            loggers. Default ``None``: at ``Trainer(log_every_n_steps)``. A step with a
            detection is always logged; ``trainer.callback_metrics`` has every step's.
        calibrate_every: watched steps between calibration replays: Lightning's closure
            run once more with interception off, its effects undone, to measure what
            interception costs (``protect``'s argument; default 100; ``None``: never,
            and ``sdc/overhead`` stays an estimate). The closure must be safe to run
            again, as a re-execution already needs; what a module logs in
            ``training_step`` is logged again on those steps.
        history, cache_bytes, stats, screen, compiled, events, collectives: as
            ``protect()`` takes them (docs/CONFIGURATION.md).
        config: ``protect()``'s settings (``sampler`` to ``collectives`` above) as one
            ``sdc_guard.GuardConfig``, instead of their keywords.

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
        log_every_n_steps: int | None = None,
        calibrate_every: int | None = DEFAULT_CALIBRATE_EVERY,
        history: int = 100,
        cache_bytes: int = 512 << 20,
        stats: bool = False,
        screen: str = "default",
        compiled: bool | None = None,
        events: Any = None,
        collectives: bool = True,
        config: GuardConfig | None = None,
    ) -> None:
        GuardedTraining.__init__(
            self, config=GuardConfig.of(
                config, sampler=sampler, e_max=e_max, backend=backend, policy=policy, history=history,
                cache_bytes=cache_bytes, stats=stats, screen=screen, compiled=compiled,
                calibrate_every=calibrate_every, events=events, collectives=collectives),
            snapshot_every=snapshot_every, checkpoint_dir=checkpoint_dir, verify_validation=verify_validation,
            metrics_port=metrics_port, metrics_address=metrics_address, pushgateway=pushgateway,
            log_every_n_steps=log_every_n_steps)
        Callback.__init__(self)
        self._undo: list[Callable[[], None]] = []
        self._steps_at_batch_start = 0

    @property
    def state_key(self) -> str:
        """Where the checkpoint keeps this callback's state: one guard per Trainer, and the
        key earlier versions used, so their checkpoints still load."""
        return "SDCGuard"

    # --- fit lifecycle ---------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self.start_metrics(trainer.global_rank, trainer.local_rank)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.start_guard(pl_module, trainer.global_rank, trainer.global_step)
        for optimizer in trainer.optimizers:
            self._patch(optimizer, pl_module)

    def _patch(self, optimizer: torch.optim.Optimizer, pl_module: "pl.LightningModule") -> None:
        """Route ``optimizer.step(closure)`` through the guard (closure = training_step +
        backward), keeping the original step for the update itself."""
        original = optimizer.step
        snapshots = self.snapshot_store(pl_module, optimizer)
        callback = self

        def guarded_step(opt: torch.optim.Optimizer, closure: Any = None, **kwargs: Any) -> Any:
            returned: list[Any] = []  # what the closure gave Lightning, last call last

            def run() -> Any:
                loss = closure()
                returned.append(loss)
                # the guard's outcome keeps a copy: the tensor Lightning holds may be rewritten
                return loss.detach().clone() if isinstance(loss, torch.Tensor) else loss

            step_fn = (lambda: original(**kwargs)) if kwargs else original
            outcome = callback.guarded_step(opt, run if closure is not None else None, step_fn=step_fn,
                                            snapshots=snapshots)
            handed = callback.handed_back_loss(outcome)
            if handed is not outcome.loss and returned and isinstance(returned[-1], torch.Tensor):
                # Lightning reads the step's loss from its closure's result, which is this tensor
                returned[-1].copy_(torch.as_tensor(handed))
            return returned[-1] if returned else outcome.loss

        self._undo.append(replace_method(optimizer, "step", guarded_step))

    def _unpatch(self) -> None:
        while self._undo:
            self._undo.pop()()

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
        values = self.step_values(outcome)
        pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=False)
        interval = trainer.log_every_n_steps
        trainer_logs = bool(interval) and (outcome.step + 1) % interval == 0
        if trainer.loggers and self.should_log(outcome, trainer_logs):
            for logger in trainer.loggers:
                logger.log_metrics(values, step=outcome.step)
                logger.save()

    def on_validation_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        self.begin_validation_batch()

    def on_validation_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        report = self.end_validation_batch()
        if report is not None:
            rank_zero_info(f"sdc_guard: corruption in a validation batch: {report.detections}")

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._unpatch()
        self.finish()
        if trainer.is_global_zero:
            print(self.summary())

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self.guard is not None:
            self.guard.deactivate()
        self._unpatch()
        # Lightning skips the callbacks' teardown after an exception: free the port here
        self.close_metrics()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self.close_metrics()
