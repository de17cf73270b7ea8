"""``sdc-guard bench detect --training --horizon N``: a small fault that lasts.

A faulty unit repeats its error at every call, and a small one does no visible harm at
any single step. This trains each workload (``--models``, ``--precisions``) from the same
weights for ``N`` steps after a warm-up of ``WARMUP_STEPS``, with one bit stuck at 1 at
one lane of every GEMM's output (``GemmFault(kind="stuck")``, no site: every GEMM of
every step, forward and backward), by default the bit worth ``2**-7`` of the value (bf16's
lowest mantissa bit; the same weight in fp32), ``--horizon-bits`` to choose (one run each). Reported per
workload:

- the harm at a single step: the update change of the first faulty step against the
  clean one from the same state (``training_runs.relative_change``; below 1 %, no single
  step calls it harmful);
- the final-loss drift: the mean loss over fixed held-out batches after ``N`` faulty
  steps against a clean run's after ``N`` clean steps (unguarded both);
- per sampler (the fault bench's), when it first caught the fault (steps after it began)
  and how many steps it caught it in, with a policy that only logs (every response
  ``log``, so that the run goes on and every detection is counted).
"""

from __future__ import annotations

import argparse
from typing import Any

from .bench_common import Outcome, Progress, machine, resolve_device, table
from ..respond.policy import Policy
from ..runtime.drills.inject import GemmFault, drill
from .training_runs import (
    Copy, bit_layout, default_schedule, output_dtype, quiet_guard_log, relative_change, samplers, workloads,
)

WARMUP_STEPS = 12
#: held-out batches the final loss is measured on (batch numbers no training step uses)
EVAL_BATCHES = range(10**6, 10**6 + 8)
MODELS = ("toy:64/64/8/2/3e-3", "hf:llama")
LOG_ALL = dict(on_detection="log", on_persistent="log", on_repeated="log", on_nondeterministic="log")


def default_bit(precision: str) -> int:
    """The bit worth ``2**-7`` of an output's value: bf16's lowest mantissa bit.

    >>> default_bit("fp32"), default_bit("bf16")
    (16, 0)
    """
    _, _, mantissa = bit_layout(output_dtype(precision))
    return len(mantissa) - 7


def run(args: argparse.Namespace) -> Outcome:
    resolve_device(args.device)
    steps = args.horizon
    names = args.models or list(MODELS)
    precisions = args.precisions or ["fp32"]
    makers = samplers(args.budget, args.every_n)
    works = workloads(names, args.seed)
    runs = []
    plan = []
    for precision in precisions:
        width, _, _ = bit_layout(output_dtype(precision))
        for bit in args.horizon_bits or [default_bit(precision)]:
            if not 0 <= bit < width:
                raise ValueError(f"horizon-bits: expected 0..{width - 1} for {precision} outputs, got {bit}")
            plan.append((precision, bit))
    progress = Progress(len(works) * len(plan) * (1 + len(makers)), quiet=args.quiet)
    with quiet_guard_log():
        for work in works:
            for precision, bit in plan:
                runs.append(_run(work, precision, steps, bit, makers, args.seed, progress))
    print(render(runs, steps))
    payload = {"command": "detect", "mode": "training-horizon", "machine": machine(resolve_device(args.device)),
               "settings": {"steps": steps, "warmup_steps": WARMUP_STEPS, "models": names, "precisions": precisions,
                            "seed": args.seed, "eval_batches": [EVAL_BATCHES.start, EVAL_BATCHES.stop]},
               "samplers": list(makers), "runs": runs}
    return Outcome(0, payload)


def _fault(bit: int) -> GemmFault:
    return GemmFault(kind="stuck", step=WARMUP_STEPS, bit=bit, direction="on")


def _run(work: Any, precision: str, steps: int, bit: int, makers: dict, seed: int, progress: Progress) -> dict:
    total = WARMUP_STEPS + steps
    schedule = default_schedule(work, total)
    fault = _fault(bit)
    record: dict[str, Any] = {"model": work.name, "precision": precision, "bit": bit, "samplers": {}}
    clean = Copy(work, schedule, precision, None, seed=seed)
    faulty = Copy(work, schedule, precision, None, seed=seed)
    for step in range(WARMUP_STEPS):
        clean.step(step)
        faulty.step(step)
    before = faulty.params()
    clean.step(WARMUP_STEPS)  # outside the drill: a drill's mode sees every GEMM of its thread
    after_clean = clean.params()
    with drill(faulty.model, fault, seed=seed) as injector:
        faulty.step(WARMUP_STEPS)
        record["single_step_update_change"] = relative_change(before, faulty.params(), after_clean)
        for step in range(WARMUP_STEPS + 1, total):
            faulty.step(step)
    for step in range(WARMUP_STEPS + 1, total):
        clean.step(step)
    record["elements_per_step"] = sum(j.elements for j in injector.injections if j.step == WARMUP_STEPS)
    record["clean_loss"], record["faulty_loss"] = clean.eval_loss(EVAL_BATCHES), faulty.eval_loss(EVAL_BATCHES)
    record["drift"] = record["faulty_loss"] - record["clean_loss"]
    record["relative_drift"] = record["drift"] / record["clean_loss"]
    progress.step(f"{work.name} {precision} bit {bit}", f"final loss {record['clean_loss']:.4f} clean, "
                  f"{record['faulty_loss']:.4f} with the stuck bit")
    for name, make in makers.items():
        guarded = Copy(work, schedule, precision, make(), seed=seed, policy=Policy(**LOG_ALL))
        caught = []
        with drill(guarded.model, fault, seed=seed):
            for step in range(total):
                outcome = guarded.step(step)
                if outcome.detected:
                    caught.append(step - WARMUP_STEPS)
        record["samplers"][name] = {"first_caught": caught[0] if caught else None, "steps_caught": len(caught)}
        progress.step(f"{work.name} {precision} {name}", f"caught at step {caught[0]} of the fault" if caught
                      else "never caught")
    return record


def render(runs: list[dict[str, Any]], steps: int) -> str:
    names = list(runs[0]["samplers"]) if runs else []
    headers = ["workload", "precision", "bit", "one step's update change", "final loss clean", "with the fault",
               "drift"] + [f"{n} caught at (steps caught)" for n in names]
    body = []
    for r in runs:
        cells = []
        for n in names:
            s = r["samplers"][n]
            cells.append("never" if s["first_caught"] is None else f"{s['first_caught']} ({s['steps_caught']})")
        body.append([r["model"], r["precision"], r["bit"], f"{100 * r['single_step_update_change']:.2g}%",
                     f"{r['clean_loss']:.4f}", f"{r['faulty_loss']:.4f}",
                     f"{r['drift']:+.2e} ({100 * r['relative_drift']:+.3f}%)", *cells])
    return "\n".join([
        f"a bit stuck at 1 at one lane of every GEMM output for {steps} steps (after {WARMUP_STEPS} clean ones); "
        f"final loss: mean over {len(EVAL_BATCHES)} held-out batches; caught at: the first step of the fault a "
        f"sampler detected it (0 = its first), every response set to log",
        table(headers, body, align="llr" + "r" * (len(headers) - 3))])
