"""Where a guard's reports and outcomes go: the metrics sink and the event log, each
failure a warning given once (monitoring never stops training).

A part of the guard (``sdc_guard.runtime.lifecycle.guard``), kept apart because it is the
one place the guard hands anything to the outside; the warn-once state lives with the
owner (``warn_once.py``), since the documented per-step pattern makes a new guard every
step.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .checks import MetricsSink
from .warn_once import warn_once


class Publisher:
    """Hands ``model``'s reports and outcomes to ``metrics`` and ``events`` (either may be
    ``None``) and gives the guard's warn-once warnings."""

    def __init__(self, model: nn.Module, metrics: MetricsSink | None, events: Any) -> None:
        self._model = model
        self._sinks = (metrics, events)  # the event log warns for its own target
        self._warned: set[str] = set()  #: keys warned for an owner that cannot be weakly referenced

    def publish(self, method: str, item: Any) -> None:
        """Hand a report or outcome to the metrics sink and the event log (``method``:
        ``"observe_report"`` or ``"observe_outcome"``); a failure there warns once per
        sink in total, across the per-step ``protect()`` blocks that share it."""
        for sink in self._sinks:
            if sink is None:
                continue
            try:
                getattr(sink, method)(item)
            except Exception as exc:  # monitoring never stops training
                self.warn_once("metrics", f"sdc_guard: metrics {method} failed ({type(exc).__name__}: "
                               f"{exc}); training continues (further failures of this sink are not reported)",
                               owner=sink)

    def warn_once(self, key: str, message: str, *, owner: Any = None) -> None:
        """Warn once per ``key`` and ``owner`` (default: the model), at the caller's caller."""
        warn_once(self._model if owner is None else owner, key, message, fallback=self._warned, stacklevel=4)
