"""``Screened``: the gradient screen, ASD mode (docs/SCREENED.md).

One of the samplers of ``sdc_guard.runtime.sampling`` (importable from there), in its own
module because it is the one that watches gradients instead of choosing GEMMs; the
per-layer statistics it compares with are ``sdc_guard.runtime.sampling.gradient_stats``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.torch_private import foreach_norm
from .budget import Budget  # noqa: F401  (the doctests' namespace)
from .gradient_stats import NO_REFERENCE, ZERO_DELTA, Deviations, NormStatistics
from .sampler_base import Sampler, SiteKey, StepCosts, check_sampler, sampler_shared, sampler_watches, _check_weight


@dataclass
class GradientScreen:
    """What the gradient screen saw at one step (``Screened.screen_gradients``)."""

    step: int
    tripped: bool  #: the statistic looked anomalous: the guard re-executes the step, verified
    #: largest per-parameter gradient norm over that parameter's typical norm (nan when a
    #: norm is not finite; compared with ``factor`` only after the warm-up)
    worst_ratio: float
    #: the norm of all gradients over that of the typical norms: below ``COLLAPSE``,
    #: the gradients collapsed (a clipping of an overflowed norm zeroes them all)
    total_ratio: float
    nonfinite: int  #: parameters whose gradient holds a NaN or an infinity
    parameters: int  #: gradients screened
    warming_up: bool  #: the statistics were still being learnt (only non-finite trips)
    #: the largest deviation of a log norm above its running mean, in running spreads
    #: (compared with ``sigmas``; 0 while warming up)
    worst_sigmas: float = 0.0
    #: the index (among the screened gradients) of the parameter with that deviation
    worst_parameter: int = -1


#: The norm of all gradients under this share of the typical norms' is a collapse.
COLLAPSE = 0.01

#: How a tripped screen was resolved (``Screened.resolve_screen``).
SCREEN_VERDICTS = ("miss", "transient", "persistent", "non_deterministic", "unresolved")


def sampler_screens(sampler: Any) -> bool:
    """Whether ``sampler`` screens gradients (has ``screen_gradients``): the guard then
    screens each optimizer step and re-executes, verified, the steps the screen trips on."""
    return callable(getattr(sampler, "screen_gradients", None)) and callable(getattr(sampler, "resolve_screen", None))


class Screened:
    """Verify no GEMM; screen the gradients instead, and re-execute a suspicious step verified.

    The front half of a silent-detection chain: after the backward and before the
    optimizer step (``Guard.optimizer_step``), the guard hands the gradients to
    ``screen_gradients``, which computes every parameter's gradient norm in one fused pass
    (``torch._foreach_norm``) and compares each with that parameter's own running
    statistics (``gradient_stats.NormStatistics``: the running mean and spread of its log
    norm, weight ``smoothing``, spread floored at ``min_spread``). The step trips when a
    norm is not finite or, after ``warmup`` steps that only learn, when some norm lies
    more than ``sigmas`` spreads above its running mean (a layer's spike measured against
    how much that layer's norm moves on its own, as torch_npu's feature-value detection
    does), or exceeds ``factor`` times its typical norm (a spike, as Megatron's
    ``is_unexpectedly_large``, whatever the spread: a ceiling for the noisiest layers), or
    when the norm of all gradients falls under ``COLLAPSE`` (a hundredth) of the typical
    norms' (a collapse: clipping an overflowed total norm zeroes every gradient). One
    host synchronisation per step, none per parameter; no dispatch mode and no GEMM check
    on the steps the screen passes.

    A tripped step is re-executed by the guard with every GEMM verified
    (``sdc_guard.respond.policy``): a corruption confirmed there is PERSISTENT; a clean
    re-execution whose gradients differ from the first run's is TRANSIENT (training goes
    on with the re-execution's gradients); identical gradients make the trip a *screen
    miss*: the statistic was legitimately unusual, counted and nothing else.

    An SDC that leaves every norm within its layer's spread passes the screen (a
    permutation of a weight gradient's rows keeps its norm exactly); that is what
    ``background`` is for: a sampler (``Budget(0.05)``) whose choices of GEMMs to verify
    are taken as they are (docs/SCREENED.md). Without one, no step is watched.

    >>> s = Screened(Budget(0.05)); s.begin_step(0); s.watches_step()
    True
    >>> s = Screened(); s.begin_step(0); s.watches_step(), s.should_verify(("fc", "forward", "mm"))
    (False, False)
    """

    def __init__(self, background: Sampler | None = None, *, sigmas: float = 6.0, factor: float = 100.0,
                 smoothing: float = 0.1, min_spread: float = 0.05, warmup: int = 10) -> None:
        if background is not None:
            check_sampler(background, "background")
            if isinstance(background, Screened):
                raise TypeError("background: expected a sampler that chooses GEMMs (Budget(0.05), Rotating(8)), "
                                "got another Screened, which would screen the same gradients twice")
        self.factor = _check_above("factor", factor, 1.0, "a number > 1 (a gradient norm above factor times "
                                   "its typical norm trips the screen)", infinite=False)
        self.sigmas = _check_above("sigmas", sigmas, 0.0, "a number > 0, or math.inf to turn the test off "
                                   "(a log norm more than sigmas running spreads above its mean trips the screen)",
                                   infinite=True)
        self.min_spread = _check_above("min_spread", min_spread, 0.0, "a number > 0 (the smallest running "
                                       "spread of a log norm: 0.05 is about 5 %)", infinite=False)
        smoothing = _check_weight("smoothing", smoothing)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup: expected a non-negative int (steps that only learn the statistics), "
                             f"got {warmup!r}")
        self.background = background
        self.smoothing = smoothing
        self.warmup = warmup
        self.step = 0
        self.trips = 0  #: steps the screen tripped on
        self.misses = 0  #: trips whose verified re-execution was identical (legitimate spikes)
        self._stats: NormStatistics | None = None  #: per-parameter running statistics
        self._shapes: list[tuple[int, ...]] | None = None  #: what the statistics are of
        self._learnt = 0  #: steps the statistics have absorbed
        self._pending: Tensor | None = None  #: the tripped step's norms, until resolved

    # --- Sampler -----------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.background is not None:
            self.background.begin_step(step)

    def watches_step(self) -> bool:
        return self.background is not None and sampler_watches(self.background)

    @property
    def shared_schedule(self) -> bool:
        """No step is watched without a background (re-executions run on every rank at
        once); with one, its schedule."""
        return self.background is None or sampler_shared(self.background)

    def should_verify(self, site: SiteKey) -> bool:
        return self.background is not None and self.background.should_verify(site)

    def end_step(self, costs: StepCosts) -> None:
        if self.background is not None:
            self.background.end_step(costs)

    @property
    def max_overhead(self) -> float | None:
        """The background's overhead budget (``Budget.max_overhead``), if it has one: what
        metrics export as the budget (the screen itself costs well under 1 %)."""
        return getattr(self.background, "max_overhead", None)

    # --- the screen ----------------------------------------------------------------------------

    @property
    def warming_up(self) -> bool:
        """True while the statistics have absorbed fewer than ``warmup`` steps."""
        return self._learnt < self.warmup

    def screen_gradients(self, grads: list[Tensor]) -> GradientScreen:
        """Screen one step's gradients (``p.grad`` of the parameters that have one).

        Norms and deviations stay on the device until one transfer of four numbers at the
        end (a tripped step, about to be re-executed, reads what it reports with a second).
        A step that passes is absorbed into the statistics at once; a tripped one waits
        for ``resolve_screen`` (a corrupted gradient must not raise the bar for the next
        one).
        """
        norms = _norms(grads)
        shapes = [tuple(g.shape) for g in grads]
        if self._stats is None or shapes != self._shapes:
            # the first step, or another set of gradients (a frozen layer thawed): learn anew
            self._stats = self._new_statistics(len(grads), norms.device)
            self._shapes, self._learnt, self._pending = shapes, 0, None
        elif self._stats.device != norms.device:  # statistics loaded from a checkpoint
            self._stats.to(norms.device)
        warming = self.warming_up
        if not grads:
            self._learnt += 1
            return GradientScreen(self.step, False, 0.0, 1.0, 0, 0, warming)
        dev = self._stats.deviations(norms)
        deviation, top, bottom, total_ratio = dev.summary.tolist()  # the step's one host synchronisation
        finite = math.isfinite(top)  # a NaN or an infinite norm makes the largest delta NaN or inf
        clean = finite and bottom > ZERO_DELTA
        tripped = not finite or (not warming and not (
            deviation <= self.sigmas and top <= math.log(self.factor) and total_ratio >= COLLAPSE))
        # no parameter has a typical norm yet (the first step): each is compared with itself
        worst_ratio = math.nan if not finite else 1.0 if top <= NO_REFERENCE else math.exp(min(top, 700.0))
        if not tripped:
            self._absorb(dev, clean=clean)
            return GradientScreen(self.step, False, worst_ratio, total_ratio, 0, len(grads), warming,
                                  0.0 if warming else deviation)
        self.trips += 1
        self._pending = dev
        nonfinite, where = torch.stack([(~torch.isfinite(norms)).sum().float(),
                                        dev.sigmas.argmax().float()]).tolist()
        return GradientScreen(self.step, True, worst_ratio, total_ratio, int(nonfinite), len(grads), warming,
                              0.0 if warming else deviation, -1 if warming else int(where))

    def resolve_screen(self, verdict: str, grads: list[Tensor] | None = None) -> None:
        """Tell the screen how its last trip was resolved: a ``"miss"`` absorbs the
        tripped step's norms into the statistics like any legitimate step's (a lasting
        change of scale widens the layer's spread and moves its mean, so that it trips
        once or twice, not at every step until a capped mean has caught up; a one-off
        outlier leaves the layer less sensitive while its spread decays back, as a layer
        that just proved unpredictable should be), ``"transient"`` absorbs those of the
        clean re-execution's ``grads``; anything else leaves the statistics as they were."""
        if verdict not in SCREEN_VERDICTS:
            raise ValueError(f"verdict: expected one of {', '.join(SCREEN_VERDICTS)}, got {verdict!r}")
        pending, self._pending = self._pending, None
        if verdict == "miss":
            self.misses += 1
            if pending is not None:
                self._absorb(pending)
        elif verdict == "transient" and grads is not None and self._stats is not None and \
                [tuple(g.shape) for g in grads] == self._shapes:
            self._absorb(self._stats.deviations(_norms(grads).to(self._stats.device)))

    def _new_statistics(self, size: int, device: torch.device | None) -> NormStatistics:
        return NormStatistics(size, smoothing=self.smoothing, min_spread=self.min_spread,
                              ready_after=max(self.warmup, 2), device=device)

    def _absorb(self, dev: Deviations, *, clean: bool = False, cap: float | None = None) -> None:
        assert self._stats is not None
        self._stats.absorb(dev, clean=clean, cap=cap)
        self._learnt += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "trips": self.trips, "misses": self.misses, "learnt": self._learnt,
            "statistics": None if self._stats is None else self._stats.state(),
            "shapes": None if self._shapes is None else [list(s) for s in self._shapes],
            "background": None if self.background is None else self.background.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.trips, self.misses, self._learnt = int(state["trips"]), int(state["misses"]), int(state["learnt"])
        self._stats = None
        if state.get("statistics") is not None:
            self._stats = NormStatistics.from_state(state["statistics"], smoothing=self.smoothing,
                                                    min_spread=self.min_spread, ready_after=max(self.warmup, 2))
        elif state.get("reference") is not None:  # saved by a version that kept one moving average
            reference = torch.tensor(state["reference"], dtype=torch.float32)
            self._stats = self._new_statistics(len(reference), None)
            self._stats.absorb(self._stats.deviations(reference))  # the typical norms carry over
            self._learnt = 0  # the spreads are learnt anew, in a warm-up of their own
        self._shapes = None if state["shapes"] is None else [tuple(s) for s in state["shapes"]]
        self._pending = None
        if self.background is not None and state.get("background") is not None:
            self.background.load_state_dict(state["background"])

    def __repr__(self) -> str:
        parts = [] if self.background is None else [repr(self.background)]
        if self.sigmas != 6.0:
            parts.append(f"sigmas={self.sigmas:g}")
        if self.factor != 100.0:
            parts.append(f"factor={self.factor:g}")
        return f"Screened({', '.join(parts)})"


def _check_above(name: str, value: object, low: float, what: str, *, infinite: bool) -> float:
    """A real number above ``low`` (and finite unless ``infinite``), else a clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__} {value!r}")
    if not (value > low and (infinite or value < math.inf)):
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return float(value)


def _norms(grads: list[Tensor]) -> Tensor:
    """Every gradient's 2-norm as one float32 vector, in one fused pass per device and dtype."""
    if not grads:
        return torch.zeros(0)
    norms = foreach_norm(grads)
    device = norms[0].device
    if all(n.device == device and n.dtype == torch.float32 for n in norms):
        return torch.stack(norms)
    return torch.stack([n.to(device, torch.float32) for n in norms])
