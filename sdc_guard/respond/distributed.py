"""Lockstep across ranks: every rank learns who flagged, and all take the same response.

One small collective per step (``flagged_ranks``, or ``step_flags`` with a gradient
screen), one more only when something was flagged or tripped (``agree_max`` on the triage
outcome). On a step whose collectives are checked in the group that spans the world, the
checks' own exchange carries the flags instead and the first collective is not needed
(``runtime/collectives/collective_checks.py``, ``Guard.agreed_flags``). Without ``torch.distributed`` initialised,
both are local no-ops, so the same code serves single-process runs. Checkpoints of
sharded state add two more (``broadcast_object``, ``gather_errors``) around each write
and each read from disk, so that every rank agrees on what exists and on what failed.

Why lockstep matters: under DDP the backward pass all-reduces gradients, so a re-run on
one rank alone would hang the others, and a rollback on one rank alone would leave the
replicas diverged.

These collectives are the guard's own: they run with every dispatch mode set aside, so
that neither the guard's collective checks nor a drill's faults take them for the step's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ..core.torch_private import disable_current_modes as _disable_current_modes


def is_distributed() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def _device() -> torch.device:
    """Where collective tensors must live for the default group's backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def flagged_ranks(flagged: bool) -> list[int]:
    """All ranks whose step flagged, identical on every rank (one all-gather).

    >>> flagged_ranks(True), flagged_ranks(False)
    ([0], [])
    """
    if not is_distributed():
        return [0] if flagged else []
    mine = torch.tensor([1 if flagged else 0], dtype=torch.int32, device=_device())
    everyone = [torch.zeros_like(mine) for _ in range(world_size())]
    with _disable_current_modes():
        dist.all_gather(everyone, mine)
    return [r for r, t in enumerate(everyone) if int(t.item())]


def step_flags(flagged: bool, tripped: bool) -> tuple[list[int], list[int]]:
    """The ranks whose step flagged a GEMM and those whose gradient screen tripped,
    identical on every rank, in the one all-gather ``flagged_ranks`` would take.

    >>> step_flags(False, True)
    ([], [0])
    """
    if not is_distributed():
        return ([0] if flagged else []), ([0] if tripped else [])
    mine = torch.tensor([int(flagged), int(tripped)], dtype=torch.int32, device=_device())
    everyone = [torch.zeros_like(mine) for _ in range(world_size())]
    with _disable_current_modes():
        dist.all_gather(everyone, mine)
    pairs = [t.tolist() for t in everyone]
    return [r for r, p in enumerate(pairs) if p[0]], [r for r, p in enumerate(pairs) if p[1]]


def agree_max(value: int) -> int:
    """The largest of every rank's ``value`` (the most severe triage outcome).

    >>> agree_max(3)
    3
    """
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    with _disable_current_modes():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def barrier() -> None:
    """Wait until every rank gets here (a no-op without a process group): the ranks that
    read a file wait for the one that writes it."""
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group): what rank
    0 sees of a shared directory, or the names it chose, become every rank's.

    >>> broadcast_object(("run", 3))
    ('run', 3)
    """
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_errors(error: str | None) -> list[str]:
    """Every rank's ``error`` that is not ``None``, identical on every rank, in rank order,
    each said once: a step that failed on one rank is known to have failed on all.

    >>> gather_errors(None), gather_errors("rank 0: the disk is full")
    ([], ['rank 0: the disk is full'])
    """
    errors = [error]
    if is_distributed():
        errors = [None] * world_size()
        dist.all_gather_object(errors, error)
    return list(dict.fromkeys(e for e in errors if e is not None))


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, identical on every rank; ``[obj]``
    without a process group.

    >>> gather_objects({"node": "n1"})
    [{'node': 'n1'}]
    """
    if not is_distributed():
        return [obj]
    everyone: list[Any] = [None] * world_size()
    dist.all_gather_object(everyone, obj)
    return everyone
