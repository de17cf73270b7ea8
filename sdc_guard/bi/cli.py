"""``sdc-guard bi``: run a built-in batch-invariance suite and exit with its verdict.

Exit status: 1 if and only if some cell of the suite is BI_FAIL; 2 when the harness itself
failed (bad arguments, counts that do not add up to the configured matrix, or the verify
suite's negative control passing); 0 otherwise. NON_DET and ERROR cells are findings for
whoever runs the system and are listed, but they do not fail the run.

    sdc-guard bi --suite verify
    sdc-guard bi --suite matmul --mode batch-size --dtype float32 --json bi.json
    sdc-guard bi --suite collective --world-sizes 2 4 --sleep-between-ws 0
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from . import DEFAULT_KS, DEFAULT_M_TOTALS, DEFAULT_NS, MODE_CHOICES, POSITIONS, load_object, make_config
from .data import DATA_SPECS
from .report import EXIT_HARNESS
from .suites import SuiteResult, matmul_suite, verify_suite

SUITES = ("verify", "matmul", "collective")
DTYPES = ("float32", "bfloat16", "float16")
#: dtypes a suite runs when --dtype is not given.
DEFAULT_DTYPES = {"verify": ("float32",), "matmul": DTYPES, "collective": ("float32",)}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _target(text: str) -> str | int:
    if text in POSITIONS:
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected one of {POSITIONS} or a row index >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``sdc-guard bi``: what to test, the matrix, and the distributed launch."""
    parser.add_argument("--suite", choices=SUITES, required=True,
                        help="verify: sdc_guard's verifier, legacy checksum as negative control; "
                             "matmul: torch.mm and F.linear; "
                             "collective: row-sharded matmul + reduce_scatter / all_reduce")
    parser.add_argument("--mode", choices=MODE_CHOICES, default="both",
                        help="composition (same M, other rows differ), batch-size (M varies) or both")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=None,
                        help="dtypes to test (default: all three for matmul, float32 otherwise)")
    parser.add_argument("--n-warmup", type=int, default=2, help="phase 0 calls per run (errors ignored)")
    parser.add_argument("--n-trials", type=int, default=3, help="phase 1 calls per variant (determinism)")
    parser.add_argument("--op", default=None,
                        help="matmul: module:attr or file.py:attr of an op(x, w) -> y to test instead; "
                             "collective: of a sdc_guard.bi.collective.DistributedOp")
    parser.add_argument("--device", default=None, help="verify/matmul: device (default cuda if available)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--verbose", action="store_true", help="list every cell, not only the findings")
    _add_matrix_arguments(parser.add_argument_group("matrix"))
    _add_collective_arguments(parser.add_argument_group("collective suite"))


def _add_matrix_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--m-totals", nargs="+", type=_positive, default=list(DEFAULT_M_TOTALS))
    group.add_argument("--ks", nargs="+", type=_positive, default=list(DEFAULT_KS))
    group.add_argument("--ns", nargs="+", type=_positive, default=list(DEFAULT_NS))
    group.add_argument("--target-rows", nargs="+", type=_target, default=list(POSITIONS),
                       help="first, middle, last or row indices")
    group.add_argument("--data", choices=[d for d in DATA_SPECS if d != "peaky"], default="wide",
                       help="input values (small-int sums exactly: it only demonstrates the vacuity warning)")


def _add_collective_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--world-sizes", nargs="+", type=_positive, default=[2, 4, 8],
                       help="one torch.distributed.run job per world size")
    group.add_argument("--master-port", type=int, default=0, help="fixed port (0: a free one per job)")
    group.add_argument("--sleep-between-ws", type=float, default=1.0, help="seconds between world sizes")
    group.add_argument("--ws-timeout", type=float, default=600.0,
                       help="seconds before a world size's job is killed (its cells become ERROR)")
    group.add_argument("--pg-timeout", type=float, default=60.0, help="seconds one collective may block")


def _run_suite(args: argparse.Namespace) -> SuiteResult:
    cells = list(itertools.product(args.m_totals, args.ks, args.ns))
    dtypes = args.dtype or DEFAULT_DTYPES[args.suite]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    configs = [make_config(args.mode, args.n_warmup, args.n_trials, args.target_rows, getattr(torch, d),
                           args.data, device) for d in dtypes]
    if args.suite == "verify":
        if args.op:
            raise ValueError("op: the verify suite tests sdc_guard's verifier; use --suite matmul for your op")
        results = [verify_suite(cfg, cells) for cfg in configs]
        return results[0] if len(results) == 1 else _merge(results)
    if args.suite == "matmul":
        ops = {args.op: load_object(args.op)} if args.op else None
        return matmul_suite(configs, cells, ops)
    from .collective import LaunchConfig, collective_suite

    if len(configs) != 1:
        raise ValueError(f"dtype: the collective suite runs one dtype at a time, got {list(dtypes)}")
    launch = LaunchConfig(tuple(args.world_sizes), args.master_port, args.sleep_between_ws,
                          args.ws_timeout, args.pg_timeout, args.op)
    return collective_suite(configs[0], launch, cells)


def _merge(results: list[SuiteResult]) -> SuiteResult:
    """One verify result over several dtypes (subjects and controls merged separately)."""
    from .report import BIReport

    control = BIReport.merge([r.control for r in results if r.control is not None])
    return SuiteResult(results[0].suite, BIReport.merge([r.report for r in results]), control, results[0].header)


def run(args: argparse.Namespace) -> int:
    """Run the suite, print the report (summary line last), write JSON; return the exit status."""
    try:
        result = _run_suite(args)
    except (ValueError, TypeError) as exc:
        print(f"sdc-guard bi: error: {exc}", file=sys.stderr)
        return EXIT_HARNESS
    print("\n".join(result.lines(args.verbose)), flush=True)
    if args.json:
        result.write_json(args.json)
    return result.exit_status
