"""Two processes on CPU (gloo), a fault on one rank, both ranks respond in lockstep.

    python examples/ddp_gloo.py

Rank 1 suffers a transient bit flip at step 3. Every rank learns of it at the end of the
step (one small all-gather), every rank re-executes the step (DDP's backward all-reduces,
so a re-run on one rank alone would hang the other), and both end with identical weights.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from sdc_guard.toy_gpt import GPT, CharData, GPTConfig, make_corpus

STEPS = 8


def worker(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    data = CharData(make_corpus())
    model = GPT(GPTConfig(vocab=data.vocab, ctx=32, d_model=32, layers=1))
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    faults = [sdc_guard.GemmFault(site="blocks.0.fc1", phase="forward", step=3)] if rank == 1 else []
    with sdc_guard.drill(model, *faults), sdc_guard.protect(model) as guard:
        for step in range(STEPS):
            x, y = data.batch(step * world_size + rank, 8, 32)

            def closure() -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                loss.backward()
                return loss

            outcome = guard.optimizer_step(optimizer, closure)
            if outcome.flagged_ranks:
                print(f"rank {rank} step {step}: rank(s) {outcome.flagged_ranks} flagged -> "
                      f"{outcome.classification}, {outcome.action}", flush=True)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    sums = [None] * world_size
    dist.all_gather_object(sums, checksum)
    if rank == 0:
        print(f"parameters identical on all ranks: {len(set(sums)) == 1}", flush=True)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    # gloo's threads can still abort the interpreter's finalization (SIGABRT, "terminate
    # called without an active exception"; pytorch/pytorch#179291): the work is done, so
    # leave without finalizing
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
