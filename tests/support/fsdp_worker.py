"""One rank of the sharded-training tests (tests/test_fsdp.py; spawned by torch.multiprocessing).

Every rank trains the same tiny GPT (tests/models.py) sharded one of two ways, in one
process group, once per scenario:

- ``fsdp``: FSDP2, ``fully_shard`` on each block and on the root, as torchtitan does;
  each rank trains on its own batch (data parallel);
- ``tp``: tensor parallelism, the MLP of each block split ``ColwiseParallel`` (fc1) /
  ``RowwiseParallel`` (fc2) over a 1-D device mesh, everything else replicated; every
  rank trains on the same batch;
- ``fsdp_compile``: as torchtitan trains: each block under activation checkpointing and
  compiled on its own (``aot_eager``), then ``fully_shard`` on each block and the root; the
  transient fault hits a GEMM the backward recomputes.

Scenarios: ``bare`` (no guard), ``clean`` (under ``protect()``), ``transient`` (one GEMM
output corrupted once on rank 1), ``persistent`` (a sticky fault on the last rank from
step 3, removed from step 4 on). After each step every rank gathers the full parameters
and Adam moments (``DTensor.full_tensor``), so the test can compare states bit for bit.

``checkpoints`` (``checkpoints()`` below) writes the snapshots as sharded (DCP)
checkpoint directories and rolls back from them: after the in-memory snapshots are
dropped, after a restart (a fresh model and optimizer, a persistent fault at the first
step), under a new run id, and with a disk that fails on one rank only.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import warnings
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
from sdc_guard.respond.checkpoint_io import host_label
from sdc_guard.runtime.sampling.schedule import set_current_step

STEPS = 6
SCENARIOS = ("bare", "clean", "transient", "persistent")


def shard(model: torch.nn.Module, kind: str, world_size: int) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (world_size,))
    if kind in ("fsdp", "fsdp_compile"):
        for block in model.blocks:
            if kind == "fsdp_compile":
                block.compile(backend="aot_eager")
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
    if scenario == "transient" and rank == 1 and kind == "fsdp_compile":  # fc1 run again in the backward
        return (sdc_guard.GemmFault(site="blocks.0.fc1", phase="backward", op="addmm", step=2),)
    if scenario == "transient" and rank == 1:
        return (sdc_guard.GemmFault(site="blocks.0.fc1", phase="forward", step=2),)
    if scenario == "persistent" and rank == world_size - 1:
        return (_persistent_fault(kind, 3),)
    return ()


def train(kind: str, scenario: str, rank: int, world_size: int) -> dict[str, Any]:
    torch._dynamo.reset()  # each scenario compiles afresh, as a job of its own would
    model = shard(make_model(ac="block") if kind == "fsdp_compile" else make_model(), kind, world_size)
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
                            "unverified": dict(report.unverified_ops), "cache_hits": guard.cache.stats.hits,
                            "compiled": guard.compiled})
            outcomes.append({"step": outcome.step, "flagged_ranks": outcome.flagged_ranks,
                             "classification": outcome.classification, "action": outcome.action,
                             "stepped": outcome.stepped, "rolled_back_to": outcome.rolled_back_to,
                             "reruns": len(outcome.reruns)})
            states.append(gathered_state(model, opt))
    return {"states": states, "outcomes": outcomes, "reports": reports}


def _persistent_fault(kind: str, step: int) -> sdc_guard.GemmFault:
    site = "head" if kind == "fsdp" else "blocks.0.fc1"  # TP: a sharded layer's local GEMM
    return sdc_guard.GemmFault(site=site, step=step, sticky=True)


def _plant_damage(directory: Path, run: str) -> None:
    """What a checkpoint folder collects (rank 0 alone): a newer copy of step 4 whose DCP
    metadata is garbage of the same size (complete by its manifest, unreadable by DCP),
    a directory whose write never finished (no manifest), and the temporary directory of
    a writer that was killed (its process is gone)."""
    newest = directory / f"sdc_guard-{run}-step4.dcp"
    bad = directory / f"sdc_guard-{run}-step6.dcp"
    shutil.copytree(newest, bad)
    (bad / ".metadata").write_bytes(bytes((bad / ".metadata").stat().st_size))
    os.utime(bad)  # newer than step 4: tried first
    (directory / f"sdc_guard-{run}-step7.dcp").mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = directory / f".sdc_guard-{run}-step8.dcp.tmp-{host_label()}-{gone.pid}"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")


def _limit_file_size(limit: int | None) -> None:
    """This process's file-size limit (``None``: back to unlimited): a disk that is full
    for this rank only. Writes past it fail with EFBIG."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))


def checkpoints(kind: str, rank: int, world_size: int, out: Path) -> tuple[dict, dict]:
    """The sharded-checkpoint scenario; returns gathered states and a JSON-able summary."""
    data_rank = rank if kind == "fsdp" else 0
    directory = out / "checkpoints"
    states: dict[str, Any] = {}
    info: dict[str, Any] = {}

    def new(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = shard(make_model(seed=seed), kind, world_size)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    # 1. a clean guarded run, its snapshots (every 2 steps, keep 2) written as checkpoints
    model, opt = new(0)
    store = sdc_guard.SnapshotStore(model, opt, every=2, keep=2, checkpoint_dir=directory)  # default run id
    clean = []
    with sdc_guard.protect(model, snapshots=store) as guard:
        for step in range(STEPS):
            guard.optimizer_step(opt, closure_for(model, opt, step, data_rank))
            clean.append(gathered_state(model, opt))
    states["clean"] = clean
    run = info["run_id"] = store.run_id
    dist.barrier()
    info["files"] = sorted(os.listdir(directory))
    info["contents"] = sorted(os.listdir(directory / f"sdc_guard-{run}-step4.dcp"))

    # 2. the in-memory snapshots dropped: restore() reads the newest checkpoint
    store.snapshots.clear()
    info["restored"] = store.restore().step
    states["restored"] = gathered_state(model, opt)

    if rank == 0:
        _plant_damage(directory, run)
    dist.barrier()

    # 3. a restart: other weights, a fresh Adam, a store of the same run, the step count
    #    resumed; a persistent fault at its first step is rolled back from disk
    model, opt = new(1)
    set_current_step(model, STEPS - 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = sdc_guard.SnapshotStore(model, opt, every=2, keep=2, checkpoint_dir=directory, run_id=run)
        info["temporaries"] = sorted(n for n in os.listdir(directory) if ".tmp-" in n)
        faults = (_persistent_fault(kind, STEPS - 1),) if rank == world_size - 1 else ()
        drill = sdc_guard.drill(model, *faults) if faults else contextlib.nullcontext()
        outcomes = []
        with drill, sdc_guard.protect(model, snapshots=store) as guard:
            for attempt in range(2):  # the last step, again after the rollback
                if attempt == 1 and faults:
                    drill.remove(faults[0])
                o = guard.optimizer_step(opt, closure_for(model, opt, STEPS - 1, data_rank))
                outcomes.append([o.step, o.flagged_ranks, o.classification, o.action, o.rolled_back_to])
                states["rolled_back" if attempt == 0 else "resumed"] = gathered_state(model, opt)
    info["outcomes"] = outcomes
    info["skipped"] = sorted(str(w.message) for w in caught if "skipping checkpoint" in str(w.message))
    dist.barrier()
    info["files_after_restart"] = sorted(os.listdir(directory))

    # 4. a restart under a new run id: the newest readable checkpoint of any run
    model, opt = new(2)
    info["any_run"] = sdc_guard.SnapshotStore(model, opt, checkpoint_dir=directory).restore().step
    states["any_run"] = gathered_state(model, opt)

    # 5. rank 1's disk fills up: the write of step 1 fails there (in DCP's shard files),
    #    and then (a second store) in the rank's own small file; every rank warns once and
    #    goes on in memory
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    model, opt = new(0)
    store = sdc_guard.SnapshotStore(model, opt, every=1, keep=2, checkpoint_dir=out / "full", run_id="full")
    second = sdc_guard.SnapshotStore(model, opt, checkpoint_dir=out / "full_small", run_id="small")
    stepped = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdc_guard.protect(model, snapshots=store) as guard:
                for step in range(3):
                    if step == 1 and rank == 1:
                        _limit_file_size(16 * 1024)  # the rank's own file fits, its shards do not
                    stepped.append(guard.optimizer_step(opt, closure_for(model, opt, step, data_rank)).stepped)
            if rank == 1:
                _limit_file_size(64)  # nothing fits
            second.take(2)
        finally:
            _limit_file_size(None)
    dist.barrier()
    info["disk"] = {"errors": [store.disk_error, second.disk_error], "stepped": stepped,
                    "warnings": [str(w.message) for w in caught if "cannot write checkpoints" in str(w.message)],
                    "files": sorted(os.listdir(out / "full")), "files_small": sorted(os.listdir(out / "full_small")),
                    "last_good": store.last_good.step}
    states["disk_last"] = gathered_state(model, opt)
    store.snapshots.clear()
    info["disk"]["restored"] = store.restore().step  # the checkpoints that were written are whole
    states["disk_restored"] = gathered_state(model, opt)
    return states, info


def run(rank: int, world_size: int, port: int, kind: str, scenarios: tuple[str, ...], out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        out = Path(out_dir)
        for scenario in scenarios:
            if scenario == "checkpoints":
                states, info = checkpoints(kind, rank, world_size, out)
                torch.save(states, out / f"rank{rank}-checkpoints.pt")
                (out / f"rank{rank}-checkpoints.json").write_text(json.dumps(info))
                continue
            results[scenario] = train(kind, scenario, rank, world_size)
        torch.save({s: r["states"] for s, r in results.items()}, out / f"rank{rank}.pt")
        summary = {s: {"outcomes": r["outcomes"], "reports": r["reports"]} for s, r in results.items()}
        (out / f"rank{rank}.json").write_text(json.dumps(summary))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort interpreter finalization (see ddp_worker.py)
