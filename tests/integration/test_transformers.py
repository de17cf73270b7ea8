"""SDCGuardCallback: real transformers.Trainer.train() runs on a small GPT-2, clean and under drills."""

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import sdc_guard  # noqa: E402
from hf_models import GEMMS_PER_STEP, Recorder, gpt2, params, train  # noqa: E402
from sdc_guard import GemmFault, Policy  # noqa: E402
from sdc_guard.integrations.transformers import STATE_KEY, SDCGuardCallback  # noqa: E402
from sdc_guard.runtime.sampling import EveryN  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

ATTN = "transformer.h.0.attn.c_attn"


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """A guarded run without faults: final parameters and those after every step."""
    recorder = Recorder(keep_params=True)
    trainer = train(SDCGuardCallback(metrics_port=None), tmp_path_factory.mktemp("clean"), callbacks=(recorder,))
    return {"final": params(trainer.model), "after": recorder.params}


def sdc_entries(log_history: list[dict]) -> list[dict]:
    return [e for e in log_history if "sdc/flag" in e]


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_import_needs_transformers_and_says_how_to_get_it() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ImportError('no transformers here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import sdc_guard\n"
        "try:\n"
        "    import sdc_guard.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError: sdc_guard.integrations.transformers needs the transformers" in out.stdout
    assert "pip install 'sdc-guard[transformers]'" in out.stdout


def test_clean_run_verifies_every_gemm_logs_and_serves_metrics(tmp_path: Path, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scraped = {}

    class Probe(TrainerCallback):  # before the guard's callback, so it sees the Trainer first
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            scraped["step"] = vars(optimizer).get("step")

        def on_step_end(self, args, state, control, **kwargs):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                scraped["body"] = r.read().decode()

    callback = SDCGuardCallback(metrics_port=port)
    recorder = Recorder()
    trainer = train(None, tmp_path, steps=4, logging_steps=2, callbacks=(Probe(), callback, recorder))
    reports = callback.reports
    assert [(r.step, r.seen, r.verified, r.flagged, dict(r.unverified_ops)) for r in reports] == [
        (s, GEMMS_PER_STEP, GEMMS_PER_STEP, 0, {}) for s in range(4)]
    kinds = {k for r in reports for k in r.by_kind}
    assert {("addmm", "forward", "float32"), ("mm", "backward", "float32"), ("bmm", "backward", "float32")} <= kinds
    assert [(o.step, o.stepped, o.flagged_ranks) for o in callback.outcomes] == [(s, True, []) for s in range(4)]
    assert callback.totals == {"steps": 4, "gemms_verified": 4 * GEMMS_PER_STEP, "detections": 0}
    # the guard's calibration replays: steps 1 and 2 run once more bare (replay mode, after
    # the guarded run), charged to those steps; from step 1 on the overhead is measured
    assert [r.step for r in reports if r.calibration_seconds > 0] == [1, 2]
    assert [r.overhead_calibrated for r in reports] == [False, True, True, True]
    assert 'sdc_guard_overhead_calibrated{rank="0"} 1.0' in scraped["body"]
    assert 'sdc_guard_calibration_seconds_total{rank="0"}' in scraped["body"]
    # the Trainer's logging steps (2, 4) carry the guard's values, and its own entries stay
    entries = sdc_entries(trainer.state.log_history)
    assert [(e["step"], e["sdc/flag"], e["sdc/gemms_verified"]) for e in entries] == [
        (2, 0.0, GEMMS_PER_STEP), (4, 0.0, GEMMS_PER_STEP)]
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [2, 4]
    assert [(step, logs["sdc/flag"]) for step, logs in recorder.logs if "sdc/flag" in logs] == [(2, 0.0), (4, 0.0)]
    assert [e["sdc/overhead_calibrated"] for e in entries] == [1.0, 1.0]
    assert 'sdc_guard_steps_total{rank="0"}' in scraped["body"]
    assert callback.metrics.url is None  # closed at the end of training, port freed
    out = capsys.readouterr().out
    assert "sdc-guard summary" in out and "steps guarded      4" in out and "detections         0" in out
    assert "interception estimated per op, a lower bound, in 1 of 4 steps" in out  # step 0 came before a replay
    # the Trainer is left as it was found
    assert "training_step" not in vars(trainer)
    assert vars(trainer.optimizer).get("step") is scraped["step"]  # what was there (an LR scheduler's wrapper)


def test_transient_faults_are_reexecuted_and_weights_match_the_clean_run(tmp_path: Path, clean: dict) -> None:
    callback = SDCGuardCallback(metrics_port=None)
    recorder = Recorder()
    faults = (GemmFault(site=ATTN, phase="forward", step=3),
              GemmFault(site="transformer.h.1.mlp.c_fc", phase="backward", step=4))
    trainer = train(callback, tmp_path, faults=faults, callbacks=(recorder,))  # default logging_steps: 500
    hit = [o for o in callback.outcomes if o.flagged_ranks]
    assert [(o.step, o.classification, o.action, o.report.detections[0].site, o.report.detections[0].phase)
            for o in hit] == [(3, "transient", "recompute", ATTN, "forward"),
                              (4, "transient", "recompute", "transformer.h.1.mlp.c_fc", "backward")]
    assert all(len(o.reruns) == 1 and o.reruns[0].verified == GEMMS_PER_STEP and not o.reruns[0].flagged
               for o in hit)
    assert all(torch.equal(a, b) for a, b in zip(params(trainer.model), clean["final"]))
    # a detection step reaches the logs whatever logging_steps is (global step = guard step + 1)
    entries = sdc_entries(trainer.state.log_history)
    assert [(e["step"], e["sdc/flag"]) for e in entries] == [(4, 1.0), (5, 1.0)]
    assert all(torch.isfinite(torch.tensor(e["sdc/loss"])) for e in entries)
    assert [step for step, logs in recorder.logs if logs.get("sdc/flag") == 1.0] == [4, 5]
    assert callback.classifications == {"transient": 2} and callback.responses == {"recompute": 2}


def test_sticky_fault_rolls_back_then_exits_with_code_17(tmp_path: Path, clean: dict) -> None:
    callback = SDCGuardCallback(metrics_port=None, snapshot_every=2, policy=Policy(window=10))
    model = gpt2()
    with pytest.raises(sdc_guard.SDCExit) as info:
        train(callback, tmp_path, model=model, faults=(GemmFault(site="lm_head", step=3, sticky=True),))
    assert info.value.code == sdc_guard.EXIT_PERSISTENT
    hit = [o for o in callback.outcomes if o.flagged_ranks]
    assert [(o.step, o.classification, o.action, o.rolled_back_to) for o in hit] == [
        (3, "persistent", "rollback", 2), (4, "persistent", "exit", None)]
    # rolled back to the state after step 2 (global step 3); the exit step did not update it
    assert all(torch.equal(a, b) for a, b in zip(params(model), clean["after"][3]))
    assert callback.totals["detections"] == 2 and callback.responses == {"rollback": 1, "exit": 1}


def test_gradient_accumulation_reexecutes_a_fault_in_an_earlier_micro_batch(tmp_path: Path) -> None:
    reference = train(SDCGuardCallback(metrics_port=None), tmp_path / "clean", steps=3, gradient_accumulation_steps=2)
    callback = SDCGuardCallback(metrics_port=None)
    # call=0: the first micro-batch's forward of step 1, long before the optimizer is called
    trainer = train(callback, tmp_path / "fault", steps=3, gradient_accumulation_steps=2,
                    faults=(GemmFault(site=ATTN, phase="forward", step=1, call=0),))
    assert [r.verified for r in callback.reports if r.attempt == 0] == [2 * GEMMS_PER_STEP] * 3
    hit = [o for o in callback.outcomes if o.flagged_ranks]
    assert [(o.step, o.classification, o.action) for o in hit] == [(1, "transient", "recompute")]
    assert hit[0].report.detections[0].call_index == 0 and hit[0].reruns[0].verified == 2 * GEMMS_PER_STEP
    assert all(torch.equal(a, b) for a, b in zip(params(trainer.model), params(reference.model)))


def test_bf16_mixed_precision_and_evaluation_are_verified(tmp_path: Path) -> None:
    callback = SDCGuardCallback(metrics_port=None, verify_validation=True)
    train(callback, tmp_path, steps=2, bf16=True, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    kinds = {k for r in callback.reports for k in r.by_kind}
    assert ("addmm", "forward", "bfloat16") in kinds and ("mm", "backward", "bfloat16") in kinds
    assert all(r.flagged == 0 and r.verified == r.seen == GEMMS_PER_STEP for r in callback.reports)
    val = callback.val_guard
    assert val is not None and len(val.reports) == 2  # 8 evaluation sequences, batches of 4
    assert all(r.verified > 0 and r.flagged == 0 and r.by_kind.get(("mm", "backward", "bfloat16")) is None
               for r in val.reports)


def test_resume_from_checkpoint_continues_the_callbacks_counters(tmp_path: Path) -> None:
    first = SDCGuardCallback(metrics_port=None, sampler=EveryN(3))
    train(first, tmp_path, steps=4, save_strategy="steps", save_steps=2,
          faults=(GemmFault(site=ATTN, phase="forward", step=0),))
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved[STATE_KEY]["step"] == 2 and saved[STATE_KEY]["totals"]["detections"] == 1
    resumed = SDCGuardCallback(metrics_port=None, sampler=EveryN(3))
    train(resumed, tmp_path, steps=4, save_strategy="no", resume=str(tmp_path / "checkpoint-2"))
    assert resumed.totals["steps"] == 4 and resumed.classifications == {"transient": 1}
    assert [r.step for r in resumed.reports] == [2, 3]
    assert [r.verified > 0 for r in resumed.reports] == [False, True]  # EveryN(3) watches step 3


def test_screened_sampler_reexecutes_a_tripped_step_and_weights_match_the_clean_run(tmp_path: Path,
                                                                                     clean: dict) -> None:
    from sdc_guard.runtime.sampling import Screened

    callback = SDCGuardCallback(metrics_port=None, sampler=Screened(warmup=2))
    fault = GemmFault(site="transformer.h.1.mlp.c_fc", phase="backward", step=3, element=(1, 1))
    trainer = train(callback, tmp_path, faults=(fault,))
    assert [r.verified for r in callback.reports if r.attempt == 0] == [0] * 5
    tripped = [o for o in callback.outcomes if o.tripped_ranks]
    assert [(o.step, o.screen, o.classification, o.action) for o in tripped] == [
        (3, "transient", "transient", "recompute")]
    assert tripped[0].reruns[0].verified == GEMMS_PER_STEP and not tripped[0].reruns[0].flagged
    assert all(torch.equal(a, b) for a, b in zip(params(trainer.model), clean["final"]))


@pytest.mark.corpus  # compiles a transformers Trainer run, about 18 s (CONTRIBUTING.md)
def test_torch_compile_true_compiles_is_verified_and_leaves_no_trace(tmp_path: Path) -> None:
    """``TrainingArguments(torch_compile=True)`` under the callback: the model compiles (as
    many graphs as without the callback; before, dynamo compiled nothing under the guard),
    every GEMM is checked in its graphs, a drilled fault is caught at its module, and after
    the run the compiled model runs its graphs without checks."""
    from torch._dynamo.utils import counters

    from sdc_guard.runtime.compiled import graph_checks

    def run(callback, faults=()):
        torch._dynamo.reset()
        counters.clear()
        return train(callback, tmp_path / str(len(faults)) / str(callback is None), steps=3, faults=faults,
                     torch_compile=True, torch_compile_backend="aot_eager")

    run(None)
    unguarded = counters["stats"]["unique_graphs"]
    callback = SDCGuardCallback(metrics_port=None)
    trainer = run(callback, faults=(GemmFault(site=ATTN, phase="backward", step=1),))
    assert counters["stats"]["unique_graphs"] == unguarded > 0 and callback.guard.compiled
    assert [(r.seen, r.verified, r.unverified_ops) for r in list(callback.guard.reports)[:3]] == \
        [(GEMMS_PER_STEP, GEMMS_PER_STEP, {})] * 3
    hit = [r for r in callback.guard.reports if r.flagged]
    assert hit and {d.site for d in hit[0].detections} == {ATTN}
    before, frames = graph_checks.checks_run(), counters["frames"]["ok"]
    batch = {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))}
    trainer.model_wrapped(**batch, labels=batch["input_ids"]).loss.backward()  # outside the callback's steps
    assert graph_checks.checks_run() == before and counters["frames"]["ok"] >= frames
