"""``sdc-guard bench calibrate``: the ``e_max`` this device's data needs, measured.

``e_max`` scales one term of the screen's threshold, the V-ABFT bracket (accumulation
error); C's own rounding, the bias and the underflow floor have terms of their own that do
not scale with it (docs/ALGORITHM.md). So ``T(e_max) = e_max * X + F`` per segment, and the
smallest ``e_max`` at which a clean segment passes is ``max(0, D - F) / X``: measured here
on every segment of the ``fp`` benchmark's clean products (``--model``: of a real training
run's GEMMs). Any ``e_max`` at or above the largest required value passes every segment
measured; the recommendation multiplies it by a stated safety margin, per dtype. Where
the fixed terms cover every segment (required ``e_max`` 0), the data asks for no
accumulation allowance at all: the default is kept, and no margin is claimed beyond what
was measured. Install a recommendation with ``sdc_guard.set_default_e_max(dtype, e_max)``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from .bench_common import FP16_NOTE, SHORT_NAME, Outcome, Progress, machine, resolve_device, shape_label, table
from .backends import GemmRequest, TorchBackend
from .bench_fp import add_data_arguments, cell_seed, clean_requests, data_cells
from .precision import default_e_max

#: Default safety margin: the recommended e_max is this many times the largest D/T seen.
MARGIN = 4.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser, trials=100)
    parser.add_argument("--margin", type=float, default=MARGIN,
                        help=f"safety factor over the largest D/T measured (default {MARGIN:g})")


def recommend(max_ratio: float, margin: float) -> float:
    """``margin * max_ratio``: the e_max to use, given the largest required e_max.

    >>> recommend(2.5e-4, 4.0)
    0.001
    """
    return margin * max_ratio


def required_e_max(req: GemmRequest) -> Tensor:
    """Per (row, segment) of ``req``, the smallest ``e_max`` at which the screen passes it:
    ``max(0, D - F) / X`` with ``T(e) = e X + F`` (0 where the fixed terms alone cover D;
    inf where no ``e_max`` would, which on a clean product means the data is beyond the
    screen's model). Torch reference path, both checks on the same operands."""
    base = replace(req, e_max=0.0)
    fixed = TorchBackend().check(base)
    scaled = TorchBackend().check(replace(req, e_max=1.0))
    assert fixed.diff is not None and fixed.threshold is not None and scaled.threshold is not None
    per = (scaled.threshold.double() - fixed.threshold.double()).clamp_min(0.0)
    excess = (fixed.diff.double() - fixed.threshold.double()).clamp_min(0.0)
    need = torch.where(excess > 0, excess / per, torch.zeros_like(excess))
    return torch.where(fixed.inputs_bad, torch.zeros_like(need), need)


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
        for req in clean_requests(dtype, dist, shape, args.trials, 1.0, device, cell_seed(args.seed, i), progress):
            need = required_e_max(req)
            ratios.append(float(torch.nan_to_num(need, nan=float("inf")).max()) if need.numel() else 0.0)
        ratios.sort()
        row = {"dtype": SHORT_NAME[dtype], "dist": dist, "m": shape[0], "k": shape[1], "n": shape[2],
               "trials": args.trials, "max_ratio": ratios[-1],
               "p99_ratio": ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))],
               "median_ratio": ratios[len(ratios) // 2], "seconds": time.perf_counter() - started}
        rows.append(row)
        progress.step(f"{row['dtype']} {dist} {shape_label(*shape)}", f"max D/T at e_max=1: {ratios[-1]:.3g}")
    print(table(["dtype", "dist", "MxKxN", "trials", "median e_max", "p99 e_max", "max e_max"],
                [[r["dtype"], r["dist"], shape_label(r["m"], r["k"], r["n"]), r["trials"],
                  f"{r['median_ratio']:.3g}", f"{r['p99_ratio']:.3g}", f"{r['max_ratio']:.3g}"] for r in rows],
                align="lllrrrr"))
    print()
    print(f"e_max each product needs (the smallest at which every segment passes); recommended e_max = "
          f"{args.margin:g} x the largest (safety margin {args.margin:g}x for data not measured):")
    summary: dict[str, Any] = {}
    for dtype in args.dtypes:
        name = SHORT_NAME[dtype]
        mine = [r for r in rows if r["dtype"] == name]
        worst = max(r["max_ratio"] for r in mine)
        default = default_e_max(dtype, device)
        if worst > 0:
            rec = recommend(worst, args.margin)
            default_margin = default / worst
            line = (f"  {name}: needs e_max {worst:.3g} -> recommended e_max {rec:.3g} "
                    f"(default {default:.3g} keeps a {default_margin:.1f}x margin on this data); "
                    f"sdc_guard.set_default_e_max(torch.{str(dtype).removeprefix('torch.')}, {rec:.3g})")
        else:
            rec, default_margin = default, float("inf")
            line = (f"  {name}: every segment passed on the fixed terms alone (C's rounding, floor): the data "
                    f"needs no accumulation allowance; keep the default {default:.3g}")
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
