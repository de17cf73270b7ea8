"""Distributed batch invariance: a row-sharded matmul followed by ``reduce_scatter`` or ``all_reduce``.

Why: the seed's operator (MC2 ``matmul_reduce_scatter``) is a tensor-parallel
``RowParallelLinear``: each rank multiplies its K-shard of ``x`` by its K-shard of ``w``
and the partial products are summed across ranks. Whether a row's sum depends on the
other rows, on M, or on which rank's chunk the row lands in is exactly what a
single-process test cannot see. Each world size runs as its own ``torch.distributed.run``
job (gloo on CPU, loopback only), so a crashed or hung job costs one world size, never
the whole run.

Inside a job every rank generates the same inputs (same seeds), runs the three phases of
``sdc_guard.bi`` on the op ``x, w -> y`` (the full ``y``, gathered), and computes its own
statuses; the statuses are then gathered so that all ranks agree on each cell. Before any
collective, the ranks agree whether the local step succeeded everywhere: an exception on
one rank makes that cell ERROR on every rank instead of leaving the others blocked in a
collective. Everything else is bounded by timeouts: the process group's (per collective)
and the job's (the parent kills the job's whole process session).

Exit codes of the worker module: 0 when the report was written, 2 on a harness fault.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import DEFAULT_CELLS, MODE_CHOICES, POSITIONS, BIConfig, Cell, Op, expected_cell_count, load_object, \
    make_config, matrix_text, run_cells
from .report import BIReport, CellResult, Status
from .suites import SuiteResult

#: Which status wins when ranks disagree about a cell (the most alarming first).
_PRECEDENCE = (Status.ERROR, Status.NON_DET, Status.BI_FAIL, Status.SKIP, Status.BI_PASS)
_OUTPUT_TAIL = 800
_TERM_GRACE_S = 5.0


@dataclass(frozen=True)
class DistributedOp:
    """A distributed op in two steps, so ranks can agree between them.

    ``local(x, w, rank, world_size)`` computes this rank's part without communicating (it
    is where bad shapes are rejected); ``communicate(partial, rank, world_size)`` runs the
    collectives and returns the full ``y [M, ...]`` on every rank.
    """

    name: str
    local: Callable[[Tensor, Tensor, int, int], Tensor]
    communicate: Callable[[Tensor, int, int], Tensor]


def shard_matmul(x: Tensor, w: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's partial product ``x[:, shard] @ w[shard]`` over its K shard.

    >>> shard_matmul(torch.ones(2, 4), torch.ones(4, 3), 1, 2).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """
    m, k = x.shape
    if m % world_size:
        raise ValueError(f"x: expected M divisible by the world size {world_size}, got M={m}")
    if k % world_size:
        raise ValueError(f"x: expected K divisible by the world size {world_size}, got K={k}")
    s = k // world_size
    return x[:, rank * s:(rank + 1) * s] @ w[rank * s:(rank + 1) * s]


def reduce_scatter_rows(partial: Tensor, rank: int, world_size: int) -> Tensor:
    """Sum the partials across ranks, each rank keeping its chunk of rows; then gather all chunks."""
    chunks = [c.contiguous() for c in partial.chunk(world_size)]
    mine = torch.empty_like(chunks[rank])
    dist.reduce_scatter(mine, chunks)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered)


def all_reduce_rows(partial: Tensor, rank: int, world_size: int) -> Tensor:
    """Sum the partials across ranks into the full ``y`` on every rank."""
    y = partial.clone()
    dist.all_reduce(y)
    return y


MATMUL_REDUCE_SCATTER = DistributedOp("matmul_reduce_scatter", shard_matmul, reduce_scatter_rows)
MATMUL_ALL_REDUCE = DistributedOp("matmul_all_reduce", shard_matmul, all_reduce_rows)
DEFAULT_OPS: tuple[DistributedOp, ...] = (MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE)


def agreed(op: DistributedOp) -> Op:
    """``op`` as a plain ``op(x, w) -> y``: local step, agreement on success, then collectives."""

    def call(x: Tensor, w: Tensor) -> Tensor:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        error: Exception | None = None
        partial = None
        try:
            partial = op.local(x, w, rank, world_size)
        except Exception as exc:  # reported as ERROR on every rank below
            error = exc
        failed = torch.zeros(world_size, dtype=torch.int64)
        failed[rank] = int(error is not None)
        dist.all_reduce(failed)
        if error is not None:
            raise error
        if failed.any():
            ranks = failed.nonzero().flatten().tolist()
            raise RuntimeError(f"rank(s) {ranks} raised in the local step; collective skipped")
        return op.communicate(partial, rank, world_size)

    call.__name__ = op.name
    return call


# ----------------------------------------------------------------------------- worker side


def _merge_rank_cells(per_rank: list[CellResult], world_size: int) -> CellResult:
    """One cell as all ranks agree on it: the most alarming status wins, and disagreement is noted.

    Ranks that agree on BI_PASS/BI_FAIL but hold different bytes for the same target row
    ran the same input to different results: NON_DET (cross-rank non-determinism).
    """
    statuses = [c.status for c in per_rank]
    status = next(s for s in _PRECEDENCE if s in statuses)
    chosen = per_rank[statuses.index(status)]
    if len(set(statuses)) > 1:
        note = "ranks disagree: " + " ".join(f"r{i}={s.value}" for i, s in enumerate(statuses))
        return replace(chosen, world_size=world_size, note=note)
    bytes_per_rank = {tuple(v.shas for v in c.variants) for c in per_rank}
    if status in (Status.BI_PASS, Status.BI_FAIL) and len(bytes_per_rank) > 1:
        return replace(chosen, world_size=world_size, status=Status.NON_DET,
                       note="ranks hold different bytes for the same target row")
    return replace(chosen, world_size=world_size)


def gather_agreement(report: BIReport) -> BIReport:
    """Every rank's statuses, gathered and merged cell by cell (the most alarming wins)."""
    world_size = dist.get_world_size()
    gathered: list[list[dict] | None] = [None] * world_size
    dist.all_gather_object(gathered, [c.to_dict() for c in report.cells])
    per_rank = [[CellResult.from_dict(d) for d in cells] for cells in gathered]  # type: ignore[union-attr]
    if len({len(cells) for cells in per_rank}) != 1:
        raise RuntimeError(f"ranks ran different numbers of cells: {[len(c) for c in per_rank]}")
    merged = tuple(_merge_rank_cells(list(cells), world_size) for cells in zip(*per_rank))
    return replace(report, cells=merged)


def _warm_up_group() -> tuple[str, ...]:
    """Process-group warm-up: a barrier and a few small collectives before any measured call."""
    try:
        dist.barrier()
        for _ in range(3):
            dist.all_reduce(torch.ones(8))
        return ()
    except Exception as exc:
        return (f"process-group warm-up: {type(exc).__name__}: {exc}",)


def _cell_arg(text: str) -> Cell:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a cell MxKxN such as 8x256x64, got {text!r}") from None
    return (m, k, n)


def _target_arg(text: str) -> str | int:
    return text if text in POSITIONS else int(text)


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sdc_guard.bi.collective", description="one world size's worker")
    p.add_argument("--json", required=True, help="where rank 0 writes the agreed report")
    p.add_argument("--cells", nargs="+", type=_cell_arg, required=True)
    p.add_argument("--mode", choices=MODE_CHOICES, default="both")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--data", default="wide")
    p.add_argument("--n-warmup", type=int, default=2)
    p.add_argument("--n-trials", type=int, default=3)
    p.add_argument("--target-rows", nargs="+", type=_target_arg, default=list(POSITIONS))
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--op", default=None, help="module:attr or file.py:attr of a DistributedOp")
    p.add_argument("--pid-dir", default=None, help="where each rank writes its pid, for the launcher's timeout")
    return p


def load_distributed_ops(spec: str | None) -> tuple[DistributedOp, ...]:
    """The built-in ops, or the one ``DistributedOp`` that ``spec`` names."""
    if spec is None:
        return DEFAULT_OPS
    op = load_object(spec)
    if not isinstance(op, DistributedOp):
        raise TypeError(f"op: expected {spec!r} to name a DistributedOp, got {type(op).__name__}")
    return (op,)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank (``torch.distributed.run ... -m sdc_guard.bi.collective``)."""
    args = _worker_parser().parse_args(argv)
    if args.pid_dir:
        Path(args.pid_dir, f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    try:
        world_size = dist.get_world_size()
        group_errors = _warm_up_group()
        config = make_config(args.mode, args.n_warmup, args.n_trials, args.target_rows,
                             getattr(torch, args.dtype), args.data, min_batch=world_size)
        reports = [run_cells(agreed(op), args.cells, config, op.name) for op in load_distributed_ops(args.op)]
        merged = BIReport.merge(reports)
        merged = replace(gather_agreement(merged), warmup_errors=group_errors + merged.warmup_errors)
        if dist.get_rank() == 0:
            merged.write_json(args.json)
        return 0
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher side


@dataclass(frozen=True)
class LaunchConfig:
    """How the parent runs one ``torch.distributed.run`` job per world size."""

    world_sizes: tuple[int, ...] = (2, 4, 8)
    master_port: int = 0  #: 0: a free loopback port per world size
    sleep_between: float = 1.0  #: seconds between world sizes, for the previous job's sockets to close
    job_timeout: float = 600.0  #: seconds before a world size's whole job is killed
    pg_timeout: float = 60.0  #: seconds any one collective may block
    op: str | None = None  #: module:attr or file.py:attr of a DistributedOp; None: the built-ins


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_args(config: BIConfig, cells: Sequence[Cell], launch: LaunchConfig, tmp: Path) -> list[str]:
    if not isinstance(config.data, str):
        raise TypeError(f"data: the collective suite needs a built-in data name, "
                        f"got {type(config.data).__name__}")
    mode = "both" if len(config.modes) == 2 else config.modes[0]
    args = ["--json", str(tmp / "report.json"), "--pid-dir", str(tmp),
            "--cells", *(f"{m}x{k}x{n}" for m, k, n in cells), "--mode", mode,
            "--dtype", str(config.dtype).removeprefix("torch."), "--data", config.data,
            "--n-warmup", str(config.n_warmup), "--n-trials", str(config.n_trials),
            "--target-rows", *map(str, config.target_rows), "--pg-timeout", str(launch.pg_timeout)]
    return args + (["--op", launch.op] if launch.op else [])


def _kill_workers(pid_dir: Path) -> None:
    """SIGKILL the workers whose pid files are in ``pid_dir`` (torchrun puts each in its own session)."""
    for pid_file in pid_dir.glob("*.pid"):
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline")
            if cmdline.exists() and b"sdc_guard.bi.collective" not in cmdline.read_bytes():
                continue  # the pid was reused by someone else's process: not ours to end
            os.kill(pid, signal.SIGKILL)
        except (ValueError, OSError):
            continue


def _launch(cmd: list[str], timeout: float, pid_dir: Path) -> tuple[int | None, str]:
    """Run ``cmd`` in its own session; on timeout end it and its workers. ``None`` rc: timed out.

    SIGTERM first (torchrun then stops its workers itself), then SIGKILL to the job's
    session and to every worker that wrote a pid file.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(_TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _kill_workers(pid_dir)
        try:
            out, _ = proc.communicate(timeout=_TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            out = ""
        return None, out


def _error_report(world_size: int, cells: Sequence[Cell], config: BIConfig, op_names: Sequence[str],
                  reason: str) -> BIReport:
    """Every expected cell of a failed job as ERROR, so the counts still add up."""
    dtype = str(config.dtype).removeprefix("torch.")
    results = tuple(CellResult(name, dtype, mode, *cell, target=str(t), status=Status.ERROR,
                               world_size=world_size, note=reason)
                    for name in op_names for cell in cells for mode in config.modes for t in config.target_rows)
    return BIReport(results, len(results), warnings=(f"world size {world_size}: {reason}",))


def _job_command(world_size: int, port: int, worker_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size), "--nnodes", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            "-m", "sdc_guard.bi.collective", *worker_args]


def _run_job(world_size: int, worker_args: list[str], launch: LaunchConfig, tmp: Path) -> tuple[int | None, str]:
    """Launch one job; with an automatic port, retry once if another process took it meanwhile."""
    for _ in range(2):
        port = launch.master_port or free_port()
        rc, output = _launch(_job_command(world_size, port, worker_args), launch.job_timeout, tmp)
        if (tmp / "report.json").exists() or launch.master_port or "address already in use" not in output.lower():
            break
    return rc, output


def run_world_size(world_size: int, config: BIConfig, cells: Sequence[Cell], launch: LaunchConfig) -> BIReport:
    """One ``torch.distributed.run`` job: its agreed report, or ERROR cells saying why there is none."""
    cells = [c for c in cells if c[0] % world_size == 0]
    op_names = [op.name for op in load_distributed_ops(launch.op)]
    matrix = f"ws={world_size}: {len(op_names)} ops x {matrix_text(cells, config)}"
    if not cells:
        return BIReport((), 0, warnings=(f"world size {world_size}: no M_total divisible by it; nothing run",))
    with tempfile.TemporaryDirectory(prefix="sdc-guard-bi-") as tmp_name:
        tmp = Path(tmp_name)
        rc, output = _run_job(world_size, _worker_args(config, cells, launch, tmp), launch, tmp)
        report_json = (tmp / "report.json").read_text() if (tmp / "report.json").exists() else None
    why = f"job timed out after {launch.job_timeout:g} s" if rc is None else f"job exited with status {rc}"
    tail = output[-_OUTPUT_TAIL:].strip().replace("\n", " | ")
    if report_json is not None:
        report = BIReport.from_dict(json.loads(report_json))
        late = (f"world size {world_size}: report written, but {why}; last output: {tail}",) if rc != 0 else ()
        expected = len(op_names) * expected_cell_count(cells, config)
        return replace(report, expected_cells=expected, matrix=matrix, warnings=report.warnings + late)
    report = _error_report(world_size, cells, config, op_names, why)
    return replace(report, matrix=matrix, warnings=(f"world size {world_size}: {why}; last output: {tail}",))


def collective_suite(config: BIConfig, launch: LaunchConfig,
                     cells: Sequence[Cell] = DEFAULT_CELLS) -> SuiteResult:
    """The distributed op(s) at each world size of ``launch``, one job each, merged.

    ``config.min_batch`` is set to each world size (batch-size mode's smaller batch must
    still split across the ranks).
    """
    for ws in launch.world_sizes:
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ValueError(f"world_sizes: expected ints >= 1, got {launch.world_sizes!r}")
    for name in ("job_timeout", "pg_timeout"):
        if not getattr(launch, name) > 0:
            raise ValueError(f"{name}: expected seconds > 0, got {getattr(launch, name)!r}")
    if launch.sleep_between < 0 or not 0 <= launch.master_port < 65536:
        raise ValueError(f"sleep_between, master_port: expected >= 0 and a port number, got "
                         f"{launch.sleep_between!r}, {launch.master_port!r}")
    reports = []
    for i, ws in enumerate(launch.world_sizes):
        if i and launch.sleep_between > 0:
            time.sleep(launch.sleep_between)
        reports.append(run_world_size(ws, replace(config, min_batch=ws), cells, launch))
    names = ", ".join(op.name for op in load_distributed_ops(launch.op))
    header = (f"suite collective: {names} (gloo, CPU) at world sizes {list(launch.world_sizes)}",)
    return SuiteResult("collective", BIReport.merge(reports), None, header)


if __name__ == "__main__":
    # Run the imported module, not this __main__ copy, so a user's op file that imports
    # DistributedOp from sdc_guard.bi.collective passes the isinstance check.
    from sdc_guard.bi.collective import worker_main as _worker_main

    sys.exit(_worker_main())
