"""``sdc-guard bench detect --training``: which samplers catch which faults in a training run.

``bench detect`` measures the check itself, GEMM by GEMM. This measures what a sampler
makes of it in real training (``sdc_guard.tools.training_runs``: the toy GPT on its corpus
and a ``transformers`` model from a small config, AdamW at their learning rates with
warm-up, decay and spikes, fp32 or bf16 autocast). After a warm-up, every step gets one
fault, its class taken in turn among the fault models (``--faults``): single bits (sign,
top exponent bit, other exponent bits, mantissa; toggled), several bits of one element,
a bit stuck at one lane of every GEMM of the step, tile-aligned periodic rows or columns
(every 8th, 16th or 32nd), a zeroed tile, two swapped rows, NaN, Inf; the GEMM drawn
uniformly among the step's forward and backward GEMMs. Each sampler (``Full()``,
``Budget(b)``, ``EveryN(n)``, ``Screened()``, the previous screen's test
``Screened(sigmas=inf, factor=10)`` that compares norms with one factor only, and
``Screened(Budget(b))``) trains its own copy of the model; at a trial step its copy runs the step once with the fault (through
``Guard.optimizer_step``, the default policy except that a persistent fault skips the
step instead of rolling back) and is then put back (model, optimizer,
sampler) and runs the step clean, so that every copy follows the same clean trajectory
and meets the same faults in the same states. A fault is *caught* when the guarded step
was a detection (``StepOutcome.detected``: a confirmed GEMM flag, or a tripped screen whose
verified re-execution found corruption or differed). What ``Full()`` catches is what the
GEMM screen in this build sees: the bench reports it, it does not assume it.

Whether a fault mattered is measured apart, on an unguarded copy: the update the
optimizer makes with the fault against the clean update from the same state,
``|faulty - clean| / |clean|`` over all parameters. More than 1 % is *harmful*, more than
10 % *severe*. Beside it, the largest change the fault made to a parameter's gradient norm
(against the clean step's): a fault that changes no norm by more than 5 % (the gradient
screen's smallest spread) is out of reach of any statistic of the norms. For scale,
every few trials the same state takes the next step's batch instead: how much an
ordinary change of batch moves the update (reported as its median).

``--clean`` measures the other side of the screen, the clean steps it re-executes
(``bench_detect_clean``); ``--horizon N`` a persistent low-magnitude fault over ``N``
steps (``bench_detect_horizon``).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from typing import Any, Callable

from .bench_common import Outcome, Progress, argtype, machine, parse_names, resolve_device, table
from ..respond.policy import Policy
from ..runtime.drills.inject import drill
from ..runtime.sampling import Sampler
from .training_runs import (
    FAULT_CLASSES, HARMFUL, SEVERE, VISIBLE, Copy, default_schedule, draw_fault, gemms_per_step,
    largest_norm_change, output_dtype, quiet_guard_log, relative_change, samplers, workloads,
)

#: Clean steps before the first trial: the screen's statistics (warm-up 10) and Budget's costs are learnt.
WARMUP_STEPS = 12
#: faults per class and workload when ``--trials`` is not given
TRIALS = 10
MODELS = ("toy:64/64/8/2/3e-3", "hf:llama")
#: a batch-change reference every this many trials
NOISE_EVERY = 5
#: the default policy, less what would outlast a trial (a rollback, an exit after a second
#: persistent fault): each trial is put back by the bench, and every fault is a first one
TRIAL_POLICY = Policy(on_persistent="skip", on_repeated="skip")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--training (faults in training runs, per sampler)")
    group.add_argument("--training", action="store_true",
                       help="inject faults of every fault model into random GEMMs of training runs and report, per "
                            "fault class, what each sampler catches and the harm it lets through")
    group.add_argument("--trials", type=int, default=None,
                       help=f"--training: faults per fault class and workload (default {TRIALS}); --attention: "
                            "SDPA calls per kind of operands and dtype, each one trial per output row (default 2)")
    group.add_argument("--budget", type=float, default=0.05, help="Budget's max_overhead (default 0.05)")
    group.add_argument("--every-n", type=int, default=8, help="EveryN's n (default 8)")
    group.add_argument("--models", default=None, type=argtype(_models),
                       help="--training: comma list of workloads, toy:D/CTX/BATCH/LAYERS/LR or hf:ARCH "
                            f"(sdc_guard.tools.bench_models; default {','.join(MODELS)}; --clean: more)")
    group.add_argument("--precisions", default=None, type=argtype(lambda t: parse_names(t, ("fp32", "bf16"),
                                                                                         "precisions")),
                       help="--training: comma list of fp32, bf16 (autocast) (default fp32; --clean: both)")
    group.add_argument("--faults", default=",".join(FAULT_CLASSES),
                       type=argtype(lambda t: parse_names(t, FAULT_CLASSES, "faults")),
                       help="--training: comma list of fault classes (default all: " + ", ".join(FAULT_CLASSES) + ")")
    group.add_argument("--clean", action="store_true",
                       help="--training: no fault; how many clean steps the gradient screen re-executes, and what "
                            "it costs (sdc_guard.tools.bench_detect_clean)")
    group.add_argument("--steps", type=int, default=None,
                       help="--training --clean: steps per run (default 300)")
    group.add_argument("--horizon", type=int, default=None, metavar="N",
                       help="--training: a bit stuck at one lane of every GEMM for N steps (200 in the issue): "
                            "final-loss drift and when each sampler caught it (sdc_guard.tools.bench_detect_horizon)")
    group.add_argument("--horizon-bits", default=None, type=argtype(_bits),
                       help="--horizon: comma list of stuck bits, one run each (default: the bit worth 2**-7 of "
                            "the value, bf16's lowest mantissa bit)")


def _bits(text: str) -> list[int]:
    try:
        bits = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"horizon-bits: expected a comma list of bit positions, got {text!r}") from None
    if not bits or any(b < 0 for b in bits):
        raise ValueError(f"horizon-bits: expected a comma list of non-negative bit positions, got {text!r}")
    return bits


def _models(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(not (n.startswith("toy:") or n.startswith("hf:")) for n in names):
        raise ValueError(f"models: expected a comma list of toy:D/CTX/BATCH/LAYERS/LR or hf:ARCH, got {text!r}")
    return names


def check_arguments(args: argparse.Namespace) -> None:
    for name in ("trials", "steps", "horizon", "every_n"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"{name.replace('_', '-')}: expected a positive int, got {value}")
    if not 0 < args.budget < math.inf:
        raise ValueError(f"budget: expected a positive overhead fraction (0.05 = 5 %), got {args.budget}")
    if args.clean and args.horizon is not None:
        raise ValueError("--clean and --horizon: expected one of them, got both")


def run(args: argparse.Namespace) -> Outcome:
    check_arguments(args)
    if args.clean:
        from . import bench_detect_clean

        return bench_detect_clean.run(args)
    if args.horizon is not None:
        from . import bench_detect_horizon

        return bench_detect_horizon.run(args)
    resolve_device(args.device)  # the copies train on the CPU (autocast "cpu"); a device name is still checked
    trials_per_class = args.trials or TRIALS
    classes = list(args.faults)
    makers = samplers(args.budget, args.every_n)
    names = list(makers)
    models, precisions = args.models or list(MODELS), args.precisions or ["fp32"]
    works = workloads(models, args.seed)
    runs = [(w, p) for w in works for p in precisions]
    progress = Progress(len(runs) * trials_per_class * len(classes), quiet=args.quiet)
    sections = []
    for work, precision in runs:
        with quiet_guard_log():
            trials, noise, gemms = _trials(work, precision, classes, trials_per_class, makers, args, progress)
        sections.append({"model": work.name, "precision": precision, "lr": work.lr, "gemms_per_step": gemms,
                         "batch_change_median": statistics.median(noise) if noise else math.nan,
                         "results": summarise(trials, classes, names), "trials": trials})
    pooled = summarise([t for s in sections for t in s["trials"]], classes, names)
    print(render(sections, pooled, names, args))
    payload = {"command": "detect", "mode": "training", "machine": machine(resolve_device(args.device)),
               "settings": {"trials_per_class": trials_per_class, "faults": classes, "budget": args.budget,
                            "every_n": args.every_n, "seed": args.seed, "warmup_steps": WARMUP_STEPS,
                            "harmful_above": HARMFUL, "severe_above": SEVERE, "models": models,
                            "precisions": precisions},
               "samplers": names, "sections": sections, "results": pooled}
    return Outcome(0, payload)


def _trials(work: Any, precision: str, classes: list[str], per_class: int, makers: dict[str, Callable[[], Sampler]],
            args: argparse.Namespace, progress: Progress) -> tuple[list[dict[str, Any]], list[float], int]:
    """One workload's trials: (the trials, the batch-change references, GEMMs per step)."""
    total = per_class * len(classes)
    schedule = default_schedule(work, WARMUP_STEPS + total)
    copies = {name: Copy(work, schedule, precision, make(), seed=args.seed, policy=TRIAL_POLICY)
              for name, make in makers.items()}
    plain = Copy(work, schedule, precision, None, seed=args.seed)
    for step in range(WARMUP_STEPS):
        for c in (*copies.values(), plain):
            c.step(step)
    gemms = gemms_per_step(work, precision)
    dtype = output_dtype(precision)
    rng = random.Random(args.seed)
    trials, noise = [], []
    for i in range(total):
        step = WARMUP_STEPS + i
        cls = classes[i % len(classes)]
        fault = draw_fault(cls, rng, step, gemms, dtype)
        seed = rng.randrange(2**31)  # the element, drawn by the drill: the same in every copy
        state = plain.state()
        before = plain.params()
        with drill(plain.model, fault, seed=seed) as injector:
            plain.step(step)
        faulty, faulty_norms = plain.params(), plain.grad_norms()
        if i % NOISE_EVERY == 0:  # the same state, the next batch: an ordinary change of the update
            plain.restore(state, step)
            plain.step(step, batch=step + 1)
            other = plain.params()
        plain.restore(state, step)
        plain.step(step)
        clean = plain.params()
        change = relative_change(before, faulty, clean)
        norm_change = largest_norm_change(faulty_norms, plain.grad_norms())
        if i % NOISE_EVERY == 0:
            noise.append(relative_change(before, other, clean))
        caught, how, screen = {}, {}, {}
        for name, c in copies.items():
            state = c.state()
            with drill(c.model, fault, seed=seed):
                outcome = c.step(step)
            caught[name] = bool(outcome.detected)
            how[name] = outcome.screen or outcome.classification or ("tripped" if outcome.tripped_ranks else None)
            if outcome.report.gradient_screened:  # what the screen saw: its margin, for the trade-off
                screen[name] = {"sigmas": outcome.report.gradient_sigmas, "ratio": outcome.report.gradient_ratio,
                                "nonfinite": outcome.report.nonfinite_grads}
            c.restore(state, step)
            c.step(step)
        injections = injector.injections
        trials.append({
            "step": step, "class": cls, "kind": fault.kind, "bits": list(fault.bits_for(dtype)),
            "direction": fault.direction, "period": fault.period, "tile": fault.tile, "call": fault.call,
            "site": injections[0].site if injections else None, "phase": injections[0].phase if injections else None,
            "gemms_hit": sum(j.changed for j in injections), "elements": sum(j.elements for j in injections),
            "update_change": change, "harmful": change > HARMFUL, "severe": change > SEVERE,
            "norm_change": norm_change, "norm_visible": norm_change > VISIBLE,
            "caught": caught, "how": how, "screen": screen})
        progress.step(f"{work.name} {precision} trial {i + 1}/{total} ({cls}, "
                      f"{injections[0].site if injections else '?'})",
                      f"update moved {change:.2g}; caught by " + (", ".join(n for n, v in caught.items() if v) or "none"))
    return trials, noise, gemms


def summarise(trials: list[dict[str, Any]], classes: list[str], names: list[str]) -> list[dict[str, Any]]:
    """Per fault class (and ``"all"``): faults, harmful and severe ones, and per sampler what
    it caught, the harmful and severe faults it let through, and the largest update change
    among the faults it let through."""
    rows = []
    for cls in (*classes, "all"):
        mine = [t for t in trials if cls == "all" or t["class"] == cls]
        harmful = [t for t in mine if t["harmful"]]
        severe = [t for t in mine if t["severe"]]
        row: dict[str, Any] = {"class": cls, "trials": len(mine), "harmful": len(harmful), "severe": len(severe),
                               "harmful_norm_visible": sum(t["norm_visible"] for t in harmful), "samplers": {}}
        for name in names:
            missed = [t["update_change"] for t in mine if not t["caught"][name]]
            caught = len(mine) - len(missed)
            through = sum(not t["caught"][name] for t in harmful)
            severe_through = sum(not t["caught"][name] for t in severe)
            row["samplers"][name] = {
                "caught": caught, "caught_rate": caught / len(mine) if mine else math.nan,
                "harmful_let_through": through,
                "harmful_let_through_rate": through / len(harmful) if harmful else math.nan,
                "severe_let_through": severe_through,
                "severe_let_through_rate": severe_through / len(severe) if severe else math.nan,
                "worst_let_through": max(missed, default=0.0),
            }
        rows.append(row)
    return rows


def _pct(value: float) -> str:
    return "-" if value != value else f"{100 * value:.0f}%"


def _table(results: list[dict[str, Any]], names: list[str]) -> str:
    headers = ["fault class", "faults", "harmful", "severe", "harmful, norm-visible"] + names
    body = []
    for r in results:
        cells = [f"{_pct(s['caught_rate'])} / {_pct(s['harmful_let_through_rate'])} / "
                 f"{_pct(s['severe_let_through_rate'])}" for s in (r["samplers"][n] for n in names)]
        body.append([r["class"], r["trials"], r["harmful"], r["severe"], r["harmful_norm_visible"], *cells])
    return table(headers, body, align="lrrrr" + "r" * len(names))


def render(sections: list[dict[str, Any]], pooled: list[dict[str, Any]], names: list[str],
           args: argparse.Namespace) -> str:
    lines = [f"faults in random GEMMs of training runs, one per step after {WARMUP_STEPS} clean steps; each cell: "
             f"caught / harmful let through / severe let through (harmful: the fault moved the optimizer's update by "
             f"more than {100 * HARMFUL:g} %, severe: by more than {100 * SEVERE:g} %; norm-visible: it changed some "
             f"parameter's gradient norm by more than {100 * VISIBLE:g} %, what a gradient statistic can see at all)"]
    for s in sections:
        lines += ["", f"{s['model']}, {s['precision']}, AdamW lr {s['lr']:g} (warm-up, cosine, spikes), "
                      f"{s['gemms_per_step']} GEMMs per step; a change of batch moves the update by "
                      f"{100 * s['batch_change_median']:.0f} % (median)", _table(s["results"], names)]
        worst = {n: s["results"][-1]["samplers"][n]["worst_let_through"] for n in names}
        lines.append("largest update change let through: " + ", ".join(f"{n} {v:.3g}" for n, v in worst.items()))
    if len(sections) > 1:
        lines += ["", "all workloads", _table(pooled, names)]
    return "\n".join(lines)
