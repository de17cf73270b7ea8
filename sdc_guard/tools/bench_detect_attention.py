"""``sdc-guard bench detect --attention``: which corruptions the fused-attention check
catches, by bit and by magnitude, in the forward output and in each input gradient.

``bench detect`` measures the GEMM check; this is the same measurement for fused attention
(``scaled_dot_product_attention``, docs/ATTENTION.md). For each dtype and each kind of
operands (``sdc_guard.tools.attention_operands``: i.i.d. Gaussian, peaked causal, the
calls of a small ``transformers`` Llama) it runs the fused kernel forward and backward,
then corrupts one element per row of one of its outputs, ``O`` (forward), ``dQ``, ``dK``
or ``dV`` (backward), as ``GemmFault(op="sdpa")`` and ``GemmFault(op="sdpa_backward",
output=0|1|2)`` would, and runs what the guard runs on the call: the screen
(``core.attention.forward_screen`` / ``backward_screen``) and, on its suspects, the exact
confirmation (``core.attention_confirm``, every flagged head examined).

Every row is an independent trial: a row's screen reads only that row of its output (and
the call's inputs), and so does its confirmation, so one call corrupted in every row of
``O`` gives ``B Hq L`` trials; ``dQ``, ``dK`` and ``dV`` are corrupted together in one
backward check, since none of the three verdicts reads the other two gradients. A trial
is *flagged* when the screen suspects its row and *detected* when the confirmation
confirms it (what the guard acts on); a confirmed row that was not changed is a false
alarm. The uncorrupted outputs of every call are checked first: their confirmed rows (must
be 0) and their screen misses (suspects the confirmation cleared) are reported beside.

Corruptions: each bit of the dtype turned on (0 -> 1) and off (1 -> 0) in a random element
of the row whose bit was in the other state; and errors of ``--magnitudes`` times the RMS
of the output over the row's head, of random sign (``_head_rms``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..core.attention import backward_screen, forward_screen
from ..core.attention_confirm import confirm_backward, confirm_forward
from .attention_operands import CASES, AttentionSample, check_shape, samples
from .bench_common import (BIT_LAYOUT, DIRECTIONS, SHORT_NAME, Outcome, Progress, argtype, bit_field, bit_set,
                           flip_rows, generator, machine, parse_names, pct, pick_per_row, resolve_device, table)

TARGETS = ("O", "dQ", "dK", "dV")
CLASSES = ("sign", "exponent (top)", "exponent (other)", "mantissa (high)", "mantissa (low)")
#: SDPA calls per kind of operands and dtype when ``--trials`` is not given
DEFAULT_CALLS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--attention (fused attention, forward output and input gradients)")
    group.add_argument("--attention", action="store_true",
                       help="measure the fused-attention (SDPA) check instead of GEMMs: bit flips and errors in "
                            "O, dQ, dK, dV (with --dtypes, --magnitudes, --trials, --seed; not --screens)")
    group.add_argument("--operands", default=",".join(CASES), type=argtype(lambda t: parse_names(t, CASES, "operands")),
                       help="attention: kinds of calls, comma list of " + ", ".join(CASES) + " (default all)")
    group.add_argument("--ctx", type=int, default=128, help="attention: context length L = S (default 128)")
    group.add_argument("--head-dim", type=int, default=64, help="attention: head dim (default 64)")
    group.add_argument("--heads", type=int, default=4, help="attention: query heads (default 4)")
    group.add_argument("--kv-heads", type=int, default=2, help="attention: key/value heads (default 2: GQA)")
    group.add_argument("--batch", type=int, default=1, help="attention: batch (default 1)")


def bit_class(dtype: torch.dtype, bit: int) -> str:
    """``bit_field`` with the exponent's top bit apart and the mantissa in halves: its
    upper ``floor(m / 2)`` bits are ``mantissa (high)``.

    >>> [bit_class(torch.bfloat16, b) for b in (15, 14, 8, 4, 3)]
    ['sign', 'exponent (top)', 'exponent (other)', 'mantissa (high)', 'mantissa (low)']
    """
    name = bit_field(dtype, bit)
    if name == "exponent":
        return "exponent (other)"
    if name == "mantissa":
        first_exp = BIT_LAYOUT[dtype][0]
        return "mantissa (high)" if bit >= first_exp - first_exp // 2 else "mantissa (low)"
    return name


@dataclass
class Tally:
    """Trials of one cell: changed elements, how many the screen flagged and how many the
    confirmation confirmed; confirmed rows without a change; changes rounded away."""

    trials: int = 0
    flagged: int = 0
    detected: int = 0
    false_alarms: int = 0
    unchanged: int = 0
    rel_errors: list[float] = field(default_factory=list)

    def add(self, other: "Tally") -> None:
        self.trials += other.trials
        self.flagged += other.flagged
        self.detected += other.detected
        self.false_alarms += other.false_alarms
        self.unchanged += other.unchanged
        self.rel_errors += other.rel_errors

    def as_dict(self) -> dict[str, Any]:
        errs = sorted(self.rel_errors)
        n = self.trials
        return {"trials": n, "flagged": self.flagged, "detected": self.detected,
                "flag_rate": self.flagged / n if n else float("nan"), "rate": self.detected / n if n else float("nan"),
                "false_alarms": self.false_alarms, "unchanged": self.unchanged,
                "median_rel_error": errs[len(errs) // 2] if errs else float("nan")}


@dataclass(frozen=True)
class Verdict:
    """Per row of one output (flattened): screen suspect, confirmed, unverifiable, D/T."""

    flagged: Tensor
    confirmed: Tensor
    unverifiable: Tensor
    ratio: Tensor


def check(sample: AttentionSample, outs: dict[str, Tensor]) -> dict[str, Verdict]:
    """What the guard runs on the call with outputs ``outs``: the screens, then the exact
    confirmation of every suspect (no limit on the heads examined)."""
    ops = sample.ops
    fwd = forward_screen(ops, outs["O"])
    conf = confirm_forward(ops, outs["O"], fwd, on_host=True, limit=None)
    bwd = backward_screen(ops, sample.grad_out, sample.out, outs["dQ"], outs["dK"], outs["dV"])
    confs = confirm_backward(ops, sample.grad_out, sample.out, outs["dQ"], outs["dK"], outs["dV"], bwd,
                             on_host=True, limit=None)
    verdicts = {}
    for name, rc, c in zip(TARGETS, (fwd, bwd.dq, bwd.dk, bwd.dv), (conf, *confs)):
        verdicts[name] = Verdict((~rc.ok & ~rc.inputs_bad).flatten(), c.sdc.flatten(), rc.inputs_bad.flatten(),
                                 rc.ratio.flatten())
    return verdicts


def _tally(verdict: Verdict, clean: Tensor, bad: Tensor, rows: Tensor, cols: Tensor, rms: Tensor) -> Tally:
    """The trials of one corrupted output (``[rows, cols]`` 2-D, one element per row)."""
    keep = ~verdict.unverifiable[rows]
    rows, cols = rows[keep], cols[keep]
    error = (bad[rows, cols].float() - clean[rows, cols].float()).abs()
    changed = error != 0  # a change rounded away (or -0 for 0) changed nothing; NaN counts as changed
    hit, flagged = verdict.confirmed[rows] & changed, verdict.flagged[rows] & changed
    rel = torch.nan_to_num(error / rms[rows], nan=float("inf"), posinf=float("inf"))
    return Tally(trials=int(changed.sum()), flagged=int(flagged.sum()), detected=int(hit.sum()),
                 false_alarms=int(verdict.confirmed.sum()) - int(hit.sum()), unchanged=int((~changed).sum()),
                 rel_errors=rel[changed].tolist())


def _flat(sample: AttentionSample) -> dict[str, Tensor]:
    """Each output as ``[rows, head dim]`` (rows in the screen's order), contiguous."""
    outs = dict(zip(TARGETS, (sample.out, *sample.grads)))
    return {name: t.reshape(-1, t.shape[-1]).contiguous() for name, t in outs.items()}


def _head_rms(flat: Tensor, rows_per_head: int) -> Tensor:
    """Per row, the RMS of its head's whole output (``[L, D]`` of one batch element and
    head): the scale an error is measured against. Not the row's own RMS: some rows are
    rounding noise around an exact 0 (``dQ`` of the first query of causal attention,
    which attends only to its own key, so ``dS`` is 0), and an error 100 times noise is
    still noise."""
    per_head = flat.float().reshape(-1, rows_per_head * flat.shape[-1]).square().mean(-1).sqrt()
    return per_head.repeat_interleave(rows_per_head)


def _corrupted(sample: AttentionSample, flat: dict[str, Tensor], bad: dict[str, Tensor]) -> dict[str, Tensor]:
    shapes = dict(zip(TARGETS, (sample.out.shape, *(g.shape for g in sample.grads))))
    return {name: bad[name].reshape(shapes[name]) for name in TARGETS}


def measure_sample(sample: AttentionSample, magnitudes: list[float], gen: torch.Generator,
                   cells: dict[tuple, Tally], clean: dict[str, dict[str, Any]]) -> None:
    """All the trials of one call, added to ``cells`` (keyed ``(target, "bit", bit,
    direction)`` and ``(target, "magnitude", r)``) and its clean check to ``clean``."""
    flat = _flat(sample)
    dtype = sample.out.dtype
    width = torch.finfo(dtype).bits
    rms = {name: _head_rms(t, sample.out.shape[-2] if name in ("O", "dQ") else sample.ops.k.shape[-2])
           for name, t in flat.items()}
    verdicts = check(sample, _corrupted(sample, flat, flat))
    for name, v in verdicts.items():
        acc = clean.setdefault(name, {"rows": 0, "suspects": 0, "confirmed": 0, "worst_ratio": 0.0})
        verifiable = ~v.unverifiable
        acc["rows"] += int(verifiable.sum())
        acc["suspects"] += int(v.flagged.sum())
        acc["confirmed"] += int(v.confirmed.sum())
        ratios = v.ratio[verifiable]
        if ratios.numel():
            acc["worst_ratio"] = max(acc["worst_ratio"], float(ratios.nan_to_num(nan=float("inf")).amax()))
    for bit in range(width):
        for direction in DIRECTIONS:
            bad, picks = {}, {}
            for name, c in flat.items():
                state = bit_set(c, bit)
                rows, cols = pick_per_row(~state if direction == "on" else state, gen)
                bad[name], picks[name] = flip_rows(c, rows, cols, bit, width), (rows, cols)
            verdicts = check(sample, _corrupted(sample, flat, bad))
            for name in TARGETS:
                cell = cells.setdefault((name, "bit", bit, direction), Tally())
                cell.add(_tally(verdicts[name], flat[name], bad[name], *picks[name], rms[name]))
    for r in magnitudes:
        bad, picks = {}, {}
        for name, c in flat.items():
            rows, cols = pick_per_row(torch.ones(c.shape, dtype=torch.bool, device=c.device), gen)
            sign = torch.where(torch.rand(rows.shape, generator=gen, device=c.device) < 0.5, -1.0, 1.0)
            b = c.clone()
            b[rows, cols] = (c[rows, cols].float() + sign * r * rms[name][rows]).to(dtype)
            bad[name], picks[name] = b, (rows, cols)
        verdicts = check(sample, _corrupted(sample, flat, bad))
        for name in TARGETS:
            cells.setdefault((name, "magnitude", r), Tally()).add(
                _tally(verdicts[name], flat[name], bad[name], *picks[name], rms[name]))


def _rows(dtype: torch.dtype, case: str, cells: dict[tuple, Tally], magnitudes: list[float]) -> dict[str, list]:
    """The JSON cells of one case (or ``all``): by bit, by class, by magnitude."""
    width = torch.finfo(dtype).bits
    by_bit, by_class, by_mag = [], [], []
    for name in TARGETS:
        for bit in range(width):
            for d, arrow in DIRECTIONS.items():
                by_bit.append({"case": case, "target": name, "bit": bit, "field": bit_field(dtype, bit),
                               "class": bit_class(dtype, bit), "direction": arrow,
                               **cells.get((name, "bit", bit, d), Tally()).as_dict()})
        for cls in CLASSES:
            for d, arrow in DIRECTIONS.items():
                pooled = Tally()
                for bit in range(width):
                    if bit_class(dtype, bit) == cls and (name, "bit", bit, d) in cells:
                        pooled.add(cells[(name, "bit", bit, d)])
                by_class.append({"case": case, "target": name, "class": cls, "direction": arrow, **pooled.as_dict()})
        for r in magnitudes:
            by_mag.append({"case": case, "target": name, "magnitude": r,
                           **cells.get((name, "magnitude", r), Tally()).as_dict()})
    return {"by_bit": by_bit, "by_class": by_class, "by_magnitude": by_mag}


def magnitude_99pct(by_mag: list[dict[str, Any]], case: str, target: str) -> float | None:
    """The smallest ``|error| / head RMS`` from which on every larger one was confirmed in
    >= 99 % of its trials (``None``: not even the largest)."""
    always = None
    for item in sorted((m for m in by_mag if m["case"] == case and m["target"] == target),
                       key=lambda m: m["magnitude"], reverse=True):
        if item["trials"] and item["rate"] >= 0.99:
            always = item["magnitude"]
        else:
            break
    return always


def run_dtype(dtype: torch.dtype, args: argparse.Namespace, device: torch.device, calls: int,
              progress: Progress) -> dict[str, Any]:
    """Every case's calls in ``dtype``: the cells per case and pooled, the clean checks."""
    pooled: dict[tuple, Tally] = {}
    cells_json: dict[str, list] = {"by_bit": [], "by_class": [], "by_magnitude": []}
    clean_rows = []
    for i, case in enumerate(args.operands):
        seed = args.seed * 1_000_003 + 7919 * list(CASES).index(case)
        gen = generator(device, seed + 1)
        cells: dict[tuple, Tally] = {}
        clean: dict[str, dict[str, Any]] = {}
        for j, sample in enumerate(samples(case, calls, dtype, device, args, seed)):
            measure_sample(sample, args.magnitudes, gen, cells, clean)
            progress.tick(f"{SHORT_NAME[dtype]} {case}", j + 1, calls)
        for key, t in cells.items():
            pooled.setdefault(key, Tally()).add(t)
        for part, rows in _rows(dtype, case, cells, args.magnitudes).items():
            cells_json[part] += rows
        clean_rows += [{"case": case, "target": name, **acc, "screen_misses": acc["suspects"] - acc["confirmed"]}
                       for name, acc in clean.items()]
    for part, rows in _rows(dtype, "all", pooled, args.magnitudes).items():
        cells_json[part] += rows
    injected_false = sum(t.false_alarms for t in pooled.values())
    summary = {
        "clean_rows": sum(c["rows"] for c in clean_rows),
        "clean_confirmed": sum(c["confirmed"] for c in clean_rows),
        "screen_misses": sum(c["screen_misses"] for c in clean_rows),
        "false_alarms": sum(c["confirmed"] for c in clean_rows) + injected_false,
        "top_exponent_on": {name: next(c["rate"] for c in cells_json["by_class"] if c["case"] == "all" and
                                       c["target"] == name and c["class"] == "exponent (top)" and c["direction"] == "0->1")
                            for name in TARGETS},
        "magnitude_99pct": {name: magnitude_99pct(cells_json["by_magnitude"], "all", name) for name in TARGETS},
    }
    return {"dtype": SHORT_NAME[dtype], "kernel": "flash (CPU)" if device.type == "cpu" else "default (sdpa's choice)",
            **cells_json, "clean": clean_rows, "summary": summary}


def _cell(item: dict[str, Any]) -> str:
    if not item["trials"]:
        return "-"
    return f"{pct(item['flag_rate'])} / {pct(item['rate'])} ({item['trials']})"


def render(results: list[dict[str, Any]], cases: list[str]) -> str:
    lines = []
    for res in results:
        dt = res["dtype"]
        cls = {(c["target"], c["class"], c["direction"]): c for c in res["by_class"] if c["case"] == "all"}
        body = [[k, arrow] + [_cell(cls[(t, k, arrow)]) for t in TARGETS] for k in CLASSES for arrow in DIRECTIONS.values()]
        lines += [f"{dt}, {res['kernel']} kernel: one element per row flipped, by bit class; screen-flagged / "
                  f"confirmed (trials), operands {', '.join(cases)} pooled",
                  table(["bit class", "flip", *TARGETS], body, align="ll" + "r" * len(TARGETS)), ""]
        bits = {(c["target"], c["bit"], c["direction"]): c for c in res["by_bit"] if c["case"] == "all"}
        width = max(c["bit"] for c in res["by_bit"]) + 1
        body = [[bit, bit_class(_dtype(dt), bit)] + [pct(bits[(t, bit, a)]["rate"]) if bits[(t, bit, a)]["trials"] else "-"
                                                       for t in TARGETS for a in DIRECTIONS.values()]
                for bit in reversed(range(width))]
        lines += [f"{dt}: confirmed, by flipped bit",
                  table(["bit", "class"] + [f"{t} {a}" for t in TARGETS for a in DIRECTIONS.values()], body,
                        align="rl" + "r" * 2 * len(TARGETS)), ""]
        mags = {(m["target"], m["magnitude"]): m for m in res["by_magnitude"] if m["case"] == "all"}
        body = [[f"{r:g}"] + [_cell(mags[(t, r)]) for t in TARGETS]
                for r in sorted({m["magnitude"] for m in res["by_magnitude"]})]
        lines += [f"{dt}: an error of r x the RMS of the output over its head, one element per row; "
                  "screen-flagged / confirmed (trials: changes not rounded away)",
                  table(["r", *TARGETS], body, align="r" * (1 + len(TARGETS))), ""]
    lines.append("summary (confirmed):")
    for res in results:
        s = res["summary"]
        top = ", ".join(f"{t} {pct(s['top_exponent_on'][t])}" for t in TARGETS)
        mag = ", ".join(f"{t} {s['magnitude_99pct'][t]:g}" if s["magnitude_99pct"][t] is not None else f"{t} never"
                        for t in TARGETS)
        lines.append(f"  {res['dtype']}: top exponent bit 0->1 {top}; >= 99 % caught from |err| >= {mag} x head RMS")
        for case in cases:
            mine = [c for c in res["clean"] if c["case"] == case]
            lines.append(f"        clean {case}: {sum(c['confirmed'] for c in mine)} confirmed, "
                         f"{sum(c['screen_misses'] for c in mine)} screen misses in {sum(c['rows'] for c in mine)} rows "
                         f"(worst D/T {max(c['worst_ratio'] for c in mine):.2g})")
        lines.append(f"        confirmed false alarms: {s['false_alarms']}")
    return "\n".join(lines)


def _dtype(name: str) -> torch.dtype:
    return next(d for d, n in SHORT_NAME.items() if n == name)


def run(args: argparse.Namespace) -> Outcome:
    check_shape(args)
    calls = DEFAULT_CALLS if args.trials is None else args.trials
    if isinstance(calls, bool) or calls < 1:
        raise ValueError(f"trials: expected a positive int (SDPA calls per kind of operands), got {calls}")
    device = resolve_device(args.device)
    progress = Progress(len(args.dtypes), quiet=args.quiet)
    results = []
    for dtype in args.dtypes:
        res = run_dtype(dtype, args, device, calls, progress)
        results.append(res)
        top = res["summary"]["top_exponent_on"]
        progress.step(SHORT_NAME[dtype], "top exponent bit 0->1 confirmed " + ", ".join(f"{t} {pct(top[t])}" for t in TARGETS))
    print(render(results, args.operands))
    payload = {"command": "detect", "mode": "attention", "machine": machine(device),
               "settings": {"operands": args.operands, "calls": calls, "batch": args.batch, "heads": args.heads,
                            "kv_heads": args.kv_heads, "ctx": args.ctx, "head_dim": args.head_dim,
                            "magnitudes": args.magnitudes, "seed": args.seed},
               "targets": list(TARGETS), "classes": list(CLASSES), "results": results}
    return Outcome(1 if any(r["summary"]["false_alarms"] for r in results) else 0, payload)
