"""One rank of the collective-check tests (tests/test_collectives.py, sdc-guard's bench):
real gloo process groups on CPU, the tiny GPT of tests/models.py trained under DDP, FSDP2
or tensor parallelism, clean or with ``sdc_guard.CollectiveFault`` drills.

A scenario is ``"clean"``, ``"<corruption>:<op>:<rank>:<step>"`` (one corruption of that
collective's result on that rank, ``*`` for every rank, at that step: ``zero``, ``flip`` or
``stale``), ``"persistent:<op>:<rank>:<step>"`` (a sticky flip from that step, removed
the step after) or ``"exit:<op>:<rank>:<step>"`` (a sticky flip with
``Policy(on_persistent="exit")``). Each scenario trains a fresh copy of the model from the
same seed; every rank writes what each step reported and its final state, gathered whole.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import sdc_guard
from models import TinyGPT, lm_batch
from sdc_guard.runtime.sampling.sampler_base import Stateless

#: a worker that has not finished by then dumps its stacks and exits (a test never hangs);
#: more for long runs (``deadline``)
WORKER_TIMEOUT = 240


def deadline(jobs: int, steps: int) -> float:
    """Seconds a run of ``jobs`` jobs of ``steps`` steps may take on two shared cores."""
    return max(WORKER_TIMEOUT, 2.0 * jobs * steps)


class CollectivesOnly(Stateless):
    """Watch every step (so that its collectives are checked) and verify no GEMM: the
    clean runs measure the collective checks alone."""

    def should_verify(self, site: Any) -> bool:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Any, args: tuple, nprocs: int, timeout: float = WORKER_TIMEOUT + 30) -> None:
    """``torch.multiprocessing.spawn`` with a deadline: the workers are killed (and the
    call raises) when it passes, so that a hang fails the test instead of the suite."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"collective workers still running after {timeout:.0f} s")


def build(kind: str, dtype: torch.dtype, world_size: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model (what is protected) and what runs the forward (a DDP wrapper)."""
    torch.manual_seed(0)
    model = TinyGPT(layers=1)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = model.to(dtype)
        return model, DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    if kind == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype != torch.float32 \
            else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = model.to(dtype)
    parallelize_module(model, mesh, {"blocks.0.fc1": ColwiseParallel(), "blocks.0.fc2": RowwiseParallel()})
    return model, model


def closure_for(runner: torch.nn.Module, opt: torch.optim.Optimizer, step: int, data_rank: int):
    x, y = lm_batch(step * 16 + data_rank)

    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(runner(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    return closure


def full_state(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def fault_of(scenario: str) -> tuple[str, sdc_guard.CollectiveFault | None, int | None]:
    """(what the scenario does, its fault, the step the fault goes away at)."""
    if scenario == "clean":
        return "clean", None, None
    what, op, rank, step = scenario.split(":")
    receiver = None if rank == "*" else int(rank)
    if what in ("persistent", "exit"):
        return what, sdc_guard.CollectiveFault(op=op, rank=receiver, step=int(step), sticky=True), int(step) + 1
    return what, sdc_guard.CollectiveFault(op=op, rank=receiver, step=int(step), call=0, corruption=what), None


def train(kind: str, dtype: torch.dtype, scenario: str, rank: int, world_size: int, steps: int) -> dict[str, Any]:
    model, runner = build(kind, dtype, world_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    what, fault, removed_at = fault_of(scenario)
    policy = sdc_guard.Policy(on_persistent="exit") if what == "exit" else sdc_guard.Policy()
    store = sdc_guard.SnapshotStore(model, opt, every=2)
    sampler = CollectivesOnly() if what == "clean" else None
    data_rank = 0 if kind == "tp" else rank
    drill = sdc_guard.drill(model, fault) if fault is not None else contextlib.nullcontext()
    reports, outcomes, exit_code = [], [], None
    try:
        with drill, sdc_guard.protect(model, policy=policy, snapshots=store, sampler=sampler) as guard:
            for step in range(steps):
                if removed_at is not None and step == removed_at:
                    drill.remove(fault)
                outcome = guard.optimizer_step(opt, closure_for(runner, opt, step, data_rank))
                r = outcome.report
                reports.append({"step": r.step, "checks": r.collective_checks, "unchecked": r.collectives_unchecked,
                                "verified": r.verified,
                                "detections": [{"op": d.op, "site": d.site, "senders": d.senders,
                                                "receiver": d.receiver, "segments": d.segments, "kind": d.kind}
                                               for d in r.detections],
                                "rerun_detections": [len(x.detections) for x in outcome.reruns]})
                outcomes.append({"step": outcome.step, "flagged_ranks": outcome.flagged_ranks,
                                 "classification": outcome.classification, "action": outcome.action,
                                 "rolled_back_to": outcome.rolled_back_to})
    except sdc_guard.SDCExit as exc:
        exit_code = exc.code
    injections = [{"step": i.step, "op": i.op, "changed": i.changed} for i in getattr(drill, "injections", [])]
    return {"reports": reports, "outcomes": outcomes, "exit_code": exit_code, "injections": injections,
            "state": full_state(model)}


def run(rank: int, world_size: int, port: int, jobs: list[tuple[str, str, str]], steps: int, out_dir: str) -> None:
    """Run each ``(kind, dtype, scenario)`` job in turn in one process group; write every
    job's reports (``rank<r>.json``) and final state (``rank<r>.pt``) under
    ``"kind/dtype/scenario"``."""
    faulthandler.dump_traceback_later(deadline(len(jobs), steps), exit=True)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        states, summary = {}, {}
        for kind, dtype_name, scenario in jobs:
            result = train(kind, getattr(torch, dtype_name), scenario, rank, world_size, steps)
            key = f"{kind}/{dtype_name}/{scenario}"
            states[key] = result.pop("state")
            summary[key] = result
        torch.save(states, Path(out_dir) / f"rank{rank}.pt")
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(summary))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort interpreter finalization (see ddp_worker.py)


def results(out_dir: Path, world_size: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every rank's summaries and states, as ``run`` wrote them."""
    summaries = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    states = [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]
    return summaries, states
