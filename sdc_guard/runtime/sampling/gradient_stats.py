"""Per-layer running statistics of gradient norms: what ``Screened`` compares a step with.

Each parameter (a layer's weight, its bias) keeps the running mean and the running spread
of the logarithm of its gradient's 2-norm, exponentially weighted, as the feature-value
detection of torch_npu and MindSpore keeps running statistics per watched tensor. The log
makes the spread relative (a spread of 0.1 is about 10 % step to step) and a change of
scale additive; the running spread learns how much each layer's norm moves on its own,
its lag behind a trend (a learning-rate warm-up, a decay) included, since a mean that lags
widens the deviations it learns from. A step's deviation is measured in spreads, with a
floor on the spread (``min_spread``) for layers whose norm barely moves.

Everything stays on the device, in as few small operations as the screen can be written
with (it runs at every optimizer step): ``deviations`` returns tensors and one summary
vector for the caller to read in one transfer, ``absorb`` updates in place and reuses the
deviations it was given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

#: smallest positive norm the log is taken of (a zero gradient has no scale to compare)
_TINY = torch.finfo(torch.float32).tiny
#: the mean of a parameter with no usable norm yet: nothing it shows can deviate upwards
_UNKNOWN = 1e30
#: a log deviation below this is a zero (or vanishing) gradient, not a layer's scale
_ZERO = -60.0


@dataclass
class Deviations:
    """One step's norms against the statistics, on the device."""

    log_norms: Tensor  #: log of each norm (of ``_TINY`` for a zero one)
    delta: Tensor  #: log norm minus its running mean: log(norm / typical norm)
    sigmas: Tensor  #: delta in running spreads (0 where a parameter is not compared yet)
    #: [largest deviation in spreads, largest delta, smallest delta, total norm / typical total]
    summary: Tensor


class NormStatistics:
    """Running mean and spread of each parameter's log gradient norm.

    A parameter's first ``1 / smoothing`` values are averaged with equal weights (a running
    average, so that the early estimates do not hang on the first step), the later ones
    exponentially with weight ``smoothing``. A parameter is compared in spreads once it has
    absorbed ``ready_after`` values. A norm that is zero or not finite is not absorbed: it
    says nothing about the layer's scale (a gradient that is legitimately all zero, of an
    expert no token was routed to, is not a deviation either).

    >>> s = NormStatistics(2, smoothing=0.5, min_spread=0.05, ready_after=2)
    >>> for _ in range(2):
    ...     s.absorb(s.deviations(torch.tensor([1.0, 4.0])))
    >>> [round(v, 2) for v in s.deviations(torch.tensor([1.0, 8.0])).summary.tolist()]
    [13.86, 0.69, 0.0, 1.96]
    """

    def __init__(self, size: int, *, smoothing: float, min_spread: float, ready_after: int,
                 device: torch.device | None = None) -> None:
        self.smoothing = smoothing
        self.min_spread = min_spread
        self.ready_after = ready_after
        self.mean = torch.full((size,), _UNKNOWN, device=device)  #: running mean of log(norm)
        self.var = torch.zeros(size, device=device)  #: running variance of log(norm)
        self.counts = torch.zeros(size, device=device)  #: values each parameter absorbed
        self._inv_spread = torch.zeros(size, device=device)  #: 1 / spread; 0 where not ready
        self._typical_total = torch.zeros((), device=device)  #: norm of the typical norms
        self._steady = False  #: every parameter past its running average: the short path
        self._absorbed = 0  #: steps absorbed (on the host: when steadiness is worth checking)

    def to(self, device: torch.device) -> None:
        for name in ("mean", "var", "counts", "_inv_spread", "_typical_total"):
            setattr(self, name, getattr(self, name).to(device))

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def spread(self) -> Tensor:
        """Each parameter's spread, floored at ``min_spread``."""
        return torch.sqrt(self.var + self.min_spread ** 2)

    def typical(self) -> Tensor:
        """Each parameter's typical norm, the exponential of its mean log norm (0 where
        nothing was absorbed yet)."""
        return torch.where(self.counts > 0, torch.exp(self.mean), torch.zeros_like(self.mean))

    def deviations(self, norms: Tensor) -> Deviations:
        """How ``norms`` (float32, on the statistics' device) stand against the statistics."""
        log_norms = torch.log(norms.clamp_min(_TINY))
        delta = log_norms - self.mean
        sigmas = delta * self._inv_spread
        total = torch.linalg.vector_norm(norms) / self._typical_total.clamp_min(_TINY)
        summary = torch.stack([sigmas.max(), delta.max(), delta.min(), total])
        return Deviations(log_norms, delta, sigmas, summary)

    def absorb(self, dev: Deviations, *, clean: bool = False, cap: float | None = None) -> None:
        """Learn one step's norms from their deviations. ``clean``: the caller read the
        summary and knows every norm is finite and non-zero (the short path, in a few
        operations); ``cap``: each deviation limited to ``cap`` (in log units: a legitimately
        unusual step moves the statistics, but by a bounded amount)."""
        if self._steady and clean and cap is None and self.ready_after * self.smoothing <= 1:
            delta, weight = dev.delta, self.smoothing  # every parameter ready, every norm usable
            self.mean.add_(delta, alpha=weight)
            self.var.add_(delta * delta, alpha=weight).mul_(1 - weight)
            self.counts.add_(1)
            self._inv_spread = torch.rsqrt(self.var + self.min_spread ** 2)
            self._typical_total = torch.linalg.vector_norm(torch.exp(self.mean))
            return
        self._absorb_masked(dev, cap)
        self._inv_spread = torch.where(self.counts >= self.ready_after, torch.rsqrt(self.var + self.min_spread ** 2),
                                       torch.zeros_like(self.var))
        self._typical_total = torch.linalg.vector_norm(self.typical())

    def _absorb_masked(self, dev: Deviations, cap: float | None) -> None:
        usable = torch.isfinite(dev.log_norms) & (dev.log_norms > math.log(_TINY) + 1)
        first = self.counts == 0
        weight = torch.clamp_min(1.0 / (self.counts + 1), self.smoothing)
        delta = torch.where(usable & ~first, dev.delta, torch.zeros_like(self.mean))
        if cap is not None:
            delta = delta.clamp(-cap, cap)
        self.mean = torch.where(usable & first, dev.log_norms, self.mean + weight * delta)
        self.var = torch.where(usable & ~first, (1 - weight) * (self.var + weight * delta * delta), self.var)
        self.counts = self.counts + usable.to(self.counts.dtype)
        self._absorbed += 1
        if self._absorbed * self.smoothing >= 1:  # a synchronisation, on a few early steps only
            self._steady = bool((self.counts * self.smoothing >= 1).all())

    def state(self) -> dict[str, list[float]]:
        return {"mean": self.mean.tolist(), "var": self.var.tolist(), "counts": self.counts.tolist()}

    @classmethod
    def from_state(cls, state: dict[str, list[float]], *, smoothing: float, min_spread: float,
                   ready_after: int) -> "NormStatistics":
        stats = cls(len(state["mean"]), smoothing=smoothing, min_spread=min_spread, ready_after=ready_after)
        stats.mean = torch.tensor(state["mean"], dtype=torch.float32)
        stats.var = torch.tensor(state["var"], dtype=torch.float32)
        stats.counts = torch.tensor(state["counts"], dtype=torch.float32)
        stats._inv_spread = torch.where(stats.counts >= ready_after, torch.rsqrt(stats.var + min_spread ** 2),
                                        torch.zeros_like(stats.var))
        stats._typical_total = torch.linalg.vector_norm(stats.typical())
        stats._steady = bool((stats.counts * smoothing >= 1).all())
        stats._absorbed = int(stats.counts.max()) if len(stats.counts) else 0
        return stats


#: a delta at or below this is a zero norm: ``Deviations.summary``'s smallest delta tells the caller
ZERO_DELTA = _ZERO
#: a largest delta at or below this: no parameter has a typical norm yet
NO_REFERENCE = -_UNKNOWN / 2
