"""Which GEMMs to verify: all of them, or a share chosen by a promise about coverage or cost.

A *site* is where a GEMM comes from: ``(module path, phase, op)``. Samplers decide per
call (``should_verify``) and learn at the end of each step (``end_step``), so that a
sampler carries its schedule across successive ``protect()`` blocks. Each sampler's
promise:

- ``Full()``: every GEMM.
- ``Rate(p, seed)``: each GEMM independently with probability ``p``, reproducible.
- ``EveryN(n)``: every GEMM of every n-th step (steps 0, n, 2n, ...), none in between.
- ``Rotating(k)``: every site at least once in every window of ``k`` consecutive steps.
- ``Budget(max_overhead)``: verification time at or under ``max_overhead`` of the step
  time without verification, spending it on the sites verified longest ago; the first
  step verifies everything, to measure each site's cost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

SiteKey = tuple[str, str, str]  #: (module path, phase, op)


@dataclass
class StepCosts:
    """What a step cost, as the guard measured it: the sampler's feedback."""

    step: int
    step_seconds: float  #: wall time of the step, verification included
    verify_seconds: float
    site_seconds: dict[SiteKey, float] = field(default_factory=dict)  #: verification time per site
    site_calls: dict[SiteKey, int] = field(default_factory=dict)  #: verified calls per site


class Sampler(Protocol):
    """The interface ``Guard`` drives. ``state_dict`` makes a resumed run continue."""

    def begin_step(self, step: int) -> None: ...
    def should_verify(self, site: SiteKey) -> bool: ...
    def end_step(self, costs: StepCosts) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Stateless:
    """Base for samplers whose only state is the step they are on."""

    step = 0

    def begin_step(self, step: int) -> None:
        self.step = step

    def end_step(self, costs: StepCosts) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class Full(_Stateless):
    """Verify every GEMM.

    >>> Full().should_verify(("fc1", "forward", "addmm"))
    True
    """

    def should_verify(self, site: SiteKey) -> bool:
        return True

    def __repr__(self) -> str:
        return "Full()"


class Rate(_Stateless):
    """Verify each GEMM with probability ``p``; the same seed gives the same choices.

    >>> [Rate(0.5, seed=1).should_verify(("x", "forward", "mm")) for _ in range(2)]
    [True, True]
    """

    def __init__(self, p: float, seed: int = 0) -> None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"p: expected a probability in [0, 1], got {p!r}")
        self.p = float(p)
        self.seed = seed
        self._rng = random.Random(seed)

    def should_verify(self, site: SiteKey) -> bool:
        return self._rng.random() < self.p

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng": self._rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        rng = state["rng"]
        self._rng.setstate((rng[0], tuple(rng[1]), rng[2]))

    def __repr__(self) -> str:
        return f"Rate({self.p}, seed={self.seed})"


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


class EveryN(_Stateless):
    """Verify every GEMM of steps 0, n, 2n, ...; nothing in between.

    >>> s = EveryN(3); s.begin_step(4); s.should_verify(("x", "forward", "mm"))
    False
    """

    def __init__(self, n: int) -> None:
        self.n = _check_positive_int("n", n)

    def should_verify(self, site: SiteKey) -> bool:
        return self.step % self.n == 0

    def __repr__(self) -> str:
        return f"EveryN({self.n})"


class Rotating:
    """Verify each site once in every window of ``k`` steps, a fixed share per step.

    Sites are numbered in order of first appearance; site ``i`` is verified on the steps
    ``s`` with ``s % k == i % k``, so any ``k`` consecutive steps cover every residue and
    each step verifies about ``1/k`` of the sites. A site is also verified on the step it
    first appears (its first window starts there).

    >>> r = Rotating(2); r.begin_step(0); r.should_verify(("a", "forward", "mm"))
    True
    """

    def __init__(self, k: int) -> None:
        self.k = _check_positive_int("k", k)
        self.step = 0
        self._index: dict[SiteKey, int] = {}

    def begin_step(self, step: int) -> None:
        self.step = step

    def should_verify(self, site: SiteKey) -> bool:
        if site not in self._index:
            self._index[site] = len(self._index) % self.k
            return True
        return self.step % self.k == self._index[site]

    def end_step(self, costs: StepCosts) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "index": [[list(site), i] for site, i in self._index.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self._index = {tuple(site): int(i) for site, i in state["index"]}

    def __repr__(self) -> str:
        return f"Rotating({self.k})"


class Budget:
    """Keep verification time at or under ``max_overhead`` of the unverified step time.

    A token bucket: every step earns ``max_overhead`` times the moving average of the
    step time without verification; the plan spends it on sites in order of staleness
    (steps since last verified), stopping at the first site it cannot afford; the time
    really spent is charged at the end of the step. So the long-run overhead is the
    budget, and every site comes round: with a full-verification overhead ``F``, each
    site is verified about every ``F / max_overhead`` steps.

    Costs are robust to a noisy machine: each site's *relative* cost is the minimum of its
    measurements during the ``warmup`` steps (which verify everything and are not
    charged; first calls pay one-off costs), and one global factor, a moving average of
    measured over predicted time across all verified sites, scales them. A timing spike
    therefore moves the whole plan for a few steps instead of pricing one site out of the
    schedule. A site first met after warm-up is verified at once and charged.

    >>> b = Budget(0.05); b.begin_step(0); b.should_verify(("a", "forward", "mm"))
    True
    """

    def __init__(self, max_overhead: float, *, smoothing: float = 0.3, warmup: int = 2) -> None:
        if isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float)) or not 0 < max_overhead:
            raise ValueError(f"max_overhead: expected a positive fraction (0.05 = 5 %), got {max_overhead!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing: expected a value in (0, 1], got {smoothing!r}")
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
        self._base_seconds: float | None = None
        self._credit = 0.0
        self._plan: set[SiteKey] = set()
        self._verify_total = 0.0
        self._base_total = 0.0
        self._completed = -1

    @property
    def warming_up(self) -> bool:
        """True during the first ``warmup`` steps, which verify everything."""
        return self._steps_done < self.warmup

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def begin_step(self, step: int) -> None:
        self.step = step
        self._plan = set() if self.warming_up else self._make_plan()

    def _make_plan(self) -> set[SiteKey]:
        assert self._base_seconds is not None
        earned = self.max_overhead * self._base_seconds
        cap = max(self._scale * sum(self._cost.values()), earned)
        self._credit = min(self._credit + earned, cap)
        plan: set[SiteKey] = set()
        spent = 0.0
        for site in sorted(self._cost, key=lambda s: (self._last.get(s, -1), s)):
            cost = self._scale * self._cost[site]
            if spent + cost > self._credit:
                break
            plan.add(site)
            spent += cost
        return plan

    def should_verify(self, site: SiteKey) -> bool:
        return self.warming_up or site not in self._cost or site in self._plan

    def end_step(self, costs: StepCosts) -> None:
        base = max(costs.step_seconds - costs.verify_seconds, 1e-9)
        warm = self.warming_up
        self._steps_done += 1
        self._completed = costs.step
        self._learn_costs(costs.site_seconds, warm)
        for site in costs.site_seconds:
            self._last[site] = costs.step
        self._base_seconds = base if warm else self._ema(self._base_seconds, base)
        if warm:
            return
        self._credit -= costs.verify_seconds
        self._verify_total += costs.verify_seconds
        self._base_total += base

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
        """Total verification time over total step time without it, after warm-up."""
        return self._verify_total / self._base_total if self._base_total else 0.0

    def coverage(self, window: int) -> float:
        """Share of known sites verified within the last ``window`` completed steps."""
        if not self._cost:
            return 0.0
        recent = sum(1 for s in self._cost if self._completed - self._last.get(s, -(10**9)) < window)
        return recent / len(self._cost)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "steps_done": self._steps_done, "scale": self._scale,
            "base_seconds": self._base_seconds, "credit": self._credit,
            "cost": [[list(s), c] for s, c in self._cost.items()],
            "last": [[list(s), i] for s, i in self._last.items()],
            "verify_total": self._verify_total, "base_total": self._base_total,
            "completed": self._completed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self._steps_done = int(state["steps_done"])
        self._scale = float(state["scale"])
        self._base_seconds = state["base_seconds"]
        self._credit = float(state["credit"])
        self._cost = {tuple(s): float(c) for s, c in state["cost"]}
        self._last = {tuple(s): int(i) for s, i in state["last"]}
        self._verify_total = float(state["verify_total"])
        self._base_total = float(state["base_total"])
        self._completed = int(state["completed"])

    def __repr__(self) -> str:
        return f"Budget({self.max_overhead})"
