"""The open step's gradient screen (``sampling.Screened``): run once, kept for the report.

A part of the guard's step (``sdc_guard.runtime.lifecycle.guard``), kept apart because it
has a state of its own, which the rest of the step never reads: whether the step was
screened (or tried to be), and what the screen saw, until the step's report takes it.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from ...report import StepReport
from ..sampling import GradientScreen, Sampler, sampler_screens

#: ``warn(key, message)``: the guard's warn-once (a monitoring failure warns once)
Warn = Callable[[str, str], None]


class GradientScreening:
    """Screens the open step's gradients for a screening sampler and fills its report."""

    def __init__(self, warn: Warn) -> None:
        self._warn = warn
        self._screen: GradientScreen | None = None  #: what the open step's screen saw
        self._tried = False  #: the open step was screened, or tried to be, or cannot be

    def reset(self) -> None:
        """A step opens: nothing screened yet."""
        self._screen, self._tried = None, False

    def excuse(self) -> None:
        """The step cannot be screened for a reason of its own (its closure raised): its
        report does not warn that nobody called the screen."""
        self._tried = True

    def screen(self, sampler: Sampler, params: list[Tensor]) -> GradientScreen | None:
        """Screen the gradients of ``params`` with ``sampler`` (a screening one); a failure
        warns once and leaves the step unscreened (``None``): it never stops training."""
        self._tried = True
        grads = [p.grad for p in params if p.grad is not None]
        try:
            self._screen = sampler.screen_gradients(grads)  # type: ignore[attr-defined]
        except Exception as exc:
            self._warn(f"screen:{type(exc).__name__}", f"sdc_guard: could not screen the gradients "
                       f"({type(exc).__name__}: {exc}); this step is not screened")
            return None
        return self._screen

    def into(self, report: StepReport, sampler: Sampler) -> None:
        """Put what the screen saw into the first run's ``report``; warn once when
        ``sampler`` screens but nothing ran the screen (a step closed without
        ``optimizer_step``)."""
        if report.attempt != 0:
            return
        if not self._tried and sampler_screens(sampler):
            self._warn("unscreened", "sdc_guard: the sampler screens gradients, but only "
                       "guard.optimizer_step(optimizer, closure) runs the screen; steps closed by "
                       "guard.step() or a protect() block are not screened (only the sampler's "
                       "background verifies anything)")
        screened = self._screen
        if screened is not None:
            report.gradient_screened = True
            report.gradient_screen_tripped = screened.tripped
            report.gradient_ratio = screened.worst_ratio
            report.gradient_total_ratio = screened.total_ratio
            report.gradient_sigmas = screened.worst_sigmas
            report.nonfinite_grads = screened.nonfinite
