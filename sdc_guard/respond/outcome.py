"""What a guarded optimizer step did (``StepOutcome``), its triage classes, the errors
the ``raise`` and ``exit`` responses raise, and the exit report.

Exit codes, for the scheduler:

- ``EXIT_TRANSIENT`` (16): stopped on a detection that was not shown to be persistent;
  restarting from the last checkpoint on the same node is reasonable.
- ``EXIT_PERSISTENT`` (17): a fault reproduced on re-execution; replace this node.
- ``EXIT_NONDETERMINISTIC`` (18): re-executions disagreed; suspect the hardware or a
  non-deterministic kernel; investigate before reusing the node.
- ``EXIT_COLLECTIVE`` (19): a persistent fault in what the collectives delivered (every
  detection of the step was of kind ``"collective"``): suspect the link between the
  sending and receiving ranks the exit report names (NIC, cable, switch port), not the
  node's compute.

The report is strict JSON (RFC 8259): a non-finite number, such as the D/T ratio of a
GEMM whose output is infinite, is written as the string ``"inf"``, ``"-inf"`` or
``"nan"`` (``float()`` reads each back).
"""

from __future__ import annotations

import enum
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .exit_codes import describe

if TYPE_CHECKING:
    from ..report import Detection, StepReport

EXIT_TRANSIENT = 16
EXIT_PERSISTENT = 17
EXIT_NONDETERMINISTIC = 18  #: what each code asks of the scheduler: ``exit_codes.EXIT_CODES``
EXIT_COLLECTIVE = 19


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
    #: what the closure returned (the re-execution's, after one), its tensors detached from
    #: their autograd graph (in a tuple, list, dict or ``ModelOutput`` too), which the
    #: guard's history of outcomes would otherwise keep alive
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
    #: the process exit code of an ``exit`` response (``exit_codes.EXIT_CODES``); None otherwise
    exit_code: int | None = None

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



def write_exit_report(directory: str | os.PathLike, code: int, outcome: StepOutcome,
                      devices: list[dict[str, Any]] | None = None) -> Path:
    """Write ``sdc_guard-exit.json`` in ``directory`` (created if missing): strict JSON,
    written to a temporary file and renamed, so a reader never sees half a report.

    Besides the step, classification and detections, the report says what the scheduler
    should do (``scheduler``: "requeue" or "exclude", from ``exit_codes.EXIT_CODES``) and
    which devices: ``suspect_devices`` are the identities (``identity.Identity``: node,
    rank, local rank, device, UUID) of the ranks that flagged, out of ``devices`` (every
    rank's, in rank order; None: unknown), ``drain`` those to take out of service (empty
    for a code that does not drain) and ``exclude_nodes`` their nodes (for a code whose
    scheduler action is "exclude")."""
    entry = describe(code)
    flagged = set(outcome.flagged_ranks) | set(outcome.tripped_ranks)
    suspects = [d for d in (devices or []) if d.get("rank") in flagged]
    drain = suspects if entry is not None and entry.drain else []
    path = Path(directory) / "sdc_guard-exit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(strict_json({
        "exit_code": code, "step": outcome.step, "flagged_ranks": outcome.flagged_ranks,
        "classification": outcome.classification, "pid": os.getpid(),
        "detections": [asdict(d) for d in outcome.detections], "tripped_ranks": outcome.tripped_ranks,
        "meaning": entry.meaning if entry is not None else None,
        "scheduler": entry.scheduler if entry is not None else None,
        "suspect_devices": suspects, "drain": drain,
        "exclude_nodes": sorted({d["node"] for d in suspects}) if entry is not None and entry.scheduler == "exclude"
        else [],
    }), indent=2, allow_nan=False)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
