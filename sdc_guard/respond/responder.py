"""The responder: decides, from the facts of one guarded optimizer step, what the guard
does next. It is passive: the guard (``runtime/lifecycle/guarded_step.py``) runs the step, gathers
the facts (agreed across ranks), asks, and acts; the responder never calls the guard,
the optimizer or the model (the anchors: Megatron's ``RerunStateMachine``, asked
``should_rerun_forward_and_backward()`` / ``should_checkpoint_and_exit()`` by the loop;
Lightning's ``EarlyStopping``, which computes a decision the trainer applies).

States and transitions (``State``; each arrow is one ``Decision``, its ``act`` what the
guard does; every rank is asked with the same agreed facts, so all take the same arrow)::

    RAN (the closure ran once; facts: a rank flagged? a gradient screen tripped? can the
     |   step be re-executed, on every rank?)
     +-- nothing flagged or tripped ---------------------------------> DONE: STEP
     +-- flagged, on_detection = recompute, re-executable -----------> TRIAGE: RERUN
     +-- flagged, otherwise (recompute not possible: skip) ----------> DONE: the action [unconfirmed]
     +-- tripped, re-executable -------------------------------------> RESCREEN: RERUN
     +-- tripped, not re-executable (screen "unresolved") -----------> as flagged, not re-executable
    TRIAGE (facts: the re-executions' triage, agreed by severity)
     +-- TRANSIENT ---------------------------------------------------> DONE: STEP (re-run's gradients)
     +-- PERSISTENT -------------------------> DONE: on_persistent, or on_repeated within window
     +-- NON_DETERMINISTIC (or CLEAN) -------------------------------> DONE: on_nondeterministic
    RESCREEN (facts: the re-executions' triage against the first run's gradients, agreed)
     +-- CLEAN (a screen miss) ---------------------------------------> DONE: STEP
     +-- TRANSIENT, on_detection = recompute ------------------------> DONE: STEP (re-run's gradients)
     +-- TRANSIENT, otherwise ---------------------------------------> DONE: on_detection
     +-- PERSISTENT / NON_DETERMINISTIC ------------------------------> DONE: as in TRIAGE

The acts (``Act``): ``STEP`` (the optimizer steps), ``RERUN`` (re-execute the closure
``policy.reruns`` times, every GEMM verified, from the state it started from, then ask
again), ``LOG`` (step anyway; the snapshots learn the step was tainted), ``SKIP``,
``ROLLBACK``, ``RAISE`` (``SDCError``), ``EXIT`` (``SDCExit`` with ``Decision.exit_code``).
The policy (``policy.py``) says which final act each classification gets; what a
re-execution restores is ``rerun.py``.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .exit_codes import code_for
from .outcome import EXIT_COLLECTIVE, EXIT_PERSISTENT, Triage
from .policy import Policy

if TYPE_CHECKING:
    from ..report import StepReport

log = logging.getLogger("sdc_guard")


class State(enum.Enum):
    """Where a guarded step's response stands (the module docstring's machine)."""

    RAN = "ran"  #: the closure ran once: decide on its facts
    TRIAGE = "triage"  #: a detection is being re-executed, to classify it
    RESCREEN = "rescreen"  #: a tripped gradient screen is being re-executed, every GEMM verified
    DONE = "done"  #: the step's response is decided


class Act(enum.Enum):
    """What the guard does for a ``Decision``."""

    STEP = "step"  #: the optimizer steps (with the first run's gradients, or a clean re-run's)
    RERUN = "rerun"  #: re-execute the closure ``Decision.reruns`` times, then ask again
    LOG = "log"  #: step anyway; the snapshots are told the step was not resolved
    SKIP = "skip"  #: drop the gradients; the optimizer untouched, buffers and user state put back
    ROLLBACK = "rollback"  #: restore the last known-good snapshot
    RAISE = "raise"  #: raise ``SDCError``
    EXIT = "exit"  #: raise ``SDCExit`` with ``Decision.exit_code``


_FINAL = {"log": Act.LOG, "skip": Act.SKIP, "rollback": Act.ROLLBACK, "raise": Act.RAISE, "exit": Act.EXIT}


@dataclass(frozen=True)
class Decision:
    """One transition of the machine: the state it leads to and what the guard does."""

    state: State
    act: Act
    #: ``StepOutcome.action``: the policy's name of the response (``"recompute"`` for a
    #: step taken with a clean re-execution's gradients), ``None`` for a plain step
    action: str | None = None
    #: ``StepOutcome.classification`` from now on (``None``: nothing to classify yet)
    classification: str | None = None
    #: the gradient screen's verdict, for the sampler and ``StepOutcome.screen`` (``None``: none)
    screen: str | None = None
    reruns: int = 0  #: re-executions to run (``RERUN``)
    #: tell the snapshots of the detection: ``True`` resolved (nothing corrupt reached the
    #: weights), ``False`` not, ``None`` nothing to tell
    resolved: bool | None = None
    #: ``EXIT``'s code, and the code instead if every rank's detections were in
    #: collectives (the guard asks the ranks only where it differs: ``None`` otherwise)
    exit_code: int | None = None
    link_exit_code: int | None = None

    @property
    def screen_with_gradients(self) -> bool:
        """Whether the screen's verdict goes to the sampler with the step's gradients (a
        verdict of re-executions: the gradients the optimizer keeps are the re-run's)."""
        return self.screen not in (None, "unresolved", "miss")


class Responder:
    """The decider of the module docstring, for one policy. ``first_run`` answers state
    ``RAN``, ``after_reruns`` a ``RERUN`` decision's state."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def first_run(self, step: int, *, flagged: list[int], tripped: list[int], rerunnable: bool) -> Decision:
        """The step ran once. ``flagged`` / ``tripped``: the ranks whose checks flagged /
        whose gradient screen tripped (agreed: the same lists on every rank);
        ``rerunnable``: every rank can re-execute the step (agreed; only read when a
        rank flagged or tripped)."""
        if flagged:
            return self._detected(step, flagged, rerunnable)
        if tripped:
            if not rerunnable:
                return self._detected(step, tripped, False, screen="unresolved")
            return Decision(State.RESCREEN, Act.RERUN, reruns=self.policy.reruns)
        return Decision(State.DONE, Act.STEP)

    def after_reruns(self, pending: Decision, step: int, triage: Triage, ranks: list[int]) -> Decision:
        """The re-executions ``pending`` asked for ran; ``triage`` is their classification,
        agreed across ranks by severity; ``ranks`` the flagged (or tripped) ranks, for the log."""
        if pending.state is State.TRIAGE:
            classification = triage.name.lower()
            if triage == Triage.TRANSIENT:
                return Decision(State.DONE, Act.STEP, action="recompute", classification=classification,
                                resolved=True)
            action = self.policy.escalate(step) if triage == Triage.PERSISTENT else self.policy.on_nondeterministic
            log.warning("sdc_guard: corruption at step %d on rank(s) %s (%s): %s", step, ranks, classification, action)
            return self._final(action, classification)
        if pending.state is not State.RESCREEN:
            raise ValueError(f"pending: expected a RERUN decision (state TRIAGE or RESCREEN), got {pending!r}")
        if triage == Triage.CLEAN:  # the statistic was legitimately unusual
            return Decision(State.DONE, Act.STEP, screen="miss")
        classification = triage.name.lower()
        if triage == Triage.TRANSIENT and self.policy.on_detection == "recompute":
            return Decision(State.DONE, Act.STEP, action="recompute", classification=classification,
                            screen=classification, resolved=True)
        if triage == Triage.PERSISTENT:
            action = self.policy.escalate(step)
        elif triage == Triage.TRANSIENT:
            action = self.policy.on_detection
        else:
            action = self.policy.on_nondeterministic
        log.warning("sdc_guard: gradient screen tripped at step %d on rank(s) %s; re-execution: %s; %s",
                    step, ranks, classification, action)
        return self._final(action, classification, screen=classification)

    def _detected(self, step: int, ranks: list[int], rerunnable: bool, screen: str | None = None) -> Decision:
        action = self.policy.on_detection
        if action == "recompute" and not rerunnable:
            # corrupted GEMMs ran outside the closure (earlier micro-batches, manual
            # optimisation): re-running the closure would not redo them; drop the step
            action = "skip"
        if action == "recompute":
            return Decision(State.TRIAGE, Act.RERUN, classification="unconfirmed", reruns=self.policy.reruns)
        log.warning("sdc_guard: corruption at step %d on rank(s) %s (%s): %s", step, ranks, "unconfirmed", action)
        return self._final(action, "unconfirmed", screen=screen)

    @staticmethod
    def _final(action: str, classification: str, screen: str | None = None) -> Decision:
        act = _FINAL[action]
        resolved = {Act.LOG: False, Act.SKIP: True}.get(act)
        code = link = None
        if act is Act.EXIT:
            code = code_for(classification)
            link = EXIT_COLLECTIVE if code == EXIT_PERSISTENT else None  # the link, not the compute
        return Decision(State.DONE, act, action=action, classification=classification, screen=screen,
                        resolved=resolved, exit_code=code, link_exit_code=link)


# --- the triage: pure functions of one rank's facts (the guard agrees them across ranks)

def signature(report: "StepReport") -> frozenset:
    """What a run's detections were: sites, phases, ops, rows and segments."""
    return frozenset((d.site, d.phase, d.op, tuple(d.rows), tuple(d.segments)) for d in report.detections)


def classify_detection(original: frozenset, signatures: list[frozenset], rerun_grads: list) -> Triage:
    """A detection's re-executions, on this rank (the seed's three-way logic): clean
    re-runs that agree with each other are TRANSIENT, re-runs flagged exactly like the
    first run PERSISTENT, anything else NON_DETERMINISTIC (CLEAN: this rank never flagged)."""
    if not original and not any(signatures):
        return Triage.CLEAN
    if not any(signatures):
        if len(rerun_grads) > 1 and not all(same_tensors(rerun_grads[0], g) for g in rerun_grads[1:]):
            return Triage.NON_DETERMINISTIC
        return Triage.TRANSIENT
    if original and all(s == original for s in signatures):
        return Triage.PERSISTENT
    return Triage.NON_DETERMINISTIC


def classify_rescreen(first: list[Tensor | None], signatures: list[frozenset], rerun_grads: list,
                      last: list[Tensor | None]) -> Triage:
    """A tripped gradient screen's re-executions, on this rank: a confirmed corruption in
    each, alike, is PERSISTENT (the fault is still there); clean re-executions that agree
    with each other but not with the first run's gradients ``first`` (``last``: the
    gradients after the re-executions) are TRANSIENT; re-executions that disagree with
    each other NON_DETERMINISTIC; clean and identical to the first run, CLEAN (a screen miss)."""
    if any(signatures):
        return Triage.PERSISTENT if all(s and s == signatures[0] for s in signatures) else Triage.NON_DETERMINISTIC
    if len(rerun_grads) > 1 and not all(same_tensors(rerun_grads[0], g) for g in rerun_grads[1:]):
        return Triage.NON_DETERMINISTIC
    return Triage.CLEAN if same_tensors(first, last) else Triage.TRANSIENT


def same_tensors(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    """Whether two lists of gradients are bitwise equal (``None`` matching ``None``)."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))
