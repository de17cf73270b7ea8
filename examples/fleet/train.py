"""The training script the fleet recipes launch (Slurm, Kubernetes, nvidia-resiliency-ext).

    python examples/fleet/train.py --steps 200
    torchrun --nproc-per-node 8 examples/fleet/train.py           # one process per device

Nothing in it is about the scheduler: the job's script sets where the structured events
and the exit report go (``SDC_GUARD_EVENTS``, ``SDC_GUARD_EXIT_REPORT_DIR``) and which
node this is (``SDC_GUARD_NODE``), the guard answers a detection (re-execute, roll back,
exit with 16, 17 or 18), and the job's script acts on the exit code and the report
(``sdc-guard drain``). docs/OPERATIONS.md.

``--drill transient`` or ``--drill sticky`` injects a fault (``sdc_guard.drill``) on the
last rank at ``--fault-step``: a sticky one reproduces, is rolled back, reproduces again
and the job exits with 17: how the recipes are rehearsed (and tested) without bad hardware.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.distributed as dist

import sdc_guard
from sdc_guard.toy_gpt import GPT, CharData, GPTConfig, make_corpus


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--drill", choices=("none", "transient", "sticky"), default="none")
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--on-detection", choices=("recompute", "exit"), default="recompute",
                        help="exit: stop at the first detection, unconfirmed (exit code 16)")
    return parser.parse_args(argv)


def train(args: argparse.Namespace, *, policy: sdc_guard.Policy | None = None,
          on_step: Callable[[int], None] | None = None) -> int:
    """Train; ``policy`` answers detections (default ``Policy(on_detection=args.on_detection)``),
    ``on_step`` runs after each optimizer step (a launcher's heartbeat). An exit response
    raises ``SDCExit``."""
    policy = policy if policy is not None else sdc_guard.Policy(on_detection=args.on_detection)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():  # torchrun, srun, ft_launcher
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank() if dist.is_initialized() else 0
    last = (dist.get_world_size() if dist.is_initialized() else 1) - 1
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    torch.manual_seed(0)
    data = CharData(make_corpus(400))
    model = GPT(GPTConfig(vocab=data.vocab, ctx=32, d_model=32, layers=1)).to(device)
    runner = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    store = sdc_guard.SnapshotStore(model, optimizer, every=2)
    faults = []
    if args.drill != "none" and rank == last:
        faults = [sdc_guard.GemmFault(site="head", step=args.fault_step, sticky=args.drill == "sticky")]

    with sdc_guard.drill(model, *faults), sdc_guard.protect(model, snapshots=store, policy=policy) as guard:
        for step in range(args.steps):
            x, y = (t.to(device) for t in data.batch(step * 8 + rank, 8, 32))

            def closure() -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(runner(x).flatten(0, 1), y.flatten())
                loss.backward()
                return loss

            outcome = guard.optimizer_step(optimizer, closure)  # an exit response raises SDCExit(16/17/18)
            if outcome.detected:
                print(f"step {step}: {outcome.classification}, {outcome.action}", flush=True)
            if on_step is not None:
                on_step(step)
    print(f"rank {rank}: trained {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(train(parse()))
