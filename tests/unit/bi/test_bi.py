"""Batch-invariance and determinism harness (issue 6): real ops, real outcomes, real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from sdc_guard import bi
from sdc_guard.tools import cli
from sdc_guard.bi.report import BIReport
from sdc_guard.bi.suites import verify_suite

from bi_ops import split_k_by_batch
from paths import ROOT, SUPPORT

OPS = SUPPORT / "bi_ops.py"
CELLS = [(8, 256, 64), (16, 512, 128)]
FAST = dict(n_warmup=1, n_trials=2)


def statuses(report: BIReport, **where) -> set[str]:
    """Statuses of the cells whose attributes match ``where``."""
    cells = [c for c in report.cells if all(getattr(c, k) == v for k, v in where.items())]
    assert cells, f"no cells match {where}"
    return {c.status.value for c in cells}


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = cli.main(["bi", *argv])
    return rc, capsys.readouterr().out


# ----------------------------------------------------------------------------- the method


def test_elementwise_op_passes_both_modes():
    report = bi.check(lambda x, w: torch.tanh(x) * w[:, 0], CELLS, **FAST)
    assert report.counts == {"BI_PASS": 12, "BI_FAIL": 0, "NON_DET": 0, "ERROR": 0, "SKIP": 0}
    assert report.summary_line() == "result: BI_PASS=12 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0"
    assert report.exit_status == 0


def test_softmax_over_rows_fails_every_cell():
    report = bi.check(lambda x, w: torch.softmax(x @ w, dim=0), CELLS, **FAST)
    assert report.counts["BI_FAIL"] == report.expected_cells == 12
    assert report.exit_status == 1
    failing = report.with_status("BI_FAIL")[0]
    a, b = failing.variants
    assert a.shas[0] != b.shas[0] and len(a.shas) == FAST["n_trials"]
    assert "BI_FAIL" in failing.describe() and a.shas[0][:16] in failing.describe()


def test_a_gemm_split_by_batch_size_fails_batch_size_and_passes_composition():
    """A GEMM whose order follows M (``bi_ops.split_k_by_batch``) fails batch-size mode,
    M = 1 against the whole batch, and passes composition mode (its rows never depend on
    the other rows' values); the host's torch.mm passes composition too, whatever its BLAS."""
    report = bi.check(split_k_by_batch, CELLS, dtype=torch.float32, **FAST)
    assert statuses(report, mode="composition") == {"BI_PASS"}
    assert statuses(report, mode="batch-size") == {"BI_FAIL"}
    batch = [c for c in report.cells if c.mode == "batch-size"]
    assert all(c.variants[0].batch == 1 and c.variants[1].batch == c.m_total for c in batch)
    composition_only = bi.check(torch.mm, CELLS, mode="composition", **FAST)
    assert composition_only.counts["BI_PASS"] == composition_only.expected_cells == 6
    assert composition_only.exit_status == 0


def test_unseeded_noise_is_non_deterministic_not_bi_fail():
    report = bi.check(lambda x, w: x @ w + 1e-3 * torch.randn(x.shape[0], w.shape[1]), CELLS, **FAST)
    assert report.counts["NON_DET"] == 12 and report.counts["BI_FAIL"] == 0
    cell = report.cells[0]
    assert len(set(cell.variants[0].shas)) == FAST["n_trials"]
    assert report.exit_status == 0  # a finding for the operator, not an op failure


def test_raising_op_is_error_and_warm_up_errors_are_reported():
    def broken(x, w):
        raise RuntimeError("kernel rejected the shape")

    report = bi.check(broken, CELLS, **FAST)
    assert report.counts["ERROR"] == 12 and report.exit_status == 0
    assert "RuntimeError: kernel rejected the shape" in report.cells[0].variants[0].error
    assert report.warmup_errors == ("RuntimeError: kernel rejected the shape",)


def test_non_tensor_output_is_error():
    report = bi.check(lambda x, w: (x @ w).tolist(), [(4, 8, 4)], **FAST)
    assert statuses(report) == {"ERROR"}
    assert "expected a torch.Tensor" in report.cells[0].variants[0].error


def test_target_outside_output_or_input_is_skip():
    report = bi.check(lambda x, w: x[:1] @ w, [(8, 32, 16)], target_rows=("first", "middle", 20), **FAST)
    assert statuses(report, target="first") == {"BI_PASS"}
    assert statuses(report, target="middle", mode="composition") == {"SKIP"}
    assert statuses(report, target="20") == {"SKIP"}  # row 20 of an 8-row batch
    assert sum(report.counts.values()) == report.expected_cells == 6


def test_first_middle_last_rows_each_tested():
    """An op that leaks other rows into its last row only: a row-0-only harness would pass it."""

    def leaks_into_last_row(x, w):
        y = x @ w
        y[-1] += x[0].sum()
        return y

    report = bi.check(leaks_into_last_row, [(8, 64, 16)], mode="composition", **FAST)
    rows = {c.target: (c.variants[0].row, c.status.value) for c in report.cells}
    assert rows == {"first": (0, "BI_PASS"), "middle": (4, "BI_PASS"), "last": (7, "BI_FAIL")}


def test_hash_counts_signed_zero_and_nan_payloads():
    zeros = torch.tensor([[0.0], [-0.0]])
    assert bi.row_sha256(zeros, 0) != bi.row_sha256(zeros, 1)
    nans = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32).reshape(2, 1)
    assert bi.row_sha256(nans, 0) != bi.row_sha256(nans, 1)
    assert bi.row_sha256(zeros, 2) is None


def test_op_gets_fresh_copies_each_trial():
    """An op that writes into its input is still deterministic: each trial gets its own copy."""
    report = bi.check(lambda x, w: x.mul_(2), [(4, 16, 8)], **FAST)
    assert statuses(report) == {"BI_PASS"}


def test_small_integer_data_is_flagged_vacuous():
    """On small integers every order sums exactly: a batch-variant GEMM then 'passes'
    batch-size mode, and is flagged."""
    with pytest.warns(bi.VacuousInputWarning, match="order-insensitive"):
        report = bi.check(split_k_by_batch, CELLS, data="small-int", **FAST)
    assert statuses(report, mode="batch-size") == {"BI_PASS"}
    assert all(c.vacuous for c in report.cells) and report.warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", bi.VacuousInputWarning)
        wide = bi.check(split_k_by_batch, CELLS, **FAST)
    assert not any(c.vacuous for c in wide.cells) and not wide.warnings
    assert statuses(wide, mode="batch-size") == {"BI_FAIL"}


def test_expected_cell_count_and_exit_rule():
    rows_mixed = bi.check(lambda x, w: torch.softmax(x @ w, dim=0), [(4, 32, 8)], mode="composition", **FAST)
    report = BIReport.merge([bi.check(lambda x, w: x @ w, [(4, 32, 8)] * 3, target_rows=("first", "last"),
                                      mode="both", **FAST), rows_mixed])
    assert report.expected_cells == 3 * 2 * 2 + 3 == sum(report.counts.values())
    assert report.counts_match and report.exit_status == 1
    truncated = BIReport(report.cells[:-1], report.expected_cells)
    assert not truncated.counts_match
    passing_only = BIReport(tuple(report.with_status("BI_PASS")), report.expected_cells)
    assert passing_only.exit_status == 2  # lost cells are a harness fault, never a silent pass
    assert BIReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(mode="sideways"), ValueError, "mode"),
        (dict(n_trials=0), ValueError, "n_trials"),
        (dict(target_rows=("top",)), ValueError, "target_rows"),
        (dict(dtype=torch.int32), TypeError, "dtype"),
        (dict(data="uniform"), ValueError, "data"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        bi.check(torch.mm, [(4, 8, 4)], **kwargs)


def test_bad_cells_name_themselves():
    with pytest.raises(ValueError, match=r"cells: expected \(m_total, k, n\)"):
        bi.check(torch.mm, [(8, 256)])


# ----------------------------------------------------------------------------- suites


def test_verify_suite_vabft_passes_and_legacy_control_fails():
    result = verify_suite(bi.make_config(**FAST), [(8, 256, 64), (16, 256, 128)])
    assert result.report.counts == {"BI_PASS": 24, "BI_FAIL": 0, "NON_DET": 0, "ERROR": 0, "SKIP": 0}
    assert {c.op for c in result.report.cells} == {"vabft_check[wide]", "vabft_check[peaky]"}
    assert result.control.counts["BI_FAIL"] == result.control.expected_cells == 12
    assert result.control_ok and result.exit_status == 0
    lines = result.lines()
    assert lines[-1] == "result: BI_PASS=24 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0"
    assert any(line.startswith("control legacy_check[peaky]") and "expected failure" in line for line in lines)


def test_verify_suite_fails_when_control_loses_sensitivity(capsys):
    """With N = 4 output columns no row can be peaky (max/mean <= N < 5): the control passes, the suite fails."""
    rc, out = run_cli(["--suite", "verify", "--m-totals", "8", "--ks", "64", "--ns", "4",
                       "--n-warmup", "0", "--n-trials", "2"], capsys)
    assert rc == 2
    assert "UNEXPECTED" in out and "lost its sensitivity" in out
    assert out.splitlines()[-1] == "result: BI_PASS=12 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0"


def test_cli_verify_passes_with_json(tmp_path, capsys):
    path = tmp_path / "verify.json"
    rc, out = run_cli(["--suite", "verify", "--m-totals", "8", "--ks", "256", "--ns", "64",
                       "--n-warmup", "1", "--n-trials", "2", "--json", str(path)], capsys)
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["summary"] == out.splitlines()[-1] == "result: BI_PASS=12 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0"
    assert data["control"]["counts"]["BI_FAIL"] == 6 and data["control"]["sensitivity_confirmed"]


def test_cli_matmul_exit_status_follows_bi_fail(tmp_path, capsys):
    small = ["--m-totals", "8", "--ks", "256", "--ns", "64", "--n-warmup", "1", "--n-trials", "2"]
    rc, out = run_cli(["--suite", "matmul", "--dtype", "float32", "--mode", "composition", *small], capsys)
    assert rc == 0 and out.splitlines()[-1] == "result: BI_PASS=6 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0"
    assert "expected cells: 6" in out
    path = tmp_path / "mm.json"
    rc, out = run_cli(["--suite", "matmul", "--dtype", "float32", "--mode", "batch-size", "--json", str(path),
                       "--op", f"{OPS}:split_k_by_batch", *small], capsys)
    assert rc == 1 and out.splitlines()[-1] == "result: BI_PASS=0 BI_FAIL=3 NON_DET=0 ERROR=0 SKIP=0"
    cells = json.loads(path.read_text())["result"]["cells"]
    assert {(c["op"], c["status"]) for c in cells} == {(f"{OPS}:split_k_by_batch", "BI_FAIL")}
    rc, out = run_cli(["--suite", "matmul", "--dtype", "float32", "--op", f"{OPS}:noisy_op", *small], capsys)
    assert rc == 0 and "NON_DET=6" in out.splitlines()[-1]
    rc, out = run_cli(["--suite", "matmul", "--dtype", "float32", "--op", f"{OPS}:raising_op", *small], capsys)
    assert rc == 0 and "ERROR=6" in out.splitlines()[-1]
    rc, _ = run_cli(["--suite", "verify", "--op", f"{OPS}:noisy_op", *small], capsys)
    assert rc == 2


# ----------------------------------------------------------------------------- processes


def sdc_guard_bi(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sdc_guard", "bi", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.corpus  # gloo processes or the example's run, 17-31 s (CONTRIBUTING.md)
@pytest.mark.slow
def test_collective_world_sizes_2_and_4(tmp_path):
    path = tmp_path / "collective.json"
    proc = sdc_guard_bi(["--suite", "collective", "--world-sizes", "2", "4", "--m-totals", "8", "--ks", "256",
                         "--ns", "64", "--n-warmup", "1", "--n-trials", "2", "--sleep-between-ws", "0",
                         "--ws-timeout", "120", "--pg-timeout", "30", "--json", str(path)], timeout=240)
    report = BIReport.from_dict(json.loads(path.read_text())["result"])
    lines = proc.stdout.splitlines()
    assert lines[-1] == report.summary_line(), proc.stdout + proc.stderr
    # 2 world sizes x 2 ops x 1 shape x 3 target rows x 2 modes, every one accounted for
    assert report.expected_cells == 24 == sum(report.counts.values())
    assert {c.world_size for c in report.cells} == {2, 4}
    assert {c.op for c in report.cells} == {"matmul_reduce_scatter", "matmul_all_reduce"}
    assert statuses(report, mode="composition") == {"BI_PASS"}
    assert report.counts["NON_DET"] == report.counts["ERROR"] == 0
    assert not any("ranks disagree" in c.note for c in report.cells)
    assert proc.returncode == (1 if report.counts["BI_FAIL"] else 0)


@pytest.mark.corpus  # gloo processes or the example's run, 17-31 s (CONTRIBUTING.md)
@pytest.mark.slow
def test_collective_exception_on_one_rank_is_error_without_hanging(tmp_path):
    path = tmp_path / "raise.json"
    proc = sdc_guard_bi(["--suite", "collective", "--world-sizes", "2", "--mode", "composition",
                         "--m-totals", "8", "16", "--ks", "256", "--ns", "64", "--n-warmup", "1",
                         "--n-trials", "2", "--op", f"{OPS}:RAISE_ON_RANK1", "--ws-timeout", "120",
                         "--pg-timeout", "30",
                         "--json", str(path)], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = BIReport.from_dict(json.loads(path.read_text())["result"])
    assert statuses(report, m_total=8) == {"ERROR"}
    assert statuses(report, m_total=16) == {"BI_PASS"}
    assert "rank(s) [1] raised" in report.cells[0].variants[0].error  # seen by rank 0, agreed by all


@pytest.mark.corpus  # gloo processes or the example's run, 17-31 s (CONTRIBUTING.md)
@pytest.mark.slow
def test_collective_hung_rank_is_killed_by_job_timeout(tmp_path):
    path = tmp_path / "hang.json"
    start = time.monotonic()
    proc = sdc_guard_bi(["--suite", "collective", "--world-sizes", "2", "--mode", "composition",
                         "--m-totals", "8", "--ks", "256", "--ns", "64", "--n-warmup", "0", "--n-trials", "1",
                         "--op", f"{OPS}:HANG_ON_RANK1", "--ws-timeout", "6", "--pg-timeout", "4",
                         "--json", str(path)], timeout=90)
    assert time.monotonic() - start < 60
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = BIReport.from_dict(json.loads(path.read_text())["result"])
    assert report.counts["ERROR"] == report.expected_cells == 3
    assert "timed out" in report.cells[0].note


@pytest.mark.corpus  # gloo processes or the example's run, 17-31 s (CONTRIBUTING.md)
@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_example_script_reports_summary_line():
    script = ROOT / "examples" / "bi_check.py"
    small = ["--m-totals", "8", "--ks", "256", "--ns", "64", "--n-trials", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    ok = subprocess.run([sys.executable, str(script), "--mode", "composition", *small],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "result: BI_PASS=3 BI_FAIL=0 NON_DET=0 ERROR=0 SKIP=0"
    both = subprocess.run([sys.executable, str(script), *small], capture_output=True, text=True, timeout=120,
                          env=env)
    # batch-size mode: BI_FAIL where the host's BLAS picks its order by M (MKL's AVX-512
    # kernels do at these shapes, its AVX2 ones not always): the exit status follows it
    counts = dict(item.split("=") for item in both.stdout.splitlines()[-1].removeprefix("result: ").split())
    failed = int(counts["BI_FAIL"])
    assert counts == {"BI_PASS": str(6 - failed), "BI_FAIL": str(failed), "NON_DET": "0", "ERROR": "0", "SKIP": "0"}
    assert failed <= 3 and both.returncode == (1 if failed else 0)
    assert ("batch-size" in both.stdout) == bool(failed) and "cells: expected 6, counted 6" in both.stdout
