"""Training loops the response tests (and their worker processes) share."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

import sdc_guard
from models import TinyGPT, lm_batch


def make_model(seed: int = 0, **kwargs: Any) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**({"layers": 1} | kwargs))


def closure_for(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int = 0):
    """The usual closure: zero_grad, forward, backward on this step's batch."""
    x, y = lm_batch(step * 16 + rank)

    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    return closure


def train(
    model: torch.nn.Module,
    steps: int,
    *,
    faults: tuple = (),
    policy: sdc_guard.Policy | None = None,
    snapshots_every: int = 2,
    rank: int = 0,
    remove_faults_after: int | None = None,
    lr: float = 1e-2,
    wrapped: torch.nn.Module | None = None,
    sampler: Any = None,
) -> tuple[list[sdc_guard.StepOutcome], list[float], sdc_guard.SnapshotStore]:
    """Train with ``guard.optimizer_step``; faults (if any) injected on this rank.

    ``wrapped`` is what runs the forward (a DDP wrapper), ``model`` what is protected.
    """
    runner = wrapped if wrapped is not None else model
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    store = sdc_guard.SnapshotStore(model, opt, every=snapshots_every)
    outcomes, losses = [], []
    drill = sdc_guard.drill(model, *faults) if faults else contextlib.nullcontext()
    with drill, sdc_guard.protect(model, policy=policy, snapshots=store, sampler=sampler) as guard:
        for step in range(steps):
            if remove_faults_after is not None and step == remove_faults_after and faults:
                for fault in faults:
                    drill.remove(fault)
            outcome = guard.optimizer_step(opt, closure_for(runner, opt, step, rank))
            outcomes.append(outcome)
            losses.append(outcome.loss.item())
    return outcomes, losses, store


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
