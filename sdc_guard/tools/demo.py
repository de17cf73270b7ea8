"""``sdc-guard demo``: watch silent data corruption get caught and handled, in a minute.

Trains a small GPT on a generated corpus with Lightning and ``SDCGuard`` verifying every
GEMM, serves Prometheus metrics on localhost, and at announced steps injects:

1. a transient bit flip: detected, re-executed (TRANSIENT), and training goes on exactly
   as in a clean reference run (same losses, bit for bit);
2. a sticky fault (a faulty unit): detected, reproduced on re-execution (PERSISTENT),
   rolled back to the last known-good snapshot; the demo then "replaces the node" (the
   fault goes away), as a scheduler would after ``EXIT_PERSISTENT``.

It ends with a summary: steps, GEMMs verified, detections and responses, overhead, and
the final loss next to the clean reference run's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import GemmFault, drill
from .toy_gpt import GPT, CharData, GPTConfig, make_corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options: size, schedule, port."""
    parser.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    parser.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--ctx", type=int, default=64, help="context length (default 64)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch (default 16)")
    parser.add_argument("--transient-step", type=int, default=30, help="step of the transient bit flip")
    parser.add_argument("--sticky-step", type=int, default=60, help="step the faulty unit appears")
    parser.add_argument("--no-faults", action="store_true", help="a clean run: no drills")
    parser.add_argument("--port", type=int, default=9464, help="Prometheus endpoint port on 127.0.0.1 (0: none)")
    parser.add_argument("--plot", metavar="PNG", help="save a plot of loss and overhead per step (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class DemoResult:
    """What the demo measured (returned for tests and scripts)."""

    losses: list[float]
    reference_losses: list[float]
    overheads: list[float]
    overhead_line: str  #: the guard's time over the steps' time without it, and how it was known
    outcomes: list[Any] = field(default_factory=list)
    gemms_verified: int = 0
    metrics_url: str | None = None
    seconds: float = 0.0

    @property
    def detections(self) -> list[Any]:
        return [o for o in self.outcomes if o.flagged_ranks]


def _lit_module(data: CharData, cfg: GPTConfig, args: argparse.Namespace) -> Any:
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader, Dataset

    class Windows(Dataset):
        def __len__(self) -> int:
            return args.steps * args.batch * 2

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = data.batch(i, 1, cfg.ctx, seed=args.seed)
            return x[0], y[0]

    class LitDemo(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(args.seed)
            self.model = GPT(cfg)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model.loss(*batch)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            # the step's loss as the guard handed it back: a rolled-back step shows the
            # last good loss, not the corrupted run's NaN
            self.log("loss", outputs["loss"], prog_bar=True)
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Windows(), batch_size=args.batch, shuffle=False)

    return LitDemo()


def _trainer(args: argparse.Namespace, callbacks: list, progress: bool) -> Any:
    from lightning.pytorch import Trainer

    return Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                   enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=progress,
                   callbacks=callbacks)


def _node_replacer(faults: Any, sticky: GemmFault) -> Any:
    """Removes the faulty unit once the guard has rolled back (the node was "replaced")."""
    from lightning.pytorch.callbacks import Callback

    class ReplaceNode(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            guard = next(c for c in trainer.callbacks if hasattr(c, "guard")).guard
            if guard.outcomes and guard.outcomes[-1].action == "rollback" and sticky in faults.faults:
                faults.remove(sticky)

    return ReplaceNode()


def run_demo(args: argparse.Namespace) -> DemoResult:
    """Reference run, then the guarded run with drills; returns what was measured."""
    from ..integrations.guarded_training import overhead_line
    from ..integrations.lightning import SDCGuard

    started = time.perf_counter()
    data = CharData(make_corpus(seed=args.seed))
    cfg = GPTConfig(vocab=data.vocab, ctx=args.ctx, d_model=args.d_model, heads=4, layers=args.layers)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    print("[1/2] clean reference run (no guard, no faults) ...", flush=True)
    reference = _lit_module(data, cfg, args)
    _trainer(args, [], progress=False).fit(reference)

    guard_cb = SDCGuard(metrics_port=args.port or None, snapshot_every=10)
    module = _lit_module(data, cfg, args)
    transient = GemmFault(site="model.blocks.0.attn.qkv", phase="forward", step=args.transient_step)
    sticky = GemmFault(site=f"model.blocks.{args.layers - 1}.fc2", step=args.sticky_step, sticky=True)
    faults = () if args.no_faults else (transient, sticky)
    print("[2/2] guarded run: SDCGuard verifies every GEMM, forward and backward", flush=True)
    if not args.no_faults:
        print(f"      step {args.transient_step}: a transient bit flip in blocks.0.attn.qkv (forward)\n"
              f"      step {args.sticky_step}: a faulty unit corrupts blocks.{args.layers - 1}.fc2 "
              f"on every call, until the node is replaced", flush=True)
    with drill(module, *faults, seed=args.seed) as injector:
        trainer = _trainer(args, [guard_cb, _node_replacer(injector, sticky)], progress=True)
        if guard_cb.metrics_port is not None:
            print(f"      Prometheus metrics: http://127.0.0.1:{guard_cb.metrics_port}/metrics", flush=True)
        trainer.fit(module)
    guard = guard_cb.guard
    return DemoResult(
        losses=module.losses, reference_losses=reference.losses,
        overheads=[r.overhead for r in guard.reports if r.attempt == 0],
        overhead_line=overhead_line(list(guard.reports)),
        outcomes=list(guard.outcomes), gemms_verified=guard_cb.totals["gemms_verified"],
        metrics_url=guard_cb.metrics_url, seconds=time.perf_counter() - started,
    )


def summary(result: DemoResult, args: argparse.Namespace) -> str:
    """The demo's closing lines."""
    lines = ["", "=" * 72, "sdc-guard demo: what happened", "=" * 72]
    lines.append(f"steps trained        {len(result.losses)}   GEMMs verified {result.gemms_verified}")
    lines.append(f"guard cost           {result.overhead_line}; every GEMM verified")
    if not result.detections:
        lines.append("detections           none")
    for o in result.detections:
        d = o.report.detections[0]
        where = f"{d.site} ({d.phase} {d.op}), rows {d.rows[:3]}, D/T={d.ratio:.3g}"
        lines.append(f"step {o.step:<4} detected  {where}")
        what = {"recompute": "re-executed clean: TRANSIENT, step kept with the clean gradients",
                "rollback": f"reproduced: PERSISTENT, rolled back to the snapshot of step {o.rolled_back_to}"}
        lines.append(f"           response  {what.get(o.action or '', o.action)}")
    cut = args.sticky_step if not args.no_faults else len(result.losses)
    same = result.losses[:cut] == result.reference_losses[:cut]
    lines.append(f"loss through step {cut - 1}: {'identical to' if same else 'DIFFERENT from'} the clean run, bit for bit")
    lines.append(f"final loss           {result.losses[-1]:.4f}   (clean reference run: {result.reference_losses[-1]:.4f})")
    if result.metrics_url:
        lines.append(f"metrics served at    {result.metrics_url}")
    if not args.no_faults:
        lines.append("escalation           a second PERSISTENT fault within 100 steps would exit with code 17")
        lines.append("                     (EXIT_PERSISTENT) so that the scheduler replaces the node")
    lines.append(f"wall time            {result.seconds:.0f} s")
    return "\n".join(lines)


def _plot(result: DemoResult, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'sdc-guard[plot]')"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(result.reference_losses, label="clean reference", lw=2, alpha=0.6)
    ax1.plot(result.losses, label="guarded run with faults", lw=1)
    for o in result.detections:
        ax1.axvline(o.step, color="red", ls=":", lw=1)
    ax1.set_ylabel("loss")
    ax1.legend()
    ax2.plot([100 * x for x in result.overheads])
    ax2.set_ylabel("guard overhead (%)")
    ax2.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"plot written to {path}"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sdc-guard demo``."""
    if not args.no_faults and not 0 <= args.transient_step < args.sticky_step < args.steps:
        raise SystemExit("demo: expected 0 <= --transient-step < --sticky-step < --steps")
    result = run_demo(args)
    print(summary(result, args))
    if args.plot:
        print(_plot(result, args.plot))
    expected = [] if args.no_faults else ["recompute", "rollback"]
    return 0 if [o.action for o in result.detections] == expected else 1
