"""Respond to corruption: triage by re-execution, recompute, skip, roll back, raise, exit.

State machine of one guarded optimizer step (``Guard.optimizer_step``), in the spirit of
Megatron-LM's ``rerun_state_machine``; every rank walks it in lockstep::

    RUN closure (forward + backward, RNG state saved)
     |
     +-- no rank flagged ------------------------------------------> STEP (optimizer.step)
     |
     +-- some rank flagged: action = policy.on_detection
           log        -> STEP anyway, snapshots tainted             [UNCONFIRMED]
           skip       -> SKIPPED: gradients dropped, optimizer untouched  [UNCONFIRMED]
           rollback   -> ROLLED_BACK to the last known-good snapshot      [UNCONFIRMED]
           raise      -> SDCError                                         [UNCONFIRMED]
           exit       -> process exit, EXIT_TRANSIENT                     [UNCONFIRMED]
           recompute  -> TRIAGE: re-run the closure ``reruns`` times, RNG and gradients
                         restored, every GEMM verified:
                re-runs clean (and, if several, bitwise equal) -> TRANSIENT:
                        STEP with the re-run's gradients
                re-runs flagged exactly like the original       -> PERSISTENT:
                        action = on_persistent (default rollback), or on_repeated
                        (default exit, EXIT_PERSISTENT) if another PERSISTENT happened
                        within ``window`` steps
                otherwise                                        -> NON_DETERMINISTIC:
                        action = on_nondeterministic (default skip); recorded as such,
                        never treated as transient or persistent

The triage outcome is agreed across ranks by severity (persistent > non-deterministic >
transient), so all ranks take the same action at the same step.

Exit codes, for the scheduler:

- ``EXIT_TRANSIENT`` (16): stopped on a detection that was not shown to be persistent;
  restarting from the last checkpoint on the same node is reasonable.
- ``EXIT_PERSISTENT`` (17): a fault reproduced on re-execution; replace this node.
- ``EXIT_NONDETERMINISTIC`` (18): re-executions disagreed; suspect the hardware or a
  non-deterministic kernel; investigate before reusing the node.

The exit code does not depend on the exit report: a report that cannot be written (a
full disk, a path that is a file) is logged and the process still exits with its code.
The report is strict JSON (RFC 8259): a non-finite number, such as the D/T ratio of a
GEMM whose output is infinite, is written as the string ``"inf"``, ``"-inf"`` or
``"nan"`` (``float()`` reads each back).
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from . import distributed
from .snapshot import SnapshotStore

if TYPE_CHECKING:
    from ..runtime.guard import Guard
    from ..runtime.report import Detection, StepReport

log = logging.getLogger("sdc_guard")

EXIT_TRANSIENT = 16
EXIT_PERSISTENT = 17
EXIT_NONDETERMINISTIC = 18

ACTIONS = ("log", "raise", "skip", "recompute", "rollback", "exit")


class Triage(enum.IntEnum):
    """Outcome of re-execution, ordered by severity (the lockstep agreement takes the max)."""

    CLEAN = 0  #: this rank never flagged
    TRANSIENT = 1
    NON_DETERMINISTIC = 2
    PERSISTENT = 3


#: metric/report names of the classifications
CLASSIFICATIONS = ("transient", "persistent", "non_deterministic", "unconfirmed")


class SDCError(RuntimeError):
    """Raised by the ``raise`` response; carries the step's report and classification."""

    def __init__(self, outcome: "StepOutcome") -> None:
        self.outcome = outcome
        self.report = outcome.report
        where = ", ".join(f"{d.site} ({d.phase} {d.op}, rank {d.rank})" for d in outcome.detections)
        ranks = outcome.flagged_ranks or outcome.tripped_ranks
        super().__init__(f"silent data corruption detected at step {outcome.step} on rank(s) "
                         f"{ranks}: {where or 'another rank'}; classification "
                         f"{outcome.classification}")


class SDCExit(SystemExit):
    """Raised by the ``exit`` response: a ``SystemExit`` with a documented code."""

    def __init__(self, code: int, outcome: "StepOutcome") -> None:
        super().__init__(code)
        self.outcome = outcome


@dataclass
class StepOutcome:
    """What a guarded optimizer step did."""

    step: int
    loss: Any
    report: "StepReport"  #: the step's first run
    flagged_ranks: list[int] = field(default_factory=list)
    classification: str | None = None  #: one of CLASSIFICATIONS, None when clean
    action: str | None = None  #: the response taken, None when clean
    stepped: bool = True  #: whether the optimizer updated the parameters
    reruns: list["StepReport"] = field(default_factory=list)
    rolled_back_to: int | None = None
    #: ranks whose gradient screen (``sampling.Screened``) tripped at this step
    tripped_ranks: list[int] = field(default_factory=list)
    #: how a tripped gradient screen was resolved, one of ``sampling.SCREEN_VERDICTS``
    #: ("miss": the verified re-execution was identical, nothing done); None: no trip
    screen: str | None = None

    @property
    def detected(self) -> bool:
        """Whether the step was a detection: a GEMM flagged on some rank, or a tripped
        gradient screen whose re-execution found corruption (or that could not be
        re-executed). A screen miss is not one."""
        return bool(self.flagged_ranks) or self.classification is not None

    @property
    def detections(self) -> list["Detection"]:
        """The first run's detections, else (a screened step, whose first run verified
        nothing) those of its re-executions."""
        if self.report.detections:
            return list(self.report.detections)
        return [d for rerun in self.reruns for d in rerun.detections]


def _check_action(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def _check_steps(steps: Any) -> list[int]:
    """``persistent_steps``: a list of step numbers (non-negative ints)."""
    if not isinstance(steps, (list, tuple)):
        raise TypeError(f"persistent_steps: expected a list of step numbers (non-negative ints), "
                        f"got {type(steps).__name__} {steps!r}")
    for step in steps:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"persistent_steps: expected non-negative int step numbers, got {step!r} in {steps!r}")
    return list(steps)


def _check_report_dir(directory: Any) -> None:
    """``exit_report_dir``: ``None`` or a path that is not an existing non-directory. It
    is created (and written) only at exit; a failure then never changes the exit code."""
    if directory is None:
        return
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"exit_report_dir: expected a directory path (str or os.PathLike) or None, "
                        f"got {type(directory).__name__} {directory!r}")
    if str(directory) == "":
        raise ValueError("exit_report_dir: expected a directory path or None, got an empty string")
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ValueError(f"exit_report_dir: expected a directory, got {str(directory)!r}, "
                         "which exists and is not a directory")


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float as a string ("inf", "-inf", "nan"), tuples
    as lists and anything else JSON cannot hold as its ``str``: what ``json.dumps(...,
    allow_nan=False)`` accepts, so strict parsers (JavaScript's, log shippers) read it.

    >>> strict_json({"ratio": float("inf"), "rows": (1, 2), "x": float("nan")})
    {'ratio': 'inf', 'rows': [1, 2], 'x': 'nan'}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return str(value)


@dataclass
class Policy:
    """How to respond to a detection; defaults chosen for a real training job.

    Re-execute first (most SDC events are transient, and a clean re-run keeps training
    exactly on course), roll back if the fault reproduces, and exit for node replacement
    if it reproduces again within ``window`` steps. Re-runs that disagree are skipped and
    reported as non-deterministic.

    >>> Policy().on_detection, Policy().on_persistent, Policy().on_repeated
    ('recompute', 'rollback', 'exit')
    """

    on_detection: str = "recompute"
    on_persistent: str = "rollback"
    on_repeated: str = "exit"
    on_nondeterministic: str = "skip"
    reruns: int = 1
    window: int = 100
    exit_report_dir: str | os.PathLike | None = None  #: where ``exit`` writes ``sdc_guard-exit.json``
    persistent_steps: list[int] = field(default_factory=list)  #: escalation memory

    def __post_init__(self) -> None:
        _check_action("on_detection", self.on_detection, ACTIONS)
        final = tuple(a for a in ACTIONS if a != "recompute")
        _check_action("on_persistent", self.on_persistent, final)
        _check_action("on_repeated", self.on_repeated, final)
        _check_action("on_nondeterministic", self.on_nondeterministic, final)
        for name in ("reruns", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.persistent_steps = _check_steps(self.persistent_steps)
        _check_report_dir(self.exit_report_dir)

    def escalate(self, step: int) -> str:
        """Action for a PERSISTENT triage at ``step``, remembering it for the window."""
        repeated = any(step - s <= self.window for s in self.persistent_steps)
        self.persistent_steps = [s for s in self.persistent_steps if step - s <= self.window] + [step]
        return self.on_repeated if repeated else self.on_persistent

    def state_dict(self) -> dict[str, Any]:
        return {"persistent_steps": list(self.persistent_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.persistent_steps = [int(s) for s in state["persistent_steps"]]


@dataclass
class _Rng:
    """The random state a re-run must reproduce (dropout and friends)."""

    cpu: Tensor
    cuda: list[Tensor]

    @classmethod
    def capture(cls) -> "_Rng":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)


def _grads(params: list[Tensor]) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _set_grads(params: list[Tensor], grads: list[Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


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
        if self.snapshots.last_good is None and not self.snapshots.checkpoints():
            self.snapshots.take(guard.step_index - 1)  # the state before the first guarded step

    def run(self, closure: Callable[[], Any] | None, *, replay: bool = False, loss: Any = None) -> StepOutcome:
        """One guarded step. ``closure=None`` (manual optimisation, GEMMs run before the
        step was called) leaves nothing to re-execute: recompute becomes skip.

        ``replay=True``: the step's forward and backward already ran and gave ``loss``
        (the Hugging Face Trainer runs them before it calls the optimizer); ``closure`` is
        called only to re-execute, re-runs the whole step and restores the RNG state and
        gradients it starts from itself, so every GEMM of the step can be re-run."""
        started = time.perf_counter()
        rng = _Rng.capture()
        grads_before = None if replay else _grads(self._params)
        self.guard.charge(time.perf_counter() - started)
        closure_start = 0 if replay else self.guard.gemms_seen  # GEMMs before this point cannot be re-run
        if not replay:
            loss = closure() if closure is not None else None
        screened = self.guard.screen_gradients(self._params)  # None unless the sampler screens
        report = self.guard.end_step()
        if screened is None:
            flagged, tripped = distributed.flagged_ranks(report.flagged > 0), []
        else:
            flagged, tripped = distributed.step_flags(report.flagged > 0, screened.tripped)
        outcome = StepOutcome(report.step, loss, report, flagged, tripped_ranks=tripped)
        try:
            if outcome.flagged_ranks:
                outside = any(d.call_index < closure_start for d in report.detections) or closure is None
                rerunnable = not distributed.agree_max(int(outside))
                self._respond(outcome, closure if rerunnable else None, rng, grads_before)
            elif outcome.tripped_ranks:
                # GEMMs before the closure cannot be re-run: agreed, as for a detection
                outside = closure is None or closure_start > 0
                rerunnable = not distributed.agree_max(int(outside))
                self._rescreen(outcome, closure if rerunnable else None, rng, grads_before)
            else:
                self._step_fn()
        finally:  # raise and exit are responses too: record them
            self.guard.outcomes.append(outcome)
            self.guard.publish("observe_outcome", outcome)
        self.guard.refresh_weights()  # encode the updated weights now, while known fresh
        started = time.perf_counter()
        if outcome.stepped or outcome.action == "skip":
            self.snapshots.after_step(report.step)  # never raises: a failing disk warns once
        self.guard.charge(time.perf_counter() - started)  # no step is open: the next report's
        self.guard.begin_step(provisional=True)
        return outcome

    def _respond(self, outcome: StepOutcome, closure: Callable[[], Any] | None, rng: _Rng,
                 grads_before: list[Tensor | None] | None) -> None:
        action = self.policy.on_detection
        outcome.classification = "unconfirmed"
        if action == "recompute" and closure is None:
            # corrupted GEMMs ran outside the closure (earlier micro-batches, manual
            # optimisation): re-running the closure would not redo them; drop the step
            action = "skip"
        if action == "recompute":
            assert closure is not None
            triage = self._triage(outcome, closure, rng, grads_before)
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
        self._apply(action, outcome)

    def _rescreen(self, outcome: StepOutcome, closure: Callable[[], Any] | None, rng: _Rng,
                  grads_before: list[Tensor | None] | None) -> None:
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
            self._respond(outcome, None, rng, grads_before)
            return
        first = _grads(self._params)
        signatures, rerun_grads = self._rerun(outcome, closure, rng, grads_before)
        if any(signatures):
            local = Triage.PERSISTENT if all(s and s == signatures[0] for s in signatures) \
                else Triage.NON_DETERMINISTIC
        elif len(rerun_grads) > 1 and not all(_same(rerun_grads[0], g) for g in rerun_grads[1:]):
            local = Triage.NON_DETERMINISTIC
        else:
            local = Triage.CLEAN if _same(first, _grads(self._params)) else Triage.TRANSIENT
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
        self._apply(action, outcome)

    def _triage(self, outcome: StepOutcome, closure: Callable[[], Any], rng: _Rng,
                grads_before: list[Tensor | None] | None) -> Triage:
        """Re-run the step ``policy.reruns`` times on every rank; classify; agree."""
        original = _signature(outcome.report)
        signatures, rerun_grads = self._rerun(outcome, closure, rng, grads_before)
        local = _classify(original, signatures, rerun_grads)
        return Triage(distributed.agree_max(int(local)))

    def _rerun(self, outcome: StepOutcome, closure: Callable[[], Any], rng: _Rng,
               grads_before: list[Tensor | None] | None) -> tuple[list[frozenset], list[list[Tensor | None]]]:
        """Re-run the step ``policy.reruns`` times, every GEMM verified, each from the RNG
        state and gradients it started from: each re-run's detection signature and, when
        there are several re-runs to compare, each one's gradients."""
        signatures, rerun_grads = [], []
        for _ in range(self.policy.reruns):
            rng.restore()
            if grads_before is not None:  # None: a replaying closure restores its own
                _set_grads(self._params, grads_before)
            self.guard.begin_step(rerun=True)
            outcome.loss = closure()
            rerun = self.guard.end_step()
            outcome.reruns.append(rerun)
            signatures.append(_signature(rerun))
            if self.policy.reruns > 1:
                rerun_grads.append(_grads(self._params))
        return signatures, rerun_grads

    def _apply(self, action: str, outcome: StepOutcome) -> None:
        if action == "log":
            self.snapshots.note_detection(resolved=False)
            self._step_fn()
        elif action == "skip":
            self.snapshots.note_detection(resolved=True)
            self.optimizer.zero_grad(set_to_none=True)
            outcome.stepped = False
        elif action == "rollback":
            self.optimizer.zero_grad(set_to_none=True)
            restored = self.snapshots.restore()
            outcome.rolled_back_to = restored.step
            outcome.stepped = False
        elif action == "raise":
            outcome.stepped = False
            raise SDCError(outcome)
        elif action == "exit":
            outcome.stepped = False
            self._exit(outcome)

    def _exit(self, outcome: StepOutcome) -> None:
        code = {"persistent": EXIT_PERSISTENT, "non_deterministic": EXIT_NONDETERMINISTIC}.get(
            outcome.classification or "", EXIT_TRANSIENT)
        try:
            if self.policy.exit_report_dir is not None and distributed.rank() == 0:
                write_exit_report(self.policy.exit_report_dir, code, outcome)
        except Exception as exc:  # the exit code is what the scheduler acts on: keep it
            log.error("sdc_guard: could not write the exit report to %s (%s: %s); exiting with code %d anyway",
                      self.policy.exit_report_dir, type(exc).__name__, exc, code)
        log.error("sdc_guard: exiting with code %d (%s) at step %d", code, outcome.classification, outcome.step)
        try:
            sys.stdout.flush()
        except Exception:  # a closed or broken stdout must not change the exit code either
            pass
        raise SDCExit(code, outcome)


def write_exit_report(directory: str | os.PathLike, code: int, outcome: StepOutcome) -> Path:
    """Write ``sdc_guard-exit.json`` in ``directory`` (created if missing): strict JSON,
    written to a temporary file and renamed, so a reader never sees half a report."""
    path = Path(directory) / "sdc_guard-exit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(strict_json({
        "exit_code": code, "step": outcome.step, "flagged_ranks": outcome.flagged_ranks,
        "classification": outcome.classification, "pid": os.getpid(),
        "detections": [asdict(d) for d in outcome.detections], "tripped_ranks": outcome.tripped_ranks,
    }), indent=2, allow_nan=False)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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


def _same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))
