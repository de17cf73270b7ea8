"""``Budget``: verify as much as a cost budget allows, in sweeps that cover every site.

One of the samplers of ``sdc_guard.runtime.sampling`` (importable from there), in its own
module because it is the one with a control loop: it learns each site's cost and the
unguarded step time, and spends the budget on whole sweeps.
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (the doctests' namespace)

from .sampler_base import SiteKey, StepCosts, _check_positive_int, _check_weight

class Budget:
    """Keep what the guard adds to a step at or under ``max_overhead`` of the unguarded step.

    What the guard adds is interception (a dispatch mode seeing every op of a watched
    step, and what that does to the model's own ops) as well as verification, and on a
    small model interception alone can exceed a 5 % budget. So the budget is spent in
    *sweeps*: a token bucket earns, every step, ``max_overhead`` times the moving average
    of the step time of unwatched steps; once the credit covers what a sweep costs, the
    next step is watched and verifies every known site, and is charged what it really
    cost: its wall time over the unguarded step (never less than the guard's own account
    of it, ``StepCosts.guard_seconds``, which includes a calibration replay if the step
    ran one). What a sweep costs is learned the same way: first the guard's own account of
    the last warm-up step (a full sweep; the whole cost where the guard calibrates), then
    the moving average of what sweeps were charged (a calibration replay's share left
    out: it is rare); never less than the verification of every site at its measured
    cost. No sweep comes before an unwatched step has measured the base. Unwatched steps run
    no mode and no hook; what the guard still does in them (the step's bookkeeping, the
    re-encoding after a sweep) is in their ``guard_seconds``, which is charged, and kept
    out of the base. With a full sweep costing ``F`` of a step, every site is verified
    about every ``F / max_overhead`` steps, and the long-run overhead is the budget.

    Costs are robust to a noisy machine: each site's *relative* cost is the minimum of its
    measurements during the ``warmup`` steps (which verify everything and are not
    charged; first calls pay one-off costs, and the guard's first calibration replays run
    there), and one global factor, a moving average of measured over predicted time
    across all verified sites, scales them. A timing spike therefore moves the whole plan
    for a few steps instead of pricing one site out of the schedule. A site first met
    after warm-up is verified at once and charged.

    ``window`` (optional) turns the coverage into a promise, and **the window wins over
    the budget**: a sweep is also taken whenever a known site would otherwise go
    ``window`` consecutive steps unverified, so every site is verified at least once in
    every ``window`` steps, credit or not. Where a sweep costs more than
    ``window * max_overhead`` of a step (a slow backend, a tiny model), the overhead is
    then a sweep every ``window`` steps, above the budget (``achieved_overhead`` and
    ``window_bound`` say so); without ``window`` the budget holds and the coverage
    stretches instead.

    >>> b = Budget(0.05, window=20); b.begin_step(0); b.watches_step(), b.should_verify(("a", "forward", "mm"))
    (True, True)
    """

    #: the sweeps follow this rank's own measured costs: ranks watch different steps
    shared_schedule = False

    def __init__(self, max_overhead: float, *, window: int | None = None, smoothing: float = 0.3,
                 warmup: int = 3) -> None:
        if isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float)) or \
                not 0 < max_overhead < float("inf"):
            raise ValueError(f"max_overhead: expected a positive fraction (0.05 = 5 %), got {max_overhead!r}")
        self.window = None if window is None else _check_positive_int("window", window)
        smoothing = _check_weight("smoothing", smoothing)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup: expected a positive int, got {warmup!r}")
        self.max_overhead = float(max_overhead)
        self.smoothing = smoothing
        self.warmup = warmup
        self.step = 0
        self._steps_done = 0
        self._cost: dict[SiteKey, float] = {}  #: relative cost (seconds at scale 1)
        self._scale = 1.0
        self._last: dict[SiteKey, int] = {}
        self._base_seconds: float | None = None  #: moving average of an unguarded step
        self._base_measured = False  #: whether an unwatched step has measured it yet
        #: moving average of what a sweep costs, all of it (None: none measured yet)
        self._sweep_seconds: float | None = None
        self._credit = 0.0
        self._sweep = False
        self._charged_total = 0.0
        self._base_total = 0.0
        self._completed = -1

    @property
    def warming_up(self) -> bool:
        """True during the first ``warmup`` steps, which verify everything."""
        return self._steps_done < self.warmup

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    @property
    def _sweep_cost(self) -> float:
        """Predicted seconds of a sweep over every known site, all it costs: what sweeps
        were charged, never less than their verification at the sites' measured costs."""
        verification = self._scale * sum(self._cost.values())
        return max(verification, self._sweep_seconds or 0.0)

    @property
    def window_bound(self) -> bool:
        """Whether ``window`` forces sweeps the budget alone would not allow (a sweep
        costs more than ``window * max_overhead`` of a step): the overhead is then above
        the budget, by the window's choice."""
        if self.window is None or self._base_seconds is None:
            return False
        return self._sweep_cost > self.window * self.max_overhead * self._base_seconds

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.warming_up:
            self._sweep = True
            return
        assert self._base_seconds is not None
        earned = self.max_overhead * self._base_seconds
        self._credit = min(self._credit + earned, max(self._sweep_cost, earned))
        # no sweep before an unwatched step has measured the base (and so what a sweep costs)
        self._sweep = (self._base_measured and self._credit >= self._sweep_cost) or self._window_due(step)

    def _window_due(self, step: int) -> bool:
        """Whether some known site was last verified ``window`` steps ago (or longer)."""
        return self.window is not None and bool(self._last) and step - min(self._last.values()) >= self.window

    def watches_step(self) -> bool:
        return self._sweep

    def should_verify(self, site: SiteKey) -> bool:
        return self._sweep or site not in self._cost

    def end_step(self, costs: StepCosts) -> None:
        watched = self._sweep
        warm = self.warming_up
        self._steps_done += 1
        self._completed = costs.step
        self._learn_costs(costs.site_seconds, warm)
        for site in costs.site_seconds:
            self._last[site] = costs.step
        added = max(costs.verify_seconds, costs.guard_seconds)  # what the guard's own account says it added
        if warm:
            # no unwatched step yet: the step less what the guard added stands in for the base,
            # and what the guard added (less a calibration replay) for a sweep's cost
            self._base_seconds = self._ema(self._base_seconds, max(costs.step_seconds - added, 1e-9))
            # (the last warm-up step's: warm, and calibrated where the guard replays)
            self._sweep_seconds = max(added - costs.calibration_seconds, 0.0)
            return
        assert self._base_seconds is not None
        if not watched:
            # an unwatched step runs no mode and verifies nothing, but may carry the guard's
            # work after the sweep before it (re-encoding the updated weights): that is
            # charged, and kept out of the base
            seconds = max(costs.step_seconds - costs.guard_seconds, 1e-9)
            self._base_seconds = self._ema(self._base_seconds if self._base_measured else None, seconds)
            self._base_measured = True
        else:
            # a watched step less what the guard added bounds the unguarded step from above: a
            # base learned in a slow spell comes down even if every step is watched
            self._base_seconds = min(self._base_seconds, max(costs.step_seconds - added, 1e-9))
        charge = max(costs.step_seconds - self._base_seconds, added) if watched else costs.guard_seconds
        if watched:
            self._sweep_seconds = self._ema(self._sweep_seconds, max(charge - costs.calibration_seconds, 0.0))
        self._credit -= charge
        self._charged_total += charge
        self._base_total += self._base_seconds

    def _learn_costs(self, measured: dict[SiteKey, float], warm: bool) -> None:
        if warm:
            for site, seconds in measured.items():
                self._cost[site] = min(seconds, self._cost.get(site, seconds))
            return
        known = [s for s in measured if s in self._cost]
        predicted = sum(self._cost[s] for s in known)
        if predicted > 0:
            self._scale = self._ema(self._scale, sum(measured[s] for s in known) / predicted)
        for site in measured:
            if site not in self._cost:
                self._cost[site] = measured[site] / self._scale

    @property
    def achieved_overhead(self) -> float:
        """Everything charged (the whole measured cost of watched steps, the guard's own
        work in unwatched ones) over the unguarded step time of the same steps, after
        warm-up."""
        return self._charged_total / self._base_total if self._base_total else 0.0

    def coverage(self, window: int) -> float:
        """Share of known sites verified within the last ``window`` completed steps."""
        if not self._cost:
            return 0.0
        recent = sum(1 for s in self._cost if self._completed - self._last.get(s, -(10**9)) < window)
        return recent / len(self._cost)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "steps_done": self._steps_done, "scale": self._scale,
            "base_seconds": self._base_seconds, "base_measured": self._base_measured,
            "sweep_seconds": self._sweep_seconds, "credit": self._credit,
            "cost": [[list(s), c] for s, c in self._cost.items()],
            "last": [[list(s), i] for s, i in self._last.items()],
            "charged_total": self._charged_total, "base_total": self._base_total,
            "completed": self._completed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self._steps_done = int(state["steps_done"])
        self._scale = float(state["scale"])
        self._base_seconds = state["base_seconds"]
        self._base_measured = bool(state.get("base_measured", False))
        sweep = state.get("sweep_seconds")
        self._sweep_seconds = None if sweep is None else float(sweep)
        self._credit = float(state["credit"])
        self._cost = {tuple(s): float(c) for s, c in state["cost"]}
        self._last = {tuple(s): int(i) for s, i in state["last"]}
        self._charged_total = float(state.get("charged_total", state.get("verify_total", 0.0)))
        self._base_total = float(state["base_total"])
        self._completed = int(state["completed"])

    def __repr__(self) -> str:
        return f"Budget({self.max_overhead:g})" if self.window is None else \
            f"Budget({self.max_overhead:g}, window={self.window})"
