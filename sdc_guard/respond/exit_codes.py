"""The exit codes of the ``exit`` response, in one table: what each means and what a
scheduler should do with the node.

Everything that maps a code to a decision reads this table: the responder (which code a
classification exits with), the exit report and the structured events (what to drain),
``sdc-guard drain`` (the scheduler commands) and the recipes in docs/OPERATIONS.md. A new
code is one more ``ExitCode`` entry here.

``scheduler`` is what the job's scheduler should do: ``"requeue"`` (restart from the last
checkpoint; the same node is fine) or ``"exclude"`` (restart elsewhere: the devices of the
flagged ranks are suspect). ``drain`` says whether those devices should be taken out of
service until a self-test (``sdc-guard selftest --burn``) passes again.

>>> code_for("persistent"), describe(17).scheduler
(17, 'exclude')
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExitCode:
    """One exit code and what it asks of the scheduler."""

    code: int
    #: the triage classification that exits with this code (``StepOutcome.classification``),
    #: or None for a code another check than triage chooses
    classification: str | None
    meaning: str
    scheduler: str  #: "requeue" or "exclude"
    drain: bool  #: the flagged ranks' devices go out of service until a self-test passes


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(16, "transient", "stopped on a detection that was not shown to be persistent; "
             "restart from the last checkpoint, on the same node", "requeue", False),
    ExitCode(17, "persistent", "a fault reproduced on re-execution: the device is faulty; "
             "restart elsewhere and drain the node", "exclude", True),
    ExitCode(18, "non_deterministic", "re-executions of the step disagreed: suspect the device; "
             "restart elsewhere and test the node before reusing it", "exclude", True),
    ExitCode(19, None, "a link between ranks failed repeatedly (a collective check): exclude "
             "both nodes' link; drain per the report", "exclude", True),
)

#: the code of an exit on a detection whose classification has no entry (``unconfirmed``:
#: the ``exit`` response without re-execution)
DEFAULT_CODE = 16

SCHEDULER_ACTIONS = ("requeue", "exclude")


def code_for(classification: str | None) -> int:
    """The exit code of an ``exit`` response to a detection of this classification.

    >>> code_for("non_deterministic"), code_for("unconfirmed"), code_for(None)
    (18, 16, 16)
    """
    for entry in EXIT_CODES:
        if entry.classification is not None and entry.classification == classification:
            return entry.code
    return DEFAULT_CODE


def describe(code: int) -> ExitCode | None:
    """The table's entry for ``code``; None for a code that is not sdc-guard's (a crash,
    a clean exit, a code another tool chose).

    >>> describe(16).drain, describe(1)
    (False, None)
    """
    return next((entry for entry in EXIT_CODES if entry.code == code), None)
