"""``sdc-guard bench``: benchmarks a user runs on their own hardware.

One subcommand per question; each prints progress on stderr while it runs, a table and a
summary at a glance on stdout when it ends, and (``--json PATH``) everything it measured:

- ``overhead``: what verification costs per matmul against the bare matmul, beside the
  legacy checksum, a full recompute and the memory-traffic floor
  (``sdc_guard.tools.bench_overhead``);
- ``fp``: false positives on clean products, the proposal's acceptance 1
  (``sdc_guard.tools.bench_fp``);
- ``detect``: detection rate by flipped bit, flip direction and error magnitude
  (``sdc_guard.tools.bench_detect``; ``--attention``: of fused attention's output and
  input gradients, ``sdc_guard.tools.bench_detect_attention``);
- ``train``: end-to-end training-step overhead of ``protect()`` with ``Full()``,
  ``Budget`` and ``EveryN``, and the coverage each achieves (``sdc_guard.tools.bench_train``);
- ``calibrate``: the largest D/T at ``e_max = 1`` on this device, and the ``e_max`` to use
  with a stated safety margin (``sdc_guard.tools.bench_fp``);
- ``collectives``: what checking the collectives costs a DDP and an FSDP2 step, and the
  checksum exchange alone (``sdc_guard.tools.bench_collectives``).

Exit status: 0, or 1 when ``fp`` counted a false positive, or 2 for bad arguments.

    sdc-guard bench overhead --json overhead.json
    sdc-guard bench overhead --shapes square --dtypes bf16 --m 1,512
    sdc-guard bench fp --trials 1000 --json fp.json
    sdc-guard bench detect --attention --json detect_attention.json
    sdc-guard bench calibrate --dtypes bf16 --trials 200
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .bench_common import Outcome, write_json

#: subcommand -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "overhead": ("sdc_guard.tools.bench_overhead", "per-matmul overhead against the bare matmul, beside the alternatives"),
    "fp": ("sdc_guard.tools.bench_fp", "false positives on clean products (must be 0)"),
    "detect": ("sdc_guard.tools.bench_detect", "detection rate by bit, flip direction and error magnitude "
               "(GEMMs; fused attention with --attention)"),
    "train": ("sdc_guard.tools.bench_train", "training-step overhead of protect() and the coverage of each sampler"),
    "calibrate": ("sdc_guard.tools.bench_calibrate", "max D/T at e_max = 1 on this device, and a recommended e_max"),
    "collectives": ("sdc_guard.tools.bench_collectives", "what checking the collectives costs a DDP and an FSDP2 "
                    "step (gloo ranks on this machine), and the checksum exchange alone"),
}

EXIT_BAD_ARGS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-parser per benchmark, each with the shared options."""
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
        p.add_argument("--json", default=None, metavar="PATH", help="write everything measured as JSON")
        p.add_argument("--seed", type=int, default=0, help="seed of the generated data (default 0)")
        p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; print its table and summary; write its JSON."""
    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    try:
        outcome: Outcome = module.run(args)
    except ValueError as exc:
        print(f"sdc-guard bench {args.benchmark}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    if args.json:
        write_json(args.json, outcome.payload)
        print(f"wrote {args.json}")
    return outcome.status
