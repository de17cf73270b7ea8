"""Check your own op for determinism and batch invariance with ``sdc_guard.bi.check``.

The op here is a plain ``relu(x @ w)``; replace ``my_op`` with yours. It must map rows
``x [M, K]`` and a shared ``w [K, N]`` to ``y [M, ...]``. On a CPU, fp32 matmuls usually
pass in composition mode (other rows change, M stays) and fail in batch-size mode (the
same row inside a batch of 1 and of M gives different bits): that is a property of the
matmul kernel, and exactly what this check is for.

    python examples/bi_check.py                      # seed matrix, both modes
    python examples/bi_check.py --mode composition --m-totals 8 --ks 256 --ns 64
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from sdc_guard import bi


def my_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op under test: row i of the output must depend only on row i of x (and w)."""
    return torch.relu(x @ w)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["composition", "batch-size", "both"], default="both")
    parser.add_argument("--m-totals", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--ks", nargs="+", type=int, default=[256, 512, 1024])
    parser.add_argument("--ns", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--n-trials", type=int, default=3)
    args = parser.parse_args()

    cells = list(itertools.product(args.m_totals, args.ks, args.ns))
    report = bi.check(my_op, cells, mode=args.mode, n_trials=args.n_trials, name="relu(x @ w)")
    for cell in report.with_status("BI_FAIL", "NON_DET", "ERROR"):
        print(cell.describe())
    print(f"cells: expected {report.expected_cells}, counted {sum(report.counts.values())}")
    print(report.summary_line())
    return report.exit_status


if __name__ == "__main__":
    sys.exit(main())
