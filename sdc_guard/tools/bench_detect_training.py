"""``sdc-guard bench detect --training``: which samplers catch bit flips in a training run.

``bench detect`` measures the check itself, GEMM by GEMM. This measures what a sampler
makes of it in training: a small GPT (``sdc_guard.tools.toy_gpt``) trains, and at every step
after a warm-up one fault is injected: one bit of one element of the output of one
GEMM, the GEMM drawn uniformly among the step's forward and backward GEMMs, the bit drawn
within its class (sign, top exponent bit, other exponent bits, mantissa; the classes in
turn), the flip a toggle. Each sampler (``Full()``, ``Budget(b)``, ``Screened()``,
``Screened(Budget(b))``) trains its own copy of the model; at a trial step its copy runs
the step once with the fault (through ``Guard.optimizer_step``, the default policy) and is
then put back (model, optimizer, sampler) and runs the step clean, so every copy follows
the same clean trajectory and meets the same faults in the same states, and what a
sampler missed never accumulates. A fault is *caught* when the guarded step was a
detection (``StepOutcome.detected``: a confirmed GEMM flag, or a tripped screen whose
verified re-execution found corruption).

Whether a fault mattered is measured apart, on an unguarded copy: the update the
optimizer makes with the fault against the clean update from the same state,
``|faulty - clean| / |clean|`` over all parameters. A fault that moves the update by more
than 1 % is *harmful*; the report says, per bit class and sampler, the fraction caught
and the fraction of harmful faults let through.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
from typing import Any

import torch
from torch import nn

from .bench_common import Outcome, Progress, bit_field, machine, pct, resolve_device, table
from ..runtime.guard import Guard, protect
from ..runtime.schedule import set_current_step
from ..runtime.inject import GemmFault, drill
from ..runtime.sampling import Budget, Full, Sampler, Screened
from ..respond.snapshot import SnapshotStore
from .toy_gpt import GPT, GPTConfig

#: Bit classes of a float32 GEMM output, in the order trials take them.
BIT_CLASSES = ("sign", "exponent (top)", "exponent", "mantissa")
#: An update moved by more than this (relative) is a harmful fault.
HARMFUL = 0.01
#: Clean steps before the first trial: the screen's reference and Budget's costs are learnt.
WARMUP_STEPS = 6
#: faults when ``--trials`` is not given
TRIALS = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--training (faults in a training run, per sampler)")
    group.add_argument("--training", action="store_true",
                       help="inject random single-bit faults into random GEMMs of a training run and report, per "
                            "bit class, what each sampler catches")
    group.add_argument("--trials", type=int, default=None,
                       help=f"--training: faults, one per step (default {TRIALS}: 50 per bit class); --attention: "
                            "SDPA calls per kind of operands and dtype, each one trial per output row (default 2)")
    group.add_argument("--budget", type=float, default=0.05, help="Budget's max_overhead (default 0.05)")


def _bits(name: str) -> list[int]:
    return [b for b in range(32) if bit_field(torch.float32, b) == name]


def _batch(seed: int, step: int, cfg: GPTConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.ctx + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


class _Copy:
    """One sampler's copy of the model, its optimizer and its guard."""

    def __init__(self, base: nn.Module, sampler: Sampler | None, device: torch.device) -> None:
        self.model = copy.deepcopy(base).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sampler = sampler
        self.guard: Guard | None = None
        if sampler is not None:  # snapshots off: a rollback is never needed, the trial is put back
            self.guard = protect(self.model, sampler=sampler,
                                 snapshots=SnapshotStore(self.model, self.opt, every=10**9))

    def state(self) -> tuple[Any, ...]:
        return (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()),
                None if self.sampler is None else copy.deepcopy(self.sampler.state_dict()))

    def restore(self, state: tuple[Any, ...], step: int) -> None:
        model, opt, sampler = state
        self.model.load_state_dict(model)
        self.opt.load_state_dict(opt)
        if self.sampler is not None and sampler is not None:
            self.sampler.load_state_dict(copy.deepcopy(sampler))
        set_current_step(self.model, step)
        if self.guard is not None:
            self.guard.cache.invalidate()  # the weights were written behind its back

    def step(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        """One training step; through the guard when there is one (its outcome)."""
        model, opt = self.model, self.opt

        def closure() -> torch.Tensor:
            loss = model.loss(x, y)
            loss.backward()
            return loss

        opt.zero_grad(set_to_none=True)
        if self.guard is None:
            closure()
            opt.step()
            return None
        with self.guard:
            return self.guard.optimizer_step(opt, closure)

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _relative_change(before: list[torch.Tensor], faulty: list[torch.Tensor], clean: list[torch.Tensor]) -> float:
    """|faulty update - clean update| / |clean update| over all parameters."""
    diff = math.sqrt(sum(float((f.double() - c.double()).square().sum()) for f, c in zip(faulty, clean)))
    norm = math.sqrt(sum(float((c.double() - b.double()).square().sum()) for b, c in zip(before, clean)))
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def run(args: argparse.Namespace) -> Outcome:
    if args.trials is None:
        args.trials = TRIALS
    if args.trials < 1:
        raise ValueError(f"trials: expected a positive int, got {args.trials}")
    if not 0 < args.budget < math.inf:
        raise ValueError(f"budget: expected a positive overhead fraction (0.05 = 5 %), got {args.budget}")
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=128, ctx=32, d_model=64, heads=4, layers=2)
    batch = 4
    base = GPT(cfg)
    names = ["Full()", f"Budget({args.budget:g})", "Screened()", f"Screened(Budget({args.budget:g}))"]
    samplers: list[Sampler] = [Full(), Budget(args.budget), Screened(), Screened(Budget(args.budget))]
    copies = {name: _Copy(base, s, device) for name, s in zip(names, samplers)}
    plain = _Copy(base, None, device)
    rng = random.Random(args.seed)
    for step in range(WARMUP_STEPS):
        x, y = (t.to(device) for t in _batch(args.seed, step, cfg, batch))
        for c in (*copies.values(), plain):
            c.step(x, y)
    full_guard = copies["Full()"].guard
    assert full_guard is not None and full_guard.last_report is not None
    gemms = full_guard.last_report.seen  # forward and backward GEMMs of a step
    progress = Progress(args.trials, quiet=args.quiet)
    trials: list[dict[str, Any]] = []
    for i in range(args.trials):
        step = WARMUP_STEPS + i
        x, y = (t.to(device) for t in _batch(args.seed, step, cfg, batch))
        cls = BIT_CLASSES[i % len(BIT_CLASSES)]
        fault = GemmFault(step=step, call=rng.randrange(gemms), bit=rng.choice(_bits(cls)), direction="flip")
        seed = rng.randrange(2**31)  # the element, drawn by the drill: the same in every copy
        # what the fault does to the update, unguarded
        state = plain.state()
        set_current_step(plain.model, step)  # the drill's clock; no guard keeps it on this copy
        with drill(plain.model, fault, seed=seed) as injector:
            plain.step(x, y)
        faulty = plain.params()
        injected = injector.injections[0] if injector.injections else None
        plain.restore(state, step)
        plain.step(x, y)
        change = _relative_change(_params_of(state, plain), faulty, plain.params())
        caught: dict[str, bool] = {}
        for name, c in copies.items():
            state = c.state()
            with drill(c.model, fault, seed=seed):
                outcome = c.step(x, y)
            caught[name] = bool(outcome.detected)
            c.restore(state, step)
            c.step(x, y)
        trials.append({"step": step, "class": cls, "bit": fault.bit, "call": fault.call,
                       "site": injected.site if injected else None, "phase": injected.phase if injected else None,
                       "changed": bool(injected and injected.changed), "update_change": change,
                       "harmful": change > HARMFUL, "caught": caught})
        progress.step(f"trial {i + 1} ({cls} bit {fault.bit}, {injected.site if injected else '?'})",
                      f"update moved {change:.2g}; caught by " + (", ".join(n for n, v in caught.items() if v) or "none"))
    results = _summarise(trials, names)
    print(_render(results, names, args, gemms))
    payload = {"command": "detect", "mode": "training", "machine": machine(device),
               "settings": {"trials": args.trials, "budget": args.budget, "seed": args.seed,
                            "warmup_steps": WARMUP_STEPS, "harmful_above": HARMFUL, "gemms_per_step": gemms,
                            "model": {"vocab": cfg.vocab, "ctx": cfg.ctx, "d_model": cfg.d_model,
                                      "heads": cfg.heads, "layers": cfg.layers, "batch": batch}},
               "samplers": names, "results": results, "trials": trials}
    return Outcome(0, payload)


def _params_of(state: tuple[Any, ...], c: _Copy) -> list[torch.Tensor]:
    """The parameters a saved state holds, in ``c.model.parameters()`` order."""
    names = [n for n, _ in c.model.named_parameters()]
    return [state[0][n] for n in names]


def _summarise(trials: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for cls in (*BIT_CLASSES, "all"):
        mine = [t for t in trials if cls == "all" or t["class"] == cls]
        harmful = [t for t in mine if t["harmful"]]
        row: dict[str, Any] = {"class": cls, "trials": len(mine), "harmful": len(harmful), "samplers": {}}
        for name in names:
            caught = sum(t["caught"][name] for t in mine)
            through = sum(not t["caught"][name] for t in harmful)
            row["samplers"][name] = {
                "caught": caught, "caught_rate": caught / len(mine) if mine else float("nan"),
                "harmful_let_through": through,
                "harmful_let_through_rate": through / len(harmful) if harmful else float("nan"),
            }
        rows.append(row)
    return rows


def _render(results: list[dict[str, Any]], names: list[str], args: argparse.Namespace, gemms: int) -> str:
    headers = ["bit class", "faults", "harmful"] + [f"{n} caught / harmful missed" for n in names]
    body = []
    for r in results:
        cells = [f"{pct(s['caught_rate'])} / {pct(s['harmful_let_through_rate'])}"
                 for s in (r["samplers"][n] for n in names)]
        body.append([r["class"], r["trials"], r["harmful"], *cells])
    return "\n".join([
        f"single-bit faults (toggle) in random GEMMs of a training run: a 2-layer GPT (d_model 64, ctx 32, batch 4, "
        f"fp32), {gemms} GEMMs per step, {args.trials} faults, one per step after {WARMUP_STEPS} clean steps",
        f"caught: the guarded step was a detection; harmful: the fault moved the optimizer's update by more than "
        f"{pct(HARMFUL)}; harmful missed: the share of harmful faults the sampler let through",
        "", table(headers, body, align="lrr" + "r" * len(names))])
