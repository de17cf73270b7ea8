"""One rank of the flag-exchange tests (tests/integration/test_collectives.py): the tiny GPT
under DDP on a real gloo group, counting the collectives the guard itself issues per
step (``torch.distributed`` calls made from ``sdc_guard``'s modules), so that a test can
tell whether the step's flags rode in the collective checks' exchange (one all-reduce,
no all-gather) or took their own all-gather.

A scenario is ``"<mode>:<fault>"``: the mode ``merged`` (collectives checked every
step), ``off`` (``protect(collectives=False)``) or ``every2`` (``EveryN(2)``: the odd
steps unwatched, their collectives unchecked); the fault ``clean``, ``gemm`` (a GEMM
fault on rank 1 at ``FAULT_STEP``) or ``coll`` (a flipped all-reduce result on rank 1 at
``FAULT_STEP``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import sdc_guard
from collective_worker import WORKER_TIMEOUT, build, closure_for
from sdc_guard.runtime.sampling import EveryN

STEPS = 4
FAULT_STEP = 2
#: the ``torch.distributed`` functions counted when ``sdc_guard`` calls them
COUNTED = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
           "all_gather_into_tensor", "reduce_scatter_tensor")


def count_guard_collectives() -> dict[str, int]:
    """Wrap ``COUNTED`` so that each call from a module of ``sdc_guard`` is counted (the
    model's own collectives, DDP's reducer's, are not Python calls from there)."""
    counts = {name: 0 for name in COUNTED}
    for name in COUNTED:
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals.get("__name__", "").startswith("sdc_guard"):
                counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def train(scenario: str, rank: int, world_size: int, counts: dict[str, int]) -> dict[str, Any]:
    mode, what = scenario.split(":")
    model, runner = build("ddp", torch.float32, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fault: Any = None
    if rank == 1 and what == "gemm":
        fault = sdc_guard.GemmFault(site="blocks.0.fc1", phase="forward", step=FAULT_STEP)
    elif rank == 1 and what == "coll":
        fault = sdc_guard.CollectiveFault(op="all_reduce", rank=1, step=FAULT_STEP, call=0, corruption="flip")
    drill = sdc_guard.drill(model, fault) if fault is not None else contextlib.nullcontext()
    # no calibration replay: its steps agree once more (calibration.py), which is not the flags
    options: dict[str, Any] = {"collectives": mode != "off", "calibrate_every": None}
    if mode == "every2":
        options["sampler"] = EveryN(2)
    steps = []
    with drill, sdc_guard.protect(model, **options) as guard:
        for step in range(STEPS):
            before = dict(counts)
            outcome = guard.optimizer_step(opt, closure_for(runner, opt, step, rank))
            used = {k: counts[k] - before[k] for k in counts if counts[k] != before[k]}
            steps.append({"step": outcome.step, "collectives": used, "flagged_ranks": outcome.flagged_ranks,
                          "classification": outcome.classification, "action": outcome.action,
                          "checks": outcome.report.collective_checks, "flagged": outcome.report.flagged})
    return {"steps": steps}


def run(rank: int, world_size: int, port: int, scenarios: list[str], out_dir: str) -> None:
    faulthandler.dump_traceback_later(WORKER_TIMEOUT, exit=True)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    counts = count_guard_collectives()
    try:
        summary = {scenario: train(scenario, rank, world_size, counts) for scenario in scenarios}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(summary))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort interpreter finalization (see ddp_worker.py)
