"""Respond to corruption: triage by re-execution, recompute, skip, roll back, raise, exit.

State machine of one guarded optimizer step (``Guard.optimizer_step``), in the spirit of
Megatron-LM's ``rerun_state_machine``; every rank walks it in lockstep (its named states
and transitions: ``responder.py``, the decider; ``runtime/lifecycle/guarded_step.py`` acts)::

    RUN closure (forward + backward, RNG state saved)
     |
     +-- no rank flagged ------------------------------------------> STEP (optimizer.step)
     |
     +-- some rank flagged: action = policy.on_detection
           log        -> STEP anyway, snapshots tainted             [UNCONFIRMED]
           skip       -> SKIPPED: gradients dropped, optimizer untouched, buffers and
                         user state put back                            [UNCONFIRMED]
           rollback   -> ROLLED_BACK to the last known-good snapshot      [UNCONFIRMED]
           raise      -> SDCError                                         [UNCONFIRMED]
           exit       -> process exit, EXIT_TRANSIENT                     [UNCONFIRMED]
           recompute  -> TRIAGE: re-run the closure ``reruns`` times, RNG, gradients,
                         buffers and user state restored (rerun.py), every GEMM verified:
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
- ``EXIT_COLLECTIVE`` (19): a persistent fault whose every detection was in a collective
  (``Detection.kind == "collective"``, on every rank): the link between the ranks the exit
  report names, not a node's compute; check the interconnect before replacing a node.

The exit code does not depend on the exit report: a report that cannot be written (a
full disk, a path that is a file) is logged and the process still exits with its code.
The report is strict JSON (RFC 8259): a non-finite number, such as the D/T ratio of a
GEMM whose output is infinite, is written as the string ``"inf"``, ``"-inf"`` or
``"nan"`` (``float()`` reads each back).

Modules: this one holds ``Policy`` (what to do); ``responder.py`` the state machine
(``Responder``, a passive decider: it is asked with the step's facts and answers a
``Decision``; ``runtime/lifecycle/guarded_step.py`` drives the step and acts on it); ``rerun.py``
what a re-execution restores (RNG, gradients, buffers, the user's state); ``outcome.py``
the outcome, errors and exit report, whose public names are importable from here too.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .outcome import (CLASSIFICATIONS, EXIT_COLLECTIVE, EXIT_NONDETERMINISTIC, EXIT_PERSISTENT, EXIT_TRANSIENT, SDCError,
                      SDCExit, StepOutcome, Triage, strict_json, write_exit_report)
from .rerun import check_state_functions

__all__ = ["ACTIONS", "CLASSIFICATIONS", "EXIT_COLLECTIVE", "EXIT_NONDETERMINISTIC", "EXIT_PERSISTENT", "EXIT_TRANSIENT", "Policy",
           "SDCError", "SDCExit", "StepOutcome", "Triage", "strict_json", "write_exit_report"]

ACTIONS = ("log", "raise", "skip", "recompute", "rollback", "exit")


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
    #: where ``exit`` writes ``sdc_guard-exit.json`` (None: ``$SDC_GUARD_EXIT_REPORT_DIR``, else nowhere)
    exit_report_dir: str | os.PathLike | None = None
    persistent_steps: list[int] = field(default_factory=list)  #: escalation memory
    #: the user's own state a re-execution restores (Megatron's ``state_save_func`` /
    #: ``state_restore_func``): ``save_state()`` is called before each guarded step's
    #: closure and returns an object; ``restore_state(obj)`` is called with it before each
    #: re-execution and when a detected step is skipped. Both or neither.
    save_state: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    restore_state: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)
    #: called with no argument before and after each re-execution of a step and around a
    #: rollback's restore, so that a hang detector that expects a heartbeat per step
    #: (nvidia-resiliency-ext's ``RankMonitorClient.send_heartbeat``) does not take a
    #: replayed step for a hang; docs/OPERATIONS.md. A failure warns once, never stops training.
    heartbeat: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    _heartbeat_failed: bool = field(default=False, init=False, repr=False, compare=False)

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
        check_state_functions(self.save_state, self.restore_state)
        if self.heartbeat is not None and not callable(self.heartbeat):
            raise TypeError(f"heartbeat: expected a callable taking no argument (such as "
                            f"RankMonitorClient.send_heartbeat) or None, got {type(self.heartbeat).__name__} "
                            f"{self.heartbeat!r}")

    def beat(self) -> None:
        """Call ``heartbeat`` (if any). Monitoring: an exception warns once per policy and
        is otherwise ignored, so the response goes on exactly as without it."""
        if self.heartbeat is None:
            return
        try:
            self.heartbeat()
        except Exception as exc:
            if not self._heartbeat_failed:
                self._heartbeat_failed = True
                warnings.warn(f"sdc_guard: Policy.heartbeat failed ({type(exc).__name__}: {exc}); the response "
                              "goes on (further failures are not reported)", RuntimeWarning, stacklevel=2)

    def escalate(self, step: int) -> str:
        """Action for a PERSISTENT triage at ``step``, remembering it for the window."""
        repeated = any(step - s <= self.window for s in self.persistent_steps)
        self.persistent_steps = [s for s in self.persistent_steps if step - s <= self.window] + [step]
        return self.on_repeated if repeated else self.on_persistent

    def state_dict(self) -> dict[str, Any]:
        return {"persistent_steps": list(self.persistent_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.persistent_steps = [int(s) for s in state["persistent_steps"]]

