"""Structured events: one JSON line per detection, response and exit, for log shippers,
on-call tools and scheduler hooks.

Where they go is named by the user: ``protect(model, events=...)`` (a path, a text stream
or a callable), else the environment variable ``SDC_GUARD_EVENTS`` (a path, or ``-`` for
standard error). The variable is the main way: a fleet's operators set it in the job's
template (the Slurm script, the pod spec) for every job, whatever launcher or integration
runs the training, without touching its code; the argument is for code that wants a
stream or a callable of its own. A path may hold ``{rank}``, ``{local_rank}`` and
``{node}`` (one file per rank, for file systems where appends from several hosts
interleave, such as NFS); its folder is created at the first event. Each line is written
with one ``write`` on a file opened for appending, so the ranks of one node can share a
local file.

An ``EventLog`` is a sink of the guard's, like the metrics: the guard hands it each
closed step report and each step outcome where it decides them. Lines (``EVENTS``):

- ``detection``: a GEMM (or attention call, or weight) whose corruption was confirmed, on
  the rank that saw it, as soon as the step's first run closes (before any re-execution,
  so that a crash or hang during one leaves the record); ``classification`` and
  ``action`` are still null there.
- ``response``: the response every rank took, in lockstep, with the triage
  ``classification`` and ``action``; ``site`` and ``kind`` are this rank's first detection's
  (null on a rank that saw none), ``sites`` all of them.
- ``exit``: the process is about to exit with ``exit_code``; ``scheduler`` ("requeue",
  "exclude") and ``drain`` (True on a rank whose device should be taken out of service)
  come from ``exit_codes.EXIT_CODES``.

Every line carries ``version``, ``time`` (unix seconds), ``event``, ``step`` and this
process's ``identity.Identity`` (``node``, ``hostname``, ``rank``, ``local_rank``,
``world_size``, ``device``, ``device_uuid``, ``device_id``, ``pid``), and the fields
``site``, ``kind``, ``classification`` and ``action`` (null where they do not apply).

A failure to write (a full disk, an unwritable path, a closed stream, a callable that
raises) is a monitoring failure: it warns once per target and never stops training or
changes an exit code.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from .exit_codes import describe
from .identity import Identity, local_identity
from .outcome import strict_json

if TYPE_CHECKING:
    from ..report import Detection, StepReport
    from .outcome import StepOutcome

ENV_EVENTS = "SDC_GUARD_EVENTS"
#: version of the line format; a field added keeps it, a field changed or removed bumps it
EVENT_VERSION = 1
EVENTS = ("detection", "response", "exit")
#: flagged rows and segments listed per detection line (the exit report has them all)
MAX_LISTED = 16

#: targets already warned about: one warning per target per process, across the
#: ``EventLog`` objects a run makes (one per ``protect()`` block with per-step blocks)
_warned: set[str] = set()


def _target_name(target: Any) -> str:
    if isinstance(target, (str, os.PathLike)):
        return str(target)
    return getattr(target, "name", None) or f"{type(target).__name__} at {id(target):#x}"


def check_events(events: Any, name: str = "events") -> None:
    """Raise ``TypeError`` / ``ValueError`` naming ``name`` unless ``events`` is what an
    ``EventLog`` takes: a path (str or os.PathLike, ``-`` for standard error), a text
    stream (an object with ``write``), a callable taking the event's dict, or None."""
    if events is None or isinstance(events, EventLog):
        return
    if isinstance(events, (str, os.PathLike)):
        if str(events) == "":
            raise ValueError(f"{name}: expected a file path, '-' for standard error, a text stream or a "
                             f"callable, got an empty string")
        if Path(events).is_dir():
            raise ValueError(f"{name}: expected a file path, got {str(events)!r}, which is a directory")
        return
    if callable(getattr(events, "write", None)) or callable(events):
        return
    raise TypeError(f"{name}: expected a file path, '-' for standard error, a text stream, a callable taking "
                    f"each event's dict, an EventLog or None, got {type(events).__name__} {events!r}")


class EventLog:
    """Writes the structured events of a guarded run (see the module docstring).

    ``target``: a path (``{rank}``, ``{local_rank}``, ``{node}`` filled in), ``"-"``
    (standard error), a text stream or a callable taking each event's dict. ``device``:
    the device the lines name (default: ``identity.default_device()`` at the first event).

    >>> import io
    >>> stream = io.StringIO(); log = EventLog(stream, device="cpu")
    >>> log.emit("exit", step=7, exit_code=17)
    True
    >>> line = json.loads(stream.getvalue()); line["event"], line["exit_code"], line["device"]
    ('exit', 17, 'cpu')
    """

    def __init__(self, target: Any, *, device: torch.device | str | None = None) -> None:
        check_events(target, "target")
        if target is None or isinstance(target, EventLog):
            raise TypeError(f"target: expected a file path, '-', a text stream or a callable, "
                            f"got {type(target).__name__}")
        self.target = target
        self.device = device
        self._identity: Identity | None = None

    @property
    def identity(self) -> Identity:
        """This process's identity, resolved at the first event (after the process group
        and the CUDA device are set up)."""
        if self._identity is None:
            self._identity = local_identity(self.device)
        return self._identity

    # --- the guard's sink -------------------------------------------------------------------

    def observe_report(self, report: "StepReport") -> None:
        """A ``detection`` line per confirmed detection of a step's first run."""
        if report.attempt > 0:
            return  # a re-execution's detections are triage, reported in the response
        for d in report.detections:
            self.emit("detection", **_detection_fields(d), attempt=report.attempt)

    def observe_outcome(self, outcome: "StepOutcome") -> None:
        """A ``response`` line for each response taken, and an ``exit`` line before an exit."""
        if outcome.action is None:
            return
        mine = outcome.detections
        fields = {
            "step": outcome.step, "site": mine[0].site if mine else None, "kind": mine[0].kind if mine else None,
            "sites": sorted({d.site for d in mine}), "classification": outcome.classification,
            "action": outcome.action, "flagged_ranks": outcome.flagged_ranks,
            "tripped_ranks": outcome.tripped_ranks, "stepped": outcome.stepped,
            "rolled_back_to": outcome.rolled_back_to, "reruns": len(outcome.reruns), "screen": outcome.screen,
        }
        self.emit("response", **fields)
        if outcome.exit_code is not None:
            entry = describe(outcome.exit_code)
            suspect = self.identity.rank in set(outcome.flagged_ranks) | set(outcome.tripped_ranks)
            self.emit("exit", **fields, exit_code=outcome.exit_code,
                      meaning=entry.meaning if entry else None, scheduler=entry.scheduler if entry else None,
                      suspect=suspect, drain=bool(entry and entry.drain and suspect))

    # --- writing ------------------------------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> bool:
        """Write one line (``event`` is one of ``EVENTS``); True if it was written. Never
        raises for a failing target: warns once per target and returns False."""
        if event not in EVENTS:
            raise ValueError(f"event: expected one of {', '.join(EVENTS)}, got {event!r}")
        try:
            ident = self.identity
            record = {"version": EVENT_VERSION, "time": time.time(), "event": event, **ident.as_dict(),
                      "step": None, "site": None, "kind": None, "classification": None, "action": None, **fields}
            if _is_callback(self.target):
                self.target(strict_json(record))
            else:
                self._write(json.dumps(strict_json(record), allow_nan=False) + "\n", ident)
        except Exception as exc:  # monitoring never stops training
            self._warn(exc)
            return False
        return True

    def _write(self, line: str, ident: Identity) -> None:
        target = self.target
        if isinstance(target, (str, os.PathLike)):
            if str(target) == "-":
                sys.stderr.write(line)
                sys.stderr.flush()
                return
            path = Path(str(target).format(rank=ident.rank, local_rank=ident.local_rank, node=ident.node))
            path.parent.mkdir(parents=True, exist_ok=True)
            data = line.encode()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, data)  # one write: lines of several writers do not interleave
                if written != len(data):
                    raise OSError(f"short write: {written} of {len(data)} bytes")
            finally:
                os.close(fd)
            return
        target.write(line)
        flush = getattr(target, "flush", None)
        if callable(flush):
            flush()

    def _warn(self, exc: BaseException) -> None:
        name = _target_name(self.target)
        if name in _warned:
            return
        _warned.add(name)
        warnings.warn(f"sdc_guard: cannot write events to {name} ({type(exc).__name__}: {exc}); training "
                      "continues (further failures of this target are not reported)", RuntimeWarning, stacklevel=3)


def _is_callback(target: Any) -> bool:
    """A callable target (not a path, not a stream): it gets each event's dict."""
    return callable(target) and not isinstance(target, (str, os.PathLike)) and not callable(getattr(target, "write", None))


def _detection_fields(d: "Detection") -> dict[str, Any]:
    fields = asdict(d)
    fields["rows"] = d.rows[:MAX_LISTED]
    fields["segments"] = d.segments[:MAX_LISTED]
    fields["flagged_rows"] = len(d.rows)
    fields.pop("rank", None)  # the identity's rank says it
    return fields


def resolve_events(events: Any, device: torch.device | str | None = None) -> EventLog | None:
    """The ``EventLog`` for ``protect(events=...)``: ``events`` itself if it is one, a new
    one on ``events``, or (``None``) on ``$SDC_GUARD_EVENTS`` when set; else None."""
    check_events(events)
    if isinstance(events, EventLog):
        return events
    if events is None:
        events = os.environ.get(ENV_EVENTS) or None
        if events is None:
            return None
        check_events(events, ENV_EVENTS)
    return EventLog(events, device=device)
