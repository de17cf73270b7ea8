"""``sdc-guard bench train``: what ``protect()`` costs a training step, end to end.

A small GPT (``sdc_guard.tools.toy_gpt``, sized for a CPU by the options; or, with ``--model``,
a ``transformers`` model built from a small config, ``sdc_guard.tools.bench_models``; or,
with ``--models``, several of them one after the other) trains in eight identical copies:
unprotected (the baseline), with an empty ``TorchDispatchMode`` around forward and
backward (what PyTorch's Python dispatch of every op costs any mode-based interception),
and under ``protect()`` with a sampler that verifies nothing (the fixed cost of
intercepting), ``Full()``, ``Budget(max_overhead)`` (the budget alone),
``Budget(max_overhead, window=W)`` (the budget, with every site verified at least once in
every ``W`` steps: the coverage window below; where a sweep costs more than ``W`` times
the budget the window wins), ``EveryN(n)`` and ``Screened()`` (the gradient screen). The
guarded copies take their steps as an integration does, through
``Guard.optimizer_step(optimizer, closure)``, so the guard's calibration replays
(``sdc_guard.runtime.lifecycle.calibration``) run and are paid for; rollback snapshots are off,
since they are the policy's cost. The copies take their steps in turn, round after round
(the order rotated each round), so that a slow spell of the machine falls on all of them;
each protected copy keeps one ``Guard`` (and so its weight-side cache, its sampler's
schedule and its model's calibration) across its steps.

Reported per configuration:

- end-to-end overhead: total step time over total baseline step time - 1, warm-up rounds
  excluded. Everything ``protect()`` adds is in it: the dispatch mode seeing every op,
  site tracking, sampling, verification, calibration replays, the step report. (Samplers
  that verify in sweeps make single steps uneven, so a median of per-round ratios would
  hide their cost; it is reported beside, as ``median``.);
- the guard's own account: what it says it added over the step time without it
  (``StepReport.guard_seconds`` over the reports' steps less it: interception as
  calibrated by the replays, bookkeeping, verification), the share of those reports that
  were calibrated (``StepReport.overhead_calibrated``), beside verification alone, and
  for ``Budget`` its ``achieved_overhead``: the reported figure should track the measured
  one;
- coverage: the largest gap, in steps, between two verifications of a site (or from a
  site's last verification to the end), so "every site verified at least once every W
  steps" is ``max gap <= W``; and ``Budget.coverage(W)``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from typing import Any

import torch
from ..core.torch_private import BaseTorchDispatchMode

from .bench_common import (
    SHORT_NAME, Outcome, Progress, argtype, busy_warning, load_average, machine, parse_dtypes, pct,
    resolve_device, sync, table,
)
from ..runtime.lifecycle.guard import protect
from ..runtime.sampling import Budget, EveryN, Full, Sampler, Screened, SiteKey, StepCosts, Stateless, sampler_watches
from ..respond.snapshot import SnapshotStore
from .toy_gpt import GPT, GPTConfig
from .train_figures import (  # noqa: F401  (the targets stay importable here)
    EMPTY_MODE, SCREENED, SPREAD_BLOCKS, TARGET_BUDGET, TARGET_FULL, TARGET_FULL_COMPILED, TARGET_FULL_COMPILED_AC,
    TARGET_FULL_EAGER, TARGET_REPORTED_GAP, TARGET_SCREENED, TARGET_WINDOW, block_overheads, budget_names,
    estimated_account, gap_points, guard_account, render, reported_against_measured, spread_of,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="measured rounds (steps per copy; default 60)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before measuring (default 3)")
    parser.add_argument("--budget", type=float, default=0.05, help="Budget's max_overhead (default 0.05)")
    parser.add_argument("--every-n", type=int, default=TARGET_WINDOW, help=f"EveryN's n (default {TARGET_WINDOW})")
    parser.add_argument("--window", type=int, default=TARGET_WINDOW,
                        help=f"coverage window in steps, promised by Budget's window= (default {TARGET_WINDOW})")
    model = parser.add_argument_group("model (a GPT with explicit attention matmuls)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (inductor): Full() and Budget against the compiled "
                             "unguarded step, the eager figures beside them (docs/COMPILE.md)")
    model.add_argument("--d-model", type=int, default=256)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--ctx", type=int, default=128)
    model.add_argument("--vocab", type=int, default=512)
    model.add_argument("--batch", type=int, default=8)
    model.add_argument("--ac", action="store_true",
                       help="activation checkpointing of every block (the backward recomputes each block's forward)")
    model.add_argument("--dtype", default="fp32", type=argtype(lambda t: _one_dtype(t)),
                       help="fp32 (default) or bf16 (autocast: the GEMMs run, and are verified, in bf16)")
    model.add_argument("--model", default=None,
                       help="a real model instead of the GPT above: hf:llama, hf:gpt2, hf:qwen2, hf:bert, ... or "
                            "toy:D/CTX/BATCH/LAYERS/LR (sdc_guard.tools.bench_models; overrides the GPT's options)")
    model.add_argument("--models", default=None,
                       help="several models, comma-separated, measured one after the other (gpt: the GPT above; "
                            "hf:llama,hf:gpt2,...); the JSON has one entry per model under 'runs'")


def _one_dtype(text: str) -> torch.dtype:
    dtypes = parse_dtypes(text)
    if len(dtypes) != 1 or dtypes[0] == torch.float16:
        raise ValueError(f"dtype: expected fp32 or bf16, got {text!r}")
    return dtypes[0]


class Never(Stateless):
    """Verify nothing: what ``protect()`` costs before any verification (the dispatch mode
    seeing every op, site tracking, the step's bookkeeping)."""

    def should_verify(self, site: SiteKey) -> bool:
        return False

    def __repr__(self) -> str:
        return "Never()"


#: A dispatch mode that only runs each op (torch's own): what PyTorch's Python dispatch
#: alone costs any interception built on a mode, before a line of sdc-guard runs (the
#: floor under "intercept only").
EmptyMode = BaseTorchDispatchMode


class RecordingSampler:
    """A sampler that passes every decision through and remembers which sites it verified
    at which step: the coverage a run really achieved, whatever the sampler claims."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.step = 0
        self.verified: dict[SiteKey, list[int]] = {}
        self.first_seen: dict[SiteKey, int] = {}

    def begin_step(self, step: int) -> None:
        self.step = step
        self.inner.begin_step(step)

    def watches_step(self) -> bool:
        return sampler_watches(self.inner)

    def should_verify(self, site: SiteKey) -> bool:
        self.first_seen.setdefault(site, self.step)
        decision = self.inner.should_verify(site)
        if decision:
            steps = self.verified.setdefault(site, [])
            if not steps or steps[-1] != self.step:
                steps.append(self.step)
        return decision

    def end_step(self, costs: StepCosts) -> None:
        self.inner.end_step(costs)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def max_gap(self, steps_run: int) -> int:
        """Largest number of consecutive steps a site went without a verification,
        counted from its first appearance to the end of the run."""
        worst = 0
        for site, first in self.first_seen.items():
            marks = [first - 1] + self.verified.get(site, []) + [steps_run]
            # the first appearance verifies under every sampler here, except EveryN off-step
            worst = max(worst, max(b - a for a, b in zip(marks, marks[1:])) - 1)
        return worst


def _model(args: argparse.Namespace, device: torch.device) -> GPT:
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, ctx=args.ctx, d_model=args.d_model, heads=args.heads, layers=args.layers,
                    checkpoint=getattr(args, "ac", False))
    return GPT(cfg).to(device)


def _batch(args: argparse.Namespace, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def run(args: argparse.Namespace) -> Outcome:
    if getattr(args, "models", None):
        return _run_models(args)
    for name in ("steps", "every_n", "window", "d_model", "layers", "heads", "ctx", "vocab", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.d_model % args.heads:
        raise ValueError(f"heads: expected a divisor of d-model {args.d_model}, got {args.heads}")
    device = resolve_device(args.device)
    work = None
    if args.model is not None:
        from .bench_models import build

        work = build(args.model, seed=args.seed)
        base = work.model.to(device)
    else:
        base = _model(args, device)
    if getattr(args, "compile", False):
        return _run_compiled(args, device, base, work)
    budget_alone, budget_window = budget_names(args)
    samplers: dict[str, Sampler | None] = {
        "baseline": None, EMPTY_MODE: None, "intercept only": Never(), "Full()": Full(),
        budget_alone: Budget(args.budget), budget_window: Budget(args.budget, window=args.window),
        f"EveryN({args.every_n})": EveryN(args.every_n), SCREENED: Screened(),
    }
    names = list(samplers)
    models = {name: copy.deepcopy(base) for name in names}
    optims = {name: torch.optim.AdamW(models[name].parameters(), lr=work.lr if work else 1e-3) for name in names}
    recorders = {name: RecordingSampler(s) for name, s in samplers.items() if s is not None and name != SCREENED}
    # every guarded copy steps through Guard.optimizer_step, as the integrations do (the
    # gradient screen and the calibration replays work there); rollback snapshots (the
    # policy's cost, a copy of model and optimizer every 50 steps by default) are off
    guards = {name: protect(models[name], sampler=samplers[SCREENED] if name == SCREENED else recorders[name],
                            snapshots=SnapshotStore(models[name], optims[name], every=10**9))
              for name in names if samplers[name] is not None}
    autocast = args.dtype == torch.bfloat16

    def loss_of(name: str, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        model = models[name]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            return work.loss_of(model, step) if work is not None else model.loss(x, y)

    def guarded_step(name: str, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        opt = optims[name]

        def closure() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = loss_of(name, x, y, step)
            loss.backward()
            return loss

        opt.zero_grad(set_to_none=True)  # before the step too: no gradients for optimizer_step to keep
        guards[name].optimizer_step(opt, closure)

    def train_step(name: str, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        if name in guards:
            return guarded_step(name, x, y, step)
        opt = optims[name]
        # forward and backward only: the guard, too, steps a GEMM-free optimizer outside its mode
        with EmptyMode() if name == EMPTY_MODE else contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            loss_of(name, x, y, step).backward()
        opt.step()

    rounds = args.warmup + args.steps
    progress = Progress(rounds, quiet=args.quiet)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  #: this thread's CPU time of each step
    reports: dict[str, list[Any]] = {name: [] for name in guards}
    report_rounds: dict[str, list[int]] = {name: [] for name in guards}  #: measured round of each report
    load_before = load_average()
    for r in range(rounds):
        x, y = _batch(args, r, device)
        order = names[r % len(names):] + names[: r % len(names)]
        took, took_cpu = {}, {}
        for name in order:
            sync(device)
            start, start_cpu = time.perf_counter(), time.thread_time()
            if name in guards:
                with guards[name]:
                    train_step(name, x, y, r)
            else:
                train_step(name, x, y, r)
            sync(device)
            took[name], took_cpu[name] = time.perf_counter() - start, time.thread_time() - start_cpu
            if name in guards and guards[name].last_report is not None and r >= args.warmup:
                reports[name].append(guards[name].last_report)
                report_rounds[name].append(r - args.warmup)
        if r >= args.warmup:
            for name in names:
                times[name].append(took[name])
                cpu[name].append(took_cpu[name])
        progress.step(f"round {r + 1}" + (" (warm-up)" if r < args.warmup else ""),
                      ", ".join(f"{name} {1e3 * took[name]:.0f} ms" for name in names))
    load_after = load_average()

    baseline = times["baseline"]
    results = []
    for name in names:
        ratios = [t / b for t, b in zip(times[name], baseline)]
        row: dict[str, Any] = {
            "config": name, "step_ms_median": 1e3 * statistics.median(times[name]),
            "overhead": statistics.median(ratios) - 1.0,
            "overhead_mean": sum(times[name]) / sum(baseline) - 1.0,
            "overhead_spread": spread_of(block_overheads(times[name], baseline)),
            # the same ratio in this thread's CPU time: where the machine is shared the steadier
            # figure (the step's own work on one intra-op thread; a lower bound with more)
            "overhead_cpu": sum(cpu[name]) / sum(cpu["baseline"]) - 1.0,
        }
        if name in guards:
            reps = reports[name]
            row.update(reported_against_measured(times[name], baseline, reps, report_rounds[name]))
            verify = sum(rep.verify_seconds for rep in reps)
            added = sum(rep.guard_seconds for rep in reps)
            unguarded = sum(rep.step_seconds - rep.guard_seconds for rep in reps)
            row.update({
                "verify_overhead": verify / unguarded if unguarded > 0 else float("nan"),
                "reported_overhead": added / unguarded if unguarded > 0 else float("nan"),
                "calibrated_share": sum(rep.overhead_calibrated for rep in reps) / len(reps) if reps else 0.0,
                # what the reports would say with interception at the per-op estimate (no replays)
                "estimated_overhead": estimated_account(reps),
                "calibration_replays": sum(1 for rep in reps if rep.calibration_seconds > 0),
                "gemms_seen_per_step": statistics.mean(rep.seen for rep in reps) if reps else 0.0,
                "gemms_verified_per_step": statistics.mean(rep.verified for rep in reps) if reps else 0.0,
                "flagged": sum(rep.flagged for rep in reps),
            })
            if name == SCREENED:
                screen = samplers[SCREENED]
                assert isinstance(screen, Screened)
                row.update({"screen_trips": screen.trips, "screen_misses": screen.misses,
                            "gradient_ratio_max": max((rep.gradient_ratio for rep in reps), default=0.0)})
                results.append(row)
                continue
            rec = recorders[name]
            row.update({"sites": len(rec.first_seen), "max_gap_steps": rec.max_gap(rounds), "window": args.window})
            row["every_site_within_window"] = row["max_gap_steps"] < args.window
            if isinstance(rec.inner, Never):
                for key in ("max_gap_steps", "every_site_within_window"):
                    row.pop(key)
            if isinstance(rec.inner, Budget):
                row["budget_achieved_overhead"] = rec.inner.achieved_overhead
                row["budget_coverage"] = rec.inner.coverage(args.window)
        results.append(row)
    text, targets = render(results, args)
    print(text)
    warning = busy_warning(load_before, load_after, device)
    if warning:
        print(warning)
    cfg = {k: getattr(args, k) for k in ("d_model", "layers", "heads", "ctx", "vocab", "batch")}
    if args.model is not None:
        cfg = {"name": args.model}
    payload = {
        "command": "train", "machine": machine(device),
        "settings": {"steps": args.steps, "warmup": args.warmup, "budget": args.budget, "every_n": args.every_n,
                     "window": args.window, "dtype": SHORT_NAME[args.dtype], "seed": args.seed, "model": cfg,
                     "parameters": sum(p.numel() for p in base.parameters())},
        "load_average": {"before": load_before, "after": load_after},
        "results": results, "targets": targets, "notes": [warning] if warning else [],
    }
    return Outcome(0, payload)


def _run_compiled(args: argparse.Namespace, device: torch.device, base: torch.nn.Module, work: Any) -> Outcome:
    """``--compile``: the unguarded, ``Full()`` and ``Budget`` steps, each compiled and each
    eager, interleaved round by round; every ratio is against the unguarded step of the
    same mode (compiled against compiled, eager against eager). Each guarded copy keeps one
    guard across its steps (its weight-side cache with it), as an integration does. Beside
    the wall-clock overhead, the same ratio of the process's CPU time (``cpu``): on a
    machine shared with other work it is the steadier figure (with one intra-op thread it
    is the step's own compute; with more it sums the threads)."""
    budget = f"Budget({args.budget:g})"
    configs: dict[str, Sampler | None] = {"baseline": None, "Full()": Full(), budget: Budget(args.budget)}
    names = [(mode, name) for mode in ("compiled", "eager") for name in configs]
    models = {key: copy.deepcopy(base) for key in names}
    runs = {key: torch.compile(models[key]) if key[0] == "compiled" else models[key] for key in names}
    optims = {key: torch.optim.AdamW(models[key].parameters(), lr=work.lr if work else 1e-3) for key in names}
    fresh = {key: copy.deepcopy(s) for key, s in ((k, configs[k[1]]) for k in names)}
    # rollback snapshots (the policy's cost) off, as in the eager bench
    snapshots = {key: SnapshotStore(models[key], optims[key], every=10**9) for key in names}
    guards = {key: protect(runs[key], sampler=fresh[key], compiled=key[0] == "compiled",
                           snapshots=snapshots[key])
              for key in names if fresh[key] is not None}
    autocast = args.dtype == torch.bfloat16

    def loss_of(key: tuple[str, str], x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        run, opt = runs[key], optims[key]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            if work is not None:
                loss = work.loss_of(run, step)
            else:
                loss = torch.nn.functional.cross_entropy(run(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        return loss

    def train_step(key: tuple[str, str], x: torch.Tensor, y: torch.Tensor, step: int, guard: Any = None) -> None:
        if guard is None:
            loss_of(key, x, y, step)
            optims[key].step()
            return
        # guarded: through optimizer_step, as the integrations step, so that calibration
        # replays measure interception where the route allows them (ModeSwitch.replayable)
        optims[key].zero_grad(set_to_none=True)
        guard.optimizer_step(optims[key], lambda: loss_of(key, x, y, step))

    rounds = args.warmup + args.steps
    times: dict[tuple[str, str], list[float]] = {key: [] for key in names}
    cpu: dict[tuple[str, str], list[float]] = {key: [] for key in names}
    reports: dict[tuple[str, str], list[Any]] = {key: [] for key in names}
    for r in range(rounds):
        x, y = _batch(args, r, device)
        for key in names[r % len(names):] + names[: r % len(names)]:
            sampler = fresh[key]
            sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            if sampler is None:
                train_step(key, x, y, r)
            else:
                with guards[key] as guard:
                    train_step(key, x, y, r, guard)
            sync(device)
            if r >= args.warmup:
                times[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - cpu_start)
                if sampler is not None and guard.last_report is not None:
                    reports[key].append(guard.last_report)
    results = []
    lines = [f"bench train --compile: {args.steps} rounds, d_model {args.d_model}, {args.layers} layers"
             f"{' (activation checkpointing)' if getattr(args, 'ac', False) else ''}, "
             f"batch {args.batch} x ctx {args.ctx}, on {device}"]
    for key in names:
        mode, name = key
        baseline = times[(mode, "baseline")]
        ratios = [t / b for t, b in zip(times[key], baseline)]
        reps = reports[key]
        row = {"mode": mode, "config": name, "step_ms_median": 1e3 * statistics.median(times[key]),
               "overhead": statistics.median(ratios) - 1.0,
               "overhead_mean": sum(times[key]) / sum(baseline) - 1.0,
               "overhead_cpu": sum(cpu[key]) / sum(cpu[(mode, "baseline")]) - 1.0,
               "gemms_verified_per_step": statistics.mean(rep.verified for rep in reps) if reps else 0.0,
               "flagged": sum(rep.flagged for rep in reps)}
        if reps:
            row.update({"reported_overhead": guard_account(reps), "reported_gap": guard_account(reps) - row["overhead_mean"],
                        "calibrated_share": sum(rep.overhead_calibrated for rep in reps) / len(reps)})
        results.append(row)
        account = (f"  reported {pct(row['reported_overhead'])} ({gap_points(row['reported_gap'])}, calibrated "
                   f"{pct(row['calibrated_share'])})" if reps else "")
        lines.append(f"  {mode:8s} {name:24s} {row['step_ms_median']:8.1f} ms  overhead median "
                     f"{100 * row['overhead']:6.1f} %  mean {100 * row['overhead_mean']:6.1f} %  "
                     f"cpu {100 * row['overhead_cpu']:6.1f} %  verified/step {row['gemms_verified_per_step']:.1f}"
                     + account)
    by = {(r["mode"], r["config"]): r for r in results}
    targets = {}
    full_target = TARGET_FULL_COMPILED_AC if getattr(args, "ac", False) else TARGET_FULL_COMPILED
    for label, config, target in ((f"full_compiled_le_{round(100 * full_target)}pct", "Full()", full_target),
                                  (f"budget_compiled_le_{round(100 * args.budget)}pct", budget, args.budget)):
        row = by[("compiled", config)]
        targets[label] = {"measured": row["overhead_mean"], "measured_cpu": row["overhead_cpu"], "target": target,
                          "met": row["overhead_mean"] <= target, "met_cpu": row["overhead_cpu"] <= target}
        lines.append(f"  target: compiled {config} <= {pct(target)}: {pct(row['overhead_mean'])} wall "
                     f"({'MET' if row['overhead_mean'] <= target else 'NOT MET'}), {pct(row['overhead_cpu'])} cpu "
                     f"({'MET' if row['overhead_cpu'] <= target else 'NOT MET'})")
    print("\n".join(lines))
    payload = {"command": "train --compile", "machine": machine(device),
               "settings": {"steps": args.steps, "warmup": args.warmup, "budget": args.budget,
                            "ac": getattr(args, "ac", False), "dtype": SHORT_NAME[args.dtype], "seed": args.seed},
               "results": results, "targets": targets}
    return Outcome(0, payload)


def _run_models(args: argparse.Namespace) -> Outcome:
    """``--models``: one run per model (``gpt``: the GPT of the options), each printed as
    it ends; the JSON holds them all under ``runs``."""
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if not names:
        raise ValueError(f"models: expected comma-separated model names (gpt, hf:llama, ...), got {args.models!r}")
    runs = []
    for name in names:
        one = argparse.Namespace(**vars(args))
        one.models, one.model = None, None if name == "gpt" else name
        runs.append(run(one).payload)
    return Outcome(0, {"command": "train", "runs": runs})
