"""Batch-invariance and determinism harness: does output row i depend only on input row i and W?

Re-execution triage is only meaningful for deterministic kernels, and a verifier's
per-row verdict must not depend on the other rows of the batch. This harness tests both,
for any ``op(x [M, K], w [K, N]) -> y [M, ...]``, with the three-phase method of
``seeds/bi-test-methodology-matmul-reduce-scatter.txt``:

- Phase 0, warm-up: ``n_warmup`` calls on any valid input; errors are reported, not fatal.
- Phase 1, determinism baseline: each variant runs ``n_trials`` times on identical input
  and the target row's exact bytes are hashed (SHA-256: -0.0 vs +0.0 and NaN payloads
  count). Different hashes: ``NON_DET``, and the cell stops there, because an A/B
  difference could no longer be told from run-to-run noise.
- Phase 2, variant A vs B: same target row, same ``w``, different other rows. Same hash:
  ``BI_PASS``; different: ``BI_FAIL``. The op raising: ``ERROR``; the target row outside
  the input or output: ``SKIP``.

Two kinds of invariance, because composition alone passes CPU fp32 ``torch.mm``, whose
row results change with M: ``composition`` (A and B both hold ``m_total`` rows) and
``batch-size`` (A holds ``min_batch`` rows, 1 unless a distributed op needs more; B holds
``m_total``). Target rows default to first, middle and last, since row 0 hides order
changes in row-sharded collectives. Data spread their exponents widely, and a cell whose
inputs sum exactly in every order is flagged as vacuous (see ``sdc_guard.bi.data``).

>>> r = check(lambda x, w: torch.relu(x) * 2, [(4, 8, 2)], n_warmup=0, n_trials=2)
>>> r.counts["BI_PASS"], r.summary_line()
(6, 'result: BI_PASS=6 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0')
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import itertools
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from .data import DataSpec, order_sensitive, resolve_data
from .report import BIReport, CellResult, Status, VariantRun

__all__ = [
    "BIConfig", "BIReport", "CellResult", "DataSpec", "DEFAULT_CELLS", "Status", "VacuousInputWarning",
    "VariantRun", "check", "load_object", "make_config", "run_cells", "row_sha256",
]

Op = Callable[[Tensor, Tensor], Tensor]
Cell = tuple[int, int, int]

#: The two kinds of invariance, and what ``mode`` accepts.
MODES: tuple[str, ...] = ("composition", "batch-size")
MODE_CHOICES: tuple[str, ...] = (*MODES, "both")
#: Named target-row positions, resolved against each variant's own M.
POSITIONS: tuple[str, ...] = ("first", "middle", "last")
#: The seed's matrix: M_total {8, 16, 32} x K {256, 512, 1024} x N {64, 128}.
DEFAULT_M_TOTALS, DEFAULT_KS, DEFAULT_NS = (8, 16, 32), (256, 512, 1024), (64, 128)
DEFAULT_CELLS: tuple[Cell, ...] = tuple(itertools.product(DEFAULT_M_TOTALS, DEFAULT_KS, DEFAULT_NS))

#: Seed offsets: the target row, the other rows of A and of B, and the weight never share a stream.
_SEED_TARGET, _SEED_A, _SEED_B, _SEED_W = 0, 1_000_000, 2_000_000, 3_000_000
_MAX_ERROR_CHARS = 300


class VacuousInputWarning(UserWarning):
    """Some cells' inputs sum exactly in every order, so their BI_PASS proves nothing."""


@dataclass(frozen=True)
class BIConfig:
    """Everything a harness run is parameterised by (``make_config`` validates it)."""

    modes: tuple[str, ...] = MODES
    n_warmup: int = 2
    n_trials: int = 3
    target_rows: tuple[str | int, ...] = POSITIONS
    dtype: torch.dtype = torch.float32
    data: DataSpec | str = "wide"
    device: torch.device = torch.device("cpu")
    min_batch: int = 1  #: M of variant A in batch-size mode (a distributed op needs >= world size)


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _check_target_rows(target_rows: Any) -> tuple[str | int, ...]:
    if isinstance(target_rows, (str, int)):
        target_rows = (target_rows,)
    rows = tuple(target_rows)
    ok = rows and all((r in POSITIONS) if isinstance(r, str) else
                      (isinstance(r, int) and not isinstance(r, bool) and r >= 0) for r in rows)
    if not ok:
        raise ValueError(f"target_rows: expected a non-empty sequence of {POSITIONS} or row indices >= 0, "
                         f"got {target_rows!r}")
    return rows


def make_config(mode: str = "both", n_warmup: int = 2, n_trials: int = 3,
                target_rows: Sequence[str | int] = POSITIONS, dtype: torch.dtype = torch.float32,
                data: DataSpec | str = "wide", device: torch.device | str | None = None,
                min_batch: int = 1) -> BIConfig:
    """A validated ``BIConfig``; errors name the argument, what was expected and what came.

    >>> make_config(mode="composition", n_trials=2).modes
    ('composition',)
    """
    if mode not in MODE_CHOICES:
        raise ValueError(f"mode: expected one of {MODE_CHOICES}, got {mode!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    if not isinstance(data, (str, DataSpec)):
        raise TypeError(f"data: expected a DataSpec or a name, got {type(data).__name__}")
    resolve_data(data, dtype)
    return BIConfig(
        modes=MODES if mode == "both" else (mode,),
        n_warmup=_check_count("n_warmup", n_warmup, 0),
        n_trials=_check_count("n_trials", n_trials, 1),
        target_rows=_check_target_rows(target_rows),
        dtype=dtype,
        data=data,
        device=torch.device(device) if device is not None else torch.device("cpu"),
        min_batch=_check_count("min_batch", min_batch, 1),
    )


def check_cells(cells: Iterable[Sequence[int]]) -> tuple[Cell, ...]:
    """``cells`` as a tuple of ``(m_total, k, n)`` positive-int triples, or ``ValueError``.

    >>> check_cells([[8, 256, 64]])
    ((8, 256, 64),)
    """
    try:
        out = tuple(tuple(c) for c in cells)
    except TypeError:
        raise TypeError(f"cells: expected an iterable of (m_total, k, n) tuples, got {cells!r}") from None
    for c in out:
        if len(c) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in c):
            raise ValueError(f"cells: expected (m_total, k, n) tuples of positive ints, got {c!r}")
    if not out:
        raise ValueError("cells: expected at least one (m_total, k, n) tuple, got none")
    return out  # type: ignore[return-value]


def expected_cell_count(cells: Sequence[Cell], config: BIConfig) -> int:
    """Cells the matrix implies: shapes x target rows x modes."""
    return len(cells) * len(config.target_rows) * len(config.modes)


def matrix_text(cells: Sequence[Cell], config: BIConfig) -> str:
    """How ``expected_cell_count`` is made up, for the printout."""
    return f"{len(cells)} shapes x {len(config.target_rows)} target rows x {len(config.modes)} modes"


def row_sha256(y: Tensor, row: int) -> str | None:
    """SHA-256 hex of the exact bytes of ``y[row]``, or ``None`` when ``row`` is outside ``y``.

    >>> row_sha256(torch.tensor([[0.0], [-0.0]]), 0) != row_sha256(torch.tensor([[0.0], [-0.0]]), 1)
    True
    """
    if not isinstance(y, Tensor):
        raise TypeError(f"op output: expected a torch.Tensor, got {type(y).__name__}")
    if y.dim() == 0 or row >= y.shape[0]:
        return None
    t = y[row].detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _shape_seed(cell: Cell) -> int:
    """Per-shape seed, stable across processes (unlike ``hash`` of a str)."""
    return zlib.crc32(repr(tuple(cell)).encode()) % 10_000


def _resolve_row(target: str | int, batch: int, m_total: int) -> int | None:
    """Index of the target row in a batch of ``batch`` rows (None: outside the input)."""
    if isinstance(target, str):
        return {"first": 0, "middle": batch // 2, "last": batch - 1}[target]
    if target >= m_total:
        return None
    return min(target, batch - 1)


@dataclass(frozen=True)
class _CellInputs:
    """A shape's data, made once and shared by its modes and target rows (never handed out)."""

    w: Tensor
    target: Tensor  #: [K]
    others: dict[tuple[str, int], Tensor]  #: (role, batch) -> [batch, K]
    vacuous: bool


def _make_inputs(cell: Cell, config: BIConfig, data: DataSpec) -> _CellInputs:
    m, k, n = cell
    h = _shape_seed(cell)
    cast = dict(dtype=config.dtype)
    w = data.weight(k, n, _generator(_SEED_W + h)).to(**cast)
    target = data.rows(1, k, "target", _generator(_SEED_TARGET + h))[0].to(**cast)
    batches = {m, min(config.min_batch, m)}
    others = {(role, b): data.rows(b, k, role, _generator(seed + h)).to(**cast)
              for role, seed in (("a", _SEED_A), ("b", _SEED_B)) for b in batches}
    return _CellInputs(w, target, others, vacuous=not order_sensitive(target.float(), w.float()))


def _variant_input(inputs: _CellInputs, role: str, batch: int, row: int) -> Tensor:
    x = inputs.others[(role, batch)].clone()
    x[row] = inputs.target
    return x


def _run_variant(op: Op, name: str, x: Tensor, w: Tensor, row: int, config: BIConfig) -> VariantRun:
    """Phase 1 for one variant: ``n_trials`` calls on fresh copies of the same input."""
    shas: list[str] = []
    out_shape = None
    for _ in range(config.n_trials):
        try:
            y = op(x.to(config.device, copy=True), w.to(config.device, copy=True))
            sha = row_sha256(y, row)
        except Exception as exc:  # the op's failure is a finding, not ours
            return VariantRun(name, x.shape[0], row, out_shape, tuple(shas), error=_describe(exc))
        out_shape = tuple(y.shape)
        if sha is None:
            return VariantRun(name, x.shape[0], row, out_shape, tuple(shas), outside=True)
        shas.append(sha)
    return VariantRun(name, x.shape[0], row, out_shape, tuple(shas))


def _status(runs: Sequence[VariantRun]) -> Status:
    """Phase 2: ERROR > SKIP > NON_DET (no comparison) > BI_PASS / BI_FAIL."""
    if any(r.error for r in runs):
        return Status.ERROR
    if any(r.outside or r.row is None for r in runs):
        return Status.SKIP
    if not all(r.deterministic for r in runs):
        return Status.NON_DET
    return Status.BI_PASS if len({r.shas[0] for r in runs}) == 1 else Status.BI_FAIL


def _run_cell(op: Op, name: str, cell: Cell, mode: str, target: str | int,
              inputs: _CellInputs, config: BIConfig) -> CellResult:
    m = cell[0]
    batches = (m, m) if mode == "composition" else (min(config.min_batch, m), m)
    runs = []
    for vname, role, batch in zip(("A", "B"), ("a", "b"), batches):
        row = _resolve_row(target, batch, m)
        if row is None:
            runs.append(VariantRun(vname, batch, None))
            continue
        runs.append(_run_variant(op, vname, _variant_input(inputs, role, batch, row), inputs.w, row, config))
    dtype = str(config.dtype).removeprefix("torch.")
    return CellResult(name, dtype, mode, *cell, target=str(target), status=_status(runs),
                      variants=tuple(runs), vacuous=inputs.vacuous)


def _warm_up(op: Op, inputs: _CellInputs, m: int, config: BIConfig) -> tuple[str, ...]:
    """Phase 0: ``n_warmup`` calls on any valid input; errors are kept, never raised."""
    errors: list[str] = []
    x = _variant_input(inputs, "a", m, 0)
    for _ in range(config.n_warmup):
        try:
            op(x.to(config.device, copy=True), inputs.w.to(config.device, copy=True))
        except Exception as exc:
            errors.append(_describe(exc))
    return tuple(dict.fromkeys(errors))


def _vacuity_warnings(vacuous: list[Cell], total: int, data: DataSpec) -> tuple[str, ...]:
    if not vacuous:
        return ()
    return (f"{len(vacuous)} of {total} shapes have order-insensitive inputs ({data.name} data: every "
            f"accumulation order gives the same bits, e.g. {vacuous[0]}), so their BI_PASS proves "
            f"nothing; use data with a wide exponent spread",)


def run_cells(op: Op, cells: Iterable[Sequence[int]], config: BIConfig, name: str | None = None) -> BIReport:
    """Run the three phases for every shape x mode x target row of ``config`` (no warnings raised).

    ``check`` is the friendly front door; suites and the distributed worker call this with
    a ready ``BIConfig``.

    >>> run_cells(lambda x, w: x @ w, [(2, 4, 2)], make_config(n_warmup=0)).expected_cells
    6
    """
    cells = check_cells(cells)
    if not callable(op):
        raise TypeError(f"op: expected a callable op(x, w) -> y, got {type(op).__name__}")
    name = name or getattr(op, "__name__", None) or repr(op)
    data = resolve_data(config.data, config.dtype)
    results: list[CellResult] = []
    vacuous: list[Cell] = []
    warmup_errors: tuple[str, ...] = ()
    for i, cell in enumerate(cells):
        inputs = _make_inputs(cell, config, data)
        if i == 0:
            warmup_errors = _warm_up(op, inputs, cell[0], config)
        if inputs.vacuous:
            vacuous.append(cell)
        for mode in config.modes:
            for target in config.target_rows:
                results.append(_run_cell(op, name, cell, mode, target, inputs, config))
    return BIReport(tuple(results), expected_cell_count(cells, config), warmup_errors,
                    _vacuity_warnings(vacuous, len(cells), data), matrix_text(cells, config))


def check(op: Op, cells: Iterable[Sequence[int]], *, mode: str = "both", n_warmup: int = 2,
          n_trials: int = 3, target_rows: Sequence[str | int] = POSITIONS,
          dtype: torch.dtype = torch.float32, data: DataSpec | str = "wide",
          device: torch.device | str | None = None, name: str | None = None) -> BIReport:
    """Test ``op(x [M, K], w [K, N]) -> y [M, ...]`` for determinism and batch invariance.

    ``cells`` are ``(m_total, k, n)`` shapes; ``mode`` is ``"composition"``, ``"batch-size"``
    or ``"both"``; ``target_rows`` are ``"first"``, ``"middle"``, ``"last"`` or row indices.
    ``data`` picks the inputs (``"wide"``, ``"gaussian"``, ``"small-int"``, ``"peaky"`` or a
    ``DataSpec``); ``device`` is where the op's inputs are put (CPU by default). Emits a
    ``VacuousInputWarning`` when some shapes' inputs could not show an order change.

    >>> r = check(lambda x, w: torch.softmax(x @ w, dim=0), [(4, 8, 2)], n_warmup=0, n_trials=2)
    >>> r.summary_line()
    'result: BI_PASS=0 BI_FAIL=6 NON_DET=0 ERROR=0 SKIP=0'
    """
    config = make_config(mode, n_warmup, n_trials, target_rows, dtype, data, device)
    report = run_cells(op, cells, config, name)
    for text in report.warnings:
        warnings.warn(text, VacuousInputWarning, stacklevel=2)
    return report


def _import(module_name: str) -> Any:
    if not module_name.endswith(".py"):
        return importlib.import_module(module_name)
    name = f"_sdc_guard_bi_user_{zlib.crc32(module_name.encode())}"
    loader_spec = importlib.util.spec_from_file_location(name, module_name)
    if loader_spec is None or loader_spec.loader is None:
        raise ImportError(f"no loader for {module_name!r}")
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    return module


def load_object(spec: str) -> Any:
    """The object ``spec`` names: ``package.module:attr`` or ``path/to/file.py:attr``.

    Lets the command line (and every worker of a distributed run) test a user's op.

    >>> load_object("torch:mm") is torch.mm
    True
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"op: expected 'module:attr' or 'file.py:attr', got {spec!r}")
    try:
        module = _import(module_name)
    except (ImportError, OSError) as exc:
        raise ValueError(f"op: cannot import {module_name!r} from {spec!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"op: module {module_name!r} has no attribute {attr!r}") from None
