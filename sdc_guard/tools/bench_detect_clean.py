"""``sdc-guard bench detect --training --clean``: the clean steps the gradient screen re-executes.

The price of the gradient screen (``Screened``) is paid on clean steps: each trip is one
fully verified re-execution. This trains each workload (``--models``, default several
toy GPTs and ``transformers`` models) in each precision (``--precisions``, default fp32
and bf16 autocast) for ``--steps`` steps with no fault, AdamW at the workload's learning
rate under the benches' schedule (``training_runs.default_schedule``: a linear warm-up
over the first 10 %, a cosine decay, a 5x spike for 3 steps at 40 % and a 10x spike for
one step at 70 %), three copies in lockstep from the same weights: unguarded, under
``Screened()`` and under the previous screen's test ``Screened(sigmas=inf,
factor=10)`` (one factor, no per-layer spread). Reported per run: the share of steps
re-executed, when (warm-up, spikes, elsewhere), what the re-executions concluded (a clean run must give only
misses: a detection on it would be a false alarm, and the exit status is then 1), the
largest deviation a passing step reached (``StepReport.gradient_sigmas``: the headroom
under ``sigmas``), and the cost: each screened copy's step time over the unguarded one's,
timed in turn every step (order rotated), over the steps the screen passed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

from .bench_common import Outcome, Progress, machine, resolve_device, table
from ..runtime.sampling import Screened
from .training_runs import Copy, Schedule, default_schedule, workloads

#: workloads when ``--models`` is left at the fault bench's default
MODELS = ("toy:64/64/8/2/3e-3", "toy:128/128/4/2/1e-2", "hf:llama", "hf:gpt2", "hf:qwen2", "hf:bert")
STEPS = 300
SCREENS = {"Screened()": Screened,
           "Screened(sigmas=inf, factor=10)": lambda: Screened(sigmas=math.inf, factor=10)}


def run(args: argparse.Namespace) -> Outcome:
    resolve_device(args.device)
    names = args.models or list(MODELS)
    precisions = args.precisions or ["fp32", "bf16"]
    steps = args.steps or STEPS
    works = workloads(names, args.seed)
    progress = Progress(len(works) * len(precisions), quiet=args.quiet)
    runs = []
    for work in works:
        for precision in precisions:
            record = _run(work, precision, steps, args.seed)
            runs.append(record)
            s = record["screens"]["Screened()"]
            progress.step(f"{work.name} {precision}", f"{s['trips']} of {steps} steps re-executed, cost "
                          f"{100 * s['cost']:.1f} %, loss {record['first_loss']:.3g} -> {record['last_loss']:.3g}")
    false_alarms = sum(s["detections"] for r in runs for s in r["screens"].values())
    print(render(runs, steps))
    payload = {"command": "detect", "mode": "training-clean", "machine": machine(resolve_device(args.device)),
               "settings": {"steps": steps, "models": names, "precisions": precisions, "seed": args.seed},
               "runs": runs, "false_alarms": false_alarms}
    return Outcome(1 if false_alarms else 0, payload)


def phase(schedule: Schedule, step: int) -> str:
    """Where in the schedule ``step`` is: the warm-up, a spike (or the two steps after
    one, while its updates settle), or elsewhere."""
    if step < schedule.warmup:
        return "warm-up"
    if any(first <= step < first + length + 2 for first, length, _ in schedule.spikes):
        return "spike"
    return "other"


def _run(work: Any, precision: str, steps: int, seed: int) -> dict[str, Any]:
    schedule = default_schedule(work, steps)
    plain = Copy(work, schedule, precision, None, seed=seed)
    screened = {name: Copy(work, schedule, precision, make(), seed=seed) for name, make in SCREENS.items()}
    order = [("plain", plain), *screened.items()]
    times: dict[str, list[float]] = {name: [] for name, _ in order}
    outcomes: dict[str, list[Any]] = {name: [] for name in screened}
    losses = []
    for step in range(steps):
        k = step % len(order)
        for name, c in order[k:] + order[:k]:  # rotated, so that a slow spell falls on every copy
            started = time.perf_counter()
            result = c.step(step)
            times[name].append(time.perf_counter() - started)
            if name == "plain":
                losses.append(float(result))
            else:
                outcomes[name].append(result)
    record: dict[str, Any] = {"model": work.name, "precision": precision, "lr": work.lr, "steps": steps,
                              "first_loss": losses[0], "last_loss": statistics.fmean(losses[-10:]), "screens": {}}
    for name, outs in outcomes.items():
        tripped = [o.report.step for o in outs if o.tripped_ranks]
        passed = [i for i, o in enumerate(outs) if not o.tripped_ranks]
        ratios = [times[name][i] / times["plain"][i] for i in passed]
        base = sum(times["plain"][i] for i in passed)
        record["screens"][name] = {
            "trips": len(tripped), "reexecuted_rate": len(tripped) / steps, "trip_steps": tripped,
            "trip_phases": {p: sum(phase(schedule, s) == p for s in tripped) for p in ("warm-up", "spike", "other")},
            "verdicts": {v: sum(o.screen == v for o in outs) for v in ("miss", "transient", "persistent",
                                                                        "non_deterministic", "unresolved")},
            "detections": sum(bool(o.detected) for o in outs),
            "max_sigmas_passed": max((o.report.gradient_sigmas for o in outs if not o.tripped_ranks), default=0.0),
            #: every step's largest deviation in spreads (after the warm-up): where other sigmas would trip
            "sigmas": [o.report.gradient_sigmas for o in outs],
            "max_ratio_passed": max((o.report.gradient_ratio for o in outs if not o.tripped_ranks), default=0.0),
            "cost": sum(times[name][i] for i in passed) / base - 1 if base > 0 else math.nan,
            "cost_median": statistics.median(ratios) - 1 if ratios else math.nan,
            "guard_account": statistics.fmean(o.report.overhead for o in outs if not o.tripped_ranks)
            if passed else math.nan,
        }
    return record


def render(runs: list[dict[str, Any]], steps: int) -> str:
    names = list(SCREENS)
    headers = ["workload", "precision"] + [f"{n} re-executed (warm-up/spike/other)" for n in names] + \
        ["Screened() max sigmas passed", "Screened() cost (median)", "Screened() guard's account"]
    body = []
    for r in runs:
        cells = []
        for n in names:
            s = r["screens"][n]
            ph = s["trip_phases"]
            cells.append(f"{100 * s['reexecuted_rate']:.1f}% ({ph['warm-up']}/{ph['spike']}/{ph['other']})")
        s = r["screens"]["Screened()"]
        body.append([r["model"], r["precision"], *cells, f"{s['max_sigmas_passed']:.1f}",
                     f"{100 * s['cost']:.1f}% ({100 * s['cost_median']:.1f}%)", f"{100 * s['guard_account']:.1f}%"])
    total = {n: sum(r["screens"][n]["trips"] for r in runs) for n in names}
    detections = sum(s["detections"] for r in runs for s in r["screens"].values())
    lines = [f"clean training runs, {steps} steps each (AdamW, warm-up over 10 %, cosine decay, 5x spike for 3 "
             f"steps at 40 %, 10x spike at 70 %); re-executed: steps the screen tripped on, each re-run with every "
             f"GEMM verified",
             table(headers, body, align="ll" + "r" * (len(headers) - 2)),
             "all runs: " + ", ".join(f"{n} re-executed {total[n]} of {steps * len(runs)} steps "
                                      f"({100 * total[n] / (steps * len(runs)):.2f} %)" for n in names)
             + f"; detections on clean runs (false alarms): {detections}"]
    return "\n".join(lines)
