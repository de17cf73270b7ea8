"""``sdc-guard bench fp``: false positives on clean products, the proposal's acceptance 1.

Acceptance 1 of the proposal (RFC 3.5.1): gaussian, uniform and scaled data, the LLM and
MOE-gate shapes, 1000 trials per cell, zero false positives. Here with bf16, fp16 and
fp32, the dtype's default ``e_max`` (or ``--e-max``), a fresh A and B for every trial, and
the verification the dispatcher picks for the device. A trial is a false positive when the
exact confirmation (``sdc_guard.core.confirm``) confirms corruption in a clean product: what
the guard would act on. Segments the screen suspected and the confirmation cleared are
counted beside (``screen_suspects``). Each cell also reports the largest screen D/T it
saw: its distance from 1 is the margin the screen kept. A product that overflowed its dtype
(fp16 on wide data) is a legitimate overflow, counted apart, not a false positive.

``--models``: the real-model corpus instead (``sdc_guard.tools.bench_models``): ``transformers``
models built from small configs and the toy GPT at the configurations where earlier
screens raised false alarms, trained for ``--steps`` guarded steps at real learning rates
in each of ``--precisions``, every GEMM verified, for each of ``--screens``. A run counts
its confirmed detections (false positives: must be 0) and the screen's misses per
segment, the rate that decides which screen can be the default.

Exit status 1 when any cell or run counted a false positive.

``clean_trials`` is shared with ``sdc-guard bench calibrate``, which runs the same data at
``e_max = 1``.
"""

from __future__ import annotations

import argparse
import time
from typing import Iterator

import torch

from .. import backends
from ..core.abft import AbftCheck
from ..backends import GemmRequest
from .bench_common import (
    DISTRIBUTIONS, FP16_NOTE, SHORT_NAME, Outcome, Progress, argtype, generator, machine, operands,
    parse_dtypes, parse_names, parse_shape, product, resolve_device, shape_label, table,
)
from ..core.confirm import confirm
from ..core.precision import SCREENS, resolve_e_max

#: The proposal's shape set for acceptance 1, CPU-sized: six LLM shapes (decode to prefill,
#: attention/FFN) and four MOE-gate shapes.
SHAPE_SETS: dict[str, list[tuple[int, int, int]]] = {
    "llm": [(1, 4096, 4096), (8, 4096, 4096), (64, 4096, 4096), (512, 4096, 4096),
            (8, 4096, 11008), (8, 11008, 4096)],
    "moe_gate": [(128, 4096, 8), (512, 4096, 8), (2048, 4096, 8), (4096, 4096, 8)],
}


def shapes_arg(text: str) -> list[tuple[int, int, int]]:
    """``llm``, ``moe_gate``, ``all`` and/or ``MxKxN``, comma-separated."""
    out: list[tuple[int, int, int]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item == "all":
            out += [s for shapes in SHAPE_SETS.values() for s in shapes]
        elif item in SHAPE_SETS:
            out += SHAPE_SETS[item]
        else:
            out.append(parse_shape(item))
    if not out:
        raise ValueError("shapes: expected at least one set or MxKxN shape")
    return out


def add_data_arguments(parser: argparse.ArgumentParser, *, trials: int) -> None:
    """The data options ``fp`` and ``calibrate`` share."""
    parser.add_argument("--dtypes", default="bf16,fp16,fp32", type=argtype(parse_dtypes),
                        help="comma list of bf16, fp16, fp32 (default all three)")
    parser.add_argument("--dists", default=",".join(DISTRIBUTIONS),
                        type=argtype(lambda t: parse_names(t, DISTRIBUTIONS, "dists")),
                        help="comma list of " + "; ".join(f"{k}: {v}" for k, v in DISTRIBUTIONS.items()))
    parser.add_argument("--shapes", default="all", type=argtype(shapes_arg),
                        help="llm, moe_gate, all (default) and/or MxKxN shapes, comma-separated")
    parser.add_argument("--trials", type=int, default=trials, help=f"trials per cell (default {trials})")
    parser.add_argument("--backend", default=None, help="verification backend (default: the dispatcher's choice)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser, trials=1000)
    parser.add_argument("--e-max", type=float, default=None,
                        help="e_max to test (default: the dtype's default on this device)")
    corpus = parser.add_argument_group("real-model corpus (instead of the synthetic cells)")
    corpus.add_argument("--models", default=None, type=argtype(_models),
                        help="comma list of toy:D/CTX/BATCH/LAYERS/LR, hf:ARCH, 'toy' (the five toy configs), "
                             "'hf' (every architecture) or 'all'")
    corpus.add_argument("--precisions", default="fp32,bf16,fp16", type=argtype(_precisions),
                        help="comma list of fp32, bf16, fp16 (default all)")
    corpus.add_argument("--steps", type=int, default=300, help="guarded training steps per run (default 300)")
    corpus.add_argument("--screens", default="default,tight",
                        type=argtype(lambda t: parse_names(t, SCREENS, "screens")), help="comma list of default, tight (default both)")


def _models(text: str) -> list[str]:
    from .bench_models import HF_ARCHS, TOY_CONFIGS

    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if item in ("toy", "all"):
            out += [f"toy:{c}" for c in TOY_CONFIGS]
        if item in ("hf", "all"):
            out += [f"hf:{a}" for a in HF_ARCHS]
        if item and item not in ("toy", "hf", "all"):
            if not item.startswith(("toy:", "hf:")):
                raise ValueError(f"models: expected toy:..., hf:..., toy, hf or all, got {item!r}")
            out.append(item)
    if not out:
        raise ValueError(f"models: expected at least one model, got {text!r}")
    return out


def _precisions(text: str) -> list[str]:
    from .bench_models import PRECISIONS

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in PRECISIONS]
    if bad or not names:
        raise ValueError(f"precisions: expected a comma list of {', '.join(PRECISIONS)}, got {text!r}")
    return names


def run_models(args: argparse.Namespace) -> Outcome:
    """The real-model corpus (see the module docstring)."""
    from .bench_models import build, train_guarded

    if args.steps < 1:
        raise ValueError(f"steps: expected a positive int, got {args.steps}")
    runs = [(m, p, s) for m in args.models for p in args.precisions for s in args.screens]
    progress = Progress(len(runs), quiet=args.quiet)
    rows = []
    for name, precision, screen in runs:
        record = train_guarded(build(name, seed=args.seed), args.steps, precision=precision, screen=screen)
        row = {"model": name, "precision": precision, "screen": screen, "steps": record.steps,
               "gemms": record.gemms, "false_positives": len(record.flagged_steps),
               "flagged_steps": record.flagged_steps, "responses": record.responses,
               "screen_misses": record.screen_misses, "segments": record.segments, "miss_rate": record.miss_rate,
               "worst_ratio": record.worst_ratio, "loss": [record.first_loss, record.last_loss],
               "exit_code": record.exit_code, "seconds": record.seconds}
        rows.append(row)
        progress.step(f"{name} {precision} {screen}",
                      f"{record.steps} steps, {len(record.flagged_steps)} false positives, "
                      f"misses {record.screen_misses}/{record.segments}")
    print(table(["model", "precision", "screen", "steps", "GEMMs", "false pos.", "screen misses", "per segment",
                 "worst D/T", "loss"],
                [[r["model"], r["precision"], r["screen"], r["steps"], r["gemms"], r["false_positives"],
                  r["screen_misses"], f"{r['miss_rate']:.2g}", f"{r['worst_ratio']:.3g}",
                  f"{r['loss'][0]:.3f} -> {r['loss'][1]:.3f}"] for r in rows], align="llllrrrrrr"))
    total = sum(r["false_positives"] for r in rows)
    print()
    for screen in args.screens:
        mine = [r for r in rows if r["screen"] == screen]
        misses, segs = sum(r["screen_misses"] for r in mine), sum(r["segments"] for r in mine)
        print(f"{screen} screen: {misses} misses in {segs} segments ({misses / segs if segs else 0:.2g} per segment) "
              f"over {len(mine)} runs")
    print(f"{'PASS' if total == 0 else 'FAIL'}: {total} confirmed false positives over {len(rows)} runs (must be 0)")
    payload = {"command": "fp", "mode": "models", "machine": machine(resolve_device(args.device)),
               "settings": {"models": args.models, "precisions": args.precisions, "screens": args.screens,
                            "steps": args.steps, "seed": args.seed},
               "runs": rows, "summary": {"false_positives": total, "runs": len(rows), "pass": total == 0}}
    return Outcome(0 if total == 0 else 1, payload)


def data_cells(args: argparse.Namespace) -> list[tuple[torch.dtype, str, tuple[int, int, int]]]:
    if args.trials < 1:
        raise ValueError(f"trials: expected a positive int, got {args.trials}")
    return [(dtype, dist, shape) for dtype in args.dtypes for dist in args.dists for shape in args.shapes]


def clean_requests(dtype: torch.dtype, dist: str, shape: tuple[int, int, int], trials: int, e_max: float,
                   device: torch.device, seed: int, progress: Progress | None = None) -> Iterator[GemmRequest]:
    """``trials`` clean products of fresh ``dist`` data, as requests."""
    m, k, n = shape
    gen = generator(device, seed)
    label = f"{SHORT_NAME[dtype]} {dist} {shape_label(*shape)}"
    for trial in range(trials):
        a, b = operands(dist, m, k, n, dtype, device, gen)
        yield GemmRequest(a, b, product(a, b), e_max)
        if progress is not None:
            progress.tick(label, trial + 1, trials)


def clean_trials(dtype: torch.dtype, dist: str, shape: tuple[int, int, int], trials: int, e_max: float,
                 device: torch.device, seed: int, backend: str | None,
                 progress: Progress | None = None) -> Iterator[tuple[GemmRequest, AbftCheck]]:
    """Screen ``trials`` clean products of fresh ``dist`` data; yields each request and check."""
    for req in clean_requests(dtype, dist, shape, trials, e_max, device, seed, progress):
        yield req, backends.select(req, backend).check(req)


def cell_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


def run(args: argparse.Namespace) -> Outcome:
    if args.models is not None:
        return run_models(args)
    device = resolve_device(args.device)
    cells = data_cells(args)
    progress = Progress(len(cells), quiet=args.quiet)
    rows = []
    for i, (dtype, dist, shape) in enumerate(cells):
        e_max = resolve_e_max(args.e_max, dtype, device)
        started = time.perf_counter()
        fp = failed_segments = overflow = unverifiable = misses = 0
        worst = 0.0
        for req, check in clean_trials(dtype, dist, shape, args.trials, e_max, device, cell_seed(args.seed, i),
                                       args.backend, progress):
            suspects = int(check.sdc.sum())
            misses += suspects
            bad = int(confirm(req, check.ok, check.inputs_bad, check.ratio, on_host=True, limit=None).sdc.sum()) \
                if suspects else 0
            fp += bad > 0
            failed_segments += bad
            overflow += bool(check.possible_overflow.any())
            unverifiable += bool(check.inputs_bad.any())
            ratio = check.ratio
            if ratio is not None and ratio.numel():
                judged = ~check.inputs_bad & ~check.possible_overflow
                worst = max(worst, float(torch.nan_to_num(torch.where(judged, ratio, 0.0), nan=float("inf")).max()))
        row = {"dtype": SHORT_NAME[dtype], "dist": dist, "m": shape[0], "k": shape[1], "n": shape[2],
               "trials": args.trials, "e_max": e_max, "false_positives": fp,
               "failed_segments": failed_segments, "overflow_trials": overflow,
               "unverifiable_trials": unverifiable, "max_ratio": worst, "screen_suspects": misses,
               "seconds": time.perf_counter() - started}
        if dtype == torch.float16 and device.type == "cpu":
            row["note"] = FP16_NOTE
        rows.append(row)
        progress.step(f"{row['dtype']} {dist} {shape_label(*shape)}",
                      f"{args.trials} trials, {fp} false positives, max D/T {worst:.3g}")
    total_fp = sum(r["false_positives"] for r in rows)
    headers = ["dtype", "dist", "MxKxN", "e_max", "trials", "false pos.", "screen suspects", "max D/T", "margin",
               "overflow"]
    body = [[r["dtype"], r["dist"], shape_label(r["m"], r["k"], r["n"]), f"{r['e_max']:.3g}", r["trials"],
             r["false_positives"], r["screen_suspects"], f"{r['max_ratio']:.3g}",
             f"{1 / r['max_ratio']:.1f}x" if r["max_ratio"] > 0 else "-", r["overflow_trials"]] for r in rows]
    print(table(headers, body, align="lllrrrrrrr"))
    print()
    total_trials = sum(r["trials"] for r in rows)
    worst_row = max(rows, key=lambda r: r["max_ratio"])
    verdict = "PASS" if total_fp == 0 else "FAIL"
    print(f"{verdict}: {total_fp} false positives in {total_trials} trials over {len(rows)} cells "
          f"(must be 0); worst D/T {worst_row['max_ratio']:.3g} ({worst_row['dtype']} {worst_row['dist']} "
          f"{shape_label(worst_row['m'], worst_row['k'], worst_row['n'])})")
    notes = sorted({r["note"] for r in rows if "note" in r})
    for note in notes:
        print(note)
    payload = {"command": "fp", "machine": machine(device),
               "settings": {"trials": args.trials, "seed": args.seed, "e_max": args.e_max},
               "rows": rows, "summary": {"false_positives": total_fp, "trials": total_trials,
                                         "cells": len(rows), "pass": total_fp == 0,
                                         "worst_ratio": worst_row["max_ratio"]},
               "notes": notes}
    return Outcome(0 if total_fp == 0 else 1, payload)
