"""What the Hugging Face callback tests train: a small GPT-2 from a config, on seeded tokens."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import sdc_guard

#: GEMMs of one training micro-batch of ``gpt2()``: per block 4 addmm + 2 bmm forward,
#: 8 mm + 4 bmm backward (two per addmm, two per bmm); the head 1 mm forward, 2 backward.
GEMMS_PER_STEP = 2 * (6 + 12) + 3


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """Two blocks, d_model 64, random init. Eager attention: its matmuls are plain
    ``bmm`` (verified); the fused SDPA kernel is not a GEMM."""
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0,
                        eos_token_id=0, attn_implementation="eager")
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """``n`` seeded sequences of ``ctx`` tokens; the labels are the inputs (the model shifts)."""

    def __init__(self, n: int = 64, ctx: int = 32, seed: int = 0) -> None:
        self.ids = torch.randint(0, 128, (n, ctx), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):
    """What a ``report_to`` integration receives (each is a callback's ``on_log``), and the
    parameters after each optimizer step."""

    def __init__(self, keep_params: bool = False) -> None:
        self.logs: list[tuple[int, dict[str, Any]]] = []
        self.params: dict[int, list[torch.Tensor]] = {}
        self.keep_params = keep_params

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs or {})))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.keep_params:
            self.params[state.global_step] = [p.detach().clone() for p in model.parameters()]


def train(callback: TrainerCallback | None, out: Path, *, steps: int = 5, faults: tuple = (), model=None,
          callbacks: tuple = (), resume: str | None = None, **kwargs: Any) -> Trainer:
    """One real ``Trainer.train()`` on CPU, with ``faults`` drilled into the model.

    Each run starts from a fresh accelerate state, as a separate job would: transformers
    4.47 turns ``bf16=True`` into ``ACCELERATE_MIXED_PRECISION=bf16`` in the environment,
    and accelerate keeps its state in a process-wide singleton, so one bf16 run left every
    later Trainer of the process in bf16."""
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    AcceleratorState._reset_state(reset_partial_state=True)
    model = model if model is not None else gpt2()
    options: dict[str, Any] = dict(output_dir=str(out), use_cpu=True, max_steps=steps, per_device_train_batch_size=4,
                                   learning_rate=1e-3, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                                   dataloader_num_workers=0)
    options.update(kwargs)
    extra = [c for c in (callback, *callbacks) if c is not None]
    trainer = Trainer(model=model, args=TrainingArguments(**options), train_dataset=Tokens(),
                      eval_dataset=Tokens(8, seed=1), callbacks=extra)
    drill = sdc_guard.drill(model, *faults) if faults else contextlib.nullcontext()
    with drill:
        trainer.train(resume_from_checkpoint=resume)
    return trainer


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
