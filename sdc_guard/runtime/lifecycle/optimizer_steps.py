"""Optimizer steps that run no GEMM are stepped with the dispatch mode off.

A part of the guard's interception (``sdc_guard.runtime.lifecycle.guard``), kept apart because it
is its own small state machine over global optimizer-step hooks.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

if TYPE_CHECKING:
    from .guard import Guard


#: What is learned about each optimizer, shared by every guard: with one ``protect()``
#: block per step each step has a guard of its own, and an optimizer's first step is
#: the only one a per-guard memory would ever see.
_learned: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  #: a first step was counted
_gemmless: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  #: ... and it ran no GEMM


class OptimizerSteps:
    """Leaves optimizer steps that run no GEMM outside the dispatch mode.

    An SGD or Adam step is elementwise arithmetic over every parameter: on a small model,
    half of a training step's aten ops, each paying the dispatch mode's Python round trip
    with nothing to verify. Each optimizer's first watched step is intercepted as usual
    and its GEMMs counted; one that ran none is from then on stepped with the mode off. One
    that ran GEMMs (Shampoo, Muon, LBFGS evaluating its closure) stays verified. What is
    learned is kept per optimizer for every guard (per-step blocks learn once). Global
    optimizer-step hooks, installed only while the guard is active.
    """

    def __init__(self, guard: "Guard") -> None:
        self.guard = guard
        self._seen_before: dict[int, int] = {}
        #: step calls in progress per optimizer: a subclass's step calling its base class's
        #: step runs the hooks twice, and only the outer call is the optimizer step
        self._depth: dict[int, int] = {}
        self._handles: list[Any] = []
        #: optimizers whose step this object paused the guard for (``ModeSwitch.pause``)
        self._paused: set[int] = set()

    def install(self) -> None:
        if not self._handles:
            self._handles = [register_optimizer_step_pre_hook(self._pre),
                             register_optimizer_step_post_hook(self._post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        """Forget steps in progress: an optimizer step that raised never ran its post-hook."""
        self._depth.clear()
        self._seen_before.clear()
        self._paused.clear()  # the guard's begin_step sets its state itself

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth = self._depth.get(id(optimizer), 0)
        self._depth[id(optimizer)] = depth + 1
        if depth:
            return
        guard = self.guard
        if optimizer in _gemmless:
            if guard.mode.pause():
                self._paused.add(id(optimizer))
        elif optimizer not in _learned and guard.intercepting:
            # the step may be closed already (``Guard.optimizer_step`` steps the optimizer
            # after reporting): the count of GEMMs seen still moves if it runs any
            self._seen_before[id(optimizer)] = guard.gemms_seen

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth = self._depth.pop(id(optimizer), 1) - 1
        if depth:
            self._depth[id(optimizer)] = depth
            return
        guard = self.guard
        # foreach and fused optimizers write parameters without bumping their versions
        guard.refresh_weights([p for group in optimizer.param_groups for p in group["params"]])
        if optimizer in _gemmless:
            if id(optimizer) in self._paused:
                self._paused.discard(id(optimizer))
                guard.mode.resume()
            return
        before = self._seen_before.pop(id(optimizer), None)
        if before is not None:
            _learned.add(optimizer)
            if guard.gemms_seen == before:
                _gemmless.add(optimizer)
