"""Trainer(callbacks=[SDCGuard()]): real Trainer.fit runs, clean and under fault drills."""

import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_only


import sdc_guard  # noqa: E402
from lit_models import LitGPT  # noqa: E402
from sdc_guard import GemmFault, Policy  # noqa: E402
from sdc_guard.runtime.sampling import EveryN  # noqa: E402

from paths import SUPPORT  # noqa: E402


def fit(module, callback, tmp_path, *, steps=8, faults=(), ckpt_path=None, **trainer_kwargs):
    kwargs = dict(accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(tmp_path),
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  limit_val_batches=0)
    kwargs.update(trainer_kwargs)
    trainer = Trainer(callbacks=[callback, *kwargs.pop("callbacks", [])], **kwargs)
    if faults:
        with sdc_guard.drill(module, *faults):
            trainer.fit(module, ckpt_path=ckpt_path)
    else:
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def params(module):
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_from_sdc_guard_import_is_lazy() -> None:
    code = "import sys, sdc_guard; assert 'lightning' not in sys.modules; sdc_guard.SDCGuard; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    from sdc_guard.integrations.lightning import SDCGuard

    assert sdc_guard.SDCGuard is SDCGuard


class Recording(Logger):
    """A logger that keeps what it is given: (step, metrics) per call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def sdc(self) -> list[tuple[int, dict]]:
        return [(step, m) for step, m in self.calls if "sdc/flag" in m]


def test_clean_run_with_defaults_logs_and_summarises(tmp_path: Path, capsys) -> None:
    module = LitGPT()
    callback = sdc_guard.SDCGuard(metrics_port=None)
    trainer = fit(module, callback, tmp_path, steps=6, log_every_n_steps=2)
    assert callback.totals == {"steps": 6, "gemms_verified": callback.totals["gemms_verified"], "detections": 0}
    assert callback.totals["gemms_verified"] == 6 * 21  # 21 GEMMs per step in this model
    assert all(r.flagged == 0 for r in callback.guard.reports)
    assert [o.step for o in callback.outcomes] == list(range(6)) and len(callback.reports) == 6
    assert trainer.callback_metrics["sdc/flag"] == 0
    assert trainer.callback_metrics["sdc/gemms_verified"] == 21
    # Lightning's closure is replayed bare on the guard's watched steps 1, 2 and 4
    assert [r.step for r in callback.reports if r.calibration_seconds > 0] == [1, 2, 4]
    assert trainer.callback_metrics["sdc/overhead_calibrated"] == 1.0
    out = capsys.readouterr().out
    assert "sdc-guard summary" in out and "steps guarded      6" in out and "detections         0" in out
    assert "in 1 of 6 steps" in out  # the first step's interception, before any replay, is the estimate
    rows = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")

    def steps_with(key: str) -> list[int]:
        return [int(r.split(",")[header.index("step")]) for r in rows[1:] if r.split(",")[header.index(key)]]

    assert steps_with("sdc/flag") == steps_with("train_loss") == [1, 3, 5]  # the Trainer's interval


def test_detection_reaches_the_loggers_at_the_default_interval(tmp_path: Path) -> None:
    """Trainer(log_every_n_steps) left at 50: no routine step of 14 is logged, the detection
    at step 12 is all the same."""
    logger = Recording()
    callback = sdc_guard.SDCGuard(metrics_port=None)
    fit(LitGPT(), callback, tmp_path, steps=14, logger=logger,
        faults=(GemmFault(site="model.blocks.0.fc1", phase="forward", step=12),))
    sdc = logger.sdc()
    assert [(step, m["sdc/flag"], m["sdc/gemms_verified"]) for step, m in sdc] == [(12, 1.0, 21)]
    assert math.isfinite(sdc[0][1]["sdc/loss"])
    assert callback.outcomes[12].classification == "transient"


def test_values_reach_callback_metrics_without_a_logger(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "best", monitor="sdc/gemms_verified", mode="max",
                                 every_n_train_steps=2, save_top_k=1)
    trainer = fit(LitGPT(), sdc_guard.SDCGuard(metrics_port=None), tmp_path, steps=4, logger=False,
                  enable_checkpointing=True, callbacks=[checkpoint])
    assert trainer.callback_metrics["sdc/flag"] == 0 and trainer.callback_metrics["sdc/gemms_verified"] == 21
    assert checkpoint.best_model_path and Path(checkpoint.best_model_path).exists()
    assert checkpoint.best_model_score == 21


def test_skipped_step_hands_back_the_last_good_loss(tmp_path: Path) -> None:
    losses = {}

    class Losses(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses[trainer.global_step - 1] = outputs["loss"].item()

    logger = Recording()
    callback = sdc_guard.SDCGuard(metrics_port=None, policy=Policy(on_detection="skip"), log_every_n_steps=3)
    fit(LitGPT(), callback, tmp_path, steps=5, callbacks=[Losses()], logger=logger,
        faults=(GemmFault(site="model.head", phase="forward", step=3),))
    hit = [o for o in callback.guard.outcomes if o.flagged_ranks]
    assert [(o.step, o.action, o.stepped) for o in hit] == [(3, "skip", False)]
    assert hit[0].loss.item() != losses[2]  # the corrupted run's loss, kept in the outcome
    assert losses[3] == losses[2]  # handed back to Lightning: the last good one
    assert all(math.isfinite(v) for v in losses.values())
    # the callback's own interval (steps 2, 5, ...) over the Trainer's 50, and the detection
    assert [(step, m["sdc/flag"], m.get("sdc/loss")) for step, m in logger.sdc()] == [
        (2, 0.0, None), (3, 1.0, losses[2])]


def test_load_state_dict_accepts_what_earlier_versions_wrote() -> None:
    callback = sdc_guard.SDCGuard(metrics_port=None, sampler=EveryN(3))
    assert callback.state_key == "SDCGuard"
    callback.load_state_dict({"step": 7, "totals": {"steps": 7, "detections": 1}})  # no counts, sampler, policy
    assert callback.classifications == {} and callback.responses == {}
    assert callback.totals == {"steps": 7, "gemms_verified": 0, "detections": 1}
    assert callback.sampler.state_dict() == EveryN(3).state_dict() and callback.policy.persistent_steps == []
    model = torch.nn.Linear(2, 2)
    callback.start_guard(model, rank=0, trainer_step=4)
    assert sdc_guard.runtime.lifecycle.guard.current_step(model) == 7  # the state's step
    callback.load_state_dict({})
    assert callback.totals == {"steps": 0, "gemms_verified": 0, "detections": 0}
    callback.start_guard(model, rank=0, trainer_step=4)
    assert sdc_guard.runtime.lifecycle.guard.current_step(model) == 4  # no step in the state: the trainer's
    state = callback.state_dict()
    assert state["version"] == 1 and json.loads(json.dumps(state)) == state


def test_fused_optimizer_updates_are_seen_by_the_weight_cache(tmp_path: Path) -> None:
    """AdamW(fused=True) writes the weights without bumping their version counters: the
    guard must not check the next step against the old weights' encodings."""

    class Fused(LitGPT):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)

    callback = sdc_guard.SDCGuard(metrics_port=None)
    fit(Fused(), callback, tmp_path, steps=3)
    assert [(r.verified, r.flagged) for r in callback.reports] == [(21, 0)] * 3


def test_transient_fault_is_recomputed_and_weights_match_the_clean_run(tmp_path: Path) -> None:
    clean = LitGPT()
    fit(clean, sdc_guard.SDCGuard(metrics_port=None), tmp_path / "clean", steps=6)
    module = LitGPT()
    callback = sdc_guard.SDCGuard(metrics_port=None)
    fit(module, callback, tmp_path / "fault", steps=6,
        faults=(GemmFault(site="model.blocks.0.attn.proj", phase="forward", step=3),))
    hit = [o for o in callback.guard.outcomes if o.flagged_ranks]
    assert [(o.step, o.classification, o.action) for o in hit] == [(3, "transient", "recompute")]
    assert hit[0].report.detections[0].site == "model.blocks.0.attn.proj"
    assert callback.classifications == {"transient": 1}
    assert all(torch.equal(a, b) for a, b in zip(params(module), params(clean)))


def test_sticky_fault_rolls_back_then_escalates_to_exit(tmp_path: Path) -> None:
    module = LitGPT()
    callback = sdc_guard.SDCGuard(metrics_port=None, snapshot_every=2, policy=Policy(window=10))
    losses = {}

    class Losses(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses[trainer.global_step - 1] = outputs["loss"].item()

    with pytest.raises(sdc_guard.SDCExit) as info:
        fit(module, callback, tmp_path, steps=10, callbacks=[Losses()],
            faults=(GemmFault(site="model.head", step=5, sticky=True),))
    assert info.value.code == sdc_guard.EXIT_PERSISTENT
    hit = [o for o in callback.guard.outcomes if o.flagged_ranks]
    assert [(o.step, o.classification, o.action) for o in hit] == [
        (5, "persistent", "rollback"), (6, "persistent", "exit")]
    assert hit[0].rolled_back_to == 4
    assert math.isfinite(losses[5]) and losses[5] == losses[4]  # the rolled-back step: the last good loss


def test_resume_from_checkpoint_continues_counters_and_sampler(tmp_path: Path) -> None:
    module = LitGPT()
    callback = sdc_guard.SDCGuard(metrics_port=None, sampler=EveryN(3))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    fit(module, callback, tmp_path, steps=4, callbacks=[ckpt], enable_checkpointing=True)
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert path.exists()
    state = torch.load(path, weights_only=False)["callbacks"]
    assert state["SDCGuard"]["step"] == 4
    resumed_module = LitGPT()
    resumed = sdc_guard.SDCGuard(metrics_port=None, sampler=EveryN(3))
    fit(resumed_module, resumed, tmp_path, steps=8, ckpt_path=str(path))
    assert resumed.totals["steps"] == 8  # 4 before the checkpoint + 4 after
    steps = [r.step for r in resumed.guard.reports]
    assert steps == [4, 5, 6, 7]
    assert [r.verified > 0 for r in resumed.guard.reports] == [False, False, True, False]  # EveryN(3): step 6


def test_manual_optimization_skips_instead_of_recomputing(tmp_path: Path) -> None:
    module = LitGPT(manual=True)
    callback = sdc_guard.SDCGuard(metrics_port=None)
    fit(module, callback, tmp_path, steps=5, faults=(GemmFault(site="model.head", phase="forward", step=2),))
    hit = [o for o in callback.guard.outcomes if o.flagged_ranks]
    assert [(o.step, o.classification, o.action, o.stepped) for o in hit] == [(2, "unconfirmed", "skip", False)]
    assert callback.totals["steps"] == 5


def test_gradient_accumulation_verifies_every_micro_batch(tmp_path: Path) -> None:
    module = LitGPT()
    callback = sdc_guard.SDCGuard(metrics_port=None)
    # step 1 spans micro-batches 2 and 3; the fault hits micro-batch 2 (outside the closure)
    fit(module, callback, tmp_path, steps=3, accumulate_grad_batches=2,
        faults=(GemmFault(site="model.head", phase="forward", step=1, call=0),))
    reports = [o.report for o in callback.guard.outcomes]
    assert [r.verified for r in reports] == [42, 42, 42]  # two micro-batches of 21 GEMMs each
    hit = [o for o in callback.guard.outcomes if o.flagged_ranks]
    assert [(o.step, o.action) for o in hit] == [(1, "skip")]


def test_bf16_mixed_precision_and_validation_are_verified(tmp_path: Path) -> None:
    module = LitGPT()
    callback = sdc_guard.SDCGuard(metrics_port=None, verify_validation=True)
    fit(module, callback, tmp_path, steps=4, precision="bf16-mixed", limit_val_batches=2, val_check_interval=2)
    kinds = {k for r in callback.guard.reports for k in r.by_kind}
    assert ("addmm", "forward", "bfloat16") in kinds and ("mm", "backward", "bfloat16") in kinds
    assert all(r.flagged == 0 for r in callback.guard.reports)
    val = callback.val_guard
    assert val is not None and len(val.reports) >= 4 and all(r.verified > 0 and r.flagged == 0 for r in val.reports)


def test_metrics_endpoint_serves_while_training(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = {}

    class Probe(__import__("lightning").pytorch.callbacks.Callback):
        def on_train_batch_end(self, trainer, *args):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                seen["body"] = r.read().decode()

    callback = sdc_guard.SDCGuard(metrics_port=port)
    fit(LitGPT(), callback, tmp_path, steps=2, callbacks=[Probe()])
    assert callback.metrics_url is not None and str(port) in callback.metrics_url
    assert "sdc_guard_" in seen["body"]


@pytest.mark.corpus  # two Trainer processes, about 20 s (CONTRIBUTING.md)
@pytest.mark.slow
def test_ddp_two_processes_fault_on_one_rank(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SUPPORT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(SUPPORT / "lit_ddp_run.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*ranks))
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert outcomes[0] == outcomes[1]
    assert [o for o in outcomes[0] if o["flagged_ranks"]] == [
        {"step": 2, "flagged_ranks": [1], "classification": "transient", "action": "recompute"}]


def test_screened_sampler_reexecutes_a_tripped_step_and_weights_match_the_clean_run(tmp_path: Path) -> None:
    from sdc_guard.runtime.sampling import Screened

    clean = LitGPT()
    fit(clean, sdc_guard.SDCGuard(metrics_port=None), tmp_path / "clean", steps=6)
    module = LitGPT()
    callback = sdc_guard.SDCGuard(metrics_port=None, sampler=Screened(warmup=2))
    fit(module, callback, tmp_path / "fault", steps=6,
        faults=(GemmFault(site="model.blocks.0.fc2", phase="backward", step=3, bit=30, element=(3, 5)),))
    outcomes = callback.guard.outcomes
    assert [r.verified for r in callback.reports if r.attempt == 0] == [0] * 6  # only the re-execution verifies
    assert [(o.step, o.screen, o.classification, o.action) for o in outcomes if o.tripped_ranks] == [
        (3, "transient", "transient", "recompute")]
    assert outcomes[3].reruns[0].verified == 21 and outcomes[3].reruns[0].flagged == 0
    assert callback.classifications == {"transient": 1} and callback.totals["detections"] == 1
    assert all(torch.equal(a, b) for a, b in zip(params(module), params(clean)))


class QuietGPT(LitGPT):
    """``LitGPT`` without ``self.log`` in ``training_step``: Lightning compiles the
    training step of a compiled module too, and dynamo (torch 2.13) fails on
    ``LightningModule.log``'s signature inspection, guarded or not."""

    def training_step(self, batch, batch_idx):
        return self._loss(batch)


@pytest.mark.corpus  # a compiled Trainer run, about 6 s (CONTRIBUTING.md)
def test_compiled_lightning_module_compiles_is_verified_and_leaves_no_trace(tmp_path: Path) -> None:
    """``Trainer.fit(torch.compile(module))`` under ``SDCGuard``: the module compiles (as
    many graphs as without the callback; before, none), every GEMM is checked in its graphs
    and a drilled fault is answered; after the fit the compiled steps run without checks."""
    from torch._dynamo.utils import counters

    from sdc_guard.runtime.compiled import graph_checks

    def run(callback, faults=()):
        torch._dynamo.reset()
        counters.clear()
        module = QuietGPT()
        fit(torch.compile(module, backend="aot_eager"), callback, tmp_path, steps=3, faults=faults)
        return module

    run(Callback())
    unguarded = counters["stats"]["unique_graphs"]
    guard = sdc_guard.SDCGuard(metrics_port=None)
    module = run(guard)
    assert counters["stats"]["unique_graphs"] == unguarded > 0 and guard.guard.compiled
    assert [(r.seen, r.verified, r.unverified_ops) for r in guard.guard.reports] == [(21, 21, {})] * 3
    before = graph_checks.checks_run()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    module.training_step((x, x), 0).backward()
    assert graph_checks.checks_run() == before and counters["frames"]["ok"] > 0
    guard = sdc_guard.SDCGuard(metrics_port=None)
    run(guard, faults=(GemmFault(site="model.blocks.0.fc1", phase="forward", step=1),))
    hit = [r for r in guard.guard.reports if r.flagged]
    assert hit and [d.site for d in hit[0].detections] == ["model.blocks.0.fc1"]
    assert guard.guard.outcomes[1].classification == "transient"
