"""``sdc-guard selftest``: is this host computing correctly, on every backend it has?

For pre-flight (before a job starts on a node) and return to service (before a drained
node takes jobs again). For each backend found, each of its devices, each training dtype
(bf16, fp16, fp32) and each case of ``selftest_cases`` (the GEMMs of a transformer
layer's forward and backward, and fused attention), three checks: the device's result
equals an exact known answer bit for bit; the backend's check passes a correct
real-valued product; the backend catches one corrupted element. ``--burn SECONDS``
repeats rounds of fresh operands until that long has passed (at least one round).

Exit status: 0 when every check of every round agreed; 1 when one did not (the report
names the backend, device, dtype and case); 3 when all agreed but the host's record
(``--history``) has fewer consecutive passing runs than ``--require-passes``; 2 for bad
arguments. ``--json`` prints the whole result as one JSON document.

The backends found are those available in this process; under ``TRITON_INTERPRET=1``
without a CUDA device the Triton kernel is also run, on CPU tensors (how the test suite
runs it), as backend ``triton``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .. import backends
from ..backends import Backend, GemmRequest, TritonBackend
from ..respond.identity import device_uuid, node_name
from . import selftest_history
from .selftest_cases import DTYPES, SHAPES, CheckResult, run_case

EXIT_FAILED = 1
EXIT_BAD_ARGS = 2
EXIT_NOT_YET = 3  #: every check passed, but not yet ``--require-passes`` runs in a row
CHECKS = ("exact", "clean", "caught")


@dataclass
class Row:
    """Every round of one (backend, device, dtype, case)."""

    backend: str
    device: str
    dtype: str
    case: str
    runs: int = 0
    failed_runs: int = 0
    skipped: str | None = None
    checks: dict[str, bool | None] = field(default_factory=lambda: dict.fromkeys(CHECKS))
    details: list[str] = field(default_factory=list)  #: the first failing round's

    @property
    def passed(self) -> bool:
        return self.failed_runs == 0

    def add(self, result: CheckResult, round_: int) -> None:
        self.runs += 1
        self.skipped = result.skipped
        for name in CHECKS:
            value = getattr(result, name)
            if value is not None:
                self.checks[name] = value if self.checks[name] is None else self.checks[name] and value
        if not result.passed:
            self.failed_runs += 1
            if not self.details:
                self.details = [f"round {round_}: {d}" for d in result.details]


def _devices_of(backend: Backend) -> list[str]:
    """Every device of this process the backend checks GEMMs on: each of the host's
    GPUs, not only the current one. A backend tied to a device type (Triton, the NPU
    operator) has that type's; the others (torch, the native CPU kernels) those of the CPU
    and the CUDA devices that they accept."""
    kind = getattr(backend, "device_type", None)
    if kind == "cpu":
        return ["cpu"]
    if kind is not None:
        module = getattr(torch, kind, None)
        count = module.device_count() if module is not None and hasattr(module, "device_count") else 1
        return [f"{kind}:{i}" for i in range(max(count, 1))]
    devices = ["cpu"] + ([f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else [])
    return [d for d in devices if _accepts(backend, d)]


def _accepts(backend: Backend, device: str) -> bool:
    """Whether ``backend`` takes a plain fp32 GEMM on ``device``."""
    probe = torch.zeros((8, 16), device=device), torch.zeros((16, 8), device=device), torch.zeros((8, 8), device=device)
    return backend.rejects(GemmRequest(*probe, 1e-3)) is None


def found_backends() -> list[Backend]:
    """The available registered backends, and the Triton kernel on CPU tensors where
    ``TRITON_INTERPRET=1`` and no CUDA device make the registered one unavailable."""
    found = [backends.get(name) for name in backends.available()]
    if "triton" not in backends.available() and os.environ.get("TRITON_INTERPRET") == "1":
        interpreted = TritonBackend(device_type="cpu")
        if interpreted.unavailable_reason() is None:
            found.append(interpreted)
    return found


@contextlib.contextmanager
def _current(device: str) -> Iterator[None]:
    """Make ``device`` the current CUDA device while its checks run (kernels launch there)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        with torch.cuda.device(dev.index):
            yield
    else:
        yield


def run_selftest(chosen: list[Backend], dtypes: tuple[torch.dtype, ...], shapes: str, burn: float,
                 seed: int) -> tuple[list[Row], int, float]:
    """Rounds of every check until ``burn`` seconds have passed (one at least): the rows,
    the rounds run and the seconds taken."""
    rows: dict[tuple[str, str, str, str], Row] = {}
    started = time.monotonic()
    rounds = 0
    while rounds == 0 or time.monotonic() - started < burn:
        for backend in chosen:
            for device in _devices_of(backend):
                with _current(device):
                    for dtype in dtypes:
                        for case in SHAPES[shapes]:
                            result = run_case(backend, device, dtype, case, seed, rounds)
                            key = (backend.name, device, result.dtype, case.name)
                            rows.setdefault(key, Row(*key)).add(result, rounds)
        rounds += 1
    return list(rows.values()), rounds, time.monotonic() - started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--burn", type=float, default=0.0, metavar="SECONDS",
                        help="repeat rounds of fresh operands for this long (default 0: one round)")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="training",
                        help="case sizes: one transformer layer's (training), 4x larger (large), 8x smaller (small)")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="check only this backend (repeatable; default: every backend found)")
    parser.add_argument("--dtype", action="append", choices=[str(d).removeprefix("torch.") for d in DTYPES],
                        help="check only this dtype (repeatable; default: bfloat16, float16, float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the known answers and the first round")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON document")
    parser.add_argument("--history", metavar="FILE",
                        help="append this run to FILE (JSON lines) and report this host's score over its runs")
    parser.add_argument("--require-passes", type=int, default=1, metavar="N",
                        help="exit 0 only if the host's last N runs passed (with --history; default 1)")


def _choose(names: list[str] | None) -> list[Backend] | str:
    found = found_backends()
    if not names:
        return found
    by_name = {b.name: b for b in found}
    missing = [n for n in names if n not in by_name]
    if missing:
        status = backends.status()
        return "; ".join(f"backend: expected one of {', '.join(by_name) or 'none'} (the backends found), "
                         f"got {n!r}" + (f", which is unavailable: {status[n]}" if status.get(n) else "")
                         for n in missing)
    return [by_name[n] for n in names]


def run(args: argparse.Namespace) -> int:
    """Run the self-test; print the result; the exit status of the module docstring."""
    if args.burn < 0 or args.require_passes < 1 or (args.require_passes > 1 and not args.history):
        print("selftest: --burn must be >= 0 and --require-passes >= 1 (above 1 only with --history)",
              file=sys.stderr)
        return EXIT_BAD_ARGS
    chosen = _choose(args.backend)
    if isinstance(chosen, str):
        print(f"selftest: {chosen}", file=sys.stderr)
        return EXIT_BAD_ARGS
    dtypes = tuple(getattr(torch, d) for d in args.dtype) if args.dtype else DTYPES
    rows, rounds, seconds = run_selftest(chosen, dtypes, args.shapes, args.burn, args.seed)
    checked = [r for r in rows if r.skipped is None]
    passed = bool(checked) and all(r.passed for r in rows)
    result = _result(args, chosen, rows, rounds, seconds, passed)
    if args.history:
        try:
            selftest_history.append(args.history, _record(result))
            result["score"] = selftest_history.score(selftest_history.runs_of(args.history, result["host"]),
                                                     result["host"])
        except (OSError, ValueError) as exc:  # the verdict stands; the record is what failed
            print(f"selftest: cannot use the history file {args.history} ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
    code = 0 if passed else EXIT_FAILED
    streak = (result["score"] or {}).get("consecutive_passes", 1 if passed else 0)
    if code == 0 and streak < args.require_passes:
        code = EXIT_NOT_YET
    result["exit_code"] = code
    print(json.dumps(result, indent=2, allow_nan=False) if args.json else _text(result))
    return code


def _result(args: argparse.Namespace, chosen: list[Backend], rows: list[Row], rounds: int, seconds: float,
            passed: bool) -> dict[str, Any]:
    failing = [r for r in rows if not r.passed]
    devices = sorted({r.device for r in rows})
    return {
        "version": 1, "host": node_name(), "hostname": socket.gethostname(), "time": time.time(),
        "torch": torch.__version__, "shapes": args.shapes, "seed": args.seed, "burn_seconds": args.burn,
        "rounds": rounds, "seconds": round(seconds, 3),
        "backends": {name: reason or "available" for name, reason in backends.status().items()}
        | {b.name: "available (TRITON_INTERPRET=1, on CPU tensors)" for b in chosen
           if getattr(b, "device_type", None) == "cpu" and b.name == "triton"},
        "devices": [{"device": d, "device_uuid": device_uuid(torch.device(d))} for d in devices],
        "results": [{"backend": r.backend, "device": r.device, "dtype": r.dtype, "case": r.case, "runs": r.runs,
                     "failed_runs": r.failed_runs, "passed": r.passed, "skipped": r.skipped, "checks": r.checks,
                     "details": r.details} for r in rows],
        "failed_backends": sorted({r.backend for r in failing}), "failed_devices": sorted({r.device for r in failing}),
        "passed": passed, "score": None,
    }


def _record(result: dict[str, Any]) -> dict[str, Any]:
    """The history line of a run: who, when, the verdict and what failed."""
    return {key: result[key] for key in ("version", "host", "hostname", "time", "shapes", "rounds", "seconds",
                                         "devices", "passed", "failed_backends", "failed_devices")} | {
        "failures": [f"{r['backend']} {r['device']} {r['dtype']} {r['case']}" for r in result["results"]
                     if not r["passed"]]}


def _text(result: dict[str, Any]) -> str:
    lines = [f"sdc-guard selftest on {result['host']}: {result['rounds']} round(s) in {result['seconds']:.1f} s, "
             f"shapes {result['shapes']}"]
    for name, status in result["backends"].items():
        lines.append(f"  backend {name:<7} {status}")
    for r in result["results"]:
        if r["skipped"] is not None:
            lines.append(f"  SKIP {r['backend']:<7} {r['device']:<7} {r['dtype']:<9} {r['case']}: {r['skipped']}")
            continue
        checks = "  ".join(f"{k}={'ok' if v else ('FAIL' if v is False else '-')}" for k, v in r["checks"].items())
        lines.append(f"  {'PASS' if r['passed'] else 'FAIL'} {r['backend']:<7} {r['device']:<7} {r['dtype']:<9} "
                     f"{r['case']:<20} {checks}  ({r['runs'] - r['failed_runs']}/{r['runs']} rounds)")
        lines += [f"       {d}" for d in r["details"]]
    failed = [r for r in result["results"] if not r["passed"]]
    skipped = sum(1 for r in result["results"] if r["skipped"] is not None)
    lines.append(f"selftest: {len(result['results']) - len(failed) - skipped} passed, {len(failed)} failed, "
                 f"{skipped} skipped"
                 + (f" (failing backends: {', '.join(result['failed_backends'])})" if failed else ""))
    if result["score"] is not None:
        s = result["score"]
        lines.append(f"host {s['host']}: {s['passed']} of its last {s['runs']} run(s) passed, "
                     f"{s['consecutive_passes']} in a row")
    return "\n".join(lines)
