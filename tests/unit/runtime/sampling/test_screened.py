"""ASD mode: the gradient screen (``sampling.Screened``) and its verified re-execution."""

import contextlib
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry


import sdc_guard  # noqa: E402
from models import MLP  # noqa: E402
from respond_helpers import closure_for, make_model, params_of  # noqa: E402
from sdc_guard import GemmFault  # noqa: E402
from sdc_guard.metrics import GuardMetrics  # noqa: E402
from sdc_guard.runtime.sampling import Budget, Screened  # noqa: E402


def screened_train(model: torch.nn.Module, steps: int, *, sampler: Screened | None = None, faults: tuple = (),
                   remove_faults_after: int | None = None, metrics=None, lr: float = 1e-2):
    """``respond_helpers.train`` under a gradient screen; returns outcomes, guard, sampler."""
    sampler = sampler if sampler is not None else Screened()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    store = sdc_guard.SnapshotStore(model, opt, every=2)
    outcomes, intercepting = [], []
    drill = sdc_guard.drill(model, *faults) if faults else contextlib.nullcontext()
    with drill, sdc_guard.protect(model, sampler=sampler, snapshots=store, metrics=metrics) as guard:
        for step in range(steps):
            if remove_faults_after is not None and step == remove_faults_after:
                for fault in faults:
                    drill.remove(fault)
            inner = closure_for(model, opt, step)

            def closure() -> torch.Tensor:
                intercepting.append(guard.intercepting)  # the dispatch mode, during forward and backward
                return inner()

            outcomes.append(guard.optimizer_step(opt, closure))
    return outcomes, intercepting, sampler


def unguarded_train(model: torch.nn.Module, steps: int, lr: float = 1e-2) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        closure_for(model, opt, step)()
        opt.step()


def test_clean_run_verifies_no_gemm_and_trains_exactly_like_an_unguarded_run() -> None:
    reference = make_model()
    unguarded_train(reference, 8)
    model = make_model()
    outcomes, intercepting, sampler = screened_train(model, 8)
    assert intercepting == [False] * 8  # no dispatch mode on any untripped step
    reports = [o.report for o in outcomes]
    assert [(r.seen, r.verified, r.watched, r.intercepted_ops) for r in reports] == [(0, 0, False, 0)] * 8
    assert all(r.gradient_screened and not r.gradient_screen_tripped and r.nonfinite_grads == 0 for r in reports)
    assert all(0 < r.gradient_ratio < sampler.factor for r in reports)
    assert all(o.screen is None and not o.reruns and o.stepped for o in outcomes)
    assert (sampler.trips, sampler.misses) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(reference)))


def test_fault_that_disturbs_the_gradients_is_re_executed_at_its_step_and_training_is_bit_identical() -> None:
    reference = make_model()
    unguarded_train(reference, 8)
    model = make_model()
    fault = GemmFault(site="blocks.0.fc1", phase="forward", step=6, bit=30, element=(3, 5))
    outcomes, intercepting, sampler = screened_train(model, 8, faults=(fault,))
    hit = outcomes[6]
    assert hit.report.seen == 0 and hit.report.gradient_screen_tripped  # the first run verified nothing
    assert (hit.screen, hit.classification, hit.action, hit.stepped) == ("transient", "transient", "recompute", True)
    assert hit.tripped_ranks == [0] and hit.flagged_ranks == []
    rerun = hit.reruns[0]
    assert (rerun.attempt, rerun.step, rerun.flagged) == (1, 6, 0) and rerun.verified == rerun.seen > 0
    assert [o.screen for i, o in enumerate(outcomes) if i != 6] == [None] * 7
    assert intercepting == [False] * 7 + [True] + [False]  # the re-execution only
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(reference)))
    assert sampler.trips == 1 and sampler.misses == 0


def test_sticky_fault_is_found_by_the_verified_re_execution_and_rolled_back() -> None:
    model = make_model()
    fault = GemmFault(site="blocks.0.fc2", phase="backward", step=5, bit=30, element=(3, 5), sticky=True)
    outcomes, _, _ = screened_train(model, 9, faults=(fault,), remove_faults_after=6)
    hit = outcomes[5]
    assert (hit.screen, hit.classification, hit.action, hit.stepped) == ("persistent", "persistent", "rollback", False)
    assert hit.report.seen == 0 and hit.reruns[0].flagged >= 1
    assert {d.site for d in hit.detections} == {"blocks.0.fc2"}
    assert hit.rolled_back_to == 4  # snapshots every 2 steps
    assert all(o.screen is None and o.stepped for o in outcomes[6:])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_legitimately_spiky_clean_step_is_a_screen_miss_and_changes_nothing() -> None:
    torch.manual_seed(0)
    base = MLP()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 16, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(10)]
    batches[7] = (batches[7][0] * 300.0, batches[7][1])  # an outlier batch: real data, huge gradients

    registry = CollectorRegistry()

    def run(guarded: bool) -> tuple[torch.nn.Module, list, Screened]:
        model = MLP()
        model.load_state_dict(base.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        sampler = Screened(warmup=3)
        outcomes = []
        with sdc_guard.protect(model, sampler=sampler, metrics=GuardMetrics(registry, rank=0)) if guarded else \
                contextlib.nullcontext() as guard:
            for x, y in batches:
                def closure() -> torch.Tensor:
                    opt.zero_grad(set_to_none=True)
                    loss = F.mse_loss(model(x), y)
                    loss.backward()
                    return loss
                if guarded:
                    outcomes.append(guard.optimizer_step(opt, closure))
                else:
                    closure()
                    opt.step()
        return model, outcomes, sampler

    reference, _, _ = run(guarded=False)
    model, outcomes, sampler = run(guarded=True)
    spike = outcomes[7]
    assert spike.report.gradient_ratio > sampler.factor and spike.report.gradient_screen_tripped
    assert (spike.screen, spike.classification, spike.action, spike.stepped) == ("miss", None, None, True)
    assert len(spike.reruns) == 1 and spike.reruns[0].flagged == 0 and spike.reruns[0].verified == 5
    assert [o.screen for i, o in enumerate(outcomes) if i != 7] == [None] * 9
    assert (sampler.trips, sampler.misses) == (1, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    value = lambda name, **labels: registry.get_sample_value(name, {"rank": "0", **labels})  # noqa: E731
    assert value("sdc_guard_gradient_screen_trips_total") == value("sdc_guard_gradient_screen_misses_total") == 1
    assert value("sdc_guard_reexecutions_total") == 1 and value("sdc_guard_flagged_steps_total") == 0
    assert all(value("sdc_guard_detections_total", classification=c) == 0 for c in sdc_guard.respond.policy.CLASSIFICATIONS)
    assert value("sdc_guard_screen_misses_total") == 0  # the GEMM screen's own misses: another thing


def test_screened_detection_is_exported_as_a_trip_and_a_transient_detection() -> None:
    registry = CollectorRegistry()
    fault = GemmFault(site="blocks.0.fc1", phase="forward", step=6, bit=30, element=(3, 5))
    screened_train(make_model(), 8, faults=(fault,), metrics=GuardMetrics(registry, rank=0))
    value = lambda name, **labels: registry.get_sample_value(name, {"rank": "0", **labels})  # noqa: E731
    assert value("sdc_guard_steps_total") == 8 and value("sdc_guard_gradient_screen_trips_total") == 1
    assert value("sdc_guard_gradient_screen_misses_total") == 0 and value("sdc_guard_reexecutions_total") == 1
    assert value("sdc_guard_detections_total", classification="transient") == 1
    assert value("sdc_guard_responses_total", action="recompute") == 1
    assert value("sdc_guard_gradient_screen_ratio") < 10


def test_screen_with_a_budget_beside_it_verifies_the_budget_s_sweeps() -> None:
    model = make_model()
    outcomes, intercepting, sampler = screened_train(model, 5, sampler=Screened(Budget(0.05, window=3)))
    reports = [o.report for o in outcomes]
    assert reports[0].verified == reports[0].seen > 0 and reports[1].verified > 0  # Budget's warm-up sweeps
    assert all(r.gradient_screened for r in reports) and sampler.trips == 0
    # the warm-up sweeps are intercepted; step 1 runs its closure bare first (a calibration replay)
    assert intercepting[:3] == [True, False, True]
    state = sampler.state_dict()
    again = Screened(Budget(0.05, window=3))
    again.load_state_dict(state)
    assert again.state_dict() == state


@pytest.mark.parametrize("kwargs, error, message", [
    ({"factor": 1.0}, ValueError, "factor: expected a number > 1"),
    ({"factor": "10"}, TypeError, "factor: expected a number > 1 .* got str '10'"),
    ({"smoothing": 0.0}, ValueError, "smoothing: expected a number in \\(0, 1\\]"),
    ({"warmup": -1}, ValueError, "warmup: expected a non-negative int .* got -1"),
    ({"background": "Budget"}, TypeError, "background: expected a sampler object"),
    ({"background": Screened()}, TypeError, "background: .* got another Screened"),
])
def test_bad_arguments_name_the_argument(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        Screened(**kwargs)


@pytest.mark.corpus  # two gloo processes (about 5 s): CONTRIBUTING.md
@pytest.mark.slow  # multi-process: `pytest -m "not slow"` skips it (CONTRIBUTING.md)
def test_distributed_screen_trips_and_re_executes_in_lockstep(tmp_path: Path) -> None:
    import json
    import socket

    import torch.multiprocessing as mp

    import ddp_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ddp_worker.run, args=(2, port, "screened", str(tmp_path)), nprocs=2, join=True)
    params = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*params))
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text())["outcomes"] for r in range(2)]
    assert summaries[0] == summaries[1]  # the same verdict and response on every rank
    tripped = [(o["step"], o["tripped_ranks"], o["screen"], o["classification"], o["action"], o["reruns"])
               for o in summaries[0] if o["tripped_ranks"]]
    assert tripped == [(3, [0, 1], "transient", "transient", "recompute", 1)]  # DDP averaged the fault into both
    assert all(o["flagged_ranks"] == [] and o["stepped"] for o in summaries[0])


def test_steps_closed_without_optimizer_step_are_not_screened_and_say_so() -> None:
    model = MLP()
    with pytest.warns(RuntimeWarning, match="only guard.optimizer_step.* runs the screen"):
        with sdc_guard.protect(model, sampler=Screened()) as guard:
            model(torch.randn(4, 16)).sum().backward()
    report = guard.last_report
    assert report is not None and not report.gradient_screened and report.verified == 0


def test_a_screen_that_fails_warns_once_and_training_goes_on() -> None:
    class Broken(Screened):
        """A screen whose statistic cannot be computed (a gradient layout it does not know)."""

        def screen_gradients(self, grads):
            raise RuntimeError("unsupported gradient layout")

    reference = make_model()
    unguarded_train(reference, 3)
    model = make_model()
    with pytest.warns(RuntimeWarning, match="could not screen the gradients .*unsupported gradient layout") as caught:
        outcomes, _, _ = screened_train(model, 3, sampler=Broken())
    assert len([w for w in caught if "could not screen" in str(w.message)]) == 1
    assert all(o.stepped and not o.report.gradient_screened and o.screen is None for o in outcomes)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(reference)))


# --- the per-layer statistics ------------------------------------------------------------------

def real_gradients(steps: int) -> list[list[torch.Tensor]]:
    """The gradients of the first ``steps`` real training steps of the tiny GPT (Adam, lr
    1e-2), from one run shared by the tests (each gets its own lists; nothing writes the
    tensors in place)."""
    history = _training_gradients()
    assert steps <= len(history), steps
    return [list(grads) for grads in history[:steps]]


@functools.cache
def _training_gradients(steps: int = 40) -> tuple[tuple[torch.Tensor, ...], ...]:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    for step in range(steps):
        closure_for(model, opt, step)()
        grads.append(tuple(p.grad.detach().clone() for p in model.parameters()))
        opt.step()
    return tuple(grads)


def test_a_layer_spike_within_the_factor_trips_the_per_layer_test_and_names_the_layer() -> None:
    history = real_gradients(30)
    per_layer, one_factor = Screened(), Screened(sigmas=float("inf"))
    for grads in history[:-1]:
        for s in (per_layer, one_factor):
            s.begin_step(0)
            assert not s.screen_gradients(grads).tripped
    spiked = [g * 4 if i == 5 else g for i, g in enumerate(history[-1])]  # one layer's gradient 4x: under factor 10
    seen = per_layer.screen_gradients(spiked)
    assert seen.tripped and seen.worst_parameter == 5 and seen.worst_sigmas > per_layer.sigmas
    assert 3.5 < seen.worst_ratio < per_layer.factor
    assert not one_factor.screen_gradients(spiked).tripped  # the previous screen's single test lets it by
    assert not per_layer.screen_gradients(history[-1]).tripped  # the tripped step was not absorbed


def test_a_lasting_change_of_scale_trips_once_then_is_learnt() -> None:
    history = real_gradients(40)
    screen = Screened()
    for grads in history[:20]:
        assert not screen.screen_gradients(grads).tripped
    trips = 0
    for grads in history[20:]:
        seen = screen.screen_gradients([g * 30 if i == 3 else g for i, g in enumerate(grads)])
        if seen.tripped:
            trips += 1
            screen.resolve_screen("miss")  # its verified re-execution was identical: legitimate
    assert 1 <= trips <= 2 and screen.misses == trips


def test_a_gradient_that_is_all_zero_neither_trips_nor_is_learnt() -> None:
    history = real_gradients(25)
    screen = Screened()
    for step, grads in enumerate(history):
        # parameter 2 gets no gradient on odd steps (an expert no token was routed to)
        seen = screen.screen_gradients([torch.zeros_like(g) if i == 2 and step % 2 else g for i, g in enumerate(grads)])
        assert not seen.tripped
    assert screen.state_dict()["statistics"]["counts"][2] == 13  # the 13 even steps only


def test_statistics_survive_a_checkpoint_and_an_old_single_reference_loads() -> None:
    history = real_gradients(16)
    screen = Screened()
    for grads in history[:-1]:
        screen.screen_gradients(grads)
    state = screen.state_dict()
    again = Screened()
    again.load_state_dict(state)
    assert again.state_dict() == state
    spiked = [g * 5 if i == 7 else g for i, g in enumerate(history[-1])]
    assert again.screen_gradients(spiked) == screen.screen_gradients(spiked)
    old = {k: v for k, v in state.items() if k != "statistics"} | {
        "reference": [float(g.norm()) for g in history[5]]}  # what a checkpoint of the previous version holds
    legacy = Screened(warmup=3)
    legacy.load_state_dict(old)
    assert legacy.warming_up  # the typical norms carry over, the spreads are learnt anew
    assert [legacy.screen_gradients(g).tripped for g in history[6:9]] == [False] * 3 and not legacy.warming_up
    assert legacy.screen_gradients([g * 1e3 if i == 0 else g for i, g in enumerate(history[9])]).tripped


@pytest.mark.parametrize("kwargs, error, message", [
    ({"sigmas": 0}, ValueError, r"sigmas: expected a number > 0, or math.inf .* got 0"),
    ({"sigmas": "6"}, TypeError, r"sigmas: expected .* got str '6'"),
    ({"min_spread": 0.0}, ValueError, r"min_spread: expected a number > 0 .* got 0.0"),
    ({"min_spread": float("inf")}, ValueError, r"min_spread: expected .* got inf"),
    ({"factor": float("inf")}, ValueError, r"factor: expected a number > 1 .* got inf"),
])
def test_bad_statistics_arguments_name_the_argument(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        Screened(**kwargs)


@pytest.mark.corpus  # 120 steps of three copies of the toy GPT (about 50 s): CONTRIBUTING.md
@pytest.mark.slow  # 120 steps of the toy GPT, three copies (sdc_guard.tools.training_runs)
def test_clean_training_through_warm_up_and_learning_rate_spikes_re_executes_at_most_a_step() -> None:
    from sdc_guard.tools.bench_models import build
    from sdc_guard.tools.training_runs import Copy, default_schedule

    work = build("toy:64/64/8/2/3e-3", seed=0)
    schedule = default_schedule(work, 120)  # warm-up over 12 steps, 5x at step 48 for 3, 10x at step 84
    plain = Copy(work, schedule, "fp32", None)
    guarded = Copy(work, schedule, "fp32", Screened())
    outcomes = []
    for step in range(120):
        plain.step(step)
        outcomes.append(guarded.step(step))
    tripped = [o.report.step for o in outcomes if o.tripped_ranks]
    assert len(tripped) <= 1 and all(o.screen == "miss" for o in outcomes if o.tripped_ranks)
    assert not any(o.detected for o in outcomes)
    assert max(o.report.gradient_sigmas for o in outcomes if not o.tripped_ranks) < 6
    assert all(torch.equal(a, b) for a, b in zip(guarded.params(), plain.params()))  # misses change nothing
