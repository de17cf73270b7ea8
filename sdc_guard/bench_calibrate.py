"""``sdc-guard bench calibrate``: the ``e_max`` this device needs, measured.

``e_max`` scales the threshold (VABFT.md): a smaller one catches smaller errors and risks
false positives. The defaults (bf16 and fp16 1e-3, fp32 2e-5) come from the Ascend
operator's recommendation; fp16 has none public. This measures, on clean products of the
``fp`` benchmark's data, the largest ``D / T`` with ``e_max = 1``: any ``e_max`` at or above
it passes every product measured (T grows linearly with ``e_max``, floors aside, which
only raise it). The recommendation multiplies it by a stated safety margin for the data
not measured, per dtype, over every distribution and shape run; install it with
``sdc_guard.set_default_e_max(dtype, e_max)``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from .bench_common import FP16_NOTE, SHORT_NAME, Outcome, Progress, machine, resolve_device, shape_label, table
from .bench_fp import add_data_arguments, cell_seed, clean_trials, data_cells
from .precision import default_e_max

#: Default safety margin: the recommended e_max is this many times the largest D/T seen.
MARGIN = 4.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser, trials=100)
    parser.add_argument("--margin", type=float, default=MARGIN,
                        help=f"safety factor over the largest D/T measured (default {MARGIN:g})")


def recommend(max_ratio: float, margin: float) -> float:
    """``margin * max_ratio``: the e_max to use, given the largest D/T at e_max = 1.

    >>> recommend(2.5e-4, 4.0)
    0.001
    """
    return margin * max_ratio


def run(args: argparse.Namespace) -> Outcome:
    if not args.margin >= 1.0:
        raise ValueError(f"margin: expected a factor >= 1, got {args.margin}")
    device = resolve_device(args.device)
    cells = data_cells(args)
    progress = Progress(len(cells), quiet=args.quiet)
    rows: list[dict[str, Any]] = []
    for i, (dtype, dist, shape) in enumerate(cells):
        started = time.perf_counter()
        ratios = []
        for check in clean_trials(dtype, dist, shape, args.trials, 1.0, device, cell_seed(args.seed, i),
                                  args.backend, progress):
            ratio = check.ratio
            if ratio is None:
                raise ValueError(f"backend: {args.backend or 'the default backend'} reports no D/T "
                                 "(the NPU operator returns bits only); calibrate with --backend torch")
            judged = ratio[~check.inputs_bad]  # clean data is finite: every segment
            ratios.append(float(torch.nan_to_num(judged, nan=float("inf")).max()) if judged.numel() else 0.0)
        ratios.sort()
        row = {"dtype": SHORT_NAME[dtype], "dist": dist, "m": shape[0], "k": shape[1], "n": shape[2],
               "trials": args.trials, "max_ratio": ratios[-1],
               "p99_ratio": ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))],
               "median_ratio": ratios[len(ratios) // 2], "seconds": time.perf_counter() - started}
        rows.append(row)
        progress.step(f"{row['dtype']} {dist} {shape_label(*shape)}", f"max D/T at e_max=1: {ratios[-1]:.3g}")
    print(table(["dtype", "dist", "MxKxN", "trials", "median D/T", "p99 D/T", "max D/T"],
                [[r["dtype"], r["dist"], shape_label(r["m"], r["k"], r["n"]), r["trials"],
                  f"{r['median_ratio']:.3g}", f"{r['p99_ratio']:.3g}", f"{r['max_ratio']:.3g}"] for r in rows],
                align="lllrrrr"))
    print()
    print(f"D/T measured with e_max = 1; recommended e_max = {args.margin:g} x the largest (safety margin "
          f"{args.margin:g}x for data not measured):")
    summary: dict[str, Any] = {}
    for dtype in args.dtypes:
        name = SHORT_NAME[dtype]
        mine = [r for r in rows if r["dtype"] == name]
        worst = max(r["max_ratio"] for r in mine)
        default = default_e_max(dtype, device)
        if worst > 0:
            rec = recommend(worst, args.margin)
            default_margin = default / worst
            line = (f"  {name}: max D/T {worst:.3g} -> recommended e_max {rec:.3g} "
                    f"(default {default:.3g} keeps a {default_margin:.1f}x margin); "
                    f"sdc_guard.set_default_e_max(torch.{str(dtype).removeprefix('torch.')}, {rec:.3g})")
        else:
            rec, default_margin = default, float("inf")
            line = f"  {name}: every D was exactly 0 (no rounding residue measured): keep the default {default:.3g}"
        print(line)
        summary[name] = {"max_ratio": worst, "recommended_e_max": rec, "margin": args.margin,
                         "default_e_max": default, "default_margin": default_margin,
                         "cells": len(mine), "trials": sum(r["trials"] for r in mine)}
    notes = [FP16_NOTE] if torch.float16 in args.dtypes and device.type == "cpu" else []
    for note in notes:
        print(note)
    payload = {"command": "calibrate", "machine": machine(device),
               "settings": {"trials": args.trials, "seed": args.seed, "margin": args.margin},
               "rows": rows, "summary": summary, "notes": notes}
    return Outcome(0, payload)
