"""``sdc-guard bench collectives``: what checking the collectives costs a distributed step.

A small GPT (``sdc_guard.tools.toy_gpt``) trains data-parallel on ``--world-size`` gloo
ranks of this machine, under DDP and under FSDP2 (``fully_shard`` on every block and the
root), in three identical copies per configuration: unguarded (the baseline), under
``protect()`` with ``collectives=False`` and with ``collectives=True`` (the default). Both
guarded copies use a sampler that watches every step and verifies no GEMM, so that they
pay the same interception and the difference between them is the collective checks alone:
the senders' and receivers' checksums and the one small all-reduce per step that exchanges
them. The copies take their steps in turn, round after round (the order rotated each
round), every rank in lockstep, so that a slow spell of the machine falls on all of them;
a step's time is the slowest rank's.

Exit status 1 when a clean run reported a detection (a false positive).

Reported per configuration: each copy's median step time; the checks' cost, ``(on - off) /
baseline``, in wall time as the median of per-round ratios and over the totals, and in
CPU time (every rank's process, all its threads, over the totals: what the checks compute,
without the waits a crowded machine adds at every synchronisation); and from the guard's
own reports the checks' time and the exchange's (its all-reduce, waits for the other ranks
included) per step, how many numbers it exchanged, and that all-reduce alone (the same
size right after a barrier, median of 50): what the extra collective costs by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from os import _exit as leave
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .bench_common import Outcome, Progress, busy_warning, load_average, machine, pct, table

KINDS = ("ddp", "fsdp")
COPIES = ("baseline", "collectives off", "collectives on")
#: a worker that has not finished by then dumps its stacks and exits
WORKER_TIMEOUT = 1800.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=40, help="measured rounds (steps per copy; default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before measuring (default 3)")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks on this machine (default 2)")
    parser.add_argument("--kinds", default="ddp,fsdp", help="ddp, fsdp or both (default ddp,fsdp)")
    model = parser.add_argument_group("model (a GPT with explicit attention matmuls)")
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--ctx", type=int, default=128)
    model.add_argument("--vocab", type=int, default=256)
    model.add_argument("--batch", type=int, default=8, help="sequences per rank and step (default 8)")
    model.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                       help="the gradients' dtype: fp32 (default) or bf16 (DDP: the model in bf16; FSDP2: "
                            "bf16 parameters and reductions)")


def _check(args: argparse.Namespace) -> list[str]:
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"kinds: expected a comma-separated list of {', '.join(KINDS)}, got {args.kinds!r}")
    for name in ("steps", "world_size", "d_model", "layers", "heads", "ctx", "vocab", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.world_size < 2:
        raise ValueError(f"world-size: expected at least 2 ranks (collectives need a peer), got {args.world_size}")
    if args.warmup < 0:
        raise ValueError(f"warmup: expected a non-negative int, got {args.warmup}")
    if args.d_model % args.heads:
        raise ValueError(f"d-model: expected a multiple of --heads ({args.heads}), got {args.d_model}")
    return kinds


def run(args: argparse.Namespace) -> Outcome:
    kinds = _check(args)
    import torch.multiprocessing as mp

    config = {k: getattr(args, k) for k in ("steps", "warmup", "d_model", "layers", "heads", "ctx", "vocab",
                                            "batch", "dtype", "quiet")}
    results, load_before = [], load_average()
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            context = mp.start_processes(_worker, args=(args.world_size, _free_port(), kind, config, str(out)),
                                         nprocs=args.world_size, join=False, start_method="spawn")
            deadline = time.monotonic() + WORKER_TIMEOUT
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        if process.is_alive():
                            process.kill()
                    raise RuntimeError(f"the {kind} workers did not finish within {WORKER_TIMEOUT:.0f} s")
            results.append(json.loads(out.read_text()))
    load_after = load_average()
    rows = [[r["kind"], r["dtype"], f"{r['params']:,}", *(f"{r['step_ms'][c]:.1f}" for c in COPIES),
             pct(r["checks_cost"]), pct(r["checks_cost_total"]), pct(r["checks_cpu_cost"]), f"{r['checks_ms']:.2f}",
             f"{r['exchange_ms']:.2f}", f"{r['exchange_alone_ms']:.2f}",
             f"{r['exchanged']:,}", r["checks_per_step"], r["detections"]] for r in results]
    print(table(["config", "dtype", "params", "baseline ms", "off ms", "on ms", "checks cost (median)",
                 "checks cost (total)", "checks cost (CPU time)", "checks ms/step", "exchange ms/step",
                 "exchange alone ms", "fp64 exchanged/step",
                 "collectives checked/step", "detections"], rows))
    warning = busy_warning(load_before, load_after, torch.device("cpu"))
    if warning:
        print(warning)
    print("checks cost = (step with collectives on - step with collectives off) / unguarded step, in wall time "
          "(median of the rounds, and over the totals) and in CPU time (every rank's threads, totals); both guarded "
          "copies verify no GEMM, so the difference is the collective checks")
    detected = sum(r["detections"] for r in results)
    if detected:
        print(f"FAIL: {detected} detection(s) in clean runs: a false positive of the collective checks")
    return Outcome(1 if detected else 0, {"benchmark": "collectives", "machine": machine(torch.device("cpu")),
                       "torch": torch.__version__, "world_size": args.world_size, "config": config,
                       "load_average": [load_before, load_after], "results": results})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(kind: str, config: dict[str, Any], world_size: int) -> torch.nn.Module:
    from .toy_gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=config["vocab"], ctx=config["ctx"], d_model=config["d_model"],
                          heads=config["heads"], layers=config["layers"]))
    bf16 = config["dtype"] == "bf16"
    if kind == "ddp":
        return model.to(torch.bfloat16) if bf16 else model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _batch(config: dict[str, Any], step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    seq = torch.randint(0, config["vocab"], (config["batch"], config["ctx"] + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _worker(rank: int, world_size: int, port: int, kind: str, config: dict[str, Any], out: str) -> None:
    import faulthandler

    import torch.distributed as dist
    import torch.nn.functional as F

    from ..respond.snapshot import SnapshotStore
    from ..runtime.lifecycle.guard import protect
    from .bench_train import Never

    faulthandler.dump_traceback_later(WORKER_TIMEOUT - 60, exit=True)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        models = {name: _build(kind, config, world_size) for name in COPIES}
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            runners = {name: DDP(m) for name, m in models.items()}
        else:
            runners = dict(models)
        optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
        guards = {name: protect(models[name], sampler=Never(), collectives=(name == "collectives on"),
                                snapshots=SnapshotStore(models[name], optims[name], every=10**9))
                  for name in COPIES[1:]}
        rounds = config["warmup"] + config["steps"]
        progress = Progress(rounds, quiet=config["quiet"] or rank != 0, stream=sys.stderr)
        times: dict[str, list[float]] = {name: [] for name in COPIES}
        cpu: dict[str, list[float]] = {name: [] for name in COPIES}  #: this process's CPU time, all threads
        reports = []
        for r in range(rounds):
            x, y = _batch(config, r, rank)
            order = COPIES[r % len(COPIES):] + COPIES[: r % len(COPIES)]
            took, cpu_took = {}, {}
            for name in order:
                opt, runner = optims[name], runners[name]

                def closure() -> torch.Tensor:
                    opt.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(runner(x).flatten(0, 1).float(), y.flatten())
                    loss.backward()
                    return loss

                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                if name in guards:
                    with guards[name]:
                        guards[name].optimizer_step(opt, closure)
                else:
                    closure()
                    opt.step()
                took[name] = time.perf_counter() - start
                cpu_took[name] = time.process_time() - cpu_start
            if r >= config["warmup"]:
                for name in COPIES:
                    times[name].append(took[name])
                    cpu[name].append(cpu_took[name])
                reports.append(guards["collectives on"].last_report)
            progress.step(f"{kind} round {r + 1}" + (" (warm-up)" if r < config["warmup"] else ""),
                          ", ".join(f"{name} {1e3 * took[name]:.0f} ms" for name in COPIES))
        alone = _exchange_alone(_exchanged(guards["collectives on"]))
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, times)
        cpus: list[Any] = [None] * world_size
        dist.all_gather_object(cpus, cpu)
        if rank == 0:
            slowest = {name: [max(t[name][i] for t in everyone) for i in range(len(times[name]))] for name in COPIES}
            base, off, on = (slowest[name] for name in COPIES)
            n = len(reports) or 1
            result = {
                "kind": kind, "dtype": config["dtype"], "params": sum(p.numel() for p in models["baseline"].parameters()),
                "step_ms": {name: 1e3 * statistics.median(slowest[name]) for name in COPIES},
                "checks_cost": statistics.median([(b - a) / c for a, b, c in zip(off, on, base)]),
                "checks_cost_total": (sum(on) - sum(off)) / sum(base),
                # CPU time (every rank's, all threads): what the checks computed, without the
                # waits a crowded machine adds to every synchronisation
                "checks_cpu_cost": (sum(sum(c["collectives on"]) for c in cpus) - sum(sum(c["collectives off"]) for c in cpus))
                / sum(sum(c["baseline"]) for c in cpus),
                "guard_cost_off": sum(off) / sum(base) - 1.0,
                "checks_ms": 1e3 * sum(rep.collective_seconds for rep in reports) / n,
                "exchange_ms": 1e3 * sum(rep.collective_exchange_seconds for rep in reports) / n,
                "exchange_share_of_step": sum(rep.collective_exchange_seconds for rep in reports) / sum(base),
                "checks_share_of_step": sum(rep.collective_seconds for rep in reports) / sum(base),
                "exchanged": _exchanged(guards["collectives on"]),
                "exchange_alone_ms": 1e3 * alone,
                "checks_per_step": statistics.mean(rep.collective_checks for rep in reports) if reports else 0,
                "unchecked": sorted({k for rep in reports for k in rep.collectives_unchecked}),
                "detections": sum(len(rep.detections) for rep in reports),
                "times_ms": {name: [1e3 * t for t in slowest[name]] for name in COPIES},
            }
            Path(out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    leave(0)  # os._exit: gloo's threads can abort interpreter finalization (tests/support/ddp_worker.py)


def _exchange_alone(numbers: int, reps: int = 50) -> float:
    """The median time of an all-reduce of ``numbers`` fp64 values right after a barrier:
    what the checks' extra collective costs by itself, without waiting for a late rank."""
    import torch.distributed as dist

    buffer = torch.zeros(max(numbers, 1), dtype=torch.float64)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _exchanged(guard: Any) -> int:
    """fp64 numbers the last step's exchange carried on this rank."""
    return guard.collective_checks.last_exchanged
