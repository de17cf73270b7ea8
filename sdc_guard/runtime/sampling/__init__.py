"""Which GEMMs to verify: all of them, or a share chosen by a promise about coverage or cost.

A *site* is where a GEMM comes from: ``(module path, phase, op)``. Samplers decide per
step whether the guard needs to see the step's GEMMs at all (``watches_step``), per call
whether to verify (``should_verify``), and learn at the end of each step (``end_step``),
so that a sampler carries its schedule across successive ``protect()`` blocks.

A step nobody watches costs nothing: the guard leaves its dispatch mode off, and the
Python dispatch mode seeing every aten op is most of what a sampled guard costs a small
model (5-10 % of a CPU step for a mode that does nothing). Each sampler's promise:

- ``Full()``: every GEMM.
- ``Rate(p, seed)``: each GEMM independently with probability ``p``, reproducible.
- ``EveryN(n)``: every GEMM of every n-th step (steps 0, n, 2n, ...); the steps in between
  are not watched.
- ``Rotating(k)``: every site at least once in every window of ``k`` consecutive steps.
- ``Budget(max_overhead, window=None)``: everything the guard adds (interception and
  verification) at or under ``max_overhead`` of the unguarded step time, spent in sweeps
  that verify every site; the first steps verify everything, to measure each site's
  cost. With ``window``, also every site at least once in every ``window`` steps.
- ``Screened(background=None)``: no GEMM on a step whose gradients look ordinary (one
  fused norm pass and one host sync per optimizer step); a step whose gradient norms
  spike or are not finite is re-executed with every GEMM verified. ``background`` (a
  ``Budget``) verifies what it chooses meanwhile, for faults too small to move a norm.
"""

from __future__ import annotations

import random
from typing import Any

import torch  # noqa: F401  (the doctests' namespace)

from .budget import Budget  # noqa: F401  (a sampler of this module's family)
from .screened import SCREEN_VERDICTS, GradientScreen, Screened, sampler_screens  # noqa: F401  (the same)
from .sampler_base import (  # noqa: F401  (the samplers' contract, importable here as before)
    SAMPLER_METHODS, STATEFUL_METHODS, Sampler, SiteKey, Stateless, StepCosts, check_sampler, sampler_shared,
    sampler_watches,
    _check_int, _check_positive_int, _check_weight,
)

class Full(Stateless):
    """Verify every GEMM.

    >>> Full().should_verify(("fc1", "forward", "addmm"))
    True
    """

    def should_verify(self, site: SiteKey) -> bool:
        return True

    def __repr__(self) -> str:
        return "Full()"


class Rate(Stateless):
    """Verify each GEMM with probability ``p``; the same seed gives the same choices.

    >>> [Rate(0.5, seed=1).should_verify(("x", "forward", "mm")) for _ in range(2)]
    [True, True]
    """

    def __init__(self, p: float, seed: int = 0) -> None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"p: expected a probability in [0, 1], got {p!r}")
        self.p = float(p)
        self.seed = _check_int("seed", seed)
        self._rng = random.Random(seed)

    def watches_step(self) -> bool:
        return self.p > 0.0

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


class EveryN(Stateless):
    """Verify every GEMM of steps 0, n, 2n, ...; the steps in between are not watched.

    >>> s = EveryN(3); s.begin_step(4); s.watches_step(), s.should_verify(("x", "forward", "mm"))
    (False, False)
    """

    def __init__(self, n: int) -> None:
        self.n = _check_positive_int("n", n)

    def watches_step(self) -> bool:
        return self.step % self.n == 0

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

    shared_schedule = True  #: every step is watched, on every rank

    def __init__(self, k: int) -> None:
        self.k = _check_positive_int("k", k)
        self.step = 0
        self._index: dict[SiteKey, int] = {}

    def begin_step(self, step: int) -> None:
        self.step = step

    def watches_step(self) -> bool:
        return True

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
