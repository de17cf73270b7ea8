"""``Screened``: the gradient screen, ASD mode (docs/SCREENED.md).

One of the samplers of ``sdc_guard.runtime.sampling`` (importable from there), in its own
module because it is the one that watches gradients instead of choosing GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .budget import Budget  # noqa: F401  (the doctests' namespace)
from .sampler_base import Sampler, SiteKey, StepCosts, check_sampler, sampler_watches, _check_weight


@dataclass
class GradientScreen:
    """What the gradient screen saw at one step (``Screened.screen_gradients``)."""

    step: int
    tripped: bool  #: the statistic looked anomalous: the guard re-executes the step, verified
    #: largest per-parameter gradient norm over that parameter's reference (nan when a norm
    #: is not finite; compared with ``factor`` only after the warm-up)
    worst_ratio: float
    #: the norm of all gradients over that of the references: below ``1 / factor**2``, the
    #: gradients collapsed (a clipping of an overflowed norm zeroes them all)
    total_ratio: float
    nonfinite: int  #: parameters whose gradient holds a NaN or an infinity
    parameters: int  #: gradients screened
    warming_up: bool  #: the reference was still being learnt (only non-finite trips)


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
    (``torch._foreach_norm``) and compares each with its reference, an exponential moving
    average of that parameter's past norms (weight ``smoothing``). The step trips when a
    norm is not finite or, after ``warmup`` steps that only learn the reference, when
    some norm exceeds ``factor`` times its reference (a spike, as Megatron's
    ``is_unexpectedly_large``), or when the norm of all gradients falls under
    ``1 / factor**2`` of the references' (a collapse: clipping an overflowed total norm
    zeroes every gradient). One host synchronisation per step, none per parameter; no
    dispatch mode and no GEMM check on the steps the screen passes.

    A tripped step is re-executed by the guard with every GEMM verified
    (``sdc_guard.respond.policy``): a corruption confirmed there is PERSISTENT; a clean
    re-execution whose gradients differ from the first run's is TRANSIENT (training goes
    on with the re-execution's gradients); identical gradients make the trip a *screen
    miss*: the statistic was legitimately unusual, counted and nothing else.

    An SDC too small to move a gradient norm ``factor``-fold passes the screen; that is
    what ``background`` is for: a sampler (``Budget(0.05)``) whose choices of GEMMs to
    verify are taken as they are (docs/SCREENED.md). Without one, no step is watched.

    >>> s = Screened(Budget(0.05)); s.begin_step(0); s.watches_step()
    True
    >>> s = Screened(); s.begin_step(0); s.watches_step(), s.should_verify(("fc", "forward", "mm"))
    (False, False)
    """

    def __init__(self, background: Sampler | None = None, *, factor: float = 10.0, smoothing: float = 0.1,
                 warmup: int = 5) -> None:
        if background is not None:
            check_sampler(background, "background")
            if isinstance(background, Screened):
                raise TypeError("background: expected a sampler that chooses GEMMs (Budget(0.05), Rotating(8)), "
                                "got another Screened, which would screen the same gradients twice")
        what = "a number > 1 (a gradient norm above factor times its reference trips the screen)"
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"factor: expected {what}, got {type(factor).__name__} {factor!r}")
        if not 1 < factor < float("inf"):
            raise ValueError(f"factor: expected {what}, got {factor!r}")
        smoothing = _check_weight("smoothing", smoothing)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup: expected a non-negative int (steps that only learn the reference), "
                             f"got {warmup!r}")
        self.background = background
        self.factor = float(factor)
        self.smoothing = smoothing
        self.warmup = warmup
        self.step = 0
        self.trips = 0  #: steps the screen tripped on
        self.misses = 0  #: trips whose verified re-execution was identical (legitimate spikes)
        self._reference: Tensor | None = None  #: per-parameter EMA of gradient norms (float32)
        self._shapes: list[tuple[int, ...]] | None = None  #: what the reference is of
        self._learnt = 0  #: steps the reference has absorbed
        self._pending: Tensor | None = None  #: the tripped step's norms, until resolved

    # --- Sampler -----------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.background is not None:
            self.background.begin_step(step)

    def watches_step(self) -> bool:
        return self.background is not None and sampler_watches(self.background)

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
        """True while the reference has absorbed fewer than ``warmup`` steps."""
        return self._learnt < self.warmup

    def screen_gradients(self, grads: list[Tensor]) -> GradientScreen:
        """Screen one step's gradients (``p.grad`` of the parameters that have one).

        Norms, ratios and the non-finite count stay on the device until one transfer of
        two numbers at the end. A step that passes is absorbed into the reference at
        once; a tripped one waits for ``resolve_screen`` (a corrupted gradient must not
        raise the bar for the next one).
        """
        norms = _norms(grads)
        shapes = [tuple(g.shape) for g in grads]
        if self._reference is None or shapes != self._shapes:
            # the first step, or another set of gradients (a frozen layer thawed): learn anew
            self._reference, self._shapes, self._learnt = norms.clone(), shapes, 0
            self._pending = None
        elif self._reference.device != norms.device:  # a reference loaded from a checkpoint
            self._reference = self._reference.to(norms.device)
        tiny = torch.finfo(torch.float32).tiny
        ratio = norms / self._reference.clamp_min(tiny)
        total = torch.linalg.vector_norm(norms) / torch.linalg.vector_norm(self._reference).clamp_min(tiny)
        nonfinite = (~torch.isfinite(norms)).sum()
        worst, total_ratio, bad = torch.stack([ratio.max(), total, nonfinite.to(ratio.dtype)]).tolist() \
            if len(grads) else (0.0, 1.0, 0.0)  # the step's one host synchronisation
        warming = self.warming_up
        tripped = bad > 0 or (not warming and not (worst <= self.factor and total_ratio * self.factor ** 2 >= 1))
        if tripped:
            self.trips += 1
            self._pending = norms
        else:
            self._absorb(norms)
        return GradientScreen(self.step, tripped, worst, total_ratio, int(bad), len(grads), warming)

    def resolve_screen(self, verdict: str, grads: list[Tensor] | None = None) -> None:
        """Tell the screen how its last trip was resolved: a ``"miss"`` absorbs the
        tripped step's norms into the reference, each capped at ``factor`` times its
        reference (the values were legitimate: a lasting change of scale must not trip
        every step, nor a one-off spike the steps after it), ``"transient"`` absorbs those of the
        clean re-execution's ``grads``; anything else leaves the reference as it was."""
        if verdict not in SCREEN_VERDICTS:
            raise ValueError(f"verdict: expected one of {', '.join(SCREEN_VERDICTS)}, got {verdict!r}")
        pending, self._pending = self._pending, None
        if verdict == "miss":
            self.misses += 1
            if pending is not None:
                self._absorb(pending)
        elif verdict == "transient" and grads is not None and self._reference is not None and \
                [tuple(g.shape) for g in grads] == self._shapes:
            self._absorb(_norms(grads))

    def _absorb(self, norms: Tensor) -> None:
        assert self._reference is not None
        finite = torch.isfinite(norms)  # a legitimate overflow must not poison the reference
        if self._learnt == 0:
            self._reference = torch.where(finite, norms, self._reference)
        else:
            # a legitimate spike moves the reference by at most factor * smoothing of itself:
            # a one-off outlier batch must not make the ordinary steps after it look collapsed
            capped = torch.minimum(norms, self._reference * self.factor)
            self._reference = torch.where(finite, torch.lerp(self._reference, capped, self.smoothing), self._reference)
        self._learnt += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "trips": self.trips, "misses": self.misses, "learnt": self._learnt,
            "reference": None if self._reference is None else self._reference.tolist(),
            "shapes": None if self._shapes is None else [list(s) for s in self._shapes],
            "background": None if self.background is None else self.background.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.trips, self.misses, self._learnt = int(state["trips"]), int(state["misses"]), int(state["learnt"])
        ref = state["reference"]
        self._reference = None if ref is None else torch.tensor(ref, dtype=torch.float32)
        self._shapes = None if state["shapes"] is None else [tuple(s) for s in state["shapes"]]
        self._pending = None
        if self.background is not None and state.get("background") is not None:
            self.background.load_state_dict(state["background"])

    def __repr__(self) -> str:
        inner = "" if self.background is None else repr(self.background)
        extra = "" if self.factor == 10.0 else f"{', ' if inner else ''}factor={self.factor:g}"
        return f"Screened({inner}{extra})"


def _norms(grads: list[Tensor]) -> Tensor:
    """Every gradient's 2-norm as one float32 vector, in one fused pass per device and dtype."""
    if not grads:
        return torch.zeros(0)
    norms = torch._foreach_norm(grads)
    device = norms[0].device
    if all(n.device == device and n.dtype == torch.float32 for n in norms):
        return torch.stack(norms)
    return torch.stack([n.to(device, torch.float32) for n in norms])
