"""GEMMs captured from real training: the operands ``bench detect --captured`` corrupts.

Why: detection power measured on i.i.d. Gaussian operands says little about training,
whose operands carry means, outlier channels, sparse attention rows and duplicated
tokens (docs/ALGORITHM.md, "What it can see"). So the operands are copied, as they ran,
from a few steps of a real model (``bench_models.build``: ``transformers`` models from
small configs, the toy GPT) trained at its learning rate in the precision asked for
(bf16 / fp16 autocast, fp16 with a GradScaler, or fp32), forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from ..core.torch_private import TorchDispatchMode

from ..runtime.dispatch.ops import GEMM_HANDLERS
from .bench_models import PRECISIONS, build

aten = torch.ops.aten
_GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)


@dataclass(frozen=True)
class CapturedGemm:
    """One GEMM of a real run, copied as it ran: ``out = beta * bias + alpha * (a @ b)``."""

    model: str
    step: int
    op: str
    a: Tensor
    b: Tensor
    out: Tensor
    bias: Tensor | None
    alpha: float
    beta: float


class _Recorder(TorchDispatchMode):
    """Copies operands and result of every GEMM run under it while ``step`` is not None
    (layouts kept: ``clone`` preserves strides)."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model
        self.step: int | None = None
        self.gemms: list[CapturedGemm] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.step is None or func not in _GEMMS:
            return out
        gemm = GEMM_HANDLERS[func.overloadpacket](args, kwargs, out)  # the guard's own reading of the call
        copy = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        self.gemms.append(CapturedGemm(self.model, self.step, gemm.op, copy(gemm.a), copy(gemm.b),
                                       copy(gemm.out), copy(gemm.bias), gemm.alpha, gemm.beta))
        return out


def capture(name: str, precision: str, steps: int, at: tuple[int, ...], seed: int = 0) -> list[CapturedGemm]:
    """Train model ``name`` (``bench_models.build``) for ``steps`` steps in ``precision``
    and return the GEMMs of the steps in ``at`` (forward and backward), unguarded: what
    a correct run computes."""
    if steps < 1 or not at or min(at) < 0 or max(at) >= steps:
        raise ValueError(f"capture steps: expected steps >= 1 and 0 <= at < steps, got steps={steps}, at={at}")
    work = build(name, seed=seed)
    amp_dtype, scaled = PRECISIONS[precision]
    model = work.model
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    recorder = _Recorder(name)
    with recorder:
        for step in range(steps):
            recorder.step = step if step in at else None
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                loss = work.loss_of(model, step)
            recorder.step = step if step in at else None
            (scaler.scale(loss) if scaler is not None else loss).backward()
            recorder.step = None
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
    return recorder.gemms
