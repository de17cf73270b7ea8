"""``sdc-guard`` command line: one subcommand per module that owns the concept.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int`` (the exit
status); this file only wires them, and imports each lazily so that ``sdc-guard selftest``
does not pay for Lightning.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("sdc_guard.tools.demo", "train a small GPT with injected faults and watch them get caught (needs lightning)"),
    "selftest": ("sdc_guard.tools.selftest", "is this host computing correctly? known answers on every backend "
                                             "found (pre-flight, return to service)"),
    "drain": ("sdc_guard.tools.drain", "the scheduler commands an exit report asks for (requeue, exclude, drain)"),
    "bi": ("sdc_guard.bi.cli", "batch-invariance and determinism harness"),
    "bench": ("sdc_guard.tools.bench", "benchmarks: overhead, false positives, detection, training overhead, e_max calibration"),
}


def build_parser() -> argparse.ArgumentParser:
    """The full parser (imports every subcommand module)."""
    parser = argparse.ArgumentParser(prog="sdc-guard", description="Silent data corruption guard for PyTorch matmuls.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sdc-guard`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    module = SUBCOMMANDS[args.command][0]
    return int(importlib.import_module(module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
