"""``Guard.optimizer_step``, driven: run the step's closure, gather the facts, ask the
responder (``respond/responder.py``, a passive decider) what to do, and do it (re-run,
step, skip, roll back, raise, exit), in lockstep across ranks. What a re-execution
restores is ``respond/rerun.py``; a calibration replay's runs are ``calibration.py``'s.

Control flows one way: this module calls the guard, the responder, the policy, the
snapshot store and the optimizer; none of them calls back.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from ...core.torch_private import tree_leaves, tree_map
from ...respond import distributed
from ...respond.identity import gather_identities, local_identity
from ...respond.outcome import SDCError, SDCExit, StepOutcome, Triage, write_exit_report
from ...respond.policy import Policy
from ...respond.rerun import StepState, grads_of
from ...respond.responder import Act, Decision, Responder, State, classify_detection, classify_rescreen, signature
from ...respond.snapshot import SnapshotStore

if TYPE_CHECKING:
    from .guard import Guard

log = logging.getLogger("sdc_guard")

#: where the exit report goes when the policy names no ``exit_report_dir``: set by the
#: job's scheduler script, which reads the report after the run (docs/OPERATIONS.md)
ENV_EXIT_REPORT_DIR = "SDC_GUARD_EXIT_REPORT_DIR"


class GuardedStep:
    """Runs ``Guard.optimizer_step`` for one optimizer: the driver of the responder's
    state machine (``respond/responder.py``)."""

    def __init__(self, guard: "Guard", optimizer: torch.optim.Optimizer, policy: Policy,
                 snapshots: SnapshotStore | None, step_fn: Callable[[], Any] | None = None) -> None:
        self.guard = guard
        self.optimizer = optimizer
        self._step_fn = step_fn if step_fn is not None else optimizer.step
        self.policy = policy
        self.responder = Responder(policy)
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
        # the step's flags ride in the collectives' exchange where it can carry them: then
        # every rank has them (``agreed_flags``) and no collective of their own is needed;
        # else (None on every rank alike) they take their own small collective
        report = guard.end_step(tripped=screened is not None and screened.tripped)
        started = time.perf_counter()  # the guard's bookkeeping from here on is charged to the next report
        if guard.agreed_flags is not None:
            flagged, tripped = guard.agreed_flags
        elif screened is None:
            flagged, tripped = distributed.flagged_ranks(report.flagged > 0), []
        else:
            flagged, tripped = distributed.step_flags(report.flagged > 0, screened.tripped)
        outcome = StepOutcome(report.step, without_graph(loss), report, flagged, tripped_ranks=tripped)
        bookkeeping = time.perf_counter() - started
        try:
            rerunnable = False
            if flagged or tripped:
                assert state is not None, "a detection or a tripped screen on a step that was not watched"
                # GEMMs before the closure cannot be re-run: agreed, so every rank decides alike
                outside = closure is None or (any(d.call_index < closure_start for d in report.detections)
                                              if flagged else closure_start > 0)
                rerunnable = not distributed.agree_max(int(outside))
            decision = self.responder.first_run(outcome.step, flagged=flagged, tripped=tripped, rerunnable=rerunnable)
            self._note(decision, outcome)
            if decision.act is Act.RERUN:
                assert closure is not None and state is not None
                decision = self._rerun_and_ask(decision, outcome, closure, state)
            self._act(decision, outcome, state)
        finally:  # raise and exit are responses too: record them
            started = time.perf_counter()
            guard.outcomes.append(outcome)
            guard.publisher.publish("observe_outcome", outcome)
            bookkeeping += time.perf_counter() - started
        guard.refresh_weights()  # encode the updated weights now, while known fresh (charges itself)
        started = time.perf_counter()
        if outcome.stepped or outcome.action == "skip":
            with guard.unintercepted():  # reads the model only: the guard's own work, not the model's ops
                self.snapshots.after_step(report.step)  # never raises: a failing disk warns once
        guard.charge(bookkeeping + time.perf_counter() - started)  # no step is open: the next report's
        guard.begin_step(provisional=True)
        return outcome

    def _rerun_and_ask(self, pending: Decision, outcome: StepOutcome, closure: Callable[[], Any],
                       state: StepState) -> Decision:
        """The re-executions ``pending`` asks for, their triage on this rank, agreed
        across ranks by severity, and the responder's answer to it."""
        first = grads_of(self._params) if pending.state is State.RESCREEN else None
        signatures, rerun_grads = self._rerun(outcome, closure, state, pending.reruns)
        if pending.state is State.RESCREEN:
            assert first is not None
            local = classify_rescreen(first, signatures, rerun_grads, grads_of(self._params))
        else:
            local = classify_detection(signature(outcome.report), signatures, rerun_grads)
        triage = Triage(distributed.agree_max(int(local)))
        ranks = outcome.flagged_ranks if pending.state is State.TRIAGE else outcome.tripped_ranks
        decision = self.responder.after_reruns(pending, outcome.step, triage, ranks)
        self._note(decision, outcome)
        return decision

    @staticmethod
    def _note(decision: Decision, outcome: StepOutcome) -> None:
        """What a decision says of the step goes into its outcome as soon as it is made
        (a re-execution that raises leaves the outcome as far as it got)."""
        if decision.classification is not None:
            outcome.classification = decision.classification
        if decision.screen is not None:
            outcome.screen = decision.screen
        if decision.action is not None:
            outcome.action = decision.action

    def _act(self, decision: Decision, outcome: StepOutcome, state: StepState | None) -> None:
        """Do what the final ``decision`` says."""
        if decision.screen is not None:
            self.guard.resolve_screen(decision.screen, self._params if decision.screen_with_gradients else None)
        if decision.resolved is not None:
            self.snapshots.note_detection(resolved=decision.resolved)
        act = decision.act
        if act in (Act.STEP, Act.LOG):
            self._step_fn()  # with the first run's gradients, or the clean re-run's
            return
        outcome.stepped = False
        if act is Act.SKIP:
            assert state is not None
            self.optimizer.zero_grad(set_to_none=True)
            state.restore_model_state()  # a dropped step leaves no trace in the buffers either
        elif act is Act.ROLLBACK:
            self.optimizer.zero_grad(set_to_none=True)
            self.policy.beat()  # a restore from disk can take a while
            restored = self.snapshots.restore()
            self.policy.beat()
            outcome.rolled_back_to = restored.step
        elif act is Act.RAISE:
            raise SDCError(outcome)
        elif act is Act.EXIT:
            self._exit(decision, outcome)
        else:
            raise AssertionError(f"not a final decision: {decision!r}")

    def _calibrate(self, closure: Callable[[], Any], state: StepState, replay: bool, loss: Any) -> Any:
        """The step with a calibration replay (``sdc_guard.runtime.lifecycle.calibration``): the
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

    def _rerun(self, outcome: StepOutcome, closure: Callable[[], Any], state: StepState,
               reruns: int) -> tuple[list[frozenset], list[list[Tensor | None]]]:
        """Re-run the step ``reruns`` times, every GEMM verified, each from the RNG state
        and gradients it started from: each re-run's detection signature and, when there
        are several re-runs to compare, each one's gradients."""
        signatures, rerun_grads = [], []
        try:
            for _ in range(reruns):
                self.policy.beat()  # a replayed step is progress, not a hang
                state.restore(self._params)  # RNG, gradients, buffers, the user's state
                self.guard.begin_step(rerun=True)
                outcome.loss = without_graph(self._call(closure))
                rerun = self.guard.end_step()
                outcome.reruns.append(rerun)
                signatures.append(signature(rerun))
                if reruns > 1:
                    rerun_grads.append(grads_of(self._params))
        finally:
            state.finish()  # the generators go on from where the first run left them
            self.policy.beat()
        return signatures, rerun_grads

    def _exit(self, decision: Decision, outcome: StepOutcome) -> None:
        assert decision.exit_code is not None
        code = decision.exit_code
        if decision.link_exit_code is not None and _only_collectives(outcome):
            code = decision.link_exit_code
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


def without_graph(loss: Any) -> Any:
    """``loss`` as a step's outcome keeps it: every tensor in it detached from its autograd
    graph (the same values, no copy), through the containers torch's pytree knows (tuple,
    list, dict, namedtuple, a Hugging Face ``ModelOutput``) and dataclasses (a shallow copy
    with the detached fields), rebuilt only where one held a graph; anything else as it
    is. Why: the guard keeps its last ``history`` outcomes (``Guard.outcomes``), and a loss
    that still held its graph kept every node of it alive, with what the nodes keep after
    the backward (under FSDP2 about 25 MB a step of the bench's 3.3 M-parameter model,
    growing for 100 steps); a closure returning ``(loss, logits)`` kept them as well."""
    return _without_graph(loss, 0)


#: how deep dataclasses nested in a closure's result are followed (one that refers back to
#: itself is not followed round)
_DEPTH = 8


def _without_graph(value: Any, depth: int) -> Any:
    if isinstance(value, Tensor):
        return value.detach() if value.grad_fn is not None else value
    if not any(_holds_graph(leaf, depth) for leaf in tree_leaves(value)):
        return value  # nothing holds a graph: the caller's own object
    return tree_map(lambda leaf: _detached(leaf, depth), value)


def _holds_graph(value: Any, depth: int) -> bool:
    """Whether a pytree leaf holds an autograd graph: a tensor with one, or a dataclass
    with one in its fields (nested ones up to ``_DEPTH`` deep)."""
    if isinstance(value, Tensor):
        return value.grad_fn is not None
    if depth < _DEPTH and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds_graph(leaf, depth + 1) for f in dataclasses.fields(value)
                   for leaf in tree_leaves(getattr(value, f.name, None)))
    return False


def _detached(value: Any, depth: int) -> Any:
    """A pytree leaf without its graph: a tensor detached, a dataclass that holds one
    copied (``copy.copy``: its type and other fields kept) with those fields detached."""
    if isinstance(value, Tensor):
        return value.detach() if value.grad_fn is not None else value
    if not _holds_graph(value, depth):
        return value
    kept = copy.copy(value)
    for f in dataclasses.fields(value):
        field = getattr(value, f.name, None)
        if any(_holds_graph(leaf, depth + 1) for leaf in tree_leaves(field)):
            object.__setattr__(kept, f.name, _without_graph(field, depth + 1))
    return kept


def _only_collectives(outcome: StepOutcome) -> bool:
    """Whether every rank's detections at this step were in collectives (one small
    collective: all ranks exit with the same code)."""
    kinds = {d.kind for d in outcome.detections}
    mine = 0 if not kinds else (1 if kinds == {"collective"} else 2)
    agreed = distributed.agree_max(mine)
    return agreed == 1


def _device_of(model: torch.nn.Module) -> torch.device | None:
    """The device of the model's first parameter (None: a model without parameters)."""
    return next((p.device for p in model.parameters()), None)
