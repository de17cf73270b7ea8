"""The examples and the demo run, at reduced size, and do what they say."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it: see CONTRIBUTING.md

from paths import ROOT  # noqa: E402

EXAMPLES = ROOT / "examples"


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.corpus  # trains in a subprocess, 8-22 s (CONTRIBUTING.md)
def test_demo_catches_both_faults_and_matches_the_clean_run() -> None:
    out = run("-m", "sdc_guard", "demo", "--port", "0").stdout
    assert "step 30   detected  model.blocks.0.attn.qkv (forward addmm)" in out
    assert "re-executed clean: TRANSIENT" in out
    assert "step 60   detected  model.blocks.1.fc2" in out
    assert "reproduced: PERSISTENT, rolled back to the snapshot of step 50" in out
    assert "loss through step 59: identical to the clean run, bit for bit" in out
    assert "final loss" in out and "clean reference run" in out


@pytest.mark.corpus  # trains in a subprocess, 8-22 s (CONTRIBUTING.md)
def test_demo_clean_run_has_no_detections() -> None:
    out = run("-m", "sdc_guard", "demo", "--no-faults", "--steps", "20", "--port", "0").stdout
    assert "detections           none" in out
    assert "loss through step 19: identical to the clean run" in out


@pytest.mark.corpus  # trains in a subprocess, 8-22 s (CONTRIBUTING.md)
def test_lightning_example() -> None:
    out = run(str(EXAMPLES / "lightning_gpt.py"), "--steps", "10", "--metrics-port", "0").stdout
    assert "GEMMs verified: 390, detections: 0" in out


@pytest.mark.corpus  # trains in a subprocess, 8-22 s (CONTRIBUTING.md)
def test_hf_trainer_example_recomputes_the_injected_fault() -> None:
    pytest.importorskip("transformers")
    out = run(str(EXAMPLES / "hf_trainer.py"), "--steps", "6", "--ctx", "32", "--batch", "4", "--fault-step", "3",
              "--metrics-port", "0").stdout
    assert "step 3: corruption in transformer.h.0.attn.c_attn (forward addmm) -> transient, recompute" in out
    # 6 steps x 39 GEMMs, and the re-executed step's 39; the detection step logged (logging_steps=20)
    assert "GEMMs verified: 273, detections: 1, log entries with sdc/*: 1" in out


@pytest.mark.corpus  # trains in a subprocess, 8-22 s (CONTRIBUTING.md)
def test_custom_loop_example_recomputes_the_injected_fault() -> None:
    out = run(str(EXAMPLES / "custom_loop.py"), "--steps", "8", "--fault-step", "5").stdout
    assert "step 5: corruption in blocks.0.fc1 (forward addmm) -> transient, recompute" in out


@pytest.mark.corpus  # trains in a subprocess, 8-22 s (CONTRIBUTING.md)
def test_inference_example_reports_overhead_and_cache_hits() -> None:
    out = run(str(EXAMPLES / "inference.py"), "--batches", "4", "--d-model", "64").stdout
    assert "GEMMs verified 100  flagged 0" in out  # 4 batches x (4 layers x 6 + head)
    assert "weight cache: " in out and " hits" in out and "verification overhead (warm)" in out


@pytest.mark.corpus  # trains in a subprocess, 8-22 s (CONTRIBUTING.md)
def test_ddp_example_responds_in_lockstep() -> None:
    out = run(str(EXAMPLES / "ddp_gloo.py")).stdout
    assert "rank 0 step 3: rank(s) [1] flagged -> transient, recompute" in out
    assert "rank 1 step 3: rank(s) [1] flagged -> transient, recompute" in out
    assert "parameters identical on all ranks: True" in out


def test_prometheus_example_config_is_valid() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI (.ci/run installs Debian's prometheus)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    proc = subprocess.run([promtool, "check", "config", str(EXAMPLES / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr
