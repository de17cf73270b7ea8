"""The responder: walks the state machine of ``sdc_guard.respond.policy`` for one
guarded optimizer step (triage by re-execution, recompute, skip, roll back, raise, exit),
in lockstep across ranks. What a re-execution restores is ``sdc_guard.respond.rerun``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from . import distributed
from .exit_codes import code_for
from .identity import gather_identities, local_identity
from .outcome import EXIT_COLLECTIVE, EXIT_PERSISTENT, SDCError, SDCExit, StepOutcome, Triage, write_exit_report
from .rerun import StepState, grads_of
from .snapshot import SnapshotStore

if TYPE_CHECKING:
    from ..runtime.guard import Guard
    from ..report import StepReport
    from .policy import Policy

log = logging.getLogger("sdc_guard")

#: where the exit report goes when the policy names no ``exit_report_dir``: set by the
#: job's scheduler script, which reads the report after the run (docs/OPERATIONS.md)
ENV_EXIT_REPORT_DIR = "SDC_GUARD_EXIT_REPORT_DIR"


def _signature(report: "StepReport") -> frozenset:
    return frozenset((d.site, d.phase, d.op, tuple(d.rows), tuple(d.segments)) for d in report.detections)


class Responder:
    """Runs ``Guard.optimizer_step``: the state machine of the module docstring."""

    def __init__(self, guard: "Guard", optimizer: torch.optim.Optimizer, policy: Policy,
                 snapshots: SnapshotStore | None, step_fn: Callable[[], Any] | None = None) -> None:
        self.guard = guard
        self.optimizer = optimizer
        self._step_fn = step_fn if step_fn is not None else optimizer.step
        self.policy = policy
        self.snapshots = snapshots if snapshots is not None else SnapshotStore(guard.model, optimizer)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        with guard.unintercepted():  # the guard's own work: not the model's ops
            self.snapshots.take_initial(guard.step_index - 1)  # unless a snapshot or checkpoint exists

    def run(self, closure: Callable[[], Any] | None, *, replay: bool = False, loss: Any = None,
            replay_started: float | None = None) -> StepOutcome:
        """One guarded step. ``closure=None`` (manual optimisation, GEMMs run before the
        step was called) leaves nothing to re-execute: recompute becomes skip.

        ``replay=True``: the step's forward and backward already ran and gave ``loss``
        (the Hugging Face Trainer runs them before it calls the optimizer); ``closure`` is
        called only to re-execute, re-runs the whole step and restores the RNG state and
        gradients it starts from itself, so every GEMM of the step can be re-run.
        ``replay_started``: when that first run began (``time.perf_counter()``), so that a
        calibration replay can pair it with a bare run.

        The state a re-execution starts from is captured only where one can happen: on a
        watched step (a detection needs verification) or one the gradient screen checks;
        an unwatched step pays nothing for it."""
        guard = self.guard
        started = time.perf_counter()
        calibrating = guard.replays.due(closure is not None and (not replay or replay_started is not None),
                                        first_run_started=replay_started if replay else None)
        state = None
        if guard.watching or guard.screens_gradients:
            with guard.unintercepted():
                state = StepState.capture(guard.model, self._params, replay=replay,
                                          save_state=self.policy.save_state, restore_state=self.policy.restore_state)
        guard.charge(time.perf_counter() - started)
        closure_start = 0 if replay else guard.gemms_seen  # GEMMs before this point cannot be re-run
        if calibrating:
            assert closure is not None and state is not None
            loss = self._calibrate(closure, state, replay, loss)
        elif not replay:
            loss = self._call(closure) if closure is not None else None
        if state is not None:
            state.first_run_done()
        screened = guard.screen_gradients(self._params)  # None unless the sampler screens
        report = guard.end_step()
        started = time.perf_counter()  # the guard's bookkeeping from here on is charged to the next report
        if screened is None:
            flagged, tripped = distributed.flagged_ranks(report.flagged > 0), []
        else:
            flagged, tripped = distributed.step_flags(report.flagged > 0, screened.tripped)
        outcome = StepOutcome(report.step, loss, report, flagged, tripped_ranks=tripped)
        bookkeeping = time.perf_counter() - started
        try:
            if outcome.flagged_ranks:
                assert state is not None, "a detection on a step that was not watched"
                outside = any(d.call_index < closure_start for d in report.detections) or closure is None
                rerunnable = not distributed.agree_max(int(outside))
                self._respond(outcome, closure if rerunnable else None, state)
            elif outcome.tripped_ranks:
                assert state is not None, "a gradient screen that tripped without a sampler that screens"
                # GEMMs before the closure cannot be re-run: agreed, as for a detection
                outside = closure is None or closure_start > 0
                rerunnable = not distributed.agree_max(int(outside))
                self._rescreen(outcome, closure if rerunnable else None, state)
            else:
                self._step_fn()
        finally:  # raise and exit are responses too: record them
            started = time.perf_counter()
            guard.outcomes.append(outcome)
            guard.publish("observe_outcome", outcome)
            bookkeeping += time.perf_counter() - started
        guard.refresh_weights()  # encode the updated weights now, while known fresh (charges itself)
        started = time.perf_counter()
        if outcome.stepped or outcome.action == "skip":
            with guard.unintercepted():  # reads the model only: the guard's own work, not the model's ops
                self.snapshots.after_step(report.step)  # never raises: a failing disk warns once
        guard.charge(bookkeeping + time.perf_counter() - started)  # no step is open: the next report's
        guard.begin_step(provisional=True)
        return outcome

    def _calibrate(self, closure: Callable[[], Any], state: StepState, replay: bool, loss: Any) -> Any:
        """The step with a calibration replay (``sdc_guard.runtime.calibration``): the
        closure once with interception off, timed, and everything it changed put back,
        then (unless the step already ran, ``replay``) the run whose results are used,
        guarded and timed. Returns the step's loss. The replay's work, putting back
        included, is charged to the step as the guard's cost."""
        guard = self.guard
        if replay:
            # the step ran guarded already: the bare replay must leave what that run left
            started = time.perf_counter()
            with guard.unintercepted():
                after = StepState.capture(guard.model, self._params, save_state=self.policy.save_state,
                                          restore_state=self.policy.restore_state)
            guard.replays.charge(time.perf_counter() - started)
            try:
                self._call(lambda: guard.replays.run_bare(closure))
            finally:
                started = time.perf_counter()
                with guard.unintercepted():
                    after.restore(self._params)
                guard.replays.charge(time.perf_counter() - started)
            return loss
        try:
            self._call(lambda: guard.replays.run_bare(closure))
        finally:
            started = time.perf_counter()
            with guard.unintercepted():
                state.restore(self._params)  # gradients, generators, buffers, the user's state
            guard.replays.charge(time.perf_counter() - started)
        return self._call(lambda: guard.replays.run_guarded(closure))

    def _call(self, closure: Callable[[], Any]) -> Any:
        """Run the closure; if it raises, close the open step (its report keeps what ran,
        detections included), open the next one and let the exception propagate, so
        that the next step counts only its own GEMMs."""
        try:
            return closure()
        except BaseException:
            if self.guard.step_open:
                self.guard.end_step(closure_raised=True)
            self.guard.begin_step(provisional=True)
            raise

    def _respond(self, outcome: StepOutcome, closure: Callable[[], Any] | None, state: StepState) -> None:
        action = self.policy.on_detection
        outcome.classification = "unconfirmed"
        if action == "recompute" and closure is None:
            # corrupted GEMMs ran outside the closure (earlier micro-batches, manual
            # optimisation): re-running the closure would not redo them; drop the step
            action = "skip"
        if action == "recompute":
            assert closure is not None
            triage = self._triage(outcome, closure, state)
            outcome.classification = triage.name.lower()
            if triage == Triage.TRANSIENT:
                outcome.action = "recompute"
                self.snapshots.note_detection(resolved=True)
                self._step_fn()  # with the clean re-run's gradients
                return
            action = (self.policy.escalate(outcome.step) if triage == Triage.PERSISTENT
                      else self.policy.on_nondeterministic)
        outcome.action = action
        log.warning("sdc_guard: corruption at step %d on rank(s) %s (%s): %s", outcome.step,
                    outcome.flagged_ranks, outcome.classification, action)
        self._apply(action, outcome, state)

    def _rescreen(self, outcome: StepOutcome, closure: Callable[[], Any] | None, state: StepState) -> None:
        """A tripped gradient screen: re-execute the step with every GEMM verified, on
        every rank, and compare. A confirmed corruption in a re-execution: PERSISTENT
        (the fault is still there); clean re-executions that agree with each other but
        not with the first run's gradients: TRANSIENT (they are what the optimizer
        steps with); re-executions that disagree with each other: NON_DETERMINISTIC;
        clean and identical to the first run: a screen miss, nothing more is done. A
        step that cannot be re-executed is answered as an unconfirmed detection."""
        if closure is None:
            outcome.screen = "unresolved"
            self.guard.resolve_screen("unresolved")
            self._respond(outcome, None, state)
            return
        first = grads_of(self._params)
        signatures, rerun_grads = self._rerun(outcome, closure, state)
        if any(signatures):
            local = Triage.PERSISTENT if all(s and s == signatures[0] for s in signatures) \
                else Triage.NON_DETERMINISTIC
        elif len(rerun_grads) > 1 and not all(_same(rerun_grads[0], g) for g in rerun_grads[1:]):
            local = Triage.NON_DETERMINISTIC
        else:
            local = Triage.CLEAN if _same(first, grads_of(self._params)) else Triage.TRANSIENT
        triage = Triage(distributed.agree_max(int(local)))
        if triage == Triage.CLEAN:  # the statistic was legitimately unusual
            outcome.screen = "miss"
            self.guard.resolve_screen("miss")
            self._step_fn()  # with gradients identical to the first run's
            return
        outcome.screen = outcome.classification = triage.name.lower()
        self.guard.resolve_screen(outcome.screen, self._params)
        if triage == Triage.TRANSIENT and self.policy.on_detection == "recompute":
            outcome.action = "recompute"
            self.snapshots.note_detection(resolved=True)
            self._step_fn()  # with the clean re-execution's gradients
            return
        if triage == Triage.PERSISTENT:
            action = self.policy.escalate(outcome.step)
        elif triage == Triage.TRANSIENT:
            action = self.policy.on_detection
        else:
            action = self.policy.on_nondeterministic
        outcome.action = action
        log.warning("sdc_guard: gradient screen tripped at step %d on rank(s) %s; re-execution: %s; %s",
                    outcome.step, outcome.tripped_ranks, outcome.classification, action)
        self._apply(action, outcome, state)

    def _triage(self, outcome: StepOutcome, closure: Callable[[], Any], state: StepState) -> Triage:
        """Re-run the step ``policy.reruns`` times on every rank; classify; agree."""
        original = _signature(outcome.report)
        signatures, rerun_grads = self._rerun(outcome, closure, state)
        local = _classify(original, signatures, rerun_grads)
        return Triage(distributed.agree_max(int(local)))

    def _rerun(self, outcome: StepOutcome, closure: Callable[[], Any], state: StepState) -> tuple[list[frozenset], list[list[Tensor | None]]]:
        """Re-run the step ``policy.reruns`` times, every GEMM verified, each from the RNG
        state and gradients it started from: each re-run's detection signature and, when
        there are several re-runs to compare, each one's gradients."""
        signatures, rerun_grads = [], []
        try:
            for _ in range(self.policy.reruns):
                self.policy.beat()  # a replayed step is progress, not a hang
                state.restore(self._params)  # RNG, gradients, buffers, the user's state
                self.guard.begin_step(rerun=True)
                outcome.loss = self._call(closure)
                rerun = self.guard.end_step()
                outcome.reruns.append(rerun)
                signatures.append(_signature(rerun))
                if self.policy.reruns > 1:
                    rerun_grads.append(grads_of(self._params))
        finally:
            state.finish()  # the generators go on from where the first run left them
            self.policy.beat()
        return signatures, rerun_grads

    def _apply(self, action: str, outcome: StepOutcome, state: StepState) -> None:
        if action == "log":
            self.snapshots.note_detection(resolved=False)
            self._step_fn()
        elif action == "skip":
            self.snapshots.note_detection(resolved=True)
            self.optimizer.zero_grad(set_to_none=True)
            state.restore_model_state()  # a dropped step leaves no trace in the buffers either
            outcome.stepped = False
        elif action == "rollback":
            self.optimizer.zero_grad(set_to_none=True)
            self.policy.beat()  # a restore from disk can take a while
            restored = self.snapshots.restore()
            self.policy.beat()
            outcome.rolled_back_to = restored.step
            outcome.stepped = False
        elif action == "raise":
            outcome.stepped = False
            raise SDCError(outcome)
        elif action == "exit":
            outcome.stepped = False
            self._exit(outcome)

    def _exit(self, outcome: StepOutcome) -> None:
        code = code_for(outcome.classification)
        if code == EXIT_PERSISTENT and _only_collectives(outcome):
            code = EXIT_COLLECTIVE  # the link, not the compute
        outcome.exit_code = code
        directory = self.policy.exit_report_dir or os.environ.get(ENV_EXIT_REPORT_DIR) or None
        try:
            if directory is not None:
                # every rank: which node and device each flagged rank is, for the report
                devices = [i.as_dict() for i in gather_identities(local_identity(_device_of(self.guard.model)))]
                if distributed.rank() == 0:
                    write_exit_report(directory, code, outcome, devices)
        except Exception as exc:  # the exit code is what the scheduler acts on: keep it
            log.error("sdc_guard: could not write the exit report to %s (%s: %s); exiting with code %d anyway",
                      directory, type(exc).__name__, exc, code)
        log.error("sdc_guard: exiting with code %d (%s) at step %d", code, outcome.classification, outcome.step)
        try:
            sys.stdout.flush()
        except Exception:  # a closed or broken stdout must not change the exit code either
            pass
        raise SDCExit(code, outcome)



def _only_collectives(outcome: StepOutcome) -> bool:
    """Whether every rank's detections at this step were in collectives (one small
    collective: all ranks exit with the same code)."""
    kinds = {d.kind for d in outcome.detections}
    mine = 0 if not kinds else (1 if kinds == {"collective"} else 2)
    agreed = distributed.agree_max(mine)
    return agreed == 1


def _classify(original: frozenset, signatures: list[frozenset], rerun_grads: list) -> Triage:
    """The seed's three-way logic, on this rank's detections."""
    if not original and not any(signatures):
        return Triage.CLEAN
    if not any(signatures):
        if len(rerun_grads) > 1 and not all(_same(rerun_grads[0], g) for g in rerun_grads[1:]):
            return Triage.NON_DETERMINISTIC
        return Triage.TRANSIENT
    if original and all(s == original for s in signatures):
        return Triage.PERSISTENT
    return Triage.NON_DETERMINISTIC


def _device_of(model: torch.nn.Module) -> torch.device | None:
    """The device of the model's first parameter (None: a model without parameters)."""
    return next((p.device for p in model.parameters()), None)


def _same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))
