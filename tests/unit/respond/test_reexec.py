"""Re-execution is exact: buffers, user state, the random generators, a raising closure,
and each guard accounting its own model's GEMMs."""

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sdc_guard  # noqa: E402
from models import BNNet, TinyGPT, bn_batch, lm_batch, state_copy  # noqa: E402
from sdc_guard import GemmFault, Policy  # noqa: E402


def _train_bn(steps: int, faults: tuple = (), policy: Policy | None = None) -> tuple[BNNet, list]:
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outcomes = []
    drill = sdc_guard.drill(model, *faults)
    with drill, sdc_guard.protect(model, policy=policy) as guard:
        for step in range(steps):
            x, y = bn_batch(step)

            def closure() -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss

            outcomes.append(guard.optimizer_step(opt, closure))
    return model, outcomes


def test_batchnorm_model_with_a_transient_fault_ends_bit_identical_to_a_clean_run() -> None:
    clean, _ = _train_bn(3)
    faulty, outcomes = _train_bn(3, faults=(GemmFault(site="fc1", phase="forward", step=1),))
    assert (outcomes[1].classification, outcomes[1].action) == ("transient", "recompute")
    assert int(faulty.bn.num_batches_tracked) == int(clean.bn.num_batches_tracked) == 3
    a, b = state_copy(clean), state_copy(faulty)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # parameters and buffers


def test_a_skipped_step_leaves_no_trace_in_the_buffers() -> None:
    policy = Policy(on_detection="skip")
    model, outcomes = _train_bn(2, faults=(GemmFault(site="fc2", phase="forward", step=1),), policy=policy)
    assert outcomes[1].action == "skip" and not outcomes[1].stepped
    assert int(model.bn.num_batches_tracked) == 1  # the skipped step's update undone


def test_user_state_is_saved_before_the_closure_and_restored_before_each_rerun() -> None:
    counter = {"micro": 0}
    saved: list[int] = []

    def save() -> int:
        saved.append(counter["micro"])
        return counter["micro"]

    def restore(value: int) -> None:
        counter["micro"] = value

    model = TinyGPT(layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy(reruns=2, save_state=save, restore_state=restore)
    with sdc_guard.drill(model, GemmFault(site="head", phase="forward", step=1)), \
            sdc_guard.protect(model, policy=policy) as guard:
        for step in range(3):
            x, y = lm_batch(step)

            def closure() -> torch.Tensor:
                counter["micro"] += 1
                opt.zero_grad()
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                return loss

            outcome = guard.optimizer_step(opt, closure)
            if step == 1:
                assert outcome.classification == "transient" and len(outcome.reruns) == 2
    assert counter["micro"] == 3  # one increment per step, as in a clean run
    assert saved == [0, 1, 2]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"save_state": lambda: 1}, ValueError, "restore_state: expected a callable too"),
    ({"restore_state": lambda s: None}, ValueError, "save_state: expected a callable too"),
    ({"save_state": 3, "restore_state": lambda s: None}, TypeError, "save_state: expected a callable, got int"),
    ({"save_state": lambda: 1, "restore_state": lambda: None}, TypeError,
     r"restore_state: expected a callable taking one argument"),
    ({"save_state": lambda x: 1, "restore_state": lambda s: None}, TypeError,
     "save_state: expected a callable taking no arguments"),
])
def test_state_functions_are_checked(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Policy(**kwargs)


def test_rerun_moves_the_generator_on_so_other_consumers_never_repeat_after_it() -> None:
    """The documented limit: the CPU generator is rewound while the re-execution runs;
    afterwards it continues from where the step's first run left it."""
    torch.manual_seed(0)
    model = TinyGPT(layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = lm_batch(0)
    drawn: dict[str, torch.Tensor] = {}
    request, done = threading.Event(), threading.Event()
    label = {"name": ""}

    def other_thread() -> None:  # another consumer of the default CPU generator
        for _ in range(3):
            request.wait()
            request.clear()
            drawn[label["name"]] = torch.rand(32 if label["name"] == "during rerun" else 64)
            done.set()

    def draw_in_other_thread(name: str) -> None:
        label["name"] = name
        done.clear()
        request.set()
        done.wait(30)

    runs = {"n": 0}

    def closure() -> torch.Tensor:
        runs["n"] += 1
        draw_in_other_thread("first run" if runs["n"] == 1 else "during rerun")
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    worker = threading.Thread(target=other_thread, daemon=True)
    worker.start()
    with sdc_guard.drill(model, GemmFault(site="head", phase="forward", step=0)), \
            sdc_guard.protect(model) as guard:
        outcome = guard.optimizer_step(opt, closure)
    draw_in_other_thread("after")
    worker.join(30)
    assert outcome.classification == "transient" and runs["n"] == 2
    assert torch.equal(drawn["during rerun"], drawn["first run"][:32])  # the limit, inside the re-execution
    assert not torch.isin(drawn["after"], drawn["first run"]).any()  # nothing repeats after it


def test_a_closure_that_raises_closes_its_step_and_the_next_counts_only_its_own() -> None:
    model = TinyGPT(layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = lm_batch(0)

    def closure(fail: bool):
        def run() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            if fail:
                raise RuntimeError("loss is not finite")
            return loss
        return run

    with sdc_guard.drill(model, GemmFault(site="head", phase="forward", step=2)), \
            sdc_guard.protect(model) as guard:
        clean = guard.optimizer_step(opt, closure(False))
        with pytest.raises(RuntimeError, match="loss is not finite"):
            guard.optimizer_step(opt, closure(True))
        failed = guard.last_report
        assert not guard.step_open or guard.gemms_seen == 0
        hit = guard.optimizer_step(opt, closure(False))
    assert failed.seen == clean.report.seen
    assert hit.report.seen == clean.report.seen  # not twice
    assert (hit.classification, hit.action) == ("transient", "recompute")  # re-runnable
    assert hit.step == failed.step + 1


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def test_inner_guard_accounts_only_its_submodule_and_the_outer_its_whole_model() -> None:
    x, _ = lm_batch(0)
    seen = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        one = TinyGPT(layers=layers)
        with sdc_guard.protect(one) as alone:
            _step(one, x)
        seen[layers] = alone.last_report.seen
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    with sdc_guard.protect(model) as outer:
        with sdc_guard.protect(model.blocks[0]) as inner:
            _step(model, x)
    assert outer.last_report.seen == seen[2]  # the whole model, inner GEMMs included
    assert inner.last_report.seen == seen[2] - seen[1] == 18  # one block's GEMMs, forward and backward


def test_sibling_guards_do_not_account_each_others_gemms() -> None:
    torch.manual_seed(0)
    a, b = TinyGPT(layers=1), TinyGPT(layers=2)
    x, _ = lm_batch(0)
    with sdc_guard.protect(a) as only_a:
        _step(a, x)
    with sdc_guard.protect(b) as only_b:
        _step(b, x)
    with sdc_guard.protect(a) as ga, sdc_guard.protect(b) as gb:
        _step(a, x)
        _step(b, x)
    assert ga.last_report.seen == only_a.last_report.seen
    assert gb.last_report.seen == only_b.last_report.seen


def test_two_guards_on_one_shared_model_in_two_threads_do_not_cross_talk() -> None:
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    x, _ = lm_batch(0)
    with sdc_guard.protect(model) as alone:
        with torch.no_grad():
            for _ in range(5):
                model(x)
    expected = alone.last_report
    reports, barrier = [], threading.Barrier(2)

    def run() -> None:
        barrier.wait(30)
        with sdc_guard.protect(model) as guard, torch.no_grad():
            for _ in range(5):
                model(x)
        reports.append(guard.last_report)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(reports) == 2
    for r in reports:
        assert r.seen == expected.seen
        assert r.sites_seen == expected.sites_seen


def test_lightning_batchnorm_model_with_a_transient_fault_ends_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from sdc_guard.integrations.lightning import SDCGuard

    class LitBN(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = BNNet()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            xs, ys = zip(*(bn_batch(i) for i in range(4)))
            return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8, shuffle=False)

    def fit(faults: tuple) -> tuple[LitBN, SDCGuard]:
        torch.manual_seed(1)
        module, callback = LitBN(), SDCGuard(metrics_port=None)
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                          default_root_dir=tmp_path, callbacks=[callback])
        with sdc_guard.drill(module, *faults):
            trainer.fit(module)
        return module, callback

    clean, _ = fit(())
    faulty, callback = fit((GemmFault(site="net.fc1", phase="forward", step=1),))
    hit = [o for o in callback.guard.outcomes if o.classification is not None]
    assert [(o.step, o.classification, o.action) for o in hit] == [(1, "transient", "recompute")]
    assert int(faulty.net.bn.num_batches_tracked) == int(clean.net.bn.num_batches_tracked) == 3
    a, b = state_copy(clean), state_copy(faulty)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
