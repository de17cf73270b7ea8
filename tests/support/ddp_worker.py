"""One rank of the distributed response tests (spawned by torch.multiprocessing)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from respond_helpers import closure_for, make_model, train


def run(rank: int, world_size: int, port: int, scenario: str, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = make_model()
        ddp = DDP(model)
        if scenario == "checkpoints":
            _checkpoints(model, ddp, rank, Path(out_dir))
            dist.barrier()
            return
        faults: tuple = ()
        if scenario == "transient" and rank == 1:
            faults = (sdc_guard.GemmFault(site="blocks.0.fc1", phase="forward", step=2),)
        if scenario == "sticky" and rank == world_size - 1:
            faults = (sdc_guard.GemmFault(site="head", step=3, sticky=True),)
        sampler = None
        if scenario == "screened":  # the gradient screen; the fault on one rank reaches all through DDP
            sampler = sdc_guard.runtime.sampling.Screened(warmup=2)
            if rank == 1:
                faults = (sdc_guard.GemmFault(site="blocks.0.fc2", phase="backward", step=3, bit=30,
                                              element=(3, 5)),)
        outcomes, losses, _ = train(model, 6, faults=faults, rank=rank, wrapped=ddp, sampler=sampler,
                                    remove_faults_after=4 if scenario == "sticky" else None)
        torch.save([p.detach() for p in model.parameters()], Path(out_dir) / f"rank{rank}.pt")
        summary = [{"step": o.step, "flagged_ranks": o.flagged_ranks, "classification": o.classification,
                    "action": o.action, "stepped": o.stepped, "rolled_back_to": o.rolled_back_to,
                    "tripped_ranks": o.tripped_ranks, "screen": o.screen, "reruns": len(o.reruns)}
                   for o in outcomes]
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"outcomes": summary, "losses": losses}))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    leave_without_finalizing()


def leave_without_finalizing() -> None:
    """End a worker whose work is done and written. gloo's worker threads can still abort
    the interpreter's finalization after ``destroy_process_group`` (SIGABRT, "terminate
    called without an active exception"; seen in two of this project's suite runs,
    pytorch/pytorch#179291 describes the race), which would fail a run that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _checkpoints(model: torch.nn.Module, ddp: torch.nn.Module, rank: int, out: Path) -> None:
    """Snapshot checkpoints in one shared folder: rank 0 writes them, every rank can roll
    back from them. A folder of each rank's own shows who writes."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = sdc_guard.SnapshotStore(model, opt, every=2, keep=2, checkpoint_dir=out / "shared")
    with sdc_guard.protect(model, snapshots=store) as guard:
        for step in range(5):
            guard.optimizer_step(opt, closure_for(ddp, opt, step, rank))
    sdc_guard.SnapshotStore(model, opt, checkpoint_dir=out / f"own{rank}").take(9)
    store.snapshots.clear()  # as after a restart: the newest checkpoint is the rollback target
    restored = store.restore()
    torch.save({"step": restored.step, "params": [p.detach() for p in model.parameters()]}, out / f"rank{rank}.pt")
