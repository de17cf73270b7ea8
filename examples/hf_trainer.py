"""Hugging Face Trainer: one callback protects every GEMM of training.

    python examples/hf_trainer.py --steps 100 --fault-step 40

Trains a small GPT-2 (built from a config, random init: nothing is downloaded) on a
generated corpus with ``Trainer(..., callbacks=[SDCGuardCallback()])``: every GEMM
verified, forward and backward; a detection re-executed before the optimizer steps,
rolled back or escalated; Prometheus metrics on http://127.0.0.1:9464/metrics while it
runs; ``sdc/*`` values in ``trainer.state.log_history`` and every ``report_to``
integration. ``--fault-step`` drills a transient bit flip into the first block's attention
projection at that step, to show it caught and re-executed.
"""

import argparse
import contextlib
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import sdc_guard
from sdc_guard.integrations.transformers import SDCGuardCallback
from sdc_guard.toy_gpt import CharData, make_corpus


class Windows(torch.utils.data.Dataset):
    """Token windows of the corpus; the model shifts the labels itself."""

    def __init__(self, data: CharData, n: int, ctx: int) -> None:
        self.data, self.n, self.ctx = data, n, ctx

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.data.batch(i, 1, self.ctx)
        return {"input_ids": x[0], "labels": x[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--fault-step", type=int, default=None, help="drill a transient fault at this step")
    parser.add_argument("--metrics-port", type=int, default=9464, help="0 disables the endpoint")
    args = parser.parse_args()

    data = CharData(make_corpus())
    torch.manual_seed(0)
    # eager attention: its matmuls are plain bmm, verified; the fused SDPA kernel is not a GEMM
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=data.vocab, n_positions=args.ctx,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(config)
    guard = SDCGuardCallback(metrics_port=args.metrics_port or None)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(output_dir=out, use_cpu=True, max_steps=args.steps, learning_rate=3e-3,
                                   per_device_train_batch_size=args.batch, logging_steps=20, report_to=[],
                                   save_strategy="no", disable_tqdm=True),
            train_dataset=Windows(data, args.steps * args.batch, args.ctx),
            callbacks=[guard],
        )
        faults = [] if args.fault_step is None else [
            sdc_guard.GemmFault(site="transformer.h.0.attn.c_attn", phase="forward", step=args.fault_step)]
        with sdc_guard.drill(model, *faults) if faults else contextlib.nullcontext():
            trainer.train()

    for outcome in guard.outcomes:
        for d in outcome.report.detections[:1]:
            print(f"step {outcome.step}: corruption in {d.site} ({d.phase} {d.op}) -> "
                  f"{outcome.classification}, {outcome.action}")
    logged = [e for e in trainer.state.log_history if "sdc/flag" in e]
    print(f"GEMMs verified: {guard.totals['gemms_verified']}, detections: {guard.totals['detections']}, "
          f"log entries with sdc/*: {len(logged)}")


if __name__ == "__main__":
    main()
