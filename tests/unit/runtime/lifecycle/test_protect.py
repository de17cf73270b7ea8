"""protect(model): interception, attribution, reports, samplers, weight-side cache."""

import contextlib
import dataclasses
import time
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker


import sdc_guard  # noqa: E402
from models import MLP, TinyGPT, lm_batch  # noqa: E402
from sdc_guard.core.abft import vabft_check  # noqa: E402
from sdc_guard.runtime.sampling import Budget, EveryN, Full, Rate, Rotating  # noqa: E402


def _turn_on_high_bit(out: torch.Tensor, index: tuple[int, ...]) -> None:
    bits = out.view(torch.int32)
    value = int(bits[index])
    bits[index] = value | (1 << next(b for b in (30, 29, 28) if not (value >> b) & 1))


class FlipAtCall(TorchDispatchMode):
    """Test-local injector: turn on the highest exponent bit that is off in one fp32
    element of the ``call``-th ``op`` call. Entered *before* protect() so the guard sees
    the corrupted output."""

    def __init__(self, op: str, call: int, index: tuple[int, ...] = (0, 0)) -> None:
        super().__init__()
        self.op, self.call, self.index, self.count, self.fired = op, call, index, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket).split(".")[-1] == self.op:
            if self.count == self.call:
                _turn_on_high_bit(out, self.index)
                self.fired = True
            self.count += 1
        return out


class FlipInModule(TorchDispatchMode):
    """Test-local injector: corrupt the first GEMM run inside module ``name`` (an
    independent ModuleTracker decides where we are)."""

    GEMMS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self, name: str, index: tuple[int, ...]) -> None:
        super().__init__()
        self.name, self.index, self.fired = name, index, None
        self.tracker = ModuleTracker()

    def __enter__(self):
        self.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = str(func.overloadpacket).split(".")[-1]
        if self.fired is None and op in self.GEMMS and any(p.endswith("." + self.name) for p in self.tracker.parents):
            _turn_on_high_bit(out, self.index)
            self.fired = op
        return out


def train_steps(model, steps, *, guard_kwargs=None, per_step_blocks=True, lr=1e-2):
    """Train ``model`` on deterministic LM batches under protect(); returns the reports."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    reports = []
    kwargs = guard_kwargs or {}
    for step in range(steps):
        x, y = lm_batch(step)
        with sdc_guard.protect(model, **kwargs) as guard:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        reports.append(guard.last_report)
    return reports


def test_mlp_counts_gemms_per_phase_and_flags_none() -> None:
    torch.manual_seed(0)
    model = MLP()
    with sdc_guard.protect(model) as guard:
        model(torch.randn(8, 16)).pow(2).sum().backward()
    r = guard.last_report
    assert (r.seen, r.verified, r.flagged, r.detections) == (5, 5, 0, [])
    forward = sum(c.verified for (op, phase, _), c in r.by_kind.items() if phase == "forward")
    backward = sum(c.verified for (op, phase, _), c in r.by_kind.items() if phase == "backward")
    assert (forward, backward) == (2, 3)
    assert r.by_kind[("addmm", "forward", "float32")].verified == 2
    assert r.by_kind[("mm", "backward", "float32")].verified == 3
    assert r.verify_seconds > 0 and r.step_seconds > r.verify_seconds
    # both over the step without the guard
    assert r.verify_overhead == pytest.approx(r.verify_seconds / (r.step_seconds - r.guard_seconds))
    # the whole cost: verification, the hooks' bookkeeping, and a round trip per intercepted op
    assert r.intercepted_ops > r.seen and r.step_seconds > r.guard_seconds > r.verify_seconds
    assert r.overhead == pytest.approx(r.guard_seconds / (r.step_seconds - r.guard_seconds))
    # an observation-only block has no closure to replay: its interception is the estimate
    assert not r.overhead_calibrated and r.interception_factor is None and r.calibration_seconds == 0
    assert r.interception_seconds == r.interception_estimate_seconds > 0


def test_the_work_between_steps_is_in_the_next_report() -> None:
    """After an optimizer step the guard re-encodes the updated weights, outside any open
    step (and, with one ``protect()`` block per step, outside any block). That work is
    the guard's cost and must appear in the next report's ``guard_seconds``: at least the
    time the re-encoding took, timed around the guard's own call (one 4096x2048 weight, so
    that it is not lost in the noise of the step's own verification). Once the model's
    blocks are seen to end right after the optimizer step, the re-encoding is left to the
    next block's first GEMM (its activation would make an encoding made now stale)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 2048)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1, 4096)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    refreshes: list[float] = []  # each block's re-encoding outside its step (after the optimizer's)
    encodes: list[int] = []  # each block's encodings of the weight, in a step or not

    def timed(guard, refresh):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return refresh(*args, **kwargs)
            finally:
                if not guard.step_open:
                    refreshes[-1] += time.perf_counter() - t0
        return run

    reports = []
    for _ in range(3):  # one block per step, as a loop that wraps only its step would
        refreshes.append(0.0)
        with sdc_guard.protect(model) as guard:
            guard.cache.refresh = timed(guard, guard.cache.refresh)  # the real re-encoding, timed from outside
            reports.append(guard.optimizer_step(opt, closure).report)
        encodes.append(guard.cache.stats.misses)
    assert refreshes[0] > 1e-4  # a 4096x2048 weight re-encoded after the first optimizer step
    assert refreshes[1:] == [0.0, 0.0]  # then left to the next block, whose activation makes it stale
    assert encodes == [2, 1, 1]  # the first block's step and its re-encoding; then one per step
    # the later reports carry at least the re-encoding after the step before them
    assert reports[1].carried_seconds >= refreshes[0], ([r.carried_seconds for r in reports], refreshes)
    for report in reports[1:]:
        assert report.guard_seconds >= report.carried_seconds + report.verify_seconds
        assert report.step_seconds > report.guard_seconds


def test_a_long_lived_block_re_encodes_right_after_each_optimizer_step() -> None:
    """Per-step blocks leave the re-encoding after an optimizer step to the next GEMM;
    a long-lived block on the same model goes back to re-encoding right after each
    optimizer step (before the next batch is loaded) once its first step shows that the
    block goes on: the window a weight corrupted at rest could slip through stays closed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 64)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    with sdc_guard.protect(model) as guard:  # a block that ends right after its step
        guard.optimizer_step(opt, closure)
    misses = []
    with sdc_guard.protect(model) as guard:
        for _ in range(3):
            guard.optimizer_step(opt, closure)
            misses.append(guard.cache.stats.misses)  # encodings made so far, the step's and after it
    # first step: its first GEMM encodes, the re-encoding after it waits (the last block ended
    # there); second: that re-encoding at its first GEMM, then right after its optimizer step
    assert misses == [1, 3, 4]


def test_transformer_trains_clean_then_catches_a_flip_with_site_and_phase() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    reports = train_steps(model, 3)
    assert all(r.flagged == 0 and r.verified == r.seen > 0 for r in reports)
    assert reports[0].step + 2 == reports[2].step  # per-step blocks number steps in order
    # step 3: flip a bit in the output of block 0's attention projection
    x, y = lm_batch(3)
    fault = FlipInModule("blocks.0.attn.proj", index=(5, 3))
    with fault, sdc_guard.protect(model) as guard:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    assert fault.fired
    r = guard.last_report
    assert r.step == reports[-1].step + 1
    assert r.flagged == 1
    (d,) = r.detections
    assert (d.site, d.phase, d.op, d.rows, d.segments) == ("blocks.0.attn.proj", "forward", fault.fired, [5], [0])
    assert d.ratio > 1


def test_backward_gemm_fault_is_attributed_to_backward() -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 16)
    fault = FlipAtCall("mm", call=0, index=(1, 2))  # the first backward mm: fc2's grad products
    with fault, sdc_guard.protect(model) as guard:
        model(x).pow(2).sum().backward()
    (d,) = guard.last_report.detections
    assert (d.site, d.phase, d.op) == ("fc2", "backward", "mm")


def _sites_by_phase(guard) -> dict[str, set[tuple[str, str]]]:
    out: dict[str, set[tuple[str, str]]] = {"forward": set(), "backward": set()}
    for site, phase, op in guard.ledger.sites_seen:
        out[phase].add((site, op.replace("addmm", "mm")))
    return out


@pytest.mark.parametrize("checkpointed", [False, True])
def test_every_backward_gemm_is_attributed_to_its_forward_module(checkpointed: bool) -> None:
    """Backward GEMMs take the site of the forward op whose gradient they compute, also
    when activation checkpointing recomputes the forward inside the backward."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    if checkpointed:
        model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
    x, y = lm_batch(0)
    with sdc_guard.protect(model) as guard:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        sites = _sites_by_phase(guard)
    prefix = "blocks.0.inner." if checkpointed else "blocks.0."
    assert (prefix + "attn.qkv", "mm") in sites["forward"] and (prefix + "attn", "bmm") in sites["forward"]
    assert sites["backward"] - {(s, op) for s, op in sites["forward"]} == set()
    assert {s for s, _ in sites["forward"]} == {s for s, _ in sites["backward"]}  # every one, no "global"


def test_inference_mode_verifies_every_linear() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    x, _ = lm_batch(0)
    with torch.inference_mode(), sdc_guard.protect(model) as guard:
        model(x)
    r = guard.last_report
    linears = 4 * 2 + 1  # qkv, proj, fc1, fc2 per block + head
    assert r.by_kind[("linear", "forward", "float32")].verified == linears
    assert r.verified == r.seen == linears + 2 * 2  # + q@k^T and att@v per block
    with torch.no_grad(), sdc_guard.protect(model) as guard:
        model(x)
    assert guard.last_report.verified == guard.last_report.seen >= linears


def test_protect_leaves_outputs_and_gradients_bit_identical() -> None:
    def run(protected: bool):
        torch.manual_seed(0)
        model = TinyGPT()
        x, y = lm_batch(0)
        if protected:
            with sdc_guard.protect(model):
                out = model(x)
                F.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
        else:
            out = model(x)
            F.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out_a, grads_a = run(False)
    out_b, grads_b = run(True)
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(g, h) for g, h in zip(grads_a, grads_b))


def test_gemm_outside_modules_is_global_and_long_lived_block_steps() -> None:
    model = MLP()
    a, b = torch.randn(4, 8), torch.randn(8, 300)
    fault = FlipAtCall("mm", call=1, index=(2, 299))
    with fault, sdc_guard.protect(model) as guard:
        _ = a @ b
        first = guard.step()
        _ = a @ b
        second = guard.step()
    assert (first.flagged, second.flagged) == (0, 1)
    assert second.step == first.step + 1
    (d,) = second.detections
    assert (d.site, d.rows, d.segments) == ("global", [2], [1])
    assert guard.reports[-1] is second  # the empty trailing step leaves no report


def test_fused_attention_is_verified_and_math_backend_is_verified() -> None:
    q = k = v = torch.randn(2, 4, 8, 16)
    model = MLP()
    with sdc_guard.protect(model) as guard:
        F.scaled_dot_product_attention(q, k, v)
    r = guard.last_report
    assert r.verified == 1 and r.attention_checks == 1 and r.unverified_ops == {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), sdc_guard.protect(model) as guard:
        F.scaled_dot_product_attention(q, k, v)
    r = guard.last_report
    assert r.unverified_ops == {} and r.verified == 2


def test_weight_cache_hits_until_the_optimizer_updates_the_weight() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    with sdc_guard.protect(model) as guard:
        model(x).sum().backward()
        guard.step()
        misses = guard.cache.stats.misses
        assert misses == 3  # fc1.W.t(), fc2.W.t() forward; fc2.W in fc2's grad-input GEMM
        model(x).sum().backward()
        guard.step()
        assert guard.cache.stats.misses == misses and guard.cache.stats.hits == 3
        held = guard.cache.nbytes
        opt.step()
        model(x).sum().backward()
        guard.step()
        assert guard.cache.stats.misses == 2 * misses
        assert len(guard.cache) == 3 and guard.cache.nbytes == held  # new versions replaced the old
    w = model.fc1.weight
    a = torch.randn(5, 16)
    c = a @ w.t()
    cache = sdc_guard.runtime.checking.cache.WeightCache()
    cache.set_parameters([w])
    cached = vabft_check(a, w.t(), c, e_max=2e-5, weight=cache.get(w.t()))
    fresh = vabft_check(a, w.t(), c, e_max=2e-5)
    assert torch.equal(cached.diff, fresh.diff) and torch.equal(cached.threshold, fresh.threshold)


def test_cache_is_bounded_and_skips_non_parameters() -> None:
    params = [torch.nn.Parameter(torch.randn(256, 512)) for _ in range(4)]
    cache = sdc_guard.runtime.checking.cache.WeightCache(max_bytes=5000)  # an entry is ~2.1 kB
    cache.set_parameters(params)
    for p in params:
        assert cache.get(p) is not None
    assert len(cache) < 4 and cache.nbytes <= cache.max_bytes and cache.stats.evictions > 0
    assert cache.get(torch.randn(256, 512)) is None and cache.stats.uncacheable == 1


def _verified_sites(reports):
    return [r.sites_verified for r in reports]


def test_every_n_sampler_continues_across_per_step_blocks() -> None:
    torch.manual_seed(0)
    reports = train_steps(MLP_like_gpt(), 7, guard_kwargs={"sampler": EveryN(3)})
    assert [r.verified > 0 for r in reports] == [True, False, False, True, False, False, True]
    assert all(r.verified == r.seen for r in reports if r.verified)
    # the steps in between are not watched: no dispatch mode, nothing seen, still reported
    assert [r.watched for r in reports] == [True, False, False, True, False, False, True]
    assert [r.step for r in reports] == list(range(7))
    assert all(r.seen == 0 for r in reports if not r.watched)


def test_unwatched_steps_run_without_the_dispatch_mode() -> None:
    """The mode is off exactly on unwatched steps, and a mode entered above ours inside
    protect() is never popped by mistake (the stack is last-in first-out)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    class Counting(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    model = MLP()
    x = torch.randn(4, 16)
    with sdc_guard.protect(model, sampler=EveryN(2)) as guard:
        states = []
        for _ in range(4):
            model(x).sum().backward()
            states.append((guard.intercepting, _get_current_dispatch_mode() is not None))
            guard.step()
        assert states == [(True, True), (False, False), (True, True), (False, False)]
        assert guard.intercepting  # step 4 is watched
        with Counting() as counting:
            guard.step()  # step 5: unwatched, but our mode is below Counting: it stays
            assert guard.intercepting and _get_current_dispatch_mode() is counting
            model(x).sum().backward()
            report = guard.step()  # step 5 closes: ours stayed and ignored what it saw
        assert report.step == 5 and not report.watched and report.seen == 0
        assert Counting.calls > 0
    assert not guard.intercepting and _get_current_dispatch_mode() is None


def MLP_like_gpt():
    return TinyGPT(layers=1)


def test_rate_sampler_is_reproducible_and_proportional() -> None:
    def run(seed):
        torch.manual_seed(0)
        reports = train_steps(MLP_like_gpt(), 6, guard_kwargs={"sampler": Rate(0.5, seed=seed)})
        return [r.verified for r in reports], sum(r.seen for r in reports)

    a, seen = run(1)
    assert a == run(1)[0]
    assert a != run(2)[0]
    assert 0.3 * seen < sum(a) < 0.7 * seen


def test_rotating_sampler_covers_every_site_in_each_window() -> None:
    torch.manual_seed(0)
    k = 3
    sampler = Rotating(k)
    model = MLP_like_gpt()
    seen_sites = []
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(9):
        x, y = lm_batch(step)
        with sdc_guard.protect(model, sampler=sampler) as guard:
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            verified = {p.site for p in guard.ledger.pending}
        opt.step()
        opt.zero_grad()
        seen_sites.append((guard.last_report.sites_seen, verified))
    all_sites = set().union(*(v for _, v in seen_sites))
    assert len(all_sites) == seen_sites[0][0] > k
    for start in range(1, 9 - k + 1):
        window = set().union(*(v for _, v in seen_sites[start:start + k]))
        assert window == all_sites, f"window at {start} misses {all_sites - window}"
    assert all(len(v) < len(all_sites) for _, v in seen_sites[1:])


@pytest.mark.corpus  # a training loop long enough for the budget (about 10 s): CONTRIBUTING.md
@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_budget_sampler_meets_its_budget_on_a_real_training_loop() -> None:
    """Measured, not mocked: the guard's own timing of a real loop (a ratio, not a time).

    Budget verifies in sweeps, one every (full overhead + interception) / budget steps; on
    this small model interception alone is a large share of a step, so the budget is 10 %.
    ``window=20`` promises the coverage whatever the machine's speed (a slow or busy
    machine stretches the budget's own sweeps past 20 steps)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=256, heads=4, layers=2, ctx=64)
    sampler = Budget(0.1, window=20)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    reports = []
    with sdc_guard.protect(model, sampler=sampler) as guard:
        for step in range(45):
            x, y = lm_batch(step, batch=8, ctx=64, vocab=256)
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
            reports.append(guard.step())
    assert reports[0].verified == reports[0].seen  # the first step measures every site
    later = reports[5:]
    verify = sum(r.verify_seconds for r in later)
    base = sum(r.step_seconds - r.verify_seconds for r in later)
    assert verify / base < 0.2, verify / base  # budget 0.1, noise allowed
    assert sampler.coverage(window=20) == 1.0
    # everything it charged, interception included: the per-op rate is calibrated once per
    # process, so a machine that gets busier mid-run drifts it; Full() charges well over 1.0
    assert 0 < sampler.achieved_overhead < 0.3
    watched = [r for r in later if r.watched]
    assert watched and all(r.verified == r.seen > 0 for r in watched)  # sweeps verify every site
    assert all(r.seen == 0 and r.verified == 0 for r in later if not r.watched)  # no mode at all
    assert len(watched) < len(later) / 2  # far from Full()


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got str"):
        sdc_guard.protect("model")
    with pytest.raises(ValueError, match="p: expected a probability"):
        Rate(1.5)
    with pytest.raises(ValueError, match="n: expected a positive int"):
        EveryN(0)
    with pytest.raises(ValueError, match="max_overhead: expected a positive fraction"):
        Budget(-1)
    with pytest.raises(ValueError, match="backend: expected one of"):
        sdc_guard.protect(MLP(), backend="nope")


def test_sampler_state_round_trips() -> None:
    sampler = Rate(0.3, seed=5)
    [sampler.should_verify(("a", "forward", "mm")) for _ in range(7)]
    state = sampler.state_dict()
    expected = [sampler.should_verify(("a", "forward", "mm")) for _ in range(20)]
    other = Rate(0.3, seed=99)
    other.load_state_dict(state)
    assert [other.should_verify(("a", "forward", "mm")) for _ in range(20)] == expected
    full = Full()
    full.begin_step(4)
    assert full.state_dict() == {"step": 4}


class _RecordingSGD(torch.optim.SGD):
    """SGD that records whether the guard intercepted while it stepped; ``gemm``: also run
    a GEMM per step (as Shampoo or Muon do), which must then stay verified."""

    def __init__(self, params, guard_box: list, gemm: bool = False) -> None:
        super().__init__(params, lr=1e-2)
        self.guard_box, self.gemm, self.intercepting = guard_box, gemm, []

    @torch.no_grad()
    def step(self, closure=None):
        self.intercepting.append(self.guard_box[0].intercepting)
        if self.gemm:
            for p in self.param_groups[0]["params"]:
                if p.grad is not None and p.grad.dim() == 2:
                    p.grad.copy_(p.grad @ torch.eye(p.grad.shape[1]))
        return super().step(closure)


@pytest.mark.parametrize("gemm", [False, True])
def test_optimizer_steps_without_gemms_run_outside_the_dispatch_mode(gemm: bool) -> None:
    """An optimizer's first step is watched; one that ran no GEMM is then stepped with the
    mode off (half the ops of a small model's step), one that ran GEMMs stays verified."""
    torch.manual_seed(0)
    model = MLP()
    box: list = [None]
    opt = _RecordingSGD(model.parameters(), box, gemm=gemm)
    x = torch.randn(4, 16)
    with sdc_guard.protect(model) as guard:
        box[0] = guard
        reports = []
        for _ in range(3):
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            reports.append(guard.step())
        assert guard.intercepting  # back on after each optimizer step
    model_gemms = 2 + 4  # fc1, fc2 forward; their input and weight gradients (fc1 has no input grad)
    if gemm:
        assert opt.intercepting == [True, True, True]
        assert all(r.seen == model_gemms - 1 + 2 and r.verified == r.seen for r in reports)
    else:
        assert opt.intercepting == [True, False, False]
        assert all(r.seen == model_gemms - 1 for r in reports)


def test_what_is_learned_about_an_optimizer_outlives_a_per_step_block() -> None:
    """With one ``protect()`` block per step each step has a new guard: the optimizer's
    first step is intercepted and counted, the later ones (other guards) are not."""
    torch.manual_seed(0)
    model = MLP()
    box: list = [None]
    opt = _RecordingSGD(model.parameters(), box)
    x = torch.randn(4, 16)
    for _ in range(3):
        with sdc_guard.protect(model) as guard:
            box[0] = guard
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        assert guard.last_report.seen == 5 and guard.last_report.flagged == 0
    assert opt.intercepting == [True, False, False]


def test_the_outcomes_kept_hold_their_losses_without_the_autograd_graph() -> None:
    """``Guard.outcomes`` keeps the last ``history`` steps' outcomes. The closure's loss
    carries the step's autograd graph; kept as it is, every node of the last hundred
    steps' graphs stayed alive (under FSDP2 about 25 MB a step of the bench's model). The
    outcome keeps the loss's values, detached: the closure's tensor is freed with its
    graph once the caller lets it go, and the values stay readable."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, values = [], []
    with sdc_guard.protect(model, calibrate_every=None) as guard:  # one run of the closure a step
        for step in range(3):
            x, y = lm_batch(step)

            def closure() -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                losses.append(weakref.ref(loss))
                values.append(loss.item())
                return loss

            outcome = guard.optimizer_step(opt, closure)
            assert outcome.loss.grad_fn is None and not outcome.loss.requires_grad
    del outcome, closure
    assert [ref() is None for ref in losses] == [True] * 3
    assert [o.loss.item() for o in guard.outcomes] == values


@dataclasses.dataclass(frozen=True)
class _Result:
    """A closure's own result type, unknown to torch's pytree."""

    loss: Tensor
    logits: Tensor
    step: int
    plain: Tensor


def test_a_result_that_refers_back_to_itself_is_detached_without_recursing_for_ever() -> None:
    """A dataclass result whose field refers back to it (a node and its parent) is
    followed a bounded number of levels: the step gets its outcome, its own loss detached."""
    from sdc_guard.runtime.lifecycle.guarded_step import without_graph

    @dataclasses.dataclass
    class Node:
        loss: Tensor
        parent: Any = None

    x = torch.ones(3, requires_grad=True)
    node = Node((x * 2).sum())
    node.parent = node
    kept = without_graph(node)
    assert type(kept) is Node and kept is not node and node.loss.grad_fn is not None
    assert kept.loss.grad_fn is None and kept.loss.item() == 6.0
    assert kept.parent.loss.grad_fn is None  # the levels it follows are detached too


@pytest.mark.parametrize("shape", ["tuple", "dict", "model_output", "dataclass"])
def test_a_closure_returning_more_than_its_loss_keeps_no_graph_in_the_outcomes(shape: str) -> None:
    """A closure may return ``(loss, logits)``, a dict, a Hugging Face ``ModelOutput`` or a
    dataclass of its own (a frozen one here):
    every tensor in it that carries the step's graph is kept detached (same values, no
    copy), so the history of outcomes holds no graph node; a value that carries none (an
    int, a tensor without a graph) is kept as the very object returned."""
    from transformers.modeling_outputs import CausalLMOutput

    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    refs, logits_kept, plain = [], [], torch.ones(2)
    with sdc_guard.protect(model, calibrate_every=None) as guard:
        for step in range(3):
            x, y = lm_batch(step)

            def closure() -> Any:
                opt.zero_grad(set_to_none=True)
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
                refs.append((weakref.ref(loss), weakref.ref(logits)))
                logits_kept.append(logits.detach().clone())
                if shape == "tuple":
                    return loss, logits, step, plain
                if shape == "dict":
                    return {"loss": loss, "logits": logits, "step": step, "plain": plain}
                if shape == "dataclass":
                    return _Result(loss, logits, step, plain)
                return CausalLMOutput(loss=loss, logits=logits)

            outcome = guard.optimizer_step(opt, closure)
    del outcome, closure
    assert [(a() is None, b() is None) for a, b in refs] == [(True, True)] * 3
    for step, kept in enumerate(guard.outcomes):
        result = kept.loss
        if shape == "tuple":
            loss, logits, number, same = result
            assert number == step and same is plain
        elif shape == "dict":
            loss, logits, same = result["loss"], result["logits"], result["plain"]
            assert result["step"] == step and same is plain
        elif shape == "dataclass":
            assert type(result) is _Result and result.step == step and result.plain is plain
            loss, logits = result.loss, result.logits
        else:
            assert isinstance(result, CausalLMOutput)
            loss, logits = result.loss, result.logits
        assert loss.grad_fn is None and logits.grad_fn is None
        assert torch.equal(logits, logits_kept[step])


def test_a_closure_result_without_a_graph_is_kept_as_returned() -> None:
    """Nothing to detach: the outcome keeps the caller's own object."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = {"loss": torch.tensor(1.0), "note": "kept"}

    def closure() -> dict:
        opt.zero_grad()
        model(torch.ones(2, 16)).sum().backward()
        return result

    with sdc_guard.protect(model, calibrate_every=None) as guard:
        outcome = guard.optimizer_step(opt, closure)
    assert outcome.loss is result


def test_an_optimizer_step_that_raises_does_not_leave_interception_off() -> None:
    class Flaky(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            Flaky.calls += 1
            if Flaky.calls == 2:  # raises while the guard has stepped outside the mode
                raise RuntimeError("optimizer failed")
            return super().step(closure)

    model = MLP()
    opt = Flaky(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16)
    with sdc_guard.protect(model) as guard:
        for step in range(3):
            model(x).sum().backward()
            with pytest.raises(RuntimeError) if step == 1 else contextlib.nullcontext():
                opt.step()
            report = guard.step()
            assert guard.intercepting, step  # the next step is watched again
        assert report.seen == 5


def test_budget_charges_interception_and_recovers_from_a_slow_warm_up() -> None:
    """Driven by exact step costs (no clock): a sweep costs its verification plus the
    interception it adds, the long-run charge is the budget, and a base step time learned
    during a slow warm-up comes down although the next steps are all watched."""
    from sdc_guard.runtime.sampling import StepCosts

    site = ("fc", "forward", "mm")
    base, verify, intercept = 0.100, 0.050, 0.020  # seconds: unguarded step, sweep, mode
    sampler = Budget(0.1, warmup=1)
    sampler.begin_step(0)
    assert sampler.watches_step()
    sampler.end_step(StepCosts(0, 1.0, verify, {site: verify}, {site: 1}))  # a slow spell
    watched = []
    for step in range(1, 71):
        sampler.begin_step(step)
        watched.append(sampler.watches_step())
        if watched[-1]:
            sampler.end_step(StepCosts(step, base + intercept + verify, verify, {site: verify}, {site: 1}))
        else:
            sampler.end_step(StepCosts(step, base, 0.0))
    # a sweep costs 0.07 s of a 0.1 s step: at a 10 % budget, one step in 7 is watched
    assert 8 <= sum(watched) <= 12, watched
    assert abs(sampler.achieved_overhead - 0.1) < 0.02
    assert sampler.coverage(window=8) == 1.0


def test_budget_charges_the_re_encoding_carried_into_the_step_after_a_sweep() -> None:
    """After a sweep the guard re-encodes the updated weights; that work lands in the
    next (unwatched) step's report as ``guard_seconds``. Budget must charge it and keep it
    out of its estimate of the unguarded step, so that the real overhead, re-encoding
    included, stays at the budget (exact costs, no clock)."""
    from sdc_guard.runtime.sampling import StepCosts

    site = ("fc", "forward", "mm")
    base, verify, intercept, refresh = 0.100, 0.050, 0.020, 0.030
    sampler = Budget(0.1, warmup=1)
    sampler.begin_step(0)
    sampler.end_step(StepCosts(0, base + intercept + verify, verify, {site: verify}, {site: 1},
                               intercept + verify))
    extra, previous_watched, steps = 0.0, True, 200
    for step in range(1, steps + 1):
        sampler.begin_step(step)
        carried = refresh if previous_watched else 0.0
        if sampler.watches_step():
            cost = intercept + verify + carried
            sampler.end_step(StepCosts(step, base + cost, verify, {site: verify}, {site: 1}, cost))
        else:
            cost = carried
            sampler.end_step(StepCosts(step, base + cost, 0.0, {}, {}, cost))
        previous_watched = sampler.watches_step()
        extra += cost
    real = extra / (steps * base)
    assert abs(real - 0.1) < 0.02, f"real overhead {real:.3f} against a 10 % budget"
    assert abs(sampler.achieved_overhead - real) < 0.01


def test_budget_window_forces_a_sweep_when_a_site_would_go_stale() -> None:
    """``window`` makes coverage a promise: a sweep that costs 70 % of a step takes 14
    steps of a 5 % budget to earn; with ``window=5`` a sweep comes every 5 steps anyway
    (over budget, said by ``achieved_overhead``), and without it the gaps are the budget's."""
    from sdc_guard.runtime.sampling import StepCosts

    sites = [("fc1", "forward", "mm"), ("fc2", "backward", "mm")]
    base, verify = 0.100, 0.070

    def run(sampler: Budget) -> list[int]:
        watched = []
        for step in range(60):
            sampler.begin_step(step)
            if sampler.watches_step():
                watched.append(step)
                spent = {s: verify / 2 for s in sites}
                sampler.end_step(StepCosts(step, base + verify, verify, spent, {s: 1 for s in sites}))
            else:
                sampler.end_step(StepCosts(step, base, 0.0))
        return watched

    free = run(Budget(0.05, warmup=1))
    assert max(b - a for a, b in zip(free, free[1:])) >= 13  # what the budget alone allows
    bound = Budget(0.05, window=5, warmup=1)
    watched = run(bound)
    assert max(b - a for a, b in zip(watched, watched[1:])) == 5
    assert 59 - watched[-1] < 5 and bound.coverage(window=5) == 1.0
    assert bound.achieved_overhead > 0.1  # 0.07 every 5 steps of 0.1: the window wins
    assert repr(bound) == "Budget(0.05, window=5)" and repr(Budget(0.05)) == "Budget(0.05)"
    with pytest.raises(ValueError, match="window: expected a positive int, got 0"):
        Budget(0.05, window=0)
