"""What the batch-invariance harness found: statuses, per-cell results and the report.

Why a module of its own: the five statuses are the harness's contract with its users
and they are never merged. ``NON_DET`` (the same input gave different bytes) is a finding
for whoever runs the system, not an op failure, so only ``BI_FAIL`` sets exit status 1;
a report whose counts do not add up to the cells its matrix implies is a harness fault
(exit status 2), never a silent pass. Reports travel as JSON between the ranks of a
distributed run and to CI, so every piece round-trips through ``to_dict``/``from_dict``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterable


class Status(str, Enum):
    """Outcome of one cell (a ``str``, so ``cell.status == "BI_PASS"`` works)."""

    BI_PASS = "BI_PASS"  #: deterministic, and the target row is the same in every variant
    BI_FAIL = "BI_FAIL"  #: deterministic, and the target row changed with the other rows
    NON_DET = "NON_DET"  #: the same input gave different bytes across trials (no phase 2)
    NON_DETERMINISTIC = "NON_DET"  #: the seed's long name (an alias of NON_DET)
    ERROR = "ERROR"  #: the op raised (or returned something that is not a tensor)
    SKIP = "SKIP"  #: the target row lies outside the input or the output

    def __str__(self) -> str:
        return self.value


#: The five counts, in report order.
STATUS_NAMES: tuple[str, ...] = tuple(s.value for s in Status)

#: Exit statuses: 1 if and only if some cell is BI_FAIL; 2 when the harness itself failed.
EXIT_OK, EXIT_BI_FAIL, EXIT_HARNESS = 0, 1, 2


@dataclass(frozen=True)
class VariantRun:
    """Phase 1 for one variant: its batch, where the target row sat, and one hash per trial."""

    name: str  #: "A" or "B"
    batch: int  #: M of this variant's input
    row: int | None  #: index of the target row in the input (None: outside it)
    out_shape: tuple[int, ...] | None = None
    shas: tuple[str, ...] = ()  #: SHA-256 hex of the target row's bytes, one per trial
    error: str | None = None
    outside: bool = False  #: the target row is outside the op's output

    @property
    def deterministic(self) -> bool:
        """All trials hashed the same (vacuously true for fewer than two)."""
        return len(set(self.shas)) <= 1


@dataclass(frozen=True)
class CellResult:
    """One cell: an op, a shape ``(m_total, k, n)``, a mode, a target row and its verdict."""

    op: str
    dtype: str
    mode: str  #: "composition" or "batch-size"
    m_total: int
    k: int
    n: int
    target: str  #: "first", "middle", "last" or a row index
    status: Status
    variants: tuple[VariantRun, ...] = ()
    vacuous: bool = False  #: inputs sum exactly in any order: a BI_PASS here proves nothing
    world_size: int | None = None
    note: str = ""

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(m_total, k, n)``."""
        return (self.m_total, self.k, self.n)

    def describe(self) -> str:
        """One line naming the cell, its shapes and (short) hashes, for failure listings."""
        where = f" ws={self.world_size}" if self.world_size is not None else ""
        head = f"{self.status.value} {self.op} {self.dtype}{where} {self.mode} {self.shape} row={self.target}"
        parts = []
        for v in self.variants:
            out = "x".join(map(str, v.out_shape)) if v.out_shape is not None else "?"
            if v.error:
                parts.append(f"{v.name}: M={v.batch} error {v.error}")
            elif v.row is None:
                parts.append(f"{v.name}: M={v.batch} target row outside the input")
            elif v.outside:
                parts.append(f"{v.name}: M={v.batch} row {v.row} outside y[{out}]")
            elif self.status == Status.NON_DET:
                parts.append(f"{v.name}: M={v.batch} y[{out}] trials {[s[:16] for s in v.shas]}")
            else:
                sha = v.shas[0][:16] if v.shas else "-"
                parts.append(f"{v.name}: M={v.batch} row {v.row} x[{v.batch},{self.k}] -> y[{out}] sha {sha}")
        tail = f" ({self.note})" if self.note else ""
        return head + (": " + "; ".join(parts) if parts else "") + tail

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CellResult":
        """Inverse of ``to_dict``."""
        variants = tuple(
            VariantRun(**{**v, "out_shape": tuple(v["out_shape"]) if v["out_shape"] is not None else None,
                          "shas": tuple(v["shas"])})
            for v in d["variants"]
        )
        return cls(**{**d, "status": Status(d["status"]), "variants": variants})


def format_counts(counts: dict[str, int]) -> str:
    """``BI_PASS=<n> BI_FAIL=<n> NON_DET=<n> ERROR=<n> SKIP=<n>``.

    >>> format_counts(dict.fromkeys(STATUS_NAMES, 0))
    'BI_PASS=0 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0'
    """
    return " ".join(f"{name}={counts[name]}" for name in STATUS_NAMES)


@dataclass(frozen=True)
class BIReport:
    """All cells of one harness run, the cell count the matrix implies, and warnings.

    >>> r = BIReport(cells=(), expected_cells=0)
    >>> r.summary_line(), r.exit_status
    ('result: BI_PASS=0 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0', 0)
    """

    cells: tuple[CellResult, ...]
    expected_cells: int
    warmup_errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    matrix: str = ""  #: how ``expected_cells`` was computed, for the printout

    @property
    def counts(self) -> dict[str, int]:
        """The five status names mapped to how many cells have each (all five always present)."""
        counts = dict.fromkeys(STATUS_NAMES, 0)
        for cell in self.cells:
            counts[cell.status.value] += 1
        return counts

    @property
    def counts_match(self) -> bool:
        """The five counts add up to the cell count the configured matrix implies."""
        return sum(self.counts.values()) == self.expected_cells

    @property
    def exit_status(self) -> int:
        """1 iff some cell is BI_FAIL; else 2 if the counts do not add up; else 0."""
        if self.counts[Status.BI_FAIL.value]:
            return EXIT_BI_FAIL
        return EXIT_OK if self.counts_match else EXIT_HARNESS

    def summary_line(self) -> str:
        """``result: BI_PASS=<n> BI_FAIL=<n> NON_DET=<n> ERROR=<n> SKIP=<n>``."""
        return "result: " + format_counts(self.counts)

    def with_status(self, *statuses: Status | str) -> list[CellResult]:
        """The cells whose status is one of ``statuses``."""
        wanted = {Status(s) for s in statuses}
        return [c for c in self.cells if c.status in wanted]

    def lines(self, verbose: bool = False) -> list[str]:
        """The human report: expected count, findings, warnings, count check, summary line last."""
        out = [f"expected cells: {self.expected_cells}" + (f" ({self.matrix})" if self.matrix else "")]
        shown = STATUS_NAMES if verbose else ("BI_FAIL", "NON_DET", "ERROR")
        out += [c.describe() for c in self.cells if c.status.value in shown]
        out += [f"warning: warm-up call failed (ignored): {e}" for e in self.warmup_errors]
        out += [f"warning: {w}" for w in self.warnings]
        counted = sum(self.counts.values())
        verdict = "ok" if self.counts_match else "MISMATCH (harness fault)"
        out.append(f"cells: expected {self.expected_cells}, counted {counted}: {verdict}")
        out.append(self.summary_line())
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (counts and summary included for readers of the file)."""
        return {
            "summary": self.summary_line(),
            "counts": self.counts,
            "expected_cells": self.expected_cells,
            "counts_match": self.counts_match,
            "matrix": self.matrix,
            "warmup_errors": list(self.warmup_errors),
            "warnings": list(self.warnings),
            "cells": [c.to_dict() for c in self.cells],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BIReport":
        """Inverse of ``to_dict``."""
        return cls(
            cells=tuple(CellResult.from_dict(c) for c in d["cells"]),
            expected_cells=int(d["expected_cells"]),
            warmup_errors=tuple(d.get("warmup_errors", ())),
            warnings=tuple(d.get("warnings", ())),
            matrix=d.get("matrix", ""),
        )

    def write_json(self, path: str | Path) -> None:
        """Write ``to_dict()`` to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def merge(cls, reports: Iterable["BIReport"], matrix: str = "") -> "BIReport":
        """One report over several runs (ops, dtypes, world sizes): cells and counts add up.

        >>> BIReport.merge([BIReport((), 2), BIReport((), 3)]).expected_cells
        5
        """
        reports = list(reports)
        return cls(
            cells=tuple(c for r in reports for c in r.cells),
            expected_cells=sum(r.expected_cells for r in reports),
            warmup_errors=tuple(dict.fromkeys(e for r in reports for e in r.warmup_errors)),
            warnings=tuple(dict.fromkeys(w for r in reports for w in r.warnings)),
            matrix=matrix or " + ".join(r.matrix for r in reports if r.matrix),
        )
