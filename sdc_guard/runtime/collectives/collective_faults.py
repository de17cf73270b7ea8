"""Fault drills of the collectives: corrupt what a rank receives from an all-reduce, an
all-gather or a reduce-scatter, reproducibly.

``drill(model, CollectiveFault(op="all_gather", rank=1, step=3, corruption="zero"))``
(``runtime/drills/inject.py``, which hands collectives here) corrupts that collective's result
on rank 1 at step 3, once its result has landed and before anyone waiting on it sees it,
the way a faulty link or NIC would: every element zeroed (the AMD ROCm ``aorta`` case
AINIC-SDC-001: the NIC read HBM before the write-back landed and every receiver got
zeros), one bit flipped, or stale data (what the same collective delivered at its
previous call, or what the buffer held before it was written). ``rank=None`` corrupts
every rank's result: receivers that all agree, which no comparison across ranks can see.
Entered before ``protect()``, as every drill, so that the guard checks what the model gets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from ...core.torch_private import disable_current_modes

from ..dispatch.collective_ops import OPS, Collective, Pending, describe, is_wait, run_then
from ..sampling.schedule import current_step

CORRUPTIONS = ("zero", "flip", "stale")
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}
_TOP_EXPONENT_BIT = {torch.float32: 30, torch.float16: 14, torch.bfloat16: 14, torch.float64: 62}


def _optional_index(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name}: expected a non-negative int or None, got {value!r}")


@dataclass
class CollectiveFault:
    """Which collective results to corrupt, and how. ``None`` fields match anything.

    ``op``: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``; ``rank``: the
    receiving rank (global) whose result is corrupted, ``None`` for every rank; ``step``:
    the step (a sticky fault starts there and stays); ``call``: which of the step's
    matching collectives on this rank, counted from 0 (re-executions of the step
    included); ``corruption``: ``"zero"`` (the whole result, or the shard), ``"flip"`` (one
    bit of one element: ``element`` indexes the result or the shard, drawn from the
    drill's seed if omitted; ``bit`` defaults to the top exponent bit) or ``"stale"`` (the
    result this rank received from the same collective at its previous call, or the
    buffer's content before the collective wrote it); ``shard``: an all-gather's shard
    (the group rank of its sender) to corrupt instead of the whole result.
    """

    op: str
    rank: int | None = None
    step: int | None = None
    call: int | None = None
    corruption: str = "flip"
    shard: int | None = None
    element: int | None = None
    bit: int | None = None
    sticky: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or self.op not in OPS:
            raise ValueError(f"op: expected one of {', '.join(map(repr, OPS))}, got {self.op!r}")
        if not isinstance(self.corruption, str) or self.corruption not in CORRUPTIONS:
            raise ValueError(f"corruption: expected one of {', '.join(map(repr, CORRUPTIONS))}, got {self.corruption!r}")
        for name in ("rank", "step", "call", "shard", "element", "bit"):
            _optional_index(name, getattr(self, name))
        if self.shard is not None and self.op != "all_gather":
            raise ValueError(f"shard: expected None for op={self.op!r} (only an all-gather's result is made of "
                             f"shards), got {self.shard!r}")
        if self.bit is not None and self.bit >= 64:
            raise ValueError(f"bit: expected 0..63 (0..31 for float32, 0..15 for bfloat16 and float16) or None, "
                             f"got {self.bit!r}")
        if not isinstance(self.sticky, bool):
            raise TypeError(f"sticky: expected a bool, got {type(self.sticky).__name__} {self.sticky!r}")


@dataclass
class CollectiveInjection:
    """One collective result that was corrupted."""

    step: int
    op: str
    rank: int  #: the receiving rank (global)
    call: int
    corruption: str
    shard: int | None
    element: int | None  #: the flipped element (in the shard, for a shard), else None
    bit: int | None
    changed: int  #: elements whose bits changed (0: the result already was what it became)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class CollectiveInjector:
    """Applies ``CollectiveFault`` s to the collectives a drill's dispatch mode sees
    (``FaultInjector.collective``); records each corruption in ``injections``."""

    def __init__(self, model: nn.Module, faults: list[CollectiveFault], rng: random.Random,
                 injections: list[Any]) -> None:
        self.model = model
        self.faults = list(faults)
        self.injections = injections
        self._rng = rng
        self._spent: set[int] = set()
        self._counts: dict[int, int] = {}
        self._count_step = -1
        self._elements: dict[int, int] = {}  #: a flip's element, drawn once per fault
        self._previous: dict[int, Tensor] = {}  #: per stale fault, the last result it saw
        self._pending = Pending()

    def remove(self, fault: CollectiveFault) -> None:
        self.faults = [f for f in self.faults if f is not fault]

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one collective op, corrupting its result where a fault says so."""
        if is_wait(func):  # functional results are waited for when they are issued (run_then)
            return func(*args, **kwargs)
        call = describe(func, args, kwargs) if self.faults else None
        if call is None or call.unchecked is not None:
            return func(*args, **kwargs)
        step = current_step(self.model)
        if step != self._count_step:  # a new step: its counts start over, the last one's waits are done
            self._counts, self._count_step = {}, step
            self._pending.clear()
        rank = _rank()
        actions: list[tuple[CollectiveFault, int, bool]] = []  #: (fault, call number, corrupt now)
        for fault in self.faults:
            key = id(fault)
            if key in self._spent or fault.op != call.op or fault.rank not in (None, rank):
                continue
            number = self._counts.get(key, 0)
            self._counts[key] = number + 1
            if fault.call is not None and number != fault.call:
                continue
            due = fault.step is None or step == fault.step or (fault.sticky and step >= fault.step)
            if due or fault.corruption == "stale":
                actions.append((fault, number, due))
        if not actions:
            return func(*args, **kwargs)
        before = call.recv.detach().clone() if call.recv is not None else None

        def landed(result: Tensor) -> None:
            for fault, number, due in actions:
                if due:
                    self._corrupt(fault, call, result, before, step, rank, number)
                    if not fault.sticky:
                        self._spent.add(id(fault))
                if fault.corruption == "stale":
                    self._previous[id(fault)] = result.detach().clone()

        return run_then(func, args, kwargs, call, landed, self._pending)

    def _corrupt(self, fault: CollectiveFault, call: Collective, result: Tensor, before: Tensor | None,
                 step: int, rank: int, number: int) -> None:
        flat = result.detach().reshape(-1)
        start, stop = 0, flat.numel()
        if fault.shard is not None:
            width = flat.numel() // call.group_size
            start, stop = fault.shard * width, (fault.shard + 1) * width
        region = flat[start:stop]
        element = bit = None
        with disable_current_modes(), torch.no_grad():
            old = region.clone()
            if fault.corruption == "zero":
                region.zero_()
            elif fault.corruption == "stale":
                source = self._previous.get(id(fault), before)
                if source is not None:
                    region.copy_(source.reshape(-1)[start:stop])
                else:
                    region.zero_()  # a functional collective's first call: its buffer held nothing
            else:
                element = fault.element if fault.element is not None else self._elements.setdefault(
                    id(fault), self._rng.randrange(max(region.numel(), 1)))
                element = min(element, region.numel() - 1)
                width = region.element_size() * 8
                bit = fault.bit if fault.bit is not None else _TOP_EXPONENT_BIT[region.dtype]
                bit = min(bit, width - 1)
                words = region.view(_INT_VIEW[region.dtype])
                mask = 1 << bit if bit < width - 1 else -(1 << bit)
                words[element] = int(words[element]) ^ mask
            changed = int((region.view(_INT_VIEW[region.dtype]) != old.view(_INT_VIEW[old.dtype])).sum())
        self.injections.append(CollectiveInjection(step, call.op, rank, number, fault.corruption, fault.shard,
                                                   element, bit, changed))
