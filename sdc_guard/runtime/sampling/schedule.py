"""The schedule's clock: the step number of each model, shared by every ``protect()`` block.

Per-step blocks (``with protect(model):`` around each step) make a new ``Guard`` every
step; the sampler's schedule (``EveryN``, ``Budget`` windows) and the fault drills count
steps, so the count lives with the model, not with a guard. A ``torch.compile(model)``
wrapper and the model it wraps are one model here: a guard of one and a drill of the
other (``SDCGuard`` protects the module Lightning unwraps) count the same steps.
"""

from __future__ import annotations

import weakref

import torch  # noqa: F401  (the doctests' namespace)
from torch import nn

#: Next step number per model, so per-step ``protect()`` blocks continue one schedule.
_next_step: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def current_step(model: nn.Module) -> int:
    """The step number ``protect(model)`` is on (or opens next): the schedule's clock.

    >>> current_step(torch.nn.Linear(2, 2))
    0
    """
    return _next_step.get(_model(model), 0)


def set_current_step(model: nn.Module, step: int) -> None:
    """Set the step number of ``model``'s schedule (a resumed run continues its count)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    _next_step[_model(model)] = step


def _model(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper wraps (``_orig_mod``), or ``model``."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


#: Per model: (the sampler, the step number) whose ``begin_step`` ran and whose
#: ``end_step`` has not: the step ``optimizer_step`` opened ahead and a ``protect()``
#: block then dropped unreported is begun already when the next block opens it again.
_begun: "weakref.WeakKeyDictionary[nn.Module, tuple[int, int]]" = weakref.WeakKeyDictionary()


def sampler_begun(model: nn.Module, sampler: object, step: int) -> bool:
    """Whether ``sampler.begin_step(step)`` ran for ``model`` without its ``end_step``
    (a sampler that earns per step, ``Budget``, must not earn twice for one step).

    >>> m = torch.nn.Linear(2, 2); s = object(); note_sampler_begun(m, s, 3)
    >>> sampler_begun(m, s, 3), sampler_begun(m, s, 4)
    (True, False)
    """
    return _begun.get(_model(model)) == (id(sampler), step)


def note_sampler_begun(model: nn.Module, sampler: object, step: int | None) -> None:
    """Record that ``sampler.begin_step(step)`` ran for ``model`` (``None``: its
    ``end_step`` ran, nothing is begun)."""
    if step is None:
        _begun.pop(_model(model), None)
    else:
        _begun[_model(model)] = (id(sampler), step)


#: Per model: guard seconds spent after its last report by a ``protect()`` block that has
#: exited (re-encoding the weights an optimizer step wrote, the responder's bookkeeping):
#: with one block per step the next report is another guard's, which takes them.
_carried: "weakref.WeakKeyDictionary[nn.Module, float]" = weakref.WeakKeyDictionary()


def carry_over(model: nn.Module, seconds: float) -> None:
    """Leave ``seconds`` of guard work for the next report of ``model``, whichever guard
    makes it."""
    if seconds > 0:
        _carried[_model(model)] = _carried.get(_model(model), 0.0) + seconds


def take_carried(model: nn.Module) -> float:
    """The guard seconds ``carry_over`` left for ``model`` (0.0 if none), now taken.

    >>> m = torch.nn.Linear(2, 2); carry_over(m, 0.25); carry_over(m, 0.5)
    >>> take_carried(m), take_carried(m)
    (0.75, 0.0)
    """
    return _carried.pop(_model(model), 0.0)


#: Models whose last ``optimizer_step`` was the last thing its ``protect()`` block did
#: (the step ``optimizer_step`` opens in advance was dropped when the block exited).
_ends_blocks: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def steps_end_blocks(model: nn.Module) -> bool:
    """Whether ``model``'s ``protect()`` blocks were last seen to end right after an
    ``optimizer_step`` (one block per step): the guard then leaves the re-encoding of
    the updated weights to the next GEMM, since the next block's activation would make
    an encoding made now stale before any GEMM read it (``Guard.begin_step``).

    >>> m = torch.nn.Linear(2, 2); note_block_end(m, after_step=True); steps_end_blocks(m)
    True
    """
    return _ends_blocks.get(_model(model), False)


def note_block_end(model: nn.Module, *, after_step: bool) -> None:
    """Record how the step ``optimizer_step`` opened in advance ended: dropped by the
    block's exit (``after_step``), or used by the block."""
    _ends_blocks[_model(model)] = after_step
