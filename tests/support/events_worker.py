"""One rank of ``test_events``'s DDP run, started as torchrun would (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment): a sticky fault on the last rank
reproduces, is rolled back, reproduces again, and every rank exits with the exit
response's code. Events go where ``$SDC_GUARD_EVENTS`` says."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))

import sdc_guard  # noqa: E402
from respond_helpers import make_model, train  # noqa: E402


def main(out: Path) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    faults = (sdc_guard.GemmFault(site="head", step=3, sticky=True),) if rank == world - 1 else ()
    try:
        train(model, 8, faults=faults, rank=rank, wrapped=DDP(model),
              policy=sdc_guard.Policy(exit_report_dir=out / "report"))
    except sdc_guard.SDCExit as exc:
        return int(exc.code)
    return 0


if __name__ == "__main__":
    code = main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's threads can abort the interpreter's finalization (see ddp_worker.py): leave
    # with the code the response chose, which is what a scheduler reads
    os._exit(code)
