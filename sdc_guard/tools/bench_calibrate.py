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
from ..core.torch_private import TorchDispatchMode

from .bench_common import FP16_NOTE, SHORT_NAME, Outcome, Progress, machine, resolve_device, shape_label, table
from ..backends import GemmRequest, TorchBackend
from .bench_fp import add_data_arguments, cell_seed, clean_requests, data_cells
from ..runtime.dispatch.intercept import GEMM_HANDLERS, current_phase
from ..core.precision import SUPPORTED_DTYPES, default_e_max

#: Default safety margin: the recommended e_max is this many times the largest D/T seen.
MARGIN = 4.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser, trials=100)
    parser.add_argument("--margin", type=float, default=MARGIN,
                        help=f"safety factor over the largest required e_max measured (default {MARGIN:g})")
    parser.add_argument("--model", default=None,
                        help="measure a real training run's GEMMs instead: toy:D/CTX/BATCH/LAYERS/LR or hf:ARCH "
                             "(sdc_guard.tools.bench_models)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"),
                        help="with --model: the training precision (default bf16 autocast)")
    parser.add_argument("--steps", type=int, default=50, help="with --model: training steps measured (default 50)")


class RequiredEMax(TorchDispatchMode):
    """Records, for every GEMM run under it, the largest e_max any of its segments needs
    (``required_e_max``), by (op, phase, dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.needs: dict[tuple[str, str, str], list[float]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        handler = GEMM_HANDLERS.get(func.overloadpacket)
        gemm = handler(args, kwargs, out) if handler is not None else None
        if gemm is not None and gemm.a.dtype in SUPPORTED_DTYPES and gemm.b.dtype == gemm.a.dtype:
            req = GemmRequest(gemm.a.detach(), gemm.b.detach(), gemm.out.detach(), 1.0,
                              bias=None if gemm.bias is None else gemm.bias.detach(), alpha=gemm.alpha,
                              beta=gemm.beta)
            need = required_e_max(req)
            key = (gemm.op, current_phase(), SHORT_NAME[gemm.a.dtype])
            self.needs.setdefault(key, []).append(float(torch.nan_to_num(need, nan=float("inf")).max())
                                                  if need.numel() else 0.0)
        return out


def run_model(args: argparse.Namespace) -> Outcome:
    """``--model``: train the model unguarded, measuring every GEMM's required e_max."""
    from .bench_models import PRECISIONS, build

    work = build(args.model, seed=args.seed)
    amp_dtype, scaled = PRECISIONS[args.precision]
    opt = torch.optim.AdamW(work.model.parameters(), lr=work.lr)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    recorder = RequiredEMax()
    progress = Progress(1, quiet=args.quiet)
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        with recorder:
            with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                loss = work.loss_of(work.model, step)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        progress.tick(args.model, step + 1, args.steps)
    rows = []
    for (op, phase, dtype), values in sorted(recorder.needs.items()):
        values.sort()
        rows.append({"op": op, "phase": phase, "dtype": dtype, "gemms": len(values), "max_e_max": values[-1],
                     "p99_e_max": values[min(len(values) - 1, int(0.99 * len(values)))],
                     "median_e_max": values[len(values) // 2]})
    print(table(["op", "phase", "dtype", "GEMMs", "median e_max", "p99 e_max", "max e_max"],
                [[r["op"], r["phase"], r["dtype"], r["gemms"], f"{r['median_e_max']:.3g}", f"{r['p99_e_max']:.3g}",
                  f"{r['max_e_max']:.3g}"] for r in rows], align="lllrrrr"))
    summary: dict[str, Any] = {}
    print()
    for dtype in sorted({r["dtype"] for r in rows}):
        worst = max(r["max_e_max"] for r in rows if r["dtype"] == dtype)
        torch_dtype = next(d for d, n in SHORT_NAME.items() if n == dtype)
        default = default_e_max(torch_dtype, torch.device("cpu"))
        margin = default / worst if worst > 0 else float("inf")
        summary[dtype] = {"max_e_max": worst, "default_e_max": default, "default_margin": margin,
                          "recommended_e_max": recommend(worst, args.margin) if worst > 0 else default}
        what = (f"needs e_max {worst:.3g}: the default {default:.3g} keeps a {margin:.1f}x margin on this run"
                if worst > 0 else f"no GEMM needed any accumulation allowance: the default {default:.3g} is not binding")
        print(f"  {dtype} ({args.model}, {args.precision}, {args.steps} steps): {what}")
    payload = {"command": "calibrate", "mode": "model", "machine": machine(torch.device("cpu")),
               "settings": {"model": args.model, "precision": args.precision, "steps": args.steps, "seed": args.seed},
               "rows": rows, "summary": summary}
    return Outcome(0, payload)


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
    if args.model is not None:
        return run_model(args)
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
