"""``sdc-guard bench detect``: which corruptions V-ABFT catches, by bit and by magnitude.

One number would hide the physics (docs/ALGORITHM.md, "What it can see"): an error far
above a segment's rounding noise is always caught, one below it never is, at zero false
positives. So detection is reported

- by bit position and flip direction (0 -> 1 and 1 -> 0) of one element of C, for each
  dtype: the top exponent bit turned on makes a value astronomically large and must be
  caught every time; low mantissa bits move a value by less than the noise;
- by injected error magnitude relative to the segment's output scale (the RMS of C over
  the 256 columns of the segment): the curve from "never" to "always".

Every row of a product is an independent trial (thresholds and checksums are row-local):
one corrupted element per row, so one check of an ``M``-row product gives ``M`` trials. A
trial counts as detected when its (row, segment) is *confirmed* corrupted (the screen
flagged it and the exact recomputation of ``sdc_guard.core.confirm`` confirmed it, as the guard
acts on it); confirmed flags on other segments are false alarms (there must be none). Each
screen (``--screens default,tight``) is measured on the same data, with its miss rate on
the clean products beside it: the share of segments it suspected that the confirmation
cleared.

``--captured MODELS`` measures the check by magnitude on GEMMs captured from real
training, through ``verify_matmul``, beside the screens before the threshold read C
(``sdc_guard.tools.bench_detect_captured``); ``--training`` measures samplers instead of
the check: faults in a training run (``sdc_guard.tools.bench_detect_training``);
``--attention`` the fused-attention check (``sdc_guard.tools.bench_detect_attention``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from .. import backends
from ..core.abft import weight_side
from ..backends import GemmRequest
from . import bench_detect_attention, bench_detect_captured
from .bench_common import (
    DIRECTIONS, DISTRIBUTIONS, FP16_NOTE, SHORT_NAME, Outcome, Progress, argtype, bit_field, bit_set, flip_rows,
    generator, machine, operands, parse_dtypes, parse_names, parse_shape, pct, pick_per_row, product, resolve_device,
    table,
)
from ..core.confirm import confirm
from ..core.precision import SCREENS, SEGMENT, resolve_screen

MAGNITUDES = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 2.0, 4.0, 10.0, 100.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default="bf16,fp16,fp32", type=argtype(parse_dtypes),
                        help="comma list of bf16, fp16, fp32 (default all three)")
    parser.add_argument("--shape", default="256x1024x1024", type=argtype(parse_shape),
                        help="MxKxN of each product (default 256x1024x1024); each row is one trial")
    parser.add_argument("--gemms", type=int, default=4,
                        help="products per dtype (default 4: trials per cell = 4 x M)")
    parser.add_argument("--dist", default="gaussian",
                        type=argtype(lambda t: parse_names(t, DISTRIBUTIONS, "dist")[0]),
                        help="data distribution: " + ", ".join(DISTRIBUTIONS) + " (default gaussian)")
    parser.add_argument("--magnitudes", default=",".join(f"{x:g}" for x in MAGNITUDES),
                        type=argtype(_floats), help="injected |error| / segment RMS of C, comma-separated")
    parser.add_argument("--e-max", type=float, default=None, help="e_max (default: the screen's default for the dtype)")
    parser.add_argument("--screens", default="default,tight",
                        type=argtype(lambda t: parse_names(t, SCREENS, "screens")), help="comma list of screens to measure: " + ", ".join(SCREENS) + " (default both)")
    parser.add_argument("--backend", default=None, help="verification backend (default: the dispatcher's choice)")
    from . import bench_detect_training  # imports torch.nn models: only when asked for

    bench_detect_training.add_arguments(parser)
    bench_detect_attention.add_arguments(parser)
    bench_detect_captured.add_arguments(parser)


def _floats(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"magnitudes: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ValueError(f"magnitudes: expected positive finite numbers, got {text!r}")
    return values


def _segment_rms(c: Tensor) -> Tensor:
    """RMS of fp32 ``c`` over each row's 256-column segments, ``[M, nseg]``."""
    from ..core.abft import segment_reduce

    sq = c.float().square()
    counts = segment_reduce(torch.ones_like(sq[:1]), lambda t, d: t.sum(d))
    return (segment_reduce(sq, lambda t, d: t.sum(d)) / counts).sqrt()


class _Tally:
    def __init__(self) -> None:
        self.trials = self.detected = self.false_alarms = self.unchanged = 0
        self.rel_errors: list[float] = []

    def rate(self) -> float:
        return self.detected / self.trials if self.trials else float("nan")

    def as_dict(self) -> dict[str, Any]:
        errs = sorted(self.rel_errors)
        return {"trials": self.trials, "detected": self.detected, "rate": self.rate(),
                "false_alarms": self.false_alarms, "unchanged": self.unchanged,
                "median_rel_error": errs[len(errs) // 2] if errs else float("nan")}


def _check(backend: Any, req: GemmRequest, bad: Tensor, rows: Tensor, cols: Tensor, rms: Tensor,
           clean: Tensor, tally: _Tally) -> None:
    """Verify corrupted ``bad`` (screen, then confirmation) and add its trials (one per row
    in ``rows``) to ``tally``."""
    bad_req = replace(req, c=bad)
    check = backend.check(bad_req)
    sdc = confirm(bad_req, check.ok, check.inputs_bad, check.ratio, on_host=True, limit=None).corrupted
    segs = cols // SEGMENT
    hit = sdc[rows, segs]
    error = (bad[rows, cols].float() - clean[rows, cols].float()).abs()
    changed = error != 0  # an error rounded away (or a flip of a NaN payload) changed nothing
    rel = torch.nan_to_num(error / rms[rows, segs], nan=float("inf"), posinf=float("inf"))
    tally.trials += int(changed.sum())
    tally.unchanged += int((~changed).sum())
    tally.detected += int((hit & changed).sum())
    tally.false_alarms += int(sdc.sum()) - int(hit.sum())
    tally.rel_errors += rel[changed].tolist()


def run_dtype(dtype: torch.dtype, screen: str, args: argparse.Namespace, device: torch.device,
              progress: Progress) -> dict[str, Any]:
    m, k, n = args.shape
    width = torch.finfo(dtype).bits
    e_max, rounding = resolve_screen(screen, args.e_max, dtype, device)
    bits = {(bit, d): _Tally() for bit in range(width) for d in DIRECTIONS}
    mags = {r: _Tally() for r in args.magnitudes}
    gen = generator(device, args.seed)
    clean_segments = clean_suspects = clean_confirmed = 0
    for g in range(args.gemms):
        a, b = operands(args.dist, m, k, n, dtype, device, gen)
        c = product(a, b)
        req = GemmRequest(a, b, c, e_max, weight=weight_side(b), rounding=rounding)
        backend = backends.select(req, args.backend)
        clean = backend.check(req)
        suspects = ~clean.ok & ~clean.inputs_bad
        clean_segments += suspects.numel()
        clean_suspects += int(suspects.sum())
        clean_confirmed += int(confirm(req, clean.ok, clean.inputs_bad, clean.ratio, on_host=True,
                                       limit=None).corrupted.sum())
        rms = _segment_rms(c)
        for bit in range(width):
            state = bit_set(c, bit)
            for direction in DIRECTIONS:
                rows, cols = pick_per_row(~state if direction == "on" else state, gen)
                if rows.numel():
                    _check(backend, req, flip_rows(c, rows, cols, bit, width), rows, cols, rms, c, bits[(bit, direction)])
        for r in args.magnitudes:
            rows, cols = pick_per_row(torch.ones(m, n, dtype=torch.bool, device=device), gen)
            sign = torch.where(torch.rand(rows.shape, generator=gen, device=device) < 0.5, -1.0, 1.0)
            bad = c.clone()
            bad[rows, cols] = (c[rows, cols].float() + sign * r * rms[rows, cols // SEGMENT]).to(dtype)
            _check(backend, req, bad, rows, cols, rms, c, mags[r])
        progress.tick(f"{SHORT_NAME[dtype]} {screen}", g + 1, args.gemms)
    by_bit = [{"bit": bit, "field": bit_field(dtype, bit), "direction": DIRECTIONS[d], **bits[(bit, d)].as_dict()}
              for (bit, d) in bits]
    by_magnitude = [{"magnitude": r, **mags[r].as_dict()} for r in args.magnitudes]
    summary = _dtype_summary(dtype, bits, mags)
    summary["false_alarms"] += clean_confirmed
    summary["clean_segments"] = clean_segments
    summary["screen_misses"] = clean_suspects - clean_confirmed
    summary["miss_rate"] = (clean_suspects - clean_confirmed) / clean_segments if clean_segments else 0.0
    terms = {"acc": rounding.acc, "bounded": rounding.bounded, "sigmas": rounding.sigmas, "coherent": rounding.coherent}
    return {"dtype": SHORT_NAME[dtype], "screen": screen, "e_max": e_max, "terms": terms, "by_bit": by_bit,
            "by_magnitude": by_magnitude, "summary": summary}


def _pool(tallies: list[_Tally]) -> dict[str, Any]:
    trials = sum(t.trials for t in tallies)
    detected = sum(t.detected for t in tallies)
    return {"trials": trials, "detected": detected, "rate": detected / trials if trials else float("nan")}


def _dtype_summary(dtype: torch.dtype, bits: dict[tuple[int, str], _Tally], mags: dict[float, _Tally]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d, arrow in DIRECTIONS.items():
        for fld in ("sign", "exponent (top)", "exponent", "mantissa"):
            out[f"{fld} {arrow}"] = _pool([t for (bit, dd), t in bits.items() if dd == d and bit_field(dtype, bit) == fld])
    full = [r for r, t in sorted(mags.items()) if t.trials and t.rate() >= 0.99]
    # the smallest magnitude from which on every larger one is also caught >= 99 %
    always = None
    for r, t in sorted(mags.items(), reverse=True):
        if t.trials and t.rate() >= 0.99:
            always = r
        else:
            break
    out["magnitude_99pct"] = always if full else None
    out["false_alarms"] = sum(t.false_alarms for t in bits.values()) + sum(t.false_alarms for t in mags.values())
    return out


def render(results: list[dict[str, Any]]) -> str:
    lines = []
    for res in results:
        rows = {}
        for item in res["by_bit"]:
            rows.setdefault(item["bit"], {"field": item["field"]})[item["direction"]] = item
        body = []
        for bit in sorted(rows, reverse=True):
            on, off = rows[bit].get("0->1"), rows[bit].get("1->0")
            body.append([bit, rows[bit]["field"], _rate(on), _rate(off),
                         f"{on['median_rel_error']:.2g}" if on and on["trials"] else "-",
                         f"{off['median_rel_error']:.2g}" if off and off["trials"] else "-"])
        t = res["terms"]
        c_term = f"min({t['sigmas']:g} sigma + coherent, rigorous)" if t["sigmas"] else "rigorous"
        lines += [f"{res['dtype']}, {res['screen']} screen (e_max {res['e_max']:.3g}, C's rounding {c_term}):"
                  " detection by flipped bit of one element of C",
                  table(["bit", "field", "0->1", "1->0", "|err|/rms 0->1", "|err|/rms 1->0"], body,
                        align="rlrrrr"), ""]
        body = [[f"{item['magnitude']:g}", _rate(item), item["unchanged"]] for item in res["by_magnitude"]]
        lines += [f"{res['dtype']}, {res['screen']} screen: detection by injected |error| / segment RMS of C",
                  table(["|err|/rms", "detected", "rounded away"], body, align="rrr"), ""]
    lines.append("summary:")
    for res in results:
        s = res["summary"]
        top_on = s["exponent (top) 0->1"]
        mag = s["magnitude_99pct"]
        lines.append(
            f"  {res['dtype']} {res['screen']}: top exponent bit 0->1 {pct(top_on['rate'])} ({top_on['trials']} trials), "
            f"1->0 {pct(s['exponent (top) 1->0']['rate'])}; other exponent bits {pct(s['exponent 0->1']['rate'])} / "
            f"{pct(s['exponent 1->0']['rate'])}; sign {pct(s['sign 0->1']['rate'])} / {pct(s['sign 1->0']['rate'])}; "
            f"mantissa {pct(s['mantissa 0->1']['rate'])} / {pct(s['mantissa 1->0']['rate'])}; "
            f">= 99 % caught from |error| >= {mag:g} x segment RMS" if mag is not None else
            f"  {res['dtype']} {res['screen']}: top exponent bit 0->1 {pct(top_on['rate'])}; no magnitude reached 99 %")
        lines.append(f"        confirmed false alarms on uncorrupted segments: {s['false_alarms']}; screen misses on the "
                     f"clean products {s['screen_misses']} of {s['clean_segments']} segments ({s['miss_rate']:.2g})")
    return "\n".join(lines)


def _rate(item: dict[str, Any] | None) -> str:
    if not item or not item["trials"]:
        return "-"
    return f"{pct(item['rate'])} ({item['trials']})"


def run(args: argparse.Namespace) -> Outcome:
    if getattr(args, "training", False) and getattr(args, "attention", False):
        raise ValueError("--training and --attention: expected one of them, got both")
    if getattr(args, "attention", False):
        return bench_detect_attention.run(args)
    if getattr(args, "captured", None):
        return bench_detect_captured.run(args, MAGNITUDES)
    if getattr(args, "training", False):
        from . import bench_detect_training

        return bench_detect_training.run(args)
    if args.gemms < 1:
        raise ValueError(f"gemms: expected a positive int, got {args.gemms}")
    device = resolve_device(args.device)
    progress = Progress(len(args.dtypes) * len(args.screens), quiet=args.quiet)
    results = []
    for dtype in args.dtypes:
        for screen in args.screens:
            res = run_dtype(dtype, screen, args, device, progress)
            results.append(res)
            top = res["summary"]["exponent (top) 0->1"]
            progress.step(f"{res['dtype']} {screen}", f"top exponent bit 0->1 detected {pct(top['rate'])}")
    print(render(results))
    notes = [FP16_NOTE] if torch.float16 in args.dtypes and device.type == "cpu" else []
    for note in notes:
        print(note)
    payload = {"command": "detect", "machine": machine(device),
               "settings": {"shape": list(args.shape), "gemms": args.gemms, "dist": args.dist,
                            "magnitudes": args.magnitudes, "seed": args.seed, "screens": args.screens},
               "results": results, "notes": notes}
    status = 1 if any(r["summary"]["false_alarms"] for r in results) else 0
    return Outcome(status, payload)
