"""``sdc-guard selftest``: real backends (the native C kernels, torch, and the Triton
kernel under ``TRITON_INTERPRET=1``) against exact references; a device GEMM made wrong by
a drill (``sdc_guard.drill`` with a ``GemmFault``, the project's own fault injection)
fails it, naming the backend; the per-host score over repeated runs."""

import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import sdc_guard
from sdc_guard.backends import native
from sdc_guard.tools import selftest as selftest_module
from sdc_guard.tools.cli import main
from sdc_guard.tools.selftest_cases import SHAPES, known_attention

CASES = {c.name for c in SHAPES["small"]}


def selftest(*args: str) -> tuple[int, dict]:
    """``sdc-guard selftest --json ...`` in this process: (exit status, the JSON result)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["selftest", "--json", *args])
    return code, json.loads(out.getvalue())


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


@pytest.mark.corpus  # every backend against the references, about 7 s (CONTRIBUTING.md)
@pytest.mark.slow  # a subprocess; the Triton interpreter
def test_every_backend_found_agrees_with_the_exact_references() -> None:
    proc = subprocess.run([sys.executable, "-m", "sdc_guard", "selftest", "--shapes", "small", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    expected = {"torch"} | ({"cpu"} if native.available() else set()) | ({"triton"} if triton_interpreted() else set())
    rows = result["results"]
    assert {r["backend"] for r in rows} == expected
    for backend in expected:
        mine = [r for r in rows if r["backend"] == backend]
        assert {(r["dtype"], r["case"]) for r in mine} == {(d, c) for d in ("bfloat16", "float16", "float32")
                                                           for c in CASES}
        checked = [r for r in mine if r["skipped"] is None]
        # the Triton kernel screens GEMMs; fused attention is the guard's screens' (torch, native)
        assert {r["case"] for r in checked} == (CASES - {"fused attention"} if backend == "triton" else CASES)
        assert all(r["checks"] == {"exact": True, "clean": True, "caught": True} for r in checked)
    assert result["passed"] and result["failed_backends"] == [] and result["exit_code"] == 0


@pytest.mark.corpus  # a subprocess at the training shapes (about 11 s): CONTRIBUTING.md
@pytest.mark.slow  # a subprocess at the training shapes
def test_default_shapes_text_report() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter takes minutes here
    proc = subprocess.run([sys.executable, "-m", "sdc_guard", "selftest"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend torch   available" in proc.stdout and "shapes training" in proc.stdout
    assert "PASS torch   cpu     bfloat16  qkv projection       exact=ok  clean=ok  caught=ok" in proc.stdout
    backends = 2 if native.available() else 1
    assert f"selftest: {backends * 12} passed, 0 failed, 0 skipped" in proc.stdout


@pytest.mark.parametrize("op, wrong", [
    ("mm", {"qkv projection", "mlp weight gradient"}),   # 2-D GEMMs, either operand transposed
    ("bmm", {"attention scores"}),                       # batched
    ("sdpa", {"fused attention"}),                       # the fused attention kernel
])
def test_a_device_computing_one_wrong_bit_fails_naming_the_backend(op: str, wrong: set[str]) -> None:
    """A stuck lowest mantissa bit in one output element of the device's kernel: below the
    screen's error bound (the clean and caught checks pass), caught by the known answer."""
    fault = sdc_guard.GemmFault(site="global", op=op, sticky=True, bit=0, direction="flip", element=(0, 1, 3, 5))
    with sdc_guard.drill(torch.nn.Module(), fault) as injected:
        code, result = selftest("--backend", "torch", "--shapes", "small")
    assert injected.injections  # the drill did corrupt the device's results
    assert code == 1 and not result["passed"] and result["exit_code"] == 1
    assert result["failed_backends"] == ["torch"] and result["failed_devices"] == ["cpu"]
    failing = {(r["dtype"], r["case"]) for r in result["results"] if not r["passed"]}
    assert failing == {(d, c) for d in ("bfloat16", "float16", "float32") for c in wrong}
    for r in result["results"]:
        if not r["passed"]:
            assert r["checks"]["exact"] is False and "exact: 1 wrong" in r["details"][0]


@pytest.mark.slow  # the Triton interpreter
def test_the_triton_kernel_is_named_when_its_device_computes_wrong() -> None:
    if not triton_interpreted():
        pytest.skip("runs the Triton kernel under TRITON_INTERPRET=1 on CPU tensors")
    fault = sdc_guard.GemmFault(site="global", op="mm", sticky=True, bit=0, direction="flip", element=(2, 2))
    with sdc_guard.drill(torch.nn.Module(), fault):
        code, result = selftest("--backend", "triton", "--shapes", "small", "--dtype", "float32")
    assert code == 1 and result["failed_backends"] == ["triton"]
    assert {r["case"] for r in result["results"] if not r["passed"]} == {"qkv projection", "mlp weight gradient"}


def test_burn_repeats_rounds_and_the_history_scores_each_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    history = tmp_path / "nodes" / "selftest.jsonl"  # its folder is made
    monkeypatch.setenv("SDC_GUARD_NODE", "gpu-node-3")
    args = ("--backend", "torch", "--shapes", "small", "--dtype", "float32", "--history", str(history))
    # the burn's clock ticks 0.1 s per reading, whatever the machine's speed or load: a
    # 0.25 s burn reads it at the start and after each round, so it runs exactly 3 rounds
    ticks = itertools.count()
    monkeypatch.setattr(selftest_module, "time", types.SimpleNamespace(monotonic=lambda: 0.1 * next(ticks),
                                                                       time=time.time))
    code, first = selftest(*args, "--burn", "0.25")
    assert code == 0 and first["rounds"] == 3 and all(r["runs"] == 3 for r in first["results"])
    assert first["score"] == {"host": "gpu-node-3", "window": 20, "runs": 1, "passed": 1, "failed": 0,
                              "pass_rate": 1.0, "consecutive_passes": 1, "last_failure": None}
    with sdc_guard.drill(torch.nn.Module(), sdc_guard.GemmFault(site="global", op="bmm", sticky=True, bit=0)):
        code, failed = selftest(*args)
    assert code == 1 and failed["score"]["runs"] == 2 and failed["score"]["consecutive_passes"] == 0
    monkeypatch.setenv("SDC_GUARD_NODE", "gpu-node-4")  # another host sharing the file
    code, other = selftest(*args)
    assert code == 0 and other["score"]["runs"] == 1
    monkeypatch.setenv("SDC_GUARD_NODE", "gpu-node-3")
    # back to service only after two passing runs in a row
    code, again = selftest(*args, "--require-passes", "2")
    assert code == 3 and again["passed"] and again["score"]["consecutive_passes"] == 1
    code, again = selftest(*args, "--require-passes", "2")
    assert code == 0 and again["score"]["consecutive_passes"] == 2
    assert again["score"]["runs"] == 4 and again["score"]["passed"] == 3
    assert again["score"]["last_failure"] == failed["time"]
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert [(r["host"], r["passed"]) for r in records] == [("gpu-node-3", True), ("gpu-node-3", False),
                                                           ("gpu-node-4", True), ("gpu-node-3", True),
                                                           ("gpu-node-3", True)]
    assert records[1]["failures"] == ["torch cpu float32 attention scores"]


def test_bad_arguments_exit_2_naming_them(capsys: pytest.CaptureFixture) -> None:
    assert main(["selftest", "--backend", "nope"]) == 2
    assert "backend: expected one of" in capsys.readouterr().err
    assert main(["selftest", "--burn", "-1"]) == 2
    assert main(["selftest", "--require-passes", "2"]) == 2  # a streak needs a history
    assert "--require-passes" in capsys.readouterr().err


def test_known_attention_is_exact_by_construction() -> None:
    """Every score of a row is the same number, so the output is each row's mean of V."""
    case = next(c for c in SHAPES["training"] if c.op == "attention")
    q, k, v, ref = known_attention(case, 0)
    scores = q @ k.transpose(-2, -1)
    assert bool((scores == scores[..., :1]).all()) and bool(q.any()) and not bool((k == k[..., :1, :]).all())
    assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, v), ref)
