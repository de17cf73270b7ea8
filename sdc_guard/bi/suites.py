"""Built-in batch-invariance suites: ``verify`` (sdc_guard's own verifier) and ``matmul``.

Why these two: a verifier's per-row verdict must not depend on the other rows of the
batch, or a corrupted row could be excused (or a clean one blamed) by its neighbours;
and triage by re-execution assumes the matmul itself is deterministic. The ``verify``
suite hashes what must be row-local in a verifier, the thresholds and the verdict bits
(not the raw checksum difference, whose last bits follow the matmul kernel). Its
negative control is the legacy checksum, whose one branch for the whole matrix depends
on every row: on inputs built to move that branch it must be ``BI_FAIL``. The control is
counted on its own line, never in the suite's counts; if it passes, the harness has lost
its sensitivity and the suite fails (exit status 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.abft import vabft_check
from . import DEFAULT_CELLS, BIConfig, Op, run_cells
from .report import EXIT_BI_FAIL, EXIT_HARNESS, EXIT_OK, STATUS_NAMES, BIReport, Status, format_counts
from ..core.legacy import legacy_check
from ..core.precision import default_e_max


def vabft_row_verdict(x: Tensor, w: Tensor) -> Tensor:
    """Per row of ``x @ w``: V-ABFT's fp32 thresholds ``[nseg]`` and verdict bits, as bytes.

    >>> vabft_row_verdict(torch.randn(3, 16), torch.randn(16, 8)).shape
    torch.Size([3, 5])
    """
    c = x @ w
    result = vabft_check(x, w, c, e_max=default_e_max(c.dtype, c.device))
    threshold = result.threshold.contiguous().view(torch.uint8)
    return torch.cat([threshold, result.ok.to(torch.uint8)], dim=-1)


def legacy_row_verdict(x: Tensor, w: Tensor) -> Tensor:
    """Per row of ``x @ w``: the legacy checksum's error estimate (fp32) and flag, as bytes.

    >>> legacy_row_verdict(torch.randn(3, 16), torch.randn(16, 8)).shape
    torch.Size([3, 5])
    """
    result = legacy_check(x, w, x @ w)
    err = result.err.float().unsqueeze(-1).contiguous().view(torch.uint8)
    return torch.cat([err, result.flags.to(torch.uint8).unsqueeze(-1)], dim=-1)


def torch_mm(x: Tensor, w: Tensor) -> Tensor:
    """``torch.mm(x, w)``."""
    return torch.mm(x, w)


def torch_linear(x: Tensor, w: Tensor) -> Tensor:
    """``F.linear`` with an ``nn.Linear``-style contiguous ``[N, K]`` weight."""
    return F.linear(x, w.t().contiguous())


#: The matmul suite's ops, by report name.
MATMUL_OPS: dict[str, Op] = {"torch.mm": torch_mm, "F.linear": torch_linear}


@dataclass(frozen=True)
class SuiteResult:
    """A suite's subject report and, for ``verify``, its negative control kept apart."""

    suite: str
    report: BIReport
    control: BIReport | None = None
    header: tuple[str, ...] = ()

    @property
    def control_ok(self) -> bool:
        """No control, or the control is BI_FAIL in every one of its (expected) cells."""
        if self.control is None:
            return True
        c = self.control
        return c.counts_match and bool(c.cells) and c.counts[Status.BI_FAIL.value] == len(c.cells)

    @property
    def exit_status(self) -> int:
        """1 iff a subject cell is BI_FAIL; else 2 if the harness failed (counts, control); else 0."""
        if self.report.counts[Status.BI_FAIL.value]:
            return EXIT_BI_FAIL
        return EXIT_OK if self.report.counts_match and self.control_ok else EXIT_HARNESS

    def control_lines(self) -> list[str]:
        """The control's own line (expected failure), plus what went wrong if it passed."""
        if self.control is None:
            return []
        ops = ", ".join(dict.fromkeys(c.op for c in self.control.cells))
        verdict = "expected failure, sensitivity confirmed" if self.control_ok else (
            "UNEXPECTED: the control did not fail everywhere; the harness lost its sensitivity")
        out = [f"control {ops} (expected BI_FAIL, not counted): {format_counts(self.control.counts)}: {verdict}"]
        if not self.control_ok:
            out += ["  " + c.describe() for c in self.control.cells if c.status != Status.BI_FAIL][:10]
        return out

    def lines(self, verbose: bool = False) -> list[str]:
        """Header, subject findings and breakdown, control line, count check; summary line last."""
        body = self.report.lines(verbose)
        return [*self.header, *body[:-1], *breakdown(self.report), *self.control_lines(), body[-1]]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "suite": self.suite,
            "exit_status": self.exit_status,
            "summary": self.report.summary_line(),
            "result": self.report.to_dict(),
            "control": None if self.control is None else {**self.control.to_dict(),
                                                          "sensitivity_confirmed": self.control_ok},
        }

    def write_json(self, path: str | Path) -> None:
        """Write ``to_dict()`` to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def breakdown(report: BIReport) -> list[str]:
    """One count line per (op, dtype, world size, mode), so a failure's kind is visible at a glance."""
    groups: dict[tuple[str, ...], dict[str, int]] = {}
    for c in report.cells:
        key = (c.op, c.dtype, "" if c.world_size is None else f"ws={c.world_size}", c.mode)
        counts = groups.setdefault(key, dict.fromkeys(STATUS_NAMES, 0))
        counts[c.status.value] += 1
    return ["  " + " ".join(k for k in key if k) + ": " + format_counts(v) for key, v in groups.items()]


def run_jobs(jobs: Sequence[tuple[str, Op, BIConfig]], cells: Sequence[tuple[int, int, int]]) -> BIReport:
    """Run each ``(name, op, config)`` over ``cells`` and merge the reports."""
    reports = [run_cells(op, cells, cfg, name) for name, op, cfg in jobs]
    runs = ", ".join(f"{name} {str(cfg.dtype).removeprefix('torch.')}" for name, _, cfg in jobs)
    return BIReport.merge(reports, matrix=f"{len(jobs)} op runs [{runs}] x {reports[0].matrix}")


def verify_suite(config: BIConfig, cells: Sequence[tuple[int, int, int]] = DEFAULT_CELLS) -> SuiteResult:
    """V-ABFT on wide and on branch-moving (peaky) data must pass; the legacy control must fail.

    >>> from sdc_guard.bi import make_config
    >>> r = verify_suite(make_config(n_warmup=0, n_trials=2), [(4, 32, 16)])
    >>> r.report.summary_line(), r.control_ok, r.exit_status
    ('result: BI_PASS=12 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0', True, 0)
    """
    peaky = replace(config, data="peaky")
    data_name = config.data if isinstance(config.data, str) else config.data.name
    subject = run_jobs([(f"vabft_check[{data_name}]", vabft_row_verdict, config),
                        ("vabft_check[peaky]", vabft_row_verdict, peaky)], cells)
    control = run_jobs([("legacy_check[peaky]", legacy_row_verdict, peaky)], cells)
    header = ("suite verify: V-ABFT thresholds and verdict bits must be row-local (BI_PASS); "
              "legacy checksum is the negative control",)
    return SuiteResult("verify", subject, control, header)


def matmul_suite(configs: Sequence[BIConfig], cells: Sequence[tuple[int, int, int]] = DEFAULT_CELLS,
                 ops: dict[str, Op] | None = None) -> SuiteResult:
    """``torch.mm`` and ``F.linear`` (or ``ops``) on each config's device and dtype.

    >>> from sdc_guard.bi import make_config
    >>> r = matmul_suite([make_config(mode="composition", n_warmup=0, n_trials=2)], [(4, 32, 16)])
    >>> r.report.counts["BI_PASS"]
    6
    """
    ops = ops or MATMUL_OPS
    devices = ", ".join(dict.fromkeys(str(c.device) for c in configs))
    header = (f"suite matmul: {', '.join(ops)} on {devices}",)
    jobs = [(name, op, cfg) for cfg in configs for name, op in ops.items()]
    return SuiteResult("matmul", run_jobs(jobs, cells), None, header)

