"""``sdc-guard bench``: every benchmark runs end to end through the CLI at a tiny size and
writes JSON that says what it should. These test the tool, never the machine: no
assertion here is about how fast anything is, only about what must hold whatever the
speed (a check that re-reads all of B costs more than one that does not).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sdc_guard.tools import cli
from sdc_guard.backends import native
from sdc_guard.tools.bench_calibrate import recommend
from sdc_guard.tools.bench_common import parse_shape, table
from sdc_guard.tools.bench_detect import bit_field

pytestmark = pytest.mark.timeout(120)


def bench(tmp_path: Path, *args: str, status: int = 0) -> dict:
    """Run ``python -m sdc_guard bench ARGS --json PATH`` and return the JSON it wrote."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "sdc_guard", "bench", *args, "--quiet", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert f"wrote {out}" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_overhead(tmp_path: Path) -> None:
    # 1 x 1024 x 1024 fp32: cold re-reads B's 1 Mi elements, warm reads 2 Ki of A and C.
    report = bench(tmp_path, "overhead", "--shapes", "1x1024x1024,16x256x300", "--dtypes", "fp32,bf16",
                   "--reps", "3", "--min-time", "0", "--warmup", "1", "--stat", "min")
    assert report["command"] == "overhead" and report["bandwidth"]["bytes_per_s"] > 0
    assert report["settings"]["statistic"] == "min"
    rows = report["rows"]
    assert [(r["dtype"], r["m"], r["k"], r["n"]) for r in rows] == [
        ("fp32", 1, 1024, 1024), ("fp32", 16, 256, 300), ("bf16", 1, 1024, 1024), ("bf16", 16, 256, 300)]
    for r in rows:
        assert r["backend"] == ("cpu" if native.available() else "torch") and r["reps"] >= 3
        assert set(r["ms"]) == {"bare", "cold", "warm", "verify_matmul", "matmul_checksum", "legacy", "recompute"}
        assert all(v > 0 for v in r["ms"].values())
        assert r["overhead"]["cold"] == pytest.approx(r["ms"]["cold"] / r["ms"]["bare"])
        assert 0 < r["floor_ms"]["warm"] < r["floor_ms"]["cold"]
    big = [r for r in rows if r["k"] == 1024]
    assert all(r["overhead"]["warm"] < r["overhead"]["cold"] for r in big)
    summary = report["summary"]
    assert set(summary) >= {"all", "fp32", "bf16", "targets", "anchors"}
    assert summary["all"]["shapes"] == 4
    # no shape has M >= 512: the cold target is not measured rather than failed
    assert summary["targets"]["cold_mean_m512_le_30pct"]["met"] is None
    assert isinstance(summary["targets"]["warm_mean_le_5pct"]["met"], bool)


@pytest.mark.corpus  # bench runs, 6-13 s (CONTRIBUTING.md)
@pytest.mark.slow  # a bench run over attention shapes (about 7 s): see CONTRIBUTING.md
def test_overhead_attention(tmp_path: Path) -> None:
    """``--attention``: one row per (dtype, L, head dim), GQA accepted, ratios are the
    paired screen / bare SDPA times (forward and backward), the target stated."""
    report = bench(tmp_path, "overhead", "--attention", "--ctx", "32,64", "--head-dims", "16",
                   "--dtypes", "fp32,bf16", "--heads", "4", "--kv-heads", "2", "--reps", "3", "--warmup", "1")
    rows = report["rows"]
    assert [(r["dtype"], r["L"], r["head_dim"]) for r in rows] == [
        ("fp32", 32, 16), ("fp32", 64, 16), ("bf16", 32, 16), ("bf16", 64, 16)]
    guard_path = "native" if native.available() else "torch"  # what protect() runs on CPU
    for r in rows:
        assert r["kv_heads"] == 2 and r["causal"] and set(r["ms"]) == {"fwd", "screen_fwd", "bwd", "screen_bwd"}
        assert all(v > 0 for v in r["overhead"].values())
        assert r["path"] == guard_path and list(r["paths"]) == [guard_path]
    assert report["target"] == 0.5 and report["worst"] == max(max(r["overhead"].values()) for r in rows)
    if native.available():  # --path both: native and torch columns, each paired with the same bare times
        both = bench(tmp_path, "overhead", "--attention", "--ctx", "32", "--head-dims", "16", "--dtypes", "fp32",
                     "--heads", "2", "--reps", "3", "--warmup", "1", "--path", "both", "--isa", "generic")
        (r,) = both["rows"]
        assert both["paths"] == ["native", "torch"] and set(r["paths"]) == {"native", "torch"}
        assert both["isa"] == "generic"
        assert r["overhead"] == r["paths"]["native"]["overhead"]
        assert all(v > 0 for p in r["paths"].values() for v in p["overhead"].values())
    assert cli.main(["bench", "overhead", "--attention", "--heads", "3", "--kv-heads", "2", "--ctx", "8",
                     "--head-dims", "8", "--quiet"]) == 2  # bad GQA grouping: a clear error, exit 2
    assert cli.main(["bench", "overhead", "--attention", "--ctx", "8", "--head-dims", "8", "--isa", "generic",
                     "--quiet"]) == 2  # an ISA for the screen protect() runs: it always runs auto


def test_overhead_default_shape_set() -> None:
    """The shape set of issue 8, and the MOE gate in fp32 only."""
    args = cli.build_parser().parse_args(["bench", "overhead"])
    from sdc_guard.tools.bench_overhead import cells

    todo = cells(args)
    shapes = {(d, s) for d, _, s in todo}
    assert len(todo) == 22
    for dtype in ("torch.bfloat16", "torch.float32"):
        for m in (1, 4, 8, 64, 512, 2048):
            assert (dtype, (m, 4096, 4096)) in {(str(d), s) for d, s in shapes}
    moe = [(str(d), s) for d, g, s in todo if g == "moe_gate"]
    assert moe == [("torch.float32", (512, 4096, 8)), ("torch.float32", (4096, 4096, 8))]


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_fp_counts_zero_on_clean_products(tmp_path: Path) -> None:
    report = bench(tmp_path, "fp", "--shapes", "8x64x300,16x128x8", "--trials", "3")
    rows = report["rows"]
    assert len(rows) == 3 * 3 * 2  # dtypes x distributions x shapes
    assert {r["dist"] for r in rows} == {"gaussian", "uniform", "scaled"}
    assert all(r["false_positives"] == 0 and r["trials"] == 3 for r in rows)
    assert all(0 < r["max_ratio"] < 1 for r in rows)
    assert report["summary"] == {**report["summary"], "false_positives": 0, "trials": 54, "pass": True}
    assert any("fp16 on CPU" in note for note in report["notes"])


def test_fp_exit_status_counts_a_failing_product(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A product that fails verification is counted (and the exit status says so): here
    the "clean" product is given a planted error, so every trial must count."""
    from sdc_guard.tools import bench_fp

    def corrupted(a, b):
        c = a @ b
        c[0, 0] += 1e4
        return c

    monkeypatch.setattr(bench_fp, "product", corrupted)
    out = tmp_path / "fp.json"
    status = cli.main(["bench", "fp", "--dtypes", "fp32", "--dists", "gaussian", "--shapes", "8x64x300",
                       "--trials", "2", "--quiet", "--json", str(out)])
    assert status == 1 and "FAIL: 2 false positives" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][0]["failed_segments"] == 2


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_detect(tmp_path: Path) -> None:
    report = bench(tmp_path, "detect", "--shape", "32x128x300", "--gemms", "1", "--magnitudes", "1e-6,2,100")
    assert [(r["dtype"], r["screen"]) for r in report["results"]] == [
        (d, s) for d in ("bf16", "fp16", "fp32") for s in ("default", "tight")]
    tight = {r["dtype"]: r for r in report["results"] if r["screen"] == "tight"}
    assert {m["magnitude"]: m["rate"] for m in tight["bf16"]["by_magnitude"]}[2.0] == 1.0  # the tight screen's 2 RMS
    for res in report["results"]:
        assert res["summary"]["clean_segments"] == 32 * 2 and 0 <= res["summary"]["screen_misses"] <= 64
        bits = 32 if res["dtype"] == "fp32" else 16
        assert len(res["by_bit"]) == 2 * bits
        top = [b for b in res["by_bit"] if b["field"] == "exponent (top)" and b["direction"] == "0->1"]
        assert len(top) == 1 and top[0]["trials"] > 0 and top[0]["rate"] == 1.0
        assert res["summary"]["exponent (top) 0->1"]["rate"] == 1.0
        by_mag = {m["magnitude"]: m for m in res["by_magnitude"]}
        assert by_mag[100.0]["rate"] == 1.0  # 100x the segment's RMS: always caught
        assert res["summary"]["false_alarms"] == 0


#: a tiny attention configuration: 2 query heads sharing 1 key/value head, L = 16, head dim 16
TINY_ATTENTION = ("--attention", "--ctx", "16", "--head-dim", "16", "--heads", "2", "--kv-heads", "1", "--trials", "1",
                  "--magnitudes", "1e-4,1000")


@pytest.mark.slow  # a bench run: see CONTRIBUTING.md
def test_detect_attention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--attention``: the real screen and confirmation of the SDPA kernel's outputs, per
    bit and per magnitude, for O, dQ, dK, dV. A screen that flagged nothing would fail the
    top-exponent bound; one that flagged everything would fail the clean calls and the
    lowest mantissa bit (whose flip moves a value by less than the rounding the bound allows)."""
    out = tmp_path / "detect.json"
    assert cli.main(["bench", "detect", *TINY_ATTENTION, "--quiet", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "confirmed, by flipped bit" in printed and "confirmed false alarms: 0" in printed
    report = json.loads(out.read_text())
    assert report["mode"] == "attention" and report["targets"] == ["O", "dQ", "dK", "dV"]
    assert [r["dtype"] for r in report["results"]] == ["bf16", "fp16", "fp32"]
    cases = ["gaussian", "peaked", "model"]
    for res in report["results"]:
        width = 32 if res["dtype"] == "fp32" else 16
        assert len(res["by_bit"]) == (len(cases) + 1) * 4 * width * 2  # each case and all pooled
        assert len(res["by_magnitude"]) == (len(cases) + 1) * 4 * 2
        rows = {"O": 32, "dQ": 32, "dK": 16, "dV": 16}  # B Hq L and B Hkv S, one call per case
        assert {(c["case"], c["target"]): c["rows"] for c in res["clean"]} == {
            (case, t): n for case in cases for t, n in rows.items()}
        assert all(c["confirmed"] == 0 for c in res["clean"])  # no confirmed detection on a clean call
        assert all(c["suspects"] == 0 and c["worst_ratio"] < 0.5 for c in res["clean"])  # nor a screen miss
        assert res["summary"]["false_alarms"] == 0
        pooled = [c for c in res["by_bit"] if c["case"] == "all"]
        assert all(c["detected"] <= c["flagged"] <= c["trials"] for c in res["by_bit"])
        for target in ("O", "dQ", "dK", "dV"):
            top = [c for c in pooled if c["target"] == target and c["field"] == "exponent (top)"
                   and c["direction"] == "0->1"]
            assert len(top) == 1 and top[0]["trials"] >= rows[target]  # elements under 2 in magnitude (bit 0)
            assert top[0]["rate"] > 0.9, (res["dtype"], target, top[0])
            low = [c for c in pooled if c["target"] == target and c["bit"] == 0]
            assert sum(c["trials"] for c in low) > 0 and all(c["flag_rate"] < 0.1 for c in low), (res["dtype"], target, low)
            big = next(m for m in res["by_magnitude"] if m["case"] == "all" and m["target"] == target
                       and m["magnitude"] == 1000)
            assert big["rate"] == 1.0  # 1000x the head's RMS in one element: always confirmed
        summary = res["summary"]
        assert summary["clean_rows"] == 3 * sum(rows.values()) and summary["clean_confirmed"] == 0
        assert set(summary["top_exponent_on"]) == {"O", "dQ", "dK", "dV"}


def test_detect_attention_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "detect", "--attention", "--heads", "3", "--kv-heads", "2", "--quiet"]) == 2
    assert "heads: expected a multiple of --kv-heads (2), got 3" in capsys.readouterr().err
    assert cli.main(["bench", "detect", "--attention", "--training", "--quiet"]) == 2
    assert "expected one of them, got both" in capsys.readouterr().err
    assert cli.main(["bench", "detect", "--attention", "--trials", "0", "--quiet"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["bench", "detect", "--attention", "--operands", "uniform"])
    assert "operands: expected names from" in capsys.readouterr().err


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_detect_training_reports_what_each_sampler_catches_by_fault_class(tmp_path: Path) -> None:
    classes = ["exponent (top)", "stuck lane", "zeroed tile", "nan"]
    report = bench(tmp_path, "detect", "--training", "--trials", "1", "--models", "toy:32/32/4/1/3e-3",
                   "--faults", ",".join(classes))
    names = ["Full()", "Budget(0.05)", "EveryN(8)", "Screened(sigmas=inf, factor=10)", "Screened()",
             "Screened(Budget(0.05))"]
    assert report["mode"] == "training" and report["samplers"] == names
    (section,) = report["sections"]
    assert section["model"] == "toy:32/32/4/1/3e-3" and section["precision"] == "fp32"
    rows = {r["class"]: r for r in report["results"]}
    assert list(rows) == [*classes, "all"] and all(rows[c]["trials"] == 1 for c in classes)
    trials = {t["class"]: t for t in section["trials"]}
    top, stuck, nan = trials["exponent (top)"], trials["stuck lane"], trials["nan"]
    assert top["caught"]["Full()"] and nan["caught"]["Full()"]  # the GEMM check sees both
    assert nan["update_change"] == float("inf") or nan["update_change"] is None  # JSON writes inf as null
    assert nan["caught"]["Screened()"] and nan["how"]["Screened()"] == "transient"  # a non-finite gradient trips
    assert stuck["kind"] == "stuck" and stuck["gemms_hit"] > 1  # a faulty lane hits every GEMM of the step
    assert trials["zeroed tile"]["kind"] == "zero_tile" and trials["zeroed tile"]["elements"] > 1
    for t in trials.values():  # the screen beside a Budget sees what the screen alone sees, and the sweeps
        assert t["caught"]["Screened(Budget(0.05))"] >= t["caught"]["Screened()"]
        assert t["harmful"] == (t["update_change"] is None or t["update_change"] > 0.01)
    everything = rows["all"]["samplers"]["Full()"]
    assert everything["caught"] == sum(t["caught"]["Full()"] for t in trials.values())
    assert everything["harmful_let_through"] == sum(t["harmful"] and not t["caught"]["Full()"] for t in trials.values())
    assert section["batch_change_median"] > 0.01  # another batch moves the update: the scale of "harmful"


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_detect_training_clean_counts_the_steps_the_screen_re_executes(tmp_path: Path) -> None:
    report = bench(tmp_path, "detect", "--training", "--clean", "--steps", "25", "--models", "toy:32/32/4/1/3e-3",
                   "--precisions", "fp32")
    (run,) = report["runs"]
    assert report["mode"] == "training-clean" and report["false_alarms"] == 0 and run["steps"] == 25
    for screen in run["screens"].values():
        assert screen["trips"] == len(screen["trip_steps"]) == sum(screen["trip_phases"].values())
        assert screen["verdicts"]["miss"] == screen["trips"] and screen["detections"] == 0  # a clean run: misses only
        assert screen["reexecuted_rate"] == screen["trips"] / 25 and len(screen["sigmas"]) == 25
    assert run["last_loss"] < run["first_loss"]  # it trains


@pytest.mark.corpus  # a 200-step training run (about 15 s): CONTRIBUTING.md
@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_detect_training_horizon_reports_drift_and_when_a_stuck_bit_was_caught(tmp_path: Path) -> None:
    report = bench(tmp_path, "detect", "--training", "--horizon", "3", "--models", "toy:32/32/4/1/3e-3",
                   "--horizon-bits", "26")
    (run,) = report["runs"]
    assert report["mode"] == "training-horizon" and run["bit"] == 26 and report["settings"]["steps"] == 3
    assert run["samplers"]["Full()"]["first_caught"] == 0  # the top exponent bit stuck: caught at its first step
    assert run["samplers"]["Full()"]["steps_caught"] >= 1
    assert run["faulty_loss"] != run["clean_loss"] and run["drift"] == run["faulty_loss"] - run["clean_loss"]
    assert run["elements_per_step"] >= 1


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_calibrate_recommends_margin_over_measured_max(tmp_path: Path) -> None:
    report = bench(tmp_path, "calibrate", "--dtypes", "bf16,fp32", "--shapes", "8x64x300", "--trials", "3",
                   "--margin", "3")
    for name in ("bf16", "fp32"):
        s = report["summary"][name]
        measured = max(r["max_ratio"] for r in report["rows"] if r["dtype"] == name)  # the e_max the data needs
        assert 0 <= measured < s["default_e_max"] and s["max_ratio"] == measured
        if measured > 0:
            assert s["recommended_e_max"] == pytest.approx(3 * measured) and s["recommended_e_max"] > measured
            assert s["default_margin"] == pytest.approx(s["default_e_max"] / measured)
        else:  # C's rounding term covered every segment: no accumulation allowance asked for
            assert s["recommended_e_max"] == s["default_e_max"]
            assert s["default_margin"] is None  # an unbounded margin: strict JSON has no Infinity
    # the measure itself: a product off by more than its fixed terms needs e_max = (D - F) / X,
    # at which its segment passes, and fails just below
    from sdc_guard.backends import GemmRequest
    from sdc_guard.tools.bench_calibrate import required_e_max
    import torch
    from sdc_guard.core.abft import vabft_check

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, generator=gen), torch.randn(64, 300, generator=gen)
    c = a @ b
    c[1, 10] += 1e-3
    need = required_e_max(GemmRequest(a, b, c, 2e-5))
    e = float(need[1, 0])
    assert e > 0 and float(need[0, 0]) == 0.0
    assert bool(vabft_check(a, b, c, e_max=e * 1.001).ok[1, 0]) and not bool(vabft_check(a, b, c, e_max=e * 0.99).ok[1, 0])


@pytest.mark.corpus  # a training subprocess (about 7 s): CONTRIBUTING.md
@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_train(tmp_path: Path) -> None:
    report = bench(tmp_path, "train", "--steps", "3", "--warmup", "1", "--d-model", "32", "--layers", "1",
                   "--heads", "2", "--ctx", "16", "--vocab", "32", "--batch", "2", "--every-n", "2",
                   "--budget", "0.05", "--window", "3")
    results = {r["config"]: r for r in report["results"]}
    assert list(results) == ["baseline", "empty dispatch mode", "intercept only", "Full()", "Budget(0.05)",
                             "Budget(0.05, window=3)", "EveryN(2)", "Screened()"]
    assert all(r["step_ms_median"] > 0 for r in results.values())
    assert "sites" not in results["empty dispatch mode"]  # no guard: nothing seen, nothing verified
    full = results["Full()"]
    assert full["gemms_verified_per_step"] == full["gemms_seen_per_step"] > 0
    assert full["max_gap_steps"] == 0 and full["flagged"] == 0
    # the guarded copies step through optimizer_step: watched steps 1 and 2
    # (rounds 1 and 2, both measured) replay the closure bare, and every report is calibrated
    assert full["calibration_replays"] == 2 and full["calibrated_share"] == 1.0
    assert results["intercept only"]["gemms_verified_per_step"] == 0
    budget = results["Budget(0.05, window=3)"]
    assert budget["max_gap_steps"] < 3 and budget["sites"] == full["sites"] > 0  # the window's promise
    assert budget["budget_coverage"] == 1.0
    assert results["EveryN(2)"]["max_gap_steps"] == 1  # verified on every second step
    screened = results["Screened()"]  # the gradient screen: no GEMM seen, none verified, no trip on clean steps
    assert (screened["gemms_seen_per_step"], screened["gemms_verified_per_step"], screened["screen_trips"]) == (0, 0, 0)
    assert 0 < screened["gradient_ratio_max"] < 10
    assert set(report["targets"]) == {"full_le_25pct", "budget_holds", "budget_window_le_7pct",
                                      "budget_every_site_within_window", "screened_le_1pct", "reported_within_3pts"}
    # the guard's own account beside the measured overhead, over the same rounds, with their spread
    for name, row in results.items():
        lo, hi = row["overhead_spread"]
        assert lo <= row["overhead_mean"] <= hi or name == "baseline"
        if name not in ("baseline", "empty dispatch mode"):
            assert row["reported_gap"] == pytest.approx(row["reported_overhead"] - row["overhead_mean"])
            assert row["reported_spread"][0] <= row["reported_spread"][1]
            assert row["reported_gap_spread"][0] <= row["reported_gap_spread"][1]
    assert set(report["targets"]["reported_within_3pts"]["gaps"]) == set(results) - {"baseline", "empty dispatch mode"}


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "overhead", "--shapes", "square", "--m", "3"]) == 2
    assert "no shape left" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "fp", "--dtypes", "int8"])
    assert exc.value.code == 2
    assert "expected names from" in capsys.readouterr().err


def test_a_training_copy_put_back_twice_takes_the_same_step() -> None:
    """The fault bench puts a copy back more than once from one saved state (the faulty
    step, a change of batch, the clean step): each must start from the same state."""
    from sdc_guard.tools.training_runs import Copy, default_schedule, relative_change, workloads

    (work,) = workloads(["toy:32/32/4/1/3e-3"], 0)
    c = Copy(work, default_schedule(work, 20), "fp32", None)
    for step in range(5):
        c.step(step)
    state, before = c.state(), c.params()
    c.step(5)
    first = c.params()
    c.restore(state, 5)
    c.step(5, batch=6)
    other = c.params()
    c.restore(state, 5)
    c.step(5)
    assert relative_change(before, first, c.params()) == 0.0
    assert relative_change(before, other, c.params()) > 0.01  # another batch: another update


def test_detect_training_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in ((["--trials", "0"], "trials: expected a positive int, got 0"),
                          (["--horizon", "0"], "horizon: expected a positive int, got 0"),
                          (["--clean", "--horizon", "5"], "--clean and --horizon: expected one of them, got both"),
                          (["--horizon", "5", "--horizon-bits", "0,16", "--precisions", "bf16", "--models",
                            "toy:32/32/4/1/3e-3"], "horizon-bits: expected 0..15 for bf16 outputs, got 16")):
        assert cli.main(["bench", "detect", "--training", "--quiet", *args]) == 2
        assert message in capsys.readouterr().err
    for args, message in ((["--models", "gpt2"], "models: expected a comma list of toy:"),
                          (["--faults", "sign,burst"], "faults: expected names from")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "detect", "--training", *args])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_helpers() -> None:
    assert parse_shape("2X3x4") == (2, 3, 4)
    with pytest.raises(ValueError, match="MxKxN"):
        parse_shape("2x3")
    assert table(["a"], [[1.0]]).splitlines()[-1] == "1.00"
    assert recommend(0.25, 4.0) == 1.0
    assert [bit_field(__import__("torch").bfloat16, b) for b in (15, 14, 7, 6)] == [
        "sign", "exponent (top)", "exponent", "mantissa"]


@pytest.mark.corpus  # inductor compiles the bench's model, cold cache (about 40 s): CONTRIBUTING.md
@pytest.mark.slow  # integration-heavy (a subprocess, inductor compiling a model): see CONTRIBUTING.md
def test_train_compiled(tmp_path: Path) -> None:
    report = bench(tmp_path, "train", "--compile", "--ac", "--steps", "2", "--warmup", "1", "--d-model", "32",
                   "--layers", "1", "--heads", "2", "--ctx", "16", "--vocab", "32", "--batch", "2")
    rows = {(r["mode"], r["config"]): r for r in report["results"]}
    budget = "Budget(0.05)"
    assert list(rows) == [(mode, config) for mode in ("compiled", "eager") for config in ("baseline", "Full()", budget)]
    # one checkpointed block (4 linear + 2 matmul forward, two gradients each) and the head:
    # 21 GEMMs, and what each route's recomputation runs again (eager checkpointing stops
    # once it has what the backward needs; the partitioner recomputes its own choice)
    assert rows[("compiled", "Full()")]["gemms_verified_per_step"] == 27
    assert rows[("eager", "Full()")]["gemms_verified_per_step"] == 26
    assert all(r["flagged"] == 0 and r["step_ms_median"] > 0 for r in rows.values())
    assert rows[("compiled", "baseline")]["overhead_cpu"] == 0.0
    assert set(report["targets"]) == {"full_compiled_le_12pct", "budget_compiled_le_5pct"} and report["settings"]["ac"]
    assert all({"measured", "measured_cpu", "met", "met_cpu"} <= set(t) for t in report["targets"].values())


@pytest.mark.corpus  # bench runs, 6-13 s (CONTRIBUTING.md)
@pytest.mark.slow  # integration-heavy (two gloo processes per configuration): see CONTRIBUTING.md
def test_collectives(tmp_path: Path) -> None:
    report = bench(tmp_path, "collectives", "--steps", "2", "--warmup", "0", "--d-model", "32", "--layers", "1",
                   "--heads", "2", "--ctx", "16", "--vocab", "32", "--batch", "2")
    results = {r["kind"]: r for r in report["results"]}
    assert list(results) == ["ddp", "fsdp"] and report["world_size"] == 2
    for kind, r in results.items():
        assert r["detections"] == 0 and r["checks_per_step"] > 0, kind  # clean runs, checked
        assert set(r["step_ms"]) == {"baseline", "collectives off", "collectives on"}
        assert len(r["times_ms"]["baseline"]) == 2 and r["exchange_alone_ms"] > 0
    # DDP: the bucket all-reduces; FSDP2: all-gathers and reduce-scatters, more numbers exchanged
    assert results["fsdp"]["checks_per_step"] > results["ddp"]["checks_per_step"]
    assert results["ddp"]["exchanged"] > 4 and results["fsdp"]["exchanged"] > 4
    assert cli.main(["bench", "collectives", "--kinds", "tp"]) == 2
    assert cli.main(["bench", "collectives", "--world-size", "1"]) == 2


@pytest.mark.corpus  # a bench run training a model, about 5 s (CONTRIBUTING.md)
def test_detect_captured(tmp_path: Path) -> None:
    """``--captured``: single-element errors in GEMMs captured from training the toy GPT in
    bf16, each confirmed at its row: no clean segment suspected by the default screen and
    no confirmed false alarm by any screen, large errors all caught, and the default screen
    (which reads C's own rounding from C) sees more at one segment RMS than the screen
    whose threshold came from A and B only ("earlier")."""
    report = bench(tmp_path, "detect", "--captured", "toy:64/64/8/2/3e-3", "--captured-steps", "2",
                   "--captured-rows", "2", "--captured-precisions", "bf16")
    res = report["results"]["bf16"]
    assert res["gemms"] > 0 and res["segments"] > 0
    assert res["suspects"]["default"] == 0
    assert all(n == 0 for n in res["confirmed"].values())
    rate = {key: r["caught"] / r["trials"] for key, r in res["rates"].items()}
    assert all(r["false_alarms"] == 0 for r in res["rates"].values())
    assert rate["default 10"] >= 0.9
    assert rate["default 1"] > rate["earlier 1"]
