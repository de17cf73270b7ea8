"""``sdc-guard bench overhead``: what verification costs per matmul, beside its alternatives.

For each shape and dtype, one run times, interleaved, the bare matmul and five ways of
checking it (``bench_common`` says how):

- ``cold``: V-ABFT with the weight side computed in the call (B read again every time,
  as the Ascend operator of the proposal does), as ``protect()`` runs it
  (``Backend.summarize``: the verdict and its summary);
- ``verify_matmul`` and ``matmul_checksum``: the public one-call functions on the same
  work (cold: they get no cached weight side), argument checks and result included, so
  that what users call is measured beside what the guard runs;
- ``warm``: V-ABFT with a cached weight-side encoding (the steady state of inference, and
  of a training step's repeated uses of one weight);
- ``legacy``: the pure-PyTorch checksum V-ABFT replaces (``sdc_guard.core.legacy``);
- ``recompute``: the naive alternative, running the matmul again and comparing;
- ``floor``: the memory-traffic floor, the bytes a verification must read (A, C, and B
  when cold) divided by a read bandwidth measured in the same run. No implementation
  that reads its inputs can beat it; on memory-bound shapes (decode, the MOE gate) it is
  what bounds the overhead from below.

Overhead is ``time / bare time``: the median over repetition rounds of each round's ratio
(so that a slow spell, which lengthens a whole round, cancels), or with ``--stat min`` the
ratio of the best times. The summary compares the means with the targets (``TARGET_*``)
and with the proposal's measured figures (``ANCHORS``), names the shapes whose memory
floor alone is above a target, and checks that each one-call function stays within
``ONE_CALL_RATIO`` of ``cold`` or ``ONE_CALL_SLACK`` seconds of it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

import torch

from .. import backends
from ..core.abft import num_segments
from ..backends import GemmRequest
from .bench_common import (
    FP16_NOTE, SHORT_NAME, Outcome, argtype, Progress, busy_warning, emulated_fp16, generator, load_average,
    machine, median, operands, parse_dtypes, parse_shape, pct, product, read_bandwidth,
    resolve_device, shape_label, spread, table, time_columns,
)
from ..core.legacy import legacy_check
from ..verify import matmul_checksum, verify_matmul
from ..core.precision import resolve_e_max
from . import bench_attention

#: A CPU-sized version of the proposal's shapes (RFC 3.3 and its use-case table):
#: group -> [(M, K, N)].
SHAPE_GROUPS: dict[str, list[tuple[int, int, int]]] = {
    "square": [(m, 4096, 4096) for m in (1, 4, 8, 64, 512, 2048)],
    "ffn_up": [(m, 4096, 11008) for m in (8, 512)],
    "ffn_down": [(m, 11008, 4096) for m in (8, 512)],
    "moe_gate": [(m, 4096, 8) for m in (512, 4096)],
}
#: Groups the proposal runs in one dtype only: its MOE gate is fp32.
GROUP_DTYPES: dict[str, tuple[torch.dtype, ...]] = {"moe_gate": (torch.float32,)}

#: The one-call functions must cost at most this times ``cold``, or ``ONE_CALL_SLACK`` more.
ONE_CALL_RATIO = 1.2
ONE_CALL_SLACK = 20e-6
#: Rows whose times' relative interquartile range exceeds this are marked noisy.
NOISY = 0.25

#: The targets this benchmark checks (docs/PERFORMANCE.md).
TARGET_WARM = 0.05  #: mean warm-cache overhead over the whole shape set
TARGET_COLD = 0.30  #: mean cold overhead over the shapes with M >= 512
COLD_MIN_M = 512

#: What the proposal measured (RFC section 3.3, Atlas A2 / 910B2), as overhead fractions.
ANCHORS: dict[str, Any] = {
    "npu_operator": {
        "what": "Ascend V-ABFT operator, K = N = 4096, M 128..4096 (weight side recomputed per call)",
        "m_range": [128, 4096],
        "bf16": [0.51, 2.86], "fp32": [0.16, 1.19],
    },
    "npu_decode": {
        "what": "Ascend V-ABFT operator, decode shapes M <= 64 (mean over the acceptance shape set)",
        "m_max": 64,
        "bf16": 3.095, "fp32": 1.862,
    },
    "legacy": {
        "what": "pure-PyTorch torch_npu.matmul_checksum the operator replaced (mean)",
        "bf16": 8.83, "fp32": 6.35,
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="all", type=argtype(_shapes_arg),
                        help="comma list of groups (" + ", ".join(SHAPE_GROUPS) + ", all) and/or "
                             "MxKxN shapes (default: all groups)")
    parser.add_argument("--m", default=None, type=argtype(_ints_arg), metavar="M[,M...]",
                        help="keep only these M values")
    parser.add_argument("--dtypes", default="bf16,fp32", type=argtype(parse_dtypes),
                        help="comma list of bf16, fp16, fp32 (default bf16,fp32; the MOE gate group runs fp32 only)")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per column, at least (default 9)")
    parser.add_argument("--min-time", type=float, default=0.3, metavar="S",
                        help="time each column for at least this many seconds: more repetitions "
                             "for fast shapes (default 0.3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per column first (default 2)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="median (default; overhead = median over rounds of time / the round's bare time) "
                             "or min (best times: robust to other processes, which only ever slow a run)")
    parser.add_argument("--backend", default=None, help="verification backend (default: the dispatcher's choice)")
    parser.add_argument("--layout", choices=("linear", "row"), default="linear",
                        help="B as W.t() of an nn.Linear weight (default) or a row-major [K, N] tensor")
    parser.add_argument("--no-recompute", action="store_true", help="skip the full-recompute column")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="PNG of overhead against M (default: next to --json, if matplotlib is installed)")
    bench_attention.add_arguments(parser.add_argument_group("attention (--attention)"))


def _shapes_arg(text: str) -> list[tuple[str, tuple[int, int, int]]]:
    cells: list[tuple[str, tuple[int, int, int]]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item == "all":
            cells += [(g, s) for g, shapes in SHAPE_GROUPS.items() for s in shapes]
        elif item in SHAPE_GROUPS:
            cells += [(item, s) for s in SHAPE_GROUPS[item]]
        else:
            cells.append(("custom", parse_shape(item)))
    if not cells:
        raise ValueError("shapes: expected at least one group or MxKxN shape")
    return cells


def _ints_arg(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"m: expected comma-separated ints, got {text!r}") from None


def cells(args: argparse.Namespace) -> list[tuple[torch.dtype, str, tuple[int, int, int]]]:
    """(dtype, group, (M, K, N)) in run order."""
    out = []
    for dtype in args.dtypes:
        for group, shape in args.shapes:
            if dtype not in GROUP_DTYPES.get(group, (dtype,)):
                continue
            if args.m is not None and shape[0] not in args.m:
                continue
            out.append((dtype, group, shape))
    return out


def measure_cell(dtype: torch.dtype, shape: tuple[int, int, int], device: torch.device,
                 args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Time every column for one shape and dtype; returns the JSON row (floors: ``add_floors``)."""
    m, k, n = shape
    a, b = operands("gaussian", m, k, n, dtype, device, generator(device, seed),
                    linear=args.layout == "linear")
    c = product(a, b)
    e_max = resolve_e_max(None, dtype, device)
    req = GemmRequest(a, b, c, e_max)
    backend = backends.select(req, args.backend)
    warm_req = replace(req, weight=backend.encode(b))  # as the weight cache would hold it
    columns = {  # verification as protect() runs it: the verdict and its summary
        "bare": lambda: product(a, b),
        "cold": lambda: backend.summarize(req),
        "warm": lambda: backend.summarize(warm_req),
        "verify_matmul": lambda: verify_matmul(a, b, c, backend=args.backend),
        "matmul_checksum": lambda: matmul_checksum(a, b, c),
        "legacy": lambda: legacy_check(a, b, c),
    }
    if not args.no_recompute:
        columns["recompute"] = lambda: torch.ne(product(a, b), c)
    probe = time_columns(columns, device, reps=1, warmup=args.warmup)
    round_seconds = sum(t[0] for t in probe.values())
    reps = max(args.reps, min(50 * args.reps, math.ceil(args.min_time * len(columns) / max(round_seconds, 1e-9))))
    times = time_columns(columns, device, reps=reps, warmup=0)
    stat = min if args.stat == "min" else median
    ms = {name: 1e3 * stat(t) for name, t in times.items()}
    bare = ms["bare"]
    if args.stat == "min":
        overhead = {name: ms[name] / bare for name in ms if name != "bare"}
    else:  # paired: each round's time over the same round's bare time, so a slow spell cancels
        overhead = {name: median([t / b for t, b in zip(times[name], times["bare"])]) for name in ms if name != "bare"}
    size = a.element_size()
    bytes_warm = (m * k + m * n) * size + k * num_segments(n) * 4  # A, C and Br
    row = {
        "dtype": SHORT_NAME[dtype], "m": m, "k": k, "n": n, "backend": backend.name, "reps": reps,
        "ms": ms, "overhead": overhead, "noise": {name: spread(t) for name, t in times.items()},
        "bytes": {"warm": bytes_warm, "cold": bytes_warm + k * n * size},  # + B
    }
    if emulated_fp16(a, device):
        row["note"] = FP16_NOTE
    return row


def add_floors(rows: list[dict[str, Any]], bandwidth: float) -> None:
    """The memory-traffic floor of each row: its bytes over the best read bandwidth seen."""
    for row in rows:
        row["floor_ms"] = {key: 1e3 * nbytes / bandwidth for key, nbytes in row["bytes"].items()}
        row["overhead"].update({f"floor_{key}": ms / row["ms"]["bare"] for key, ms in row["floor_ms"].items()})


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means per dtype and overall, the targets, and the proposal's figures beside ours."""
    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    def block(sel: list[dict[str, Any]]) -> dict[str, Any]:
        big = [r for r in sel if r["m"] >= COLD_MIN_M]
        decode = [r for r in sel if r["m"] <= ANCHORS["npu_decode"]["m_max"]]
        out = {
            "shapes": len(sel),
            "warm_mean": mean([r["overhead"]["warm"] for r in sel]),
            "cold_mean_m512": mean([r["overhead"]["cold"] for r in big]),
            "cold_mean": mean([r["overhead"]["cold"] for r in sel]),
            "legacy_mean": mean([r["overhead"]["legacy"] for r in sel]),
            "decode_cold_mean": mean([r["overhead"]["cold"] for r in decode]),
            "decode_warm_mean": mean([r["overhead"]["warm"] for r in decode]),
        }
        if any("recompute" in r["overhead"] for r in sel):
            out["recompute_mean"] = mean([r["overhead"]["recompute"] for r in sel if "recompute" in r["overhead"]])
        return out

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    summary: dict[str, Any] = {"all": block(rows)}
    summary.update({d: block([r for r in rows if r["dtype"] == d]) for d in dtypes})
    overall = summary["all"]
    def met(value: float, target: float) -> bool | None:
        return None if math.isnan(value) else bool(value <= target)

    # Shapes whose memory-traffic floor alone exceeds a target cannot meet it whatever the
    # implementation (the MOE gate: a GEMV-like product that reads A once, as must its check).
    warm_bound = [r for r in rows if r["overhead"]["floor_warm"] > TARGET_WARM]
    cold_bound = [r for r in rows if r["m"] >= COLD_MIN_M and r["overhead"]["floor_cold"] > TARGET_COLD]
    warm_rest = [r["overhead"]["warm"] for r in rows if r not in warm_bound]
    cold_rest = [r["overhead"]["cold"] for r in rows if r["m"] >= COLD_MIN_M and r not in cold_bound]

    def label(r: dict[str, Any]) -> str:
        return f"{r['dtype']} {shape_label(r['m'], r['k'], r['n'])}"

    summary["targets"] = {
        "warm_mean_le_5pct": {"target": TARGET_WARM, "measured": overall["warm_mean"],
                              "met": met(overall["warm_mean"], TARGET_WARM),
                              "floor_bound_shapes": [label(r) for r in warm_bound],
                              "measured_without_floor_bound": mean(warm_rest)},
        "cold_mean_m512_le_30pct": {"target": TARGET_COLD, "measured": overall["cold_mean_m512"],
                                    "met": met(overall["cold_mean_m512"], TARGET_COLD),
                                    "floor_bound_shapes": [label(r) for r in cold_bound],
                                    "measured_without_floor_bound": mean(cold_rest)},
    }
    over = [f"{name} {label(r)}" for r in rows for name in ("verify_matmul", "matmul_checksum")
            if r["ms"][name] > max(ONE_CALL_RATIO * r["ms"]["cold"], r["ms"]["cold"] + 1e3 * ONE_CALL_SLACK)]
    summary["targets"]["one_call"] = {"ratio": ONE_CALL_RATIO, "slack_s": ONE_CALL_SLACK, "over": over,
                                      "met": not over if rows else None}
    summary["anchors"] = _anchor_comparison(rows)
    return summary


def _anchor_comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    lo_m, hi_m = ANCHORS["npu_operator"]["m_range"]
    for dtype in ("bf16", "fp32"):
        sel = [r for r in rows if r["dtype"] == dtype]
        if not sel:
            continue
        square = [r for r in sel if r["k"] == r["n"] == 4096 and lo_m <= r["m"] <= hi_m]
        if square:
            worst_cold = max(r["overhead"]["cold"] for r in square)
            lo, hi = ANCHORS["npu_operator"][dtype]
            out.append({"dtype": dtype, "what": f"cold, K=N=4096, M in {[r['m'] for r in square]}",
                        "ours_max": worst_cold, "anchor": [lo, hi], "anchor_what": ANCHORS["npu_operator"]["what"],
                        "beats": worst_cold < lo})
        decode = [r for r in sel if r["m"] <= ANCHORS["npu_decode"]["m_max"]]
        if decode:
            for col in ("cold", "warm"):
                ours = sum(r["overhead"][col] for r in decode) / len(decode)
                anchor = ANCHORS["npu_decode"][dtype]
                out.append({"dtype": dtype, "what": f"{col}, decode M <= 64 (mean of {len(decode)})",
                            "ours_mean": ours, "anchor": anchor, "anchor_what": ANCHORS["npu_decode"]["what"],
                            "beats": ours < anchor})
        ours_legacy = sum(r["overhead"]["legacy"] for r in sel) / len(sel)
        ours_cold = sum(r["overhead"]["cold"] for r in sel) / len(sel)
        out.append({"dtype": dtype, "what": f"cold, all {len(sel)} shapes (mean); our legacy copy measured {pct(ours_legacy)}",
                    "ours_mean": ours_cold, "anchor": ANCHORS["legacy"][dtype],
                    "anchor_what": ANCHORS["legacy"]["what"], "beats": ours_cold < ANCHORS["legacy"][dtype]})
    return out


def render(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The table, the anchor comparison and the verdict lines."""
    headers = ["dtype", "shape", "MxKxN", "bare ms", "cold", "warm", "verify_matmul", "matmul_checksum", "legacy",
               "recompute", "floor cold", "floor warm", "noise"]
    body = []
    for r in rows:
        o = r["overhead"]
        noise = max((v for v in r["noise"].values() if v == v), default=float("nan"))
        body.append([r["dtype"], r.get("group", ""), shape_label(r["m"], r["k"], r["n"]), r["ms"]["bare"],
                     pct(o["cold"]), pct(o["warm"]), pct(o["verify_matmul"]), pct(o["matmul_checksum"]),
                     pct(o["legacy"]), pct(o.get("recompute", float("nan"))),
                     pct(o["floor_cold"]), pct(o["floor_warm"]), pct(noise) + (" !" if noise > NOISY else "")])
    noisy = sum(1 for row in body if row[-1].endswith("!"))
    lines = ["overhead = verification time / bare matmul time, interleaved repetitions (median of the "
             "per-round ratios, or ratio of best times with --stat min); noise = widest relative "
             "interquartile range of the row's times", "",
             table(headers, body, align="lllrrrrrrrrrr"), ""]
    if noisy:
        lines += [f"{noisy} rows marked ! were noisy (quartiles more than {pct(NOISY)} apart): another process "
                  "probably shared the CPU; rerun them (--shapes, --m) or use --stat min", ""]
    lines.append("means:")
    for key, block in summary.items():
        if key in ("targets", "anchors"):
            continue
        extra = f", recompute {pct(block['recompute_mean'])}" if "recompute_mean" in block else ""
        lines.append(f"  {key:4s}: warm {pct(block['warm_mean'])} over {block['shapes']} shapes, "
                     f"cold {pct(block['cold_mean_m512'])} for M >= {COLD_MIN_M} ({pct(block['cold_mean'])} over all), "
                     f"legacy {pct(block['legacy_mean'])}{extra}")
    if summary["anchors"]:
        lines += ["", "against the proposal's measurements (Ascend 910B2):"]
        for item in summary["anchors"]:
            ours = item.get("ours_max", item.get("ours_mean"))
            anchor = item["anchor"]
            anchor_text = f"{pct(anchor[0])}-{pct(anchor[1])}" if isinstance(anchor, list) else pct(anchor)
            verdict = "beats" if item["beats"] else "does NOT beat"
            lines.append(f"  {item['dtype']} {item['what']}: ours {pct(ours)} {verdict} "
                         f"{anchor_text} ({item['anchor_what']})")
    t = summary["targets"]
    lines += ["", "targets:"]
    for key, what in (("warm_mean_le_5pct", f"warm mean <= {pct(TARGET_WARM)}"),
                      ("cold_mean_m512_le_30pct", f"cold mean for M >= {COLD_MIN_M} <= {pct(TARGET_COLD)}")):
        item = t[key]
        line = f"  {what}: {pct(item['measured'])} -> {_verdict(item['met'])}"
        if item["floor_bound_shapes"]:
            line += (f"; {pct(item['measured_without_floor_bound'])} without "
                     f"{', '.join(item['floor_bound_shapes'])}, whose memory floor alone is above the target")
        lines.append(line)
    calls = t["one_call"]
    lines.append(f"  verify_matmul / matmul_checksum within {ONE_CALL_RATIO:g}x of cold or "
                 f"{ONE_CALL_SLACK * 1e6:.0f} us of it on every shape: {_verdict(calls['met'])}"
                 + (f" (not on {', '.join(calls['over'])})" if calls["over"] else ""))
    return "\n".join(lines)


def _verdict(met: bool | None) -> str:
    return "not measured (no such shape in this run)" if met is None else ("MET" if met else "NOT MET")


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    """Overhead against M per dtype and column, for each (K, N); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted({(r["k"], r["n"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (k, n) in zip(axes[0], groups):
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            sel = sorted((r for r in rows if (r["k"], r["n"]) == (k, n) and r["dtype"] == dtype), key=lambda r: r["m"])
            if not sel:
                continue
            for col, style in (("cold", "-o"), ("warm", "-s"), ("legacy", ":^"), ("floor_warm", "--")):
                ax.plot([r["m"] for r in sel], [100 * r["overhead"][col] for r in sel], style, label=f"{dtype} {col}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"K={k}, N={n}")
        ax.set_xlabel("M")
        ax.set_ylabel("overhead %")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> Outcome:
    if args.attention:  # fused attention (SDPA): its own cells and table
        return bench_attention.run(args)
    device = resolve_device(args.device)
    todo = cells(args)
    if not todo:
        raise ValueError("shapes: no shape left to run (check --shapes, --m and --dtypes)")
    progress = Progress(len(todo), quiet=args.quiet)
    load_before = load_average()
    bandwidth, how = read_bandwidth(device)
    progress.note(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({how}); {len(todo)} shapes on {device}")
    rows = []
    for i, (dtype, group, shape) in enumerate(todo):
        row = measure_cell(dtype, shape, device, args, args.seed + i)
        row["group"] = group
        rows.append(row)
        o = row["overhead"]
        progress.step(f"{row['dtype']} {group} {shape_label(*shape)}",
                      f"bare {row['ms']['bare']:.2f} ms, cold {pct(o['cold'])}, warm {pct(o['warm'])}")
    bandwidth_after, _ = read_bandwidth(device)
    add_floors(rows, max(bandwidth, bandwidth_after))  # a floor: the best bandwidth seen
    summary = summarize(rows)
    text = render(rows, summary)
    notes = sorted({r["note"] for r in rows if "note" in r})
    warning = busy_warning(load_before, load_average(), device)
    print(text)
    for note in notes + ([warning] if warning else []):
        print(note)
    payload = {
        "command": "overhead", "machine": machine(device),
        "settings": {"reps_min": args.reps, "min_time_s": args.min_time, "warmup": args.warmup,
                     "layout": args.layout, "statistic": args.stat, "seed": args.seed},
        "bandwidth": {"bytes_per_s": max(bandwidth, bandwidth_after), "before": bandwidth,
                      "after": bandwidth_after, "method": how},
        "load_average": {"before": load_before, "after": load_average()},
        "rows": rows, "summary": summary, "anchors": ANCHORS, "notes": notes + ([warning] if warning else []),
    }
    plot_path = args.plot or (args.json[: -len(".json")] + ".png" if args.json and args.json.endswith(".json") else None)
    if plot_path:
        payload["plot"] = plot_path if plot(rows, plot_path) else None
        if payload["plot"] is None and args.plot:
            print(f"no plot written to {args.plot}: matplotlib is not installed (pip install 'sdc-guard[plot]')")
    return Outcome(0, payload)
