"""What a ``sdc-guard bench train`` run reports (``sdc_guard.tools.bench_train`` measures):
the targets, the figures over blocks of rounds, the guard's own account beside the
measured overhead, and the table with each target met or not."""

from __future__ import annotations

import argparse
from typing import Any

from .bench_common import SHORT_NAME, pct, table

#: The configuration that runs forward and backward under ``EmptyMode``.
EMPTY_MODE = "empty dispatch mode"

#: The targets this benchmark checks (docs/PERFORMANCE.md): eager ``Full()`` at most 25 %
#: of the step; Budget alone holds its budget (``--budget``, 5 % by default); with a
#: window, which wins over the budget, 7 %; every guarded row's own account within 3
#: points of what it measured. (``TARGET_FULL``: the compiled route's, ``--compile``.)
TARGET_FULL = 0.20
TARGET_FULL_EAGER = 0.25
TARGET_REPORTED_GAP = 0.03
#: Consecutive blocks of measured rounds the spread of a figure is taken over.
SPREAD_BLOCKS = 5
TARGET_BUDGET = 0.07
TARGET_WINDOW = 20
#: The compiled route's targets (``--compile``): ``Full()`` of the compiled step, without and
#: with activation checkpointing (``--ac``); ``Budget`` holds its budget.
TARGET_FULL_COMPILED = 0.10
TARGET_FULL_COMPILED_AC = 0.12
#: The gradient screen's target: its steady state, clean.
TARGET_SCREENED = 0.01
SCREENED = "Screened()"


def block_overheads(times: list[float], baseline: list[float], blocks: int = SPREAD_BLOCKS) -> list[float]:
    """The measured overhead (total over total baseline, less 1) of each of ``blocks``
    consecutive runs of rounds: how much the figure moves within one run."""
    n = len(times)
    bounds = [n * j // blocks for j in range(blocks + 1)]
    return [sum(times[a:b]) / sum(baseline[a:b]) - 1.0 for a, b in zip(bounds, bounds[1:]) if b > a]


def spread_of(values: list[float]) -> list[float]:
    """``[lowest, highest]`` of ``values`` (nan without any)."""
    return [min(values), max(values)] if values else [float("nan"), float("nan")]


def guard_account(reports: list[Any]) -> float:
    """What the guard says it added over the step time without it, over ``reports``."""
    added = sum(rep.guard_seconds for rep in reports)
    unguarded = sum(rep.step_seconds - rep.guard_seconds for rep in reports)
    return added / unguarded if unguarded > 0 else float("nan")


def reported_against_measured(times: list[float], baseline: list[float], reports: list[Any],
                               rounds: list[int], blocks: int = SPREAD_BLOCKS) -> dict[str, Any]:
    """The guard's own account beside the measured overhead, over the whole run and over
    each block of rounds (the same rounds on both sides): ``reported_gap`` is reported
    less measured, and its spread how far the blocks' gaps range."""
    n = len(times)
    bounds = [n * j // blocks for j in range(blocks + 1)]
    reported, gaps = [], []
    for a, b in zip(bounds, bounds[1:]):
        inside = [rep for rep, r in zip(reports, rounds) if a <= r < b]
        if b > a and inside:
            value = guard_account(inside)
            reported.append(value)
            gaps.append(value - (sum(times[a:b]) / sum(baseline[a:b]) - 1.0))
    measured = sum(times) / sum(baseline) - 1.0
    whole = guard_account(reports)
    return {"reported_spread": spread_of(reported), "reported_gap": whole - measured, "reported_gap_spread": spread_of(gaps)}


def percent_range(spread: list[float], points: bool = False) -> str:
    """``[lo, hi]`` as ``lo..hi`` in percent (``points``: signed points)."""
    lo, hi = spread
    if lo != lo:
        return "-"
    return f"{100 * lo:+.1f}..{100 * hi:+.1f}" if points else f"{100 * lo:.1f}..{100 * hi:.1f}"


def gap_points(value: float) -> str:
    return "-" if value != value else f"{100 * value:+.1f} pt"


def estimated_account(reports: list[Any]) -> float:
    """The guard's account with interception at its per-op estimate instead of the
    calibrated figure (what ``StepReport.overhead`` said before calibration replays)."""
    added = [r.guard_seconds - r.interception_seconds + r.interception_estimate_seconds for r in reports]
    rest = sum(r.step_seconds for r in reports) - sum(added)
    return sum(added) / rest if rest > 0 else float("nan")


def budget_names(args: argparse.Namespace) -> tuple[str, str]:
    """The two Budget rows: the budget alone, and with the coverage window."""
    return f"Budget({args.budget:g})", f"Budget({args.budget:g}, window={args.window})"


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    body = []
    for r in results:
        base = r["config"] == "baseline"
        guarded = "reported_overhead" in r
        body.append([r["config"], f"{r['step_ms_median']:.1f}", "-" if base else pct(r["overhead_mean"]),
                     "-" if base else percent_range(r["overhead_spread"]), "-" if base else pct(r["overhead"]),
                     "-" if base else pct(r["overhead_cpu"]),
                     pct(r["reported_overhead"]) if guarded else "-",
                     percent_range(r["reported_spread"]) if guarded else "-",
                     gap_points(r["reported_gap"]) if guarded else "-",
                     percent_range(r["reported_gap_spread"], points=True) if guarded else "-",
                     pct(r.get("estimated_overhead", float("nan"))),
                     pct(r["calibrated_share"]) if "calibrated_share" in r else "-",
                     r.get("calibration_replays", "-"),
                     pct(r.get("verify_overhead", float("nan"))),
                     f"{r.get('gemms_verified_per_step', 0):.1f}/{r.get('gemms_seen_per_step', 0):.0f}" if "gemms_seen_per_step" in r else "-",
                     r.get("sites", "-"), r.get("max_gap_steps", "-"),
                     pct(r["budget_coverage"]) if "budget_coverage" in r else "-"])
    what = (f"{args.model} ({SHORT_NAME[args.dtype]})" if args.model is not None else
            f"a {args.layers}-layer GPT (d_model {args.d_model}, ctx {args.ctx}, batch {args.batch}, "
            f"{SHORT_NAME[args.dtype]})")
    lines = [f"training steps of {what}, {args.steps} measured rounds",
             "overhead: total step time / total baseline step time - 1 (end to end; samplers that "
             "verify in sweeps make single steps uneven, so this is the figure), with its range over "
             f"{SPREAD_BLOCKS} consecutive blocks of the rounds; median: over rounds of step time / "
             "baseline step time - 1; cpu: the overhead in this thread's CPU time (steadier where other "
             "processes share the cores; with one intra-op thread, the step's own work); reported: what the guard says it added (StepReport.guard_seconds "
             "over the step time without it: interception calibrated by replays, bookkeeping, "
             "verification, the replays themselves), over the same rounds and blocks; gap: reported - "
             "overhead, in points, and its range over the blocks; calibrated: share of those "
             "reports whose interception was measured, not estimated (StepReport.overhead_calibrated); "
             "estimate: the same with interception at the per-op estimate, uncalibrated; "
             "replays: calibration replays among the measured steps (each about one more unguarded "
             "run of the step, in both overhead and reported); verify: verification alone", "",
             table(["config", "step ms", "overhead", "range", "median", "cpu", "reported", "range", "gap", "range",
                    "estimate", "calibrated", "replays", "verify", "verified/seen GEMMs", "sites", "max gap",
                    f"coverage({args.window})"], body, align="lrrrrrrrrrrrrrrrrr"), ""]
    by = {r["config"]: r for r in results}
    full = by["Full()"]
    alone_name, window_name = budget_names(args)
    alone, window = by[alone_name], by[window_name]
    targets = {
        "full_le_25pct": {"measured": full["overhead_mean"], "target": TARGET_FULL_EAGER,
                          "met": full["overhead_mean"] <= TARGET_FULL_EAGER},
        "budget_holds": {"measured": alone["overhead_mean"], "target": args.budget,
                         "met": alone["overhead_mean"] <= args.budget},
        "budget_window_le_7pct": {"measured": window["overhead_mean"], "target": TARGET_BUDGET,
                                  "met": window["overhead_mean"] <= TARGET_BUDGET},
        "budget_every_site_within_window": {"measured": window["max_gap_steps"], "window": args.window,
                                            "met": window["max_gap_steps"] < args.window},
    }
    screened = by[SCREENED]
    targets["screened_le_1pct"] = {"measured": screened["overhead_mean"], "target": TARGET_SCREENED,
                                   "met": screened["overhead_mean"] <= TARGET_SCREENED}
    fixed, empty = by.get("intercept only"), by.get(EMPTY_MODE)
    if fixed is not None and empty is not None:
        lines += [f"fixed cost of protect() before any verification (every op through the dispatch mode, "
                  f"site tracking, step bookkeeping): {pct(fixed['overhead_mean'])} of the step; PyTorch's "
                  f"dispatch mode alone (an empty one around forward and backward): "
                  f"{pct(empty['overhead_mean'])}", ""]

    def met(key: str) -> str:
        return "MET" if targets[key]["met"] else "NOT MET"

    lines += ["targets:",
              f"  Full() <= {pct(TARGET_FULL_EAGER)} of the step: {pct(full['overhead_mean'])} -> {met('full_le_25pct')}",
              f"  {alone_name} <= {pct(args.budget)}: {pct(alone['overhead_mean'])} (its own account "
              f"{pct(alone['budget_achieved_overhead'])}) -> {met('budget_holds')}",
              f"  {window_name} <= {pct(TARGET_BUDGET)} (the window wins over the budget where a sweep costs more "
              f"than {args.window} x {pct(args.budget)} of a step): {pct(window['overhead_mean'])} (its own account "
              f"{pct(window['budget_achieved_overhead'])}) -> {met('budget_window_le_7pct')}",
              f"  every site verified at least once every {args.window} steps under {window_name}: "
              f"longest gap {window['max_gap_steps']} steps -> {met('budget_every_site_within_window')}",
              f"  {SCREENED} (gradient screen, no GEMM verified unless it trips; no snapshots) <= "
              f"{pct(TARGET_SCREENED)}: {pct(screened['overhead_mean'])} ({screened['screen_trips']} trips, "
              f"{screened['screen_misses']} misses) -> {met('screened_le_1pct')}"]
    gaps = {r["config"]: r["reported_gap"] for r in results if "reported_gap" in r}
    worst = max(gaps, key=lambda name: abs(gaps[name]))
    targets["reported_within_3pts"] = {"gaps": gaps, "target": TARGET_REPORTED_GAP,
                                       "met": all(abs(g) <= TARGET_REPORTED_GAP for g in gaps.values())}
    lines.append(f"  every guarded row's reported overhead within {100 * TARGET_REPORTED_GAP:.0f} points of the "
                 f"measured one: largest gap {gap_points(gaps[worst])} ({worst}) -> {met('reported_within_3pts')}")
    return "\n".join(lines), targets
