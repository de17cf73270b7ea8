"""The sampler contract: a site, the costs a step reports, the ``Sampler`` protocol, the
argument checks every sampler shares, and ``Stateless`` (samplers without a schedule).

The samplers themselves are in ``sdc_guard.runtime.sampling`` (``Budget`` in
``sdc_guard.runtime.sampling.budget``); this module is what they all build on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch  # noqa: F401  (the doctests' namespace)

SiteKey = tuple[str, str, str]  #: (module path, phase, op)


@dataclass
class StepCosts:
    """What a step cost, as the guard measured it: the sampler's feedback."""

    step: int
    step_seconds: float  #: wall time of the step, verification included
    verify_seconds: float
    site_seconds: dict[SiteKey, float] = field(default_factory=dict)  #: verification time per site
    site_calls: dict[SiteKey, int] = field(default_factory=dict)  #: verified calls per site
    #: everything the guard added (interception, bookkeeping, verification, a calibration
    #: replay; ``StepReport.guard_seconds``: the whole cost where ``overhead_calibrated``)
    guard_seconds: float = 0.0
    #: the part of ``guard_seconds`` a calibration replay took (``runtime.lifecycle.calibration``)
    calibration_seconds: float = 0.0


class Sampler(Protocol):
    """The interface ``Guard`` drives. ``state_dict`` makes a resumed run continue.

    ``watches_step`` is optional (a sampler without it watches every step): called after
    ``begin_step``, ``False`` promises that ``should_verify`` would refuse every GEMM of
    the step, so the guard need not intercept it.
    """

    def begin_step(self, step: int) -> None: ...
    def should_verify(self, site: SiteKey) -> bool: ...
    def end_step(self, costs: StepCosts) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


SAMPLER_METHODS = ("begin_step", "should_verify", "end_step")
STATEFUL_METHODS = ("state_dict", "load_state_dict")


def check_sampler(sampler: Any, name: str = "sampler", *, stateful: bool = False) -> Sampler:
    """Return ``sampler``, or raise ``TypeError`` naming ``name`` unless it is a sampler
    object: one with ``begin_step``, ``should_verify`` and ``end_step`` (``stateful``:
    also ``state_dict`` and ``load_state_dict``, which checkpoints need).

    >>> check_sampler("Full")
    Traceback (most recent call last):
    ...
    TypeError: sampler: expected a sampler object (with begin_step, should_verify, end_step) such as Full() or Budget(0.05), got str 'Full'
    """
    methods = SAMPLER_METHODS + (STATEFUL_METHODS if stateful else ())
    if isinstance(sampler, type):
        got = f"the class {sampler.__name__} (pass an instance: {sampler.__name__}(...))"
    elif not all(callable(getattr(sampler, m, None)) for m in methods):
        missing = [m for m in methods if not callable(getattr(sampler, m, None))]
        got = f"{type(sampler).__name__} {sampler!r}"
        if len(missing) < len(methods):
            got += f", which has no {', '.join(missing)}"
    else:
        return sampler
    raise TypeError(f"{name}: expected a sampler object (with {', '.join(methods)}) such as Full() or "
                    f"Budget(0.05), got {got}")


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return value


def _check_weight(name: str, value: object) -> float:
    """A moving average's weight: a real number in (0, 1]."""
    what = "a number in (0, 1] (the moving average's weight of the newest value)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__} {value!r}")
    if not 0 < value <= 1:
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return float(value)


def sampler_watches(sampler: Sampler) -> bool:
    """``sampler.watches_step()``; a sampler without that method watches every step."""
    watches = getattr(sampler, "watches_step", None)
    return True if watches is None else bool(watches())


def sampler_shared(sampler: Sampler) -> bool:
    """Whether ``sampler`` watches the same steps on every rank of a job
    (``shared_schedule``; a sampler that does not say is assumed not to): the collective
    checks need every rank of a group to check the same collectives
    (``runtime/collectives/collective_checks.py``), so they run only under such a sampler.

    >>> from sdc_guard.runtime.sampling import Budget, EveryN
    >>> sampler_shared(EveryN(4)), sampler_shared(Budget(0.05))
    (True, False)
    """
    return bool(getattr(sampler, "shared_schedule", False))


class Stateless:
    """Base for samplers whose only state is the step they are on."""

    step = 0
    #: the watched steps depend on the step number alone: the same on every rank
    shared_schedule = True

    def begin_step(self, step: int) -> None:
        self.step = step

    def watches_step(self) -> bool:
        return True

    def end_step(self, costs: StepCosts) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value
