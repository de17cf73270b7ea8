"""Lightning DDP (2 CPU processes, gloo) with a transient fault on rank 1 only.

Run as a script: Lightning's "ddp" strategy re-launches this file for rank 1.
"""

import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer

import sdc_guard
from lit_models import LitGPT


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    module = LitGPT()
    callback = sdc_guard.SDCGuard(metrics_port=None)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      limit_val_batches=0, callbacks=[callback])
    faults = (sdc_guard.GemmFault(site="model.blocks.0.fc1", phase="forward", step=2),) if rank == 1 else ()
    with sdc_guard.drill(module, *faults):
        trainer.fit(module)
    torch.save([p.detach() for p in module.parameters()], out / f"rank{trainer.global_rank}.pt")
    summary = [{"step": o.step, "flagged_ranks": o.flagged_ranks, "classification": o.classification,
                "action": o.action} for o in callback.guard.outcomes]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
