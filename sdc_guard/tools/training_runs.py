"""What the training benches of ``sdc-guard bench detect --training`` share.

- real training: a workload of ``sdc_guard.tools.bench_models`` (the toy GPT on the
  generated corpus, or a ``transformers`` model from a small config on structured
  tokens), AdamW at the workload's learning rate under a schedule with a linear warm-up,
  a cosine decay and learning-rate spikes, in fp32 or under bf16 autocast;
- copies of one workload (``Copy``), each with its optimizer and, for a sampler, its own
  guard, that take the same step from the same state with the same random draws (dropout
  included), and can be put back, so that every copy meets the same fault in the same
  state and what one sampler missed never accumulates;
- the fault classes (``FAULT_CLASSES``): each a way to draw a ``GemmFault`` of one fault
  model (``sdc_guard.runtime.drills.fault_models``) at random;
- the harm of a fault: the update the optimizer makes with it against the clean update
  from the same state, ``|faulty - clean| / |clean|`` over all parameters.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from ..respond.policy import Policy
from ..respond.snapshot import SnapshotStore
from ..runtime.lifecycle.guard import Guard, protect
from ..runtime.drills.inject import GemmFault
from ..runtime.sampling import Budget, EveryN, Full, Sampler, Screened
from ..runtime.sampling.schedule import set_current_step
from .bench_models import PRECISIONS, Workload, build

#: The fault classes, in the order trials take them; "stuck lane" is the only persistent
#: one (every GEMM of the step, the same position: a faulty lane), the others hit one GEMM.
FAULT_CLASSES = ("sign", "exponent (top)", "exponent", "mantissa", "multi-bit", "stuck lane", "rows", "columns",
                 "zeroed tile", "swapped rows", "nan", "inf")
#: The single-bit classes (the first bench's), the rest are the fault models beyond one bit.
SINGLE_BIT = FAULT_CLASSES[:4]
#: An update moved by more than this (relative) is a harmful fault; by more than SEVERE, a severe one.
HARMFUL = 0.01
SEVERE = 0.1
#: A fault that changes some parameter's gradient norm by more than this (relative) is
#: visible to a statistic of the norms at all (``Screened``'s smallest spread, min_spread).
VISIBLE = 0.05
#: The tile of the periodic patterns and of swapped rows, the sizes a zeroed tile is drawn from.
PATTERN_TILE = 128
ZERO_TILES = (16, 64)
PERIODS = (8, 16, 32)


def output_dtype(precision: str) -> torch.dtype:
    """The dtype of the GEMM outputs a drill corrupts under ``precision``."""
    amp, _ = PRECISIONS[precision]
    return amp or torch.float32


def bit_layout(dtype: torch.dtype) -> tuple[int, list[int], list[int]]:
    """(width, exponent bits, mantissa bits) of ``dtype``."""
    exponent, mantissa = {torch.float32: (8, 23), torch.bfloat16: (8, 7), torch.float16: (5, 10)}[dtype]
    return 1 + exponent + mantissa, list(range(mantissa, mantissa + exponent)), list(range(mantissa))


def draw_fault(cls: str, rng: random.Random, step: int, gemms: int, dtype: torch.dtype) -> GemmFault:
    """A fault of class ``cls`` at ``step``, in a GEMM drawn among the step's ``gemms``
    (every GEMM of the step for a stuck lane), its bits drawn for outputs of ``dtype``.

    >>> draw_fault("stuck lane", random.Random(0), 3, 10, torch.float32).kind
    'stuck'
    """
    width, exponent, mantissa = bit_layout(dtype)
    call = rng.randrange(gemms)
    one = dict(step=step, call=call, direction="flip")
    if cls == "sign":
        return GemmFault(bit=width - 1, **one)
    if cls == "exponent (top)":
        return GemmFault(bit=width - 2, **one)
    if cls == "exponent":
        return GemmFault(bit=rng.choice(exponent[:-1]), **one)
    if cls == "mantissa":
        return GemmFault(bit=rng.choice(mantissa), **one)
    if cls == "multi-bit":
        return GemmFault(bits=tuple(sorted(rng.sample(range(width), rng.choice((2, 3, 4))))), **one)
    if cls == "stuck lane":
        return GemmFault(kind="stuck", step=step, bit=rng.randrange(width), direction=rng.choice(("on", "off")))
    if cls in ("rows", "columns"):
        return GemmFault(kind=cls, bit=rng.randrange(width), period=rng.choice(PERIODS), tile=PATTERN_TILE, **one)
    if cls == "zeroed tile":
        return GemmFault(kind="zero_tile", step=step, call=call, tile=rng.choice(ZERO_TILES))
    if cls == "swapped rows":
        return GemmFault(kind="swap_rows", step=step, call=call, tile=PATTERN_TILE)
    if cls in ("nan", "inf"):
        return GemmFault(kind=cls, step=step, call=call)
    raise ValueError(f"faults: expected names from {', '.join(FAULT_CLASSES)}, got {cls!r}")


@dataclass(frozen=True)
class Schedule:
    """Learning rate of each step: a linear warm-up over ``warmup`` steps, a cosine decay
    to a tenth of ``base`` at ``steps``, and ``spikes`` of ``(first step, length, factor)``:
    the rate times ``factor`` for ``length`` steps (a restart, a misconfigured rate).

    >>> s = Schedule(1e-3, steps=100, warmup=10, spikes=((50, 2, 10.0),)); s.lr(0), round(s.lr(50) / s.lr(49))
    (0.0001, 10)
    """

    base: float
    steps: int
    warmup: int = 0
    spikes: tuple[tuple[int, int, float], ...] = ()

    def lr(self, step: int) -> float:
        if step < self.warmup:
            factor = (step + 1) / self.warmup
        else:
            progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
            factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for first, length, times in self.spikes:
            if first <= step < first + length:
                factor *= times
        return self.base * factor


def default_schedule(work: Workload, steps: int) -> Schedule:
    """The benches' schedule: warm-up over the first 10 % of the steps, cosine decay, and
    two spikes: 5x for 3 steps at 40 %, 10x for one step at 70 %."""
    return Schedule(work.lr, steps, warmup=max(1, steps // 10),
                    spikes=((int(steps * 0.4), 3, 5.0), (int(steps * 0.7), 1, 10.0)))


class Copy:
    """One copy of a workload: its model, AdamW, and a guard over it when ``sampler`` is
    given (rollback snapshots off unless ``snapshots``: a trial is put back by the bench)."""

    def __init__(self, work: Workload, schedule: Schedule, precision: str, sampler: Sampler | None, *,
                 seed: int = 0, policy: Policy | None = None) -> None:
        self.work = work
        self.model = copy.deepcopy(work.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=schedule.lr(0))
        self.schedule = schedule
        self.amp, _ = PRECISIONS[precision]
        self.sampler = sampler
        self.seed = seed
        self.guard: Guard | None = None
        if sampler is not None:
            self.guard = protect(self.model, sampler=sampler, policy=policy or Policy(),
                                 snapshots=SnapshotStore(self.model, self.opt, every=10**9))

    def state(self) -> tuple[Any, ...]:
        return (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()),
                None if self.sampler is None else copy.deepcopy(self.sampler.state_dict()))

    def restore(self, state: tuple[Any, ...], step: int) -> None:
        """Put ``state`` (``self.state()``) back, as before ``step``. The state stays
        reusable: an optimizer loads a state dict's tensors without copying them, and its
        next step would write into them."""
        model, opt, sampler = state
        self.model.load_state_dict(model)
        self.opt.load_state_dict(copy.deepcopy(opt))
        if self.sampler is not None and sampler is not None:
            self.sampler.load_state_dict(copy.deepcopy(sampler))
        set_current_step(self.model, step)
        if self.guard is not None:
            self.guard.cache.invalidate()  # the weights were written behind its back

    def loss(self, step: int) -> Tensor:
        """The workload's loss of ``step`` on its own batch, under the copy's precision."""
        with torch.autocast("cpu", dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
            return self.work.loss_of(self.model, step)

    def step(self, step: int, batch: int | None = None) -> Any:
        """Training step ``step`` (its learning rate, its random draws, its batch or batch
        number ``batch``); through the guard when there is one (its ``StepOutcome``), else
        the loss."""
        model, opt = self.model, self.opt
        for group in opt.param_groups:
            group["lr"] = self.schedule.lr(step)
        torch.manual_seed(self.seed * 1_000_003 + step)  # the same dropout masks in every copy

        def closure() -> Tensor:
            opt.zero_grad(set_to_none=True)
            loss = self.loss(step if batch is None else batch)
            loss.backward()
            return loss.detach()

        if self.guard is None:
            set_current_step(model, step)  # the drills' clock; no guard keeps it on this copy
            loss = closure()
            opt.step()
            return loss
        with self.guard:
            return self.guard.optimizer_step(opt, closure)

    def params(self) -> list[Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def grad_norms(self) -> list[float]:
        """The 2-norm of each parameter's gradient as the last step left it (0 for none)."""
        return [0.0 if p.grad is None else float(p.grad.float().norm()) for p in self.model.parameters()]

    @torch.no_grad()
    def eval_loss(self, batches: range) -> float:
        """Mean loss over fixed batches (held out: step numbers no training step uses)."""
        was = self.model.training
        self.model.eval()
        try:
            return sum(float(self.loss(b)) for b in batches) / len(batches)
        finally:
            self.model.train(was)


def relative_change(before: list[Tensor], faulty: list[Tensor], clean: list[Tensor]) -> float:
    """|faulty update - clean update| / |clean update| over all parameters.

    >>> z = [torch.zeros(2)]; relative_change(z, [torch.tensor([1.0, 1.1])], [torch.ones(2)])
    0.0707...
    """
    diff = math.sqrt(sum(float((f.double() - c.double()).square().sum()) for f, c in zip(faulty, clean)))
    norm = math.sqrt(sum(float((c.double() - b.double()).square().sum()) for b, c in zip(before, clean)))
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def largest_norm_change(faulty: list[float], clean: list[float]) -> float:
    """The largest relative change of a gradient norm, ``exp(max |log(faulty / clean)|) - 1``
    over the parameters with a gradient (inf for a norm that is not finite).

    >>> largest_norm_change([1.0, 2.2], [1.0, 2.0])
    0.1...
    """
    worst = 0.0
    for f, c in zip(faulty, clean):
        if not math.isfinite(f):
            return math.inf
        if f > 0 and c > 0:
            worst = max(worst, abs(math.log(f / c)))
        elif (f > 0) != (c > 0):
            return math.inf
    return math.expm1(worst)


def gemms_per_step(work: Workload, precision: str) -> int:
    """GEMMs one training step of ``work`` runs (forward and backward), counted by a guard."""
    probe = Copy(work, Schedule(0.0, 1), precision, Full())
    probe.step(0)
    assert probe.guard is not None and probe.guard.last_report is not None
    return probe.guard.last_report.seen


def samplers(budget: float, every_n: int) -> dict[str, Callable[[], Sampler]]:
    """The samplers the training benches compare, by the name their reports give them:
    ``Full()``, ``Budget(budget)``, ``EveryN(every_n)``, the previous screen's test (one
    factor of 10, no per-layer spread), ``Screened()`` and ``Screened(Budget(budget))``."""
    b = budget
    return {
        "Full()": Full,
        f"Budget({b:g})": lambda: Budget(b),
        f"EveryN({every_n})": lambda: EveryN(every_n),
        "Screened(sigmas=inf, factor=10)": lambda: Screened(sigmas=math.inf, factor=10),
        "Screened()": Screened,
        f"Screened(Budget({b:g}))": lambda: Screened(Budget(b)),
    }


@contextlib.contextmanager
def quiet_guard_log() -> Iterator[None]:
    """The guard's warnings off while a bench drills faults on purpose (each detection
    would log a line; the bench reports them all), restored after."""
    logger = logging.getLogger("sdc_guard")
    level = logger.level
    logger.setLevel(logging.ERROR + 10)
    try:
        yield
    finally:
        logger.setLevel(level)


def workloads(names: list[str], seed: int) -> list[Workload]:
    """The named workloads (``bench_models.build``), weights drawn from ``seed``."""
    return [build(name, seed) for name in names]
