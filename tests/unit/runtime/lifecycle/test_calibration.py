"""The guard's whole cost: calibration replays (when they run, what they charge, that they
change nothing), unwatched steps that install nothing, and Budget charging what it
measured. Structure only: no assertion on how long anything took."""


import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode


import sdc_guard  # noqa: E402
from sdc_guard import Policy  # noqa: E402
from sdc_guard.runtime.lifecycle.calibration import Calibration, Pair, calibration_of  # noqa: E402
from sdc_guard.runtime.sampling import Budget, EveryN, StepCosts  # noqa: E402
from models import BNNet, bn_batch, state_copy  # noqa: E402


def _train(steps: int, *, calibrate_every: int | None, sampler=None, policy: Policy | None = None,
           seen: list | None = None) -> tuple[BNNet, torch.optim.Optimizer, list, list[int]]:
    """BNNet (BatchNorm, dropout) trained through ``optimizer_step``; returns the model, its
    optimizer, the outcomes and how many times each step's closure ran. ``seen``: per
    closure call, (step, a dispatch mode on, module hooks on the model, optimizer hooks)."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    outcomes, calls = [], []
    with sdc_guard.protect(model, sampler=sampler, policy=policy, calibrate_every=calibrate_every) as guard:
        for step in range(steps):
            x, y = bn_batch(step)
            calls.append(0)

            def closure() -> torch.Tensor:
                calls[-1] += 1
                if seen is not None:
                    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
                    optimizer_hooks = len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks)
                    seen.append((step, _get_current_dispatch_mode() is not None, hooks, optimizer_hooks))
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss

            outcomes.append(guard.optimizer_step(opt, closure))
    return model, opt, outcomes, calls


def test_replays_run_on_watched_steps_1_2_4_8_16_and_every_nth_and_are_charged() -> None:
    _, _, outcomes, calls = _train(10, calibrate_every=3)
    replayed = [o.report.step for o in outcomes if o.report.calibration_seconds > 0]
    assert replayed == [1, 2, 3, 4, 6, 8, 9]
    assert calls == [2 if step in replayed else 1 for step in range(10)]  # one bare run more, no other
    for o in outcomes:
        r = o.report
        # the replay is part of the guard's cost, inside guard_seconds, and so in overhead
        assert r.guard_seconds >= r.calibration_seconds
        assert r.overhead == pytest.approx(r.guard_seconds / (r.step_seconds - r.guard_seconds))
        assert r.interception_estimate_seconds > 0 and r.intercepted_ops > 0
    first = outcomes[0].report  # nothing measured yet: the per-op estimate, and said so
    assert not first.overhead_calibrated and first.interception_factor is None
    assert first.interception_seconds == first.interception_estimate_seconds
    for o in outcomes[1:]:  # from the first replay on, every report applies the measured factor
        r = o.report
        assert r.overhead_calibrated and r.interception_factor is not None and r.interception_factor >= 0
        # the factor times the estimate, cut only where it would leave the step less time than
        # its fastest bare run (a factor from a disturbed pool)
        assert 0 <= r.interception_seconds <= r.interception_factor * r.interception_estimate_seconds + 1e-12
        assert r.guard_seconds >= r.interception_seconds + r.calibration_seconds
    fresh = BNNet()  # the calibration lives with the model: another model starts its own
    assert (calibration_of(fresh, 3).replays, calibration_of(fresh, 3).factor) == (0, None)


def test_a_run_with_calibration_replays_ends_bit_identical_to_one_without() -> None:
    """Dropout draws and BatchNorm statistics in every step: a replay that left either
    moved would show in the weights, the buffers, the optimizer state or the generator."""
    with_replays, opt_a, outcomes_a, calls_a = _train(6, calibrate_every=1)
    rng_a = torch.get_rng_state()
    without, opt_b, outcomes_b, calls_b = _train(6, calibrate_every=None)
    rng_b = torch.get_rng_state()
    assert sum(calls_a) == 6 + 5 and sum(calls_b) == 6  # every watched step but the first replayed
    a, b = state_copy(with_replays), state_copy(without)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert int(with_replays.bn.num_batches_tracked) == 6
    for pa, pb in zip(with_replays.parameters(), without.parameters()):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq"))
    assert [float(o.loss.detach()) for o in outcomes_a] == [float(o.loss.detach()) for o in outcomes_b]
    assert torch.equal(rng_a, rng_b)
    assert not any(o.report.overhead_calibrated for o in outcomes_b)  # never replayed: an estimate


def test_the_users_state_is_put_back_after_a_replay() -> None:
    """Policy(save_state, restore_state): what the closure changes of the user's own state
    is restored after the bare run, as before a re-execution."""
    counter = {"n": 0}
    policy = Policy(save_state=lambda: dict(counter), restore_state=lambda s: counter.update(s))

    def bump(module, args):
        counter["n"] += 1

    torch.manual_seed(0)
    model = BNNet()
    model.fc1.register_forward_pre_hook(bump)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    with sdc_guard.protect(model, policy=policy, calibrate_every=1) as guard:
        for step in range(4):
            x, y = bn_batch(step)

            def closure() -> torch.Tensor:
                calls.append(step)
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss

            guard.optimizer_step(opt, closure)
    assert calls == [0, 1, 1, 2, 2, 3, 3]  # steps 1-3 ran twice: bare, then guarded
    assert counter["n"] == 4  # one forward per step counted, although steps 1-3 ran two


def test_unwatched_steps_install_no_mode_no_hooks_capture_nothing_and_never_replay() -> None:
    """EveryN(3) watches steps 0, 3, 6: the closures of the others run with no dispatch
    mode, no module hooks, no optimizer-step hooks, and the re-execution state (here the
    user's) is not captured for them."""
    saved = []
    policy = Policy(save_state=lambda: saved.append(1), restore_state=lambda s: None)
    seen: list = []
    _, _, outcomes, calls = _train(8, calibrate_every=1, sampler=EveryN(3), policy=policy, seen=seen)
    watched = [o.report.step for o in outcomes if o.report.watched]
    assert watched == [0, 3, 6]
    guarded = [s for s in seen if s[0] in watched and s[1]]
    assert len(guarded) == 3 and all(hooks > 0 and optimizer_hooks > 0 for _, _, hooks, optimizer_hooks in guarded)
    unwatched = [s for s in seen if s[0] not in watched]
    assert len(unwatched) == 5 and all(s[1:] == (False, 0, 0) for s in unwatched), unwatched
    assert len(saved) == len(watched)  # captured for watched steps only
    # the replays: watched steps 1 and 2 (steps 3 and 6), never an unwatched one
    assert [o.report.step for o in outcomes if o.report.calibration_seconds > 0] == [3, 6]
    assert calls == [2 if step in (3, 6) else 1 for step in range(8)]
    bare = [s for s in seen if s[0] in watched and not s[1]]
    assert [s[0] for s in bare] == [3, 6] and all(s[2] == 0 for s in bare)  # the bare runs: no module hooks
    # an unwatched step intercepts nothing of its own: what it carries is the end of the
    # watched step before it (step 1: the optimizer's first step, run under the mode after
    # step 0 closed to learn that it runs no GEMM; steps 4 and 7: the optimizer's
    # record_function exit, after the mode came back), and once calibrated, its report is
    # the whole cost
    quiet = [o.report for o in outcomes if not o.report.watched and o.report.step != 1]
    assert [r.step for r in quiet] == [2, 4, 5, 7]
    assert [r.intercepted_ops for r in quiet] == [0, 1, 0, 1] and all(r.overhead_calibrated for r in quiet)


def test_no_replay_under_a_fault_drill() -> None:
    """A drill's mode would see the bare run too: steps under another mode are not replayed."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sdc_guard.drill(model), sdc_guard.protect(model, calibrate_every=1) as guard:
        for step in range(4):
            x, y = bn_batch(step)
            report = guard.optimizer_step(opt, lambda: F.cross_entropy(model(x), y).backward()).report
            assert report.calibration_seconds == 0 and not report.overhead_calibrated


def test_calibration_pools_pairs_and_its_schedule() -> None:
    c = Calibration(every=4)
    assert [c.due() for _ in range(21)] == [i in (1, 2, 4, 8, 12, 16, 20) for i in range(21)]
    assert [i for i in range(300) if Calibration(every=100).picks(i)] == [1, 2, 4, 8, 16, 100, 200]
    assert c.factor is None and c.floor == 0.0
    c.add(Pair(bare=1.0, guarded=2.0, measured=0.2, estimate=0.4))  # residual 0.8: 2x the estimate
    c.add(Pair(bare=1.1, guarded=1.5, measured=0.2, estimate=0.4))  # residual 0.2: 0.5x
    assert c.factor == pytest.approx((2.0 + 0.5) / 2) and c.floor == 1.0  # the first two: all there is
    c.add(Pair(bare=1.0, guarded=1.8, measured=0.2, estimate=0.4))  # 1.5x
    assert c.factor == pytest.approx(1.5)  # from the third on, the first two are left out
    c.add(Pair(bare=1.0, guarded=1.4, measured=0.2, estimate=0.4))  # 0.5x
    c.add(Pair(bare=1.0, guarded=9.0, measured=0.2, estimate=0.4))  # a preempted guarded run: 19.5x
    assert c.factor == pytest.approx(1.5)  # the median does not follow it
    for _ in range(10):
        c.add(Pair(bare=1.0, guarded=1.0, measured=0.1, estimate=0.4))  # noise: negative residuals
    assert len(c.pairs) == 8 and c.factor == 0.0  # the last 8 only, floored at 0
    assert Calibration(every=None).due() is False
    with pytest.raises(ValueError, match="calibrate_every: expected a positive int"):
        sdc_guard.protect(BNNet(), calibrate_every=0)


def test_a_models_first_two_replays_are_left_out_of_its_factor_once_a_later_one_is_there() -> None:
    """A model's first bare runs pay one-off costs (bench train: 270-350 ms against 195-235
    later), so their pairs' residuals come out too small, often negative; pooled, they held
    the factor at 0. They stand in only until a later pair is there. Left out by rank, not
    by time: a later pair whose bare run is long (a longer batch) is as good as any."""
    c = Calibration(every=4)
    c.add(Pair(bare=1.6, guarded=1.1, measured=0.0, estimate=0.01))  # the first: residual -0.5
    assert c.factor == 0.0  # alone, it is all there is (floored at 0)
    c.add(Pair(bare=1.3, guarded=1.2, measured=0.0, estimate=0.01))  # the second: residual -0.1
    assert c.usable() == c.early and c.factor == 0.0
    c.add(Pair(bare=1.0, guarded=1.1, measured=0.0, estimate=0.01))  # residual 0.1: 10x
    assert c.usable() == [c.pairs[0]] and c.factor == pytest.approx(10.0)
    c.add(Pair(bare=2.0, guarded=2.16, measured=0.0, estimate=0.01))  # a longer batch: 16x, kept
    c.add(Pair(bare=1.0, guarded=1.12, measured=0.0, estimate=0.01))  # 12x
    assert len(c.usable()) == 3 and c.factor == pytest.approx(12.0)
    assert c.floor == 1.0 and c.replays == 5


def test_a_pair_timed_in_cpu_time_ignores_a_preempted_run() -> None:
    """A pair with the thread's CPU time: its residual is taken there, the guard's own
    (wall) timings brought to that clock by the guarded run's CPU share, so a run another
    process preempted (twice the wall time, the same CPU time) leaves it where it was;
    ``Calibration.cpu`` says which clock the factor is in."""
    quiet = Pair(bare=1.0, guarded=1.6, measured=0.4, estimate=0.1, bare_cpu=1.0, guarded_cpu=1.6)
    preempted = Pair(bare=1.0, guarded=3.2, measured=0.8, estimate=0.1, bare_cpu=1.0, guarded_cpu=1.6)
    assert quiet.residual == pytest.approx(0.2) and preempted.residual == pytest.approx(0.2)
    assert Pair(bare=1.0, guarded=3.2, measured=0.8, estimate=0.1).residual == pytest.approx(1.4)  # wall only
    c = Calibration(every=4)
    c.add(preempted)
    assert c.cpu and c.factor == pytest.approx(2.0)
    c.add(Pair(bare=1.0, guarded=1.6, measured=0.4, estimate=0.1))
    assert not c.cpu


def test_replays_on_one_cpu_thread_are_timed_in_cpu_time_and_reported_in_wall_time() -> None:
    """A CPU model on one intra-op thread replays with the thread's CPU time as well
    (``calibration.thread_clock``); with more threads wall time alone. The report brings
    the factor to its step's wall time: never below the calibration's own."""
    threads = torch.get_num_threads()
    try:
        for n, cpu in ((1, True), (2, False)):
            torch.set_num_threads(n)
            model, _, outcomes, _ = _train(3, calibrate_every=1)  # a replay on every step from the second
            calibration = calibration_of(model, 1)
            pooled = calibration.early + list(calibration.pairs)
            assert len(pooled) == 2 and all(p.cpu is cpu for p in pooled)
            assert calibration.cpu is cpu
            last = outcomes[-1].report
            assert last.overhead_calibrated
            if cpu:  # the step's wall time over its CPU time, at least 1
                assert last.interception_factor >= calibration.factor
            else:
                assert last.interception_factor == calibration.factor
    finally:
        torch.set_num_threads(threads)


def test_budget_plans_and_charges_the_whole_measured_cost_of_a_sweep() -> None:
    """Exact costs (no clock). A sweep verifies for 0.02 s but costs 0.10 s in all (the
    mode's interception), on a 0.10 s step: the budget must space sweeps by the whole cost
    (one in about 10 steps at 10 %), not by verification (one in 2), and charge each
    what it took, a calibration replay included."""
    site = ("fc", "forward", "mm")
    base, verify, whole, replay = 0.100, 0.020, 0.100, 0.100
    sampler = Budget(0.1, warmup=1)
    sampler.begin_step(0)
    # the warm-up step: the guard's own account (calibrated) is the whole sweep cost
    sampler.end_step(StepCosts(0, base + whole, verify, {site: verify}, {site: 1}, whole))
    watched = []
    charged_replay = None
    for step in range(1, 201):
        sampler.begin_step(step)
        if sampler.watches_step():
            watched.append(step)
            extra = replay if len(watched) == 3 else 0.0  # one sweep also ran a calibration replay
            before = sampler._charged_total
            sampler.end_step(StepCosts(step, base + whole + extra, verify, {site: verify}, {site: 1},
                                       whole + extra, extra))
            if extra:
                charged_replay = sampler._charged_total - before
        else:
            sampler.end_step(StepCosts(step, base, 0.0))
    gaps = [b - a for a, b in zip(watched, watched[1:])]
    assert min(gaps) >= 9, gaps  # whole cost 1.0 step at 0.1 a step: ten steps apart, not two
    assert charged_replay == pytest.approx(whole + replay)  # the replay is charged where it ran
    # long run: the charge (replay included) at the budget
    assert abs(sampler.achieved_overhead - 0.1) < 0.015, sampler.achieved_overhead
    assert not Budget(0.1, window=20).window_bound


def test_budget_window_wins_and_says_so() -> None:
    """A sweep costing a whole step with window=5 at a 5 % budget: the window forces a
    sweep every 5 steps (20 %), ``window_bound`` and ``achieved_overhead`` say so."""
    site = ("fc", "forward", "mm")
    sampler = Budget(0.05, window=5, warmup=1)
    sampler.begin_step(0)
    sampler.end_step(StepCosts(0, 0.2, 0.02, {site: 0.02}, {site: 1}, 0.1))
    for step in range(1, 41):
        sampler.begin_step(step)
        if sampler.watches_step():
            sampler.end_step(StepCosts(step, 0.2, 0.02, {site: 0.02}, {site: 1}, 0.1))
        else:
            sampler.end_step(StepCosts(step, 0.1, 0.0))
    assert sampler.window_bound and sampler.achieved_overhead > 0.15
    state = sampler.state_dict()
    other = Budget(0.05, window=5, warmup=1)
    other.load_state_dict(state)
    assert other.state_dict() == state



def test_budget_sweeps_only_once_an_unwatched_step_has_measured_the_base() -> None:
    """After warm-up, the base is only the guard's account (step less what it said it
    added); a sweep waits for an unwatched step to measure it, whatever the credit."""
    site = ("fc", "forward", "mm")
    sampler = Budget(10.0, warmup=1)  # credit for a sweep every step
    sampler.begin_step(0)
    sampler.end_step(StepCosts(0, 0.2, 0.01, {site: 0.01}, {site: 1}, 0.02))
    watched = []
    for step in range(1, 6):
        sampler.begin_step(step)
        watched.append(sampler.watches_step())
        if watched[-1]:
            sampler.end_step(StepCosts(step, 0.2, 0.01, {site: 0.01}, {site: 1}, 0.02))
        else:
            sampler.end_step(StepCosts(step, 0.1, 0.0))
    assert watched == [False, True, True, True, True]


class _CountingBudget(Budget):
    """Budget, counting its begin_step calls per step number."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.begun: list[int] = []

    def begin_step(self, step: int) -> None:
        self.begun.append(step)
        super().begin_step(step)


@pytest.mark.parametrize("new_guard_each_step", [False, True])
def test_a_sampler_begins_each_step_once_with_one_block_per_step(new_guard_each_step: bool) -> None:
    """optimizer_step opens the next step ahead (begin_step), the block's exit drops it
    unreported, the next block opens it again: the sampler must not begin it twice, or
    Budget earns its credit twice per step (and spent twice its budget)."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = _CountingBudget(0.05, warmup=1)
    guard = sdc_guard.protect(model, sampler=sampler)
    for step in range(6):
        x, y = bn_batch(step)
        if new_guard_each_step:
            guard = sdc_guard.protect(model, sampler=sampler)
        with guard:
            guard.optimizer_step(opt, lambda: F.cross_entropy(model(x), y).backward())
    assert sampler.begun == list(range(7))  # step 6: opened ahead by the last optimizer_step
