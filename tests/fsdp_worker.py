"""One rank of the sharded-training tests (tests/test_fsdp.py; spawned by torch.multiprocessing).

Every rank trains the same tiny GPT (tests/models.py) sharded one of two ways, in one
process group, once per scenario:

- ``fsdp``: FSDP2, ``fully_shard`` on each block and on the root, as torchtitan does;
  each rank trains on its own batch (data parallel);
- ``tp``: tensor parallelism, the MLP of each block split ``ColwiseParallel`` (fc1) /
  ``RowwiseParallel`` (fc2) over a 1-D device mesh, everything else replicated; every
  rank trains on the same batch.

Scenarios: ``bare`` (no guard), ``clean`` (under ``protect()``), ``transient`` (one GEMM
output corrupted once on rank 1), ``persistent`` (a sticky fault on the last rank from
step 3, removed from step 4 on). After each step every rank gathers the full parameters
and Adam moments (``DTensor.full_tensor``), so the test can compare states bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import sdc_guard
from respond_helpers import closure_for, make_model

STEPS = 6
SCENARIOS = ("bare", "clean", "transient", "persistent")


def shard(model: torch.nn.Module, kind: str, world_size: int) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (world_size,))
    if kind == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        for i in range(len(model.blocks)):
            parallelize_module(model, mesh, {f"blocks.{i}.fc1": ColwiseParallel(),
                                             f"blocks.{i}.fc2": RowwiseParallel()})
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def gathered_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    moments = [full(opt.state[p][k]) for p in params if p in opt.state for k in ("exp_avg", "exp_avg_sq")]
    return {"params": [full(p) for p in params], "moments": moments}


def faults_for(scenario: str, kind: str, rank: int, world_size: int) -> tuple:
    if scenario == "transient" and rank == 1:
        return (sdc_guard.GemmFault(site="blocks.0.fc1", phase="forward", step=2),)
    if scenario == "persistent" and rank == world_size - 1:
        site = "head" if kind == "fsdp" else "blocks.0.fc1"  # TP: a sharded layer's local GEMM
        return (sdc_guard.GemmFault(site=site, step=3, sticky=True),)
    return ()


def train(kind: str, scenario: str, rank: int, world_size: int) -> dict[str, Any]:
    model = shard(make_model(), kind, world_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data_rank = rank if kind == "fsdp" else 0  # TP ranks share the batch
    states, outcomes, reports = [], [], []
    if scenario == "bare":
        for step in range(STEPS):
            closure_for(model, opt, step, data_rank)()
            opt.step()
            states.append(gathered_state(model, opt))
        return {"states": states, "outcomes": outcomes, "reports": reports}
    faults = faults_for(scenario, kind, rank, world_size)
    store = sdc_guard.SnapshotStore(model, opt, every=2)
    drill = sdc_guard.drill(model, *faults) if faults else contextlib.nullcontext()
    with drill, sdc_guard.protect(model, snapshots=store) as guard:
        for step in range(STEPS):
            if scenario == "persistent" and step == 4 and faults:
                for fault in faults:
                    drill.remove(fault)
            outcome = guard.optimizer_step(opt, closure_for(model, opt, step, data_rank))
            report = outcome.report  # the step's first run
            reports.append({"seen": report.seen, "verified": report.verified, "flagged": report.flagged,
                            "unverified": dict(report.unverified_ops), "cache_hits": guard.cache.stats.hits})
            outcomes.append({"step": outcome.step, "flagged_ranks": outcome.flagged_ranks,
                             "classification": outcome.classification, "action": outcome.action,
                             "stepped": outcome.stepped, "rolled_back_to": outcome.rolled_back_to,
                             "reruns": len(outcome.reruns)})
            states.append(gathered_state(model, opt))
    return {"states": states, "outcomes": outcomes, "reports": reports}


def run(rank: int, world_size: int, port: int, kind: str, scenarios: tuple[str, ...], out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        for scenario in scenarios:
            results[scenario] = train(kind, scenario, rank, world_size)
        out = Path(out_dir)
        torch.save({s: r["states"] for s, r in results.items()}, out / f"rank{rank}.pt")
        summary = {s: {"outcomes": r["outcomes"], "reports": r["reports"]} for s, r in results.items()}
        (out / f"rank{rank}.json").write_text(json.dumps(summary))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort interpreter finalization (see ddp_worker.py)
