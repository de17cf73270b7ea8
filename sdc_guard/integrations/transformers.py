"""``Trainer(..., callbacks=[SDCGuardCallback()])``: sdc-guard for the Hugging Face Trainer.

The same arguments and behaviour as Lightning's ``SDCGuard`` (both are
``sdc_guard.integrations.guarded_training.GuardedTraining``): every training GEMM
verified, forward and backward; a detection re-executed before the optimizer steps, a
fault that reproduces rolled back, one that reproduces again exits with code 17; per-step
values in the Trainer's logs; a Prometheus endpoint; ``callback.outcomes`` and
``callback.reports``; the callback's state in the Trainer's checkpoints.

How it reaches the step. ``transformers.Trainer`` runs each micro-batch's forward and
backward in ``training_step``, then clips the gradients, runs the ``on_pre_optimizer_step``
callbacks and calls ``optimizer.step()`` (accelerate's wrapper) without a closure: by the
time the optimizer is called, every GEMM of the step has run. So, from ``on_train_begin``,
the callback wraps two methods on the Trainer's own instances (no subclass needed, and a
subclass's overrides stay in force):

- ``trainer.training_step``: the guard intercepts each micro-batch's forward and
  backward; the callback keeps the step's micro-batches (the Trainer holds them for the
  step anyway) and the RNG state and gradients the step began with;
- ``trainer.optimizer.step``: the guard closes the step, reads its flags (one host sync)
  and responds before the real step runs (``Guard.optimizer_step(..., replay=True)``).
  A re-execution replays the whole step: RNG state and gradients restored, every
  micro-batch's ``training_step`` run again (under ``accelerator.no_sync`` for all but the
  last, as the Trainer does), the gradients clipped again to ``max_grad_norm``. A
  detection in any micro-batch of gradient accumulation is therefore re-executed, not
  skipped.

The same replay measures what interception costs (``calibrate_every``; the guard's
calibration, ``sdc_guard.runtime.lifecycle.calibration``): on the steps it picks, after the guarded
run, the step's micro-batches run once more with interception off, timed against the
guarded run (from the first micro-batch to the optimizer step), and the gradients,
generators and buffers the guarded run left are put back.

Re-executing inside ``training_step`` instead was rejected: the Trainer clips the
gradients, logs their norm and runs ``on_pre_optimizer_step`` between the backward and the
optimizer step, and all of that must see the gradients the optimizer will use.
``TrainerCallback`` events carry no reference to the Trainer; the callback finds the
Trainer that holds it on the call stack of ``on_train_begin``.

Logging. The values (``sdc/flag``, ``sdc/gemms_verified``, ``sdc/overhead``; on a step
with a detection also ``sdc/loss``) go through ``trainer.log``: an entry of their own in
``state.log_history`` and, through ``on_log``, every ``report_to`` integration. Routine
steps are logged when the Trainer logs (``logging_steps``) or every ``log_every_n_steps``;
a step with a detection always. Entries carry the Trainer's ``global_step`` (the guard's
step number + 1).

The loss. The Trainer adds each micro-batch's loss to its running loss when
``training_step`` returns, before the optimizer step where a detection is answered, so the
``loss`` it logs for that interval includes the first run's (a NaN or Inf one is replaced
by its ``logging_nan_inf_filter``, on by default). ``sdc/loss`` is the loss handed back:
the re-run's for a clean re-execution, the last good step's for a skipped or rolled-back
step.

State. Counters, the step count, the sampler's and the policy's state go into
``TrainerState.stateful_callbacks["sdc_guard"]`` at every step, so into each checkpoint's
``trainer_state.json``, and ``train(resume_from_checkpoint=...)`` restores them. Not
through ``ExportableState``: the Trainer restores those only with
``restore_callback_states_from_checkpoint=True`` (off by default), by constructing a new
callback from JSON arguments and replacing the caller's, which a sampler or policy object
cannot survive and which would leave the caller's ``callback.outcomes`` stale. (With that
option on, the Trainer warns that it ignores "sdc_guard"; the callback restores it.)

Limits: fp16 with a gradient scaler skips a flagged step instead of re-executing it (the
scaler has already unscaled that step's gradients); DeepSpeed and FSDP are not supported;
the ``grad_norm`` the Trainer logs for a re-executed step is the first run's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "sdc_guard.integrations.transformers needs the transformers and accelerate packages: "
        "pip install 'sdc-guard[transformers]'") from exc

from sdc_guard.integrations.guarded_training import (DEFAULT_CALIBRATE_EVERY, DEFAULT_METRICS_PORT, GuardedTraining,
                                                     replace_method)
from sdc_guard.respond.policy import Policy
from sdc_guard.runtime.lifecycle.config import GuardConfig
from sdc_guard.runtime.sampling import Sampler
from sdc_guard.respond.snapshot import SnapshotStore

__all__ = ["DEFAULT_METRICS_PORT", "STATE_KEY", "SDCGuardCallback"]

#: Key of the callback's state in ``TrainerState.stateful_callbacks``.
STATE_KEY = "sdc_guard"

log = logging.getLogger("sdc_guard")


@dataclass
class _StepStart:
    """What a replay of the step restores: the RNG state and gradients it began with."""

    cpu_rng: Tensor
    cuda_rng: list[Tensor]
    grads: list[tuple[Tensor, Tensor | None]]

    @classmethod
    def capture(cls, params: list[Tensor]) -> "_StepStart":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(torch.get_rng_state(), cuda,
                   [(p, None if p.grad is None else p.grad.detach().clone()) for p in params])

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        for p, grad in self.grads:
            p.grad = None if grad is None else grad.clone()


@dataclass
class _MicroBatch:
    """One ``training_step`` call, to run again."""

    model: nn.Module
    inputs: Any
    args: tuple
    kwargs: dict


def _trainer_holding(callback: TrainerCallback) -> Trainer:
    """The ``transformers.Trainer`` whose callbacks include ``callback``, found on the call
    stack (callback events are called from the Trainer's own methods)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and any(c is callback for c in candidate.callback_handler.callbacks):
                return candidate
            frame = frame.f_back
    finally:
        del frame
    raise RuntimeError("SDCGuardCallback: no transformers.Trainer holding this callback was found; pass it "
                       "to the Trainer (Trainer(..., callbacks=[SDCGuardCallback()]) or trainer.add_callback)")


def _total(losses: list[Any]) -> Any:
    """The step's loss as the Trainer sums it: the micro-batches' losses added up."""
    if not losses:
        return None
    return functools.reduce(lambda a, b: a + b, losses)


class SDCGuardCallback(GuardedTraining, TrainerCallback):
    """Verify every training GEMM; respond to silent data corruption; export metrics.

    Args:
        sampler: which GEMMs to verify. Default ``Full()``: every one. For very large
            runs, ``Budget(0.05)`` bounds the cost at 5 % of the step time.
        policy: how to respond. Default ``Policy()``: re-execute the step; roll back if
            the fault reproduces; exit with ``EXIT_PERSISTENT`` (17) if it reproduces
            again within 100 steps.
        snapshot_every: steps between in-memory known-good snapshots (rollback targets).
        checkpoint_dir: if set, known-good snapshots are also written there atomically
            (by global rank 0; a folder every rank can read).
        e_max: threshold coefficient override (default: per dtype).
        backend: force a verification backend (default: best available).
        verify_validation: also verify evaluation batches (reported, never acted on).
        metrics_port: port of the Prometheus endpoint on 127.0.0.1; ``port + local
            process index`` per process. Default 9464; ``None`` disables the endpoint. A
            port in use warns once and training continues.
        metrics_address: address to bind (default loopback).
        pushgateway: push metrics there at the end of training (for short or batch jobs).
        log_every_n_steps: how often routine per-step values are logged. Default
            ``None``: when the Trainer logs (``logging_steps``). A step with a detection
            is always logged.
        calibrate_every: watched steps between calibration replays: the step's
            micro-batches run once more with interception off, after the guarded run,
            and what that run left is put back, to measure what interception costs
            (``protect``'s argument; default 100; ``None``: never, and ``sdc/overhead``
            stays an estimate).
        history, cache_bytes, stats, screen, compiled, events, collectives: as
            ``protect()`` takes them (docs/CONFIGURATION.md).
        config: ``protect()``'s settings (``sampler`` to ``collectives`` above) as one
            ``sdc_guard.GuardConfig``, instead of their keywords.

    Example::

        trainer = Trainer(model, args, train_dataset=data, callbacks=[SDCGuardCallback()])
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
        self._trainer: Trainer | None = None
        self._training_step: Callable[..., Any] | None = None  #: the Trainer's own
        self._undo: list[Callable[[], None]] = []
        self._snapshots: SnapshotStore | None = None
        self._start: _StepStart | None = None
        self._started: float | None = None  #: when the step's first micro-batch began
        self._micro: list[_MicroBatch] = []
        self._losses: list[Any] = []
        self._steps_at_step_begin = 0

    # --- training lifecycle --------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, **kwargs: Any) -> None:
        trainer = _trainer_holding(self)
        if model is None or trainer.optimizer is None:
            raise RuntimeError("SDCGuardCallback: the Trainer began training without a model or optimizer")
        self._trainer = trainer
        saved = (state.stateful_callbacks or {}).get(STATE_KEY)
        if saved is not None and state.global_step > 0:  # resume_from_checkpoint
            self.load_state_dict(saved)
        self.start_metrics(args.process_index, args.local_process_index)
        self.start_guard(model, args.process_index, state.global_step)
        wrapped = trainer.optimizer  # accelerate's AcceleratedOptimizer around the torch one
        inner = getattr(wrapped, "optimizer", wrapped)
        self._snapshots = self.snapshot_store(model, inner)
        self._micro, self._losses, self._start, self._started = [], [], None, None
        self._patch_training_step(trainer, inner)
        self._patch_optimizer_step(trainer, wrapped, inner)
        if self.verify_validation:
            self._patch_prediction_step(trainer)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        guard = self._require_guard()
        if not guard.step_open:
            guard.begin_step()
        self._steps_at_step_begin = self.totals["steps"]
        guard.activate()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        guard = self._require_guard()
        guard.deactivate()
        state.stateful_callbacks[STATE_KEY] = self.state_dict()  # what the next checkpoint keeps
        if self.totals["steps"] == self._steps_at_step_begin:
            return  # the optimizer was not called (nothing to report)
        outcome = guard.outcomes[-1]
        trainer_logs = bool(control.should_log)
        if self.should_log(outcome, trainer_logs):
            assert self._trainer is not None
            self._trainer.log(self.step_values(outcome))
            control.should_log = trainer_logs  # on_log cleared it: the Trainer's own entry still comes

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if state.is_world_process_zero:
            print(self.summary())  # while the endpoint it names still serves
        self._stop()

    def _stop(self) -> None:
        """Leave the Trainer as it was found: methods restored, endpoint closed."""
        while self._undo:
            self._undo.pop()()
        self.finish()
        self.close_metrics()
        self._micro, self._losses, self._start, self._started = [], [], None, None

    def _require_guard(self) -> Any:
        if self.guard is None:
            raise RuntimeError("SDCGuardCallback: on_train_begin has not run (is it the Trainer's callback?)")
        return self.guard

    # --- the wrapped methods ---------------------------------------------------------------

    def _patch_training_step(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        original = trainer.training_step
        params = [p for group in optimizer.param_groups for p in group["params"]]
        callback = self

        def training_step(trainer_self: Trainer, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if not callback._micro:  # the step's first micro-batch
                guard = callback._require_guard()
                began = time.perf_counter()
                with guard.unintercepted():  # the guard's own work, not the model's ops
                    callback._start = _StepStart.capture(params)
                guard.charge(time.perf_counter() - began)
                callback._started = time.perf_counter()  # the step's first run, for a calibration replay
            # a shallow copy: the Trainer may pop keys from the dict it was given
            callback._micro.append(_MicroBatch(model, copy.copy(inputs), args, kwargs))
            try:
                loss = original(model, inputs, *args, **kwargs)
            except BaseException:
                callback._stop()
                raise
            callback._losses.append(loss)
            return loss

        self._undo.append(replace_method(trainer, "training_step", training_step))
        self._training_step = original

    def _patch_optimizer_step(self, trainer: Trainer, wrapped: torch.optim.Optimizer,
                              inner: torch.optim.Optimizer) -> None:
        original = wrapped.step
        callback = self

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            start, micro, loss = callback._start, callback._micro, _total(callback._losses)
            started = callback._started
            callback._micro, callback._losses, callback._start, callback._started = [], [], None, None
            scaler = getattr(trainer.accelerator, "scaler", None)
            rerun = None if scaler is not None or start is None else functools.partial(
                callback._replay, trainer, start, micro)
            assert callback._snapshots is not None
            try:
                callback.guarded_step(inner, rerun, step_fn=lambda: original(*args, **kwargs),
                                      snapshots=callback._snapshots, replay=True, loss=loss,
                                      replay_started=started)
            except BaseException:
                callback._stop()
                raise
            return None  # what accelerate's step returns

        self._undo.append(replace_method(wrapped, "step", step))

    def _replay(self, trainer: Trainer, start: _StepStart, micro: list[_MicroBatch]) -> Any:
        """Run the whole step again from its start, as the Trainer ran it."""
        start.restore()
        assert self._training_step is not None
        losses = []
        for i, batch in enumerate(micro):
            sync = (contextlib.nullcontext() if i == len(micro) - 1
                    else trainer.accelerator.no_sync(model=batch.model))
            with sync:
                losses.append(self._training_step(batch.model, copy.copy(batch.inputs), *batch.args,
                                                  **batch.kwargs))
        max_norm = trainer.args.max_grad_norm
        if max_norm is not None and max_norm > 0 and micro:
            trainer.accelerator.clip_grad_norm_(micro[-1].model.parameters(), max_norm)
        return _total(losses)

    def _patch_prediction_step(self, trainer: Trainer) -> None:
        original = trainer.prediction_step
        callback = self

        def prediction_step(trainer_self: Trainer, *args: Any, **kwargs: Any) -> Any:
            callback.begin_validation_batch()
            try:
                return original(*args, **kwargs)
            finally:
                report = callback.end_validation_batch()
                if report is not None:
                    log.warning("sdc_guard: corruption in an evaluation batch: %s", report.detections)

        self._undo.append(replace_method(trainer, "prediction_step", prediction_step))
