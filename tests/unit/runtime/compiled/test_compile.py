"""protect() on torch.compile'd models: GEMMs checked inside the graphs, no graph break, no trace left.

Most tests compile with ``backend="aot_eager"`` (dynamo + AOT autograd, the graph structure
inductor receives, without C++ compilation); one compiles with inductor.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.overrides import _get_current_function_mode_stack

import pytest

import sdc_guard
from sdc_guard.runtime.compiled import function_mode, graph_checks
from sdc_guard.runtime.drills.inject import GemmFault, drill
from sdc_guard.runtime.sampling import EveryN

from gemm_count import compiled_gemms  # noqa: E402
from models import MLP, TinyGPT, lm_batch  # noqa: E402

#: GEMMs of one TinyGPT training step (2 blocks: 4 linear + 2 matmul forward, two
#: gradients each backward; the head 1 forward, 2 backward); the token embedding is no GEMM
GPT_GEMMS = 2 * (6 + 12) + 3


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def mlp_step(model, x):
    model(x).square().mean().backward()


def gpt_closure(model, opt, step):
    x, y = lm_batch(step)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return loss
    return closure


def test_compiled_mlp_is_checked_in_one_graph_forward_and_backward():
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16)
    before = function_mode.checks_run()
    with sdc_guard.protect(compiled) as guard:
        mlp_step(compiled, x)
    report = guard.last_report
    assert guard.compiled
    assert (report.seen, report.verified, report.flagged) == (5, 5, 0)  # 2 forward, 3 backward
    assert function_mode.checks_run() - before == 5  # the in-graph checks ran
    assert graphs() == 1 and counters["frames"]["ok"] == 1
    assert not counters["graph_break"]
    phases = {site[1] for site in guard.ledger.sites_seen}
    assert phases == {"forward", "backward"}
    modules = {site[0] for site in guard.ledger.sites_seen}
    assert modules == {"fc1", "fc2"}  # sites from the module stack dynamo traced


@pytest.mark.slow  # torch.compile: see CONTRIBUTING.md
def test_sites_of_a_compiled_sequential_are_its_module_paths():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    compiled = torch.compile(model, backend="aot_eager")
    with sdc_guard.protect(compiled) as guard:
        mlp_step(compiled, torch.randn(4, 16))
    assert {site[0] for site in guard.ledger.sites_seen} == {"0", "2"}  # dynamo calls the root "fn" here


def test_explain_counts_one_graph_no_break_and_the_users_own_graph():
    """Dynamo's graph is the user's own: the function mode passes every function through
    where dynamo traces (the checks are put into the graphs AOT autograd partitions,
    ``tests/test_compile_graph.py``), so no tap, no check and no break is in it."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 16)
    with sdc_guard.protect(model, compiled=True):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    targets = [str(node.target) for node in explained.graphs[0].graph.nodes if node.op == "call_function"]
    assert not [t for t in targets if "sdc_guard" in t or "autograd_function_apply" in t]
    assert sum("linear" in t for t in targets) == 2


@pytest.mark.slow  # a whole model through torch.compile: see CONTRIBUTING.md
def test_compiled_gpt_reports_like_eager_and_does_not_recompile_across_steps():
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(4):  # a per-step protect() block each step, as the README shows
        with sdc_guard.protect(compiled) as guard:
            outcome = guard.optimizer_step(opt, gpt_closure(compiled, opt, step))
        losses.append(float(outcome.loss.detach()))
        report = outcome.report
        assert (report.seen, report.verified, report.flagged) == (GPT_GEMMS, GPT_GEMMS, 0)
        assert report.unverified_ops == {}
    assert graphs() == 1, "a new guard each step must not recompile"
    assert losses[-1] < losses[0]
    eager = TinyGPT()
    with sdc_guard.protect(eager) as guard:
        gpt_closure(eager, torch.optim.SGD(eager.parameters()), 0)()
    assert guard.last_report.seen == GPT_GEMMS  # the same GEMMs as the eager route sees


def test_the_compiled_routes_function_mode_calls_are_charged_to_the_step_as_an_estimate(monkeypatch):
    """On the compiled route no check times the function mode's round trips (the tensor
    methods AOT autograd's wrappers call, the extern kernels, the check ops themselves):
    each call it passed on is counted and charged at the rate measured once per process,
    and the account says it is an estimate (no replays on that route)."""
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with sdc_guard.protect(compiled) as guard:
        reports = [guard.optimizer_step(opt, gpt_closure(compiled, opt, step)).report for step in range(4)]
        rate = function_mode.function_round_trip_seconds()  # the rate the reports used: measured once
        assert 0 < rate < 1e-3 and function_mode.function_round_trip_seconds() == rate
        # it is measured on a thread of its own: this thread's mode counts none of it
        monkeypatch.setattr(function_mode, "_function_round_trip", [])
        interception = guard.mode.interception
        one = torch.ones(2)
        interception.take_function_calls()
        torch.add(one, 1.0)
        assert function_mode.function_round_trip_seconds() > 0
        assert interception.take_function_calls() == 1
    for report in reports:
        assert report.intercepted_ops == 0 and report.seen == GPT_GEMMS
        assert report.function_mode_calls > GPT_GEMMS  # each check op is one, and each graph op
        assert report.interception_estimate_seconds == pytest.approx(report.function_mode_calls * rate)
        # the estimate as charged, unless it alone would exceed the step (then the step, all of it)
        assert report.interception_seconds == pytest.approx(report.interception_estimate_seconds) or (
            report.interception_seconds < report.interception_estimate_seconds
            and report.guard_seconds == pytest.approx(report.step_seconds))
        assert report.guard_seconds >= report.verify_seconds + report.interception_seconds - 1e-12
        assert not report.overhead_calibrated and report.interception_factor is None
    assert len({r.function_mode_calls for r in reports[2:]}) == 1  # the counts restart each step
    eager = TinyGPT()
    with sdc_guard.protect(eager, compiled=False) as guard:
        gpt_closure(eager, torch.optim.SGD(eager.parameters()), 0)()
    assert guard.last_report.function_mode_calls == 0 and guard.last_report.intercepted_ops > 0


def test_leaving_protect_leaves_no_trace():
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16)
    with sdc_guard.protect(compiled):
        mlp_step(compiled, x)
    assert not _get_current_function_mode_stack() and function_mode.current_sink() is None
    before = function_mode.checks_run()
    frames = counters["frames"]["ok"]
    for _ in range(3):
        mlp_step(compiled, x)  # outside: the graph without checks, compiled once
    assert function_mode.checks_run() == before
    assert counters["frames"]["ok"] == frames + 1 and graphs() == 2
    later = torch.compile(MLP(d_hidden=24), backend="aot_eager")  # a model compiled after the block
    mlp_step(later, x)
    assert counters["frames"]["ok"] == frames + 2 and graphs() == 3 and function_mode.checks_run() == before
    # and the compiled model outside the block computes what the unguarded one does
    torch.manual_seed(0)
    plain = MLP()
    assert torch.equal(compiled(x), torch.compile(plain, backend="aot_eager")(x))


def test_unwatched_steps_run_the_graph_without_checks():
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    sampler = EveryN(2)
    x = torch.randn(4, 16)
    seen = []
    for _ in range(4):
        before = function_mode.checks_run()
        with sdc_guard.protect(compiled, sampler=sampler) as guard:
            mlp_step(compiled, x)
        seen.append((guard.last_report.verified, function_mode.checks_run() - before))
    assert seen == [(5, 5), (0, 0), (5, 5), (0, 0)]
    assert graphs() == 2  # one with checks, one without: each compiled once


def test_compiled_route_is_scoped_to_its_thread():
    import threading
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16)
    mlp_step(compiled, x)
    seen: list = []
    with sdc_guard.protect(compiled) as guard:
        worker = threading.Thread(target=lambda: seen.append(
            (bool(_get_current_function_mode_stack()), function_mode.current_sink())))
        worker.start()
        worker.join()
        mlp_step(compiled, x)
    assert seen == [(False, None)]
    assert guard.last_report.verified == 5


@pytest.mark.slow  # a whole model through torch.compile (10-30 s): see CONTRIBUTING.md
def test_transient_fault_on_compiled_gpt_is_recomputed_to_the_clean_run():
    def train(faults):
        torch.manual_seed(0)
        model = TinyGPT()
        compiled = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        outcomes = []
        with drill(compiled, *faults) as injector, sdc_guard.protect(compiled) as guard:
            for step in range(3):
                outcomes.append(guard.optimizer_step(opt, gpt_closure(compiled, opt, step)))
        return model, outcomes, injector

    clean, clean_outcomes, _ = train(())
    assert all(o.classification is None for o in clean_outcomes)
    fault = GemmFault(site="blocks.1.fc1", phase="forward", step=1)
    faulted, outcomes, injector = train((fault,))
    assert len(injector.injections) == 1 and injector.injections[0].changed
    hit = outcomes[1]
    assert (hit.classification, hit.action) == ("transient", "recompute")
    assert [(d.site, d.phase, d.op) for d in hit.report.detections] == [("blocks.1.fc1", "forward", "addmm")]
    assert hit.reruns[0].flagged == 0 and hit.reruns[0].verified == GPT_GEMMS
    for a, b in zip(clean.parameters(), faulted.parameters()):
        assert torch.equal(a, b)  # the run went on bit-identical to the clean one
    # a finished drill leaves no injection point behind (it would corrupt later compiled runs)
    assert graph_checks.active_drills() == ()


@pytest.mark.slow  # a whole model through torch.compile (10-30 s): see CONTRIBUTING.md
def test_persistent_backward_fault_on_compiled_gpt_rolls_back():
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fault = GemmFault(site="blocks.0.attn.qkv", phase="backward", step=1, sticky=True)
    with drill(compiled, fault), sdc_guard.protect(compiled) as guard:
        first = guard.optimizer_step(opt, gpt_closure(compiled, opt, 0))
        snapshot = [p.detach().clone() for p in model.parameters()]
        hit = guard.optimizer_step(opt, gpt_closure(compiled, opt, 1))
    assert first.classification is None
    assert (hit.classification, hit.action, hit.stepped) == ("persistent", "rollback", False)
    assert {(d.site, d.phase) for d in hit.report.detections} == {("blocks.0.attn.qkv", "backward")}
    assert hit.rolled_back_to == 0
    for p, q in zip(model.parameters(), snapshot):
        assert torch.equal(p, q)  # back to the known-good state after step 0


@pytest.mark.slow  # a whole model through torch.compile (10-30 s): see CONTRIBUTING.md
def test_inductor_compiled_mlp_is_checked_and_a_fault_caught():
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model)  # inductor: C++ on CPU
    x = torch.randn(4, 16)
    fault = GemmFault(site="fc2", phase="backward", step=1)
    with drill(compiled, fault), sdc_guard.protect(compiled) as guard:
        mlp_step(compiled, x)
        clean = guard.step()
        mlp_step(compiled, x)
        hit = guard.step()
    assert (clean.seen, clean.verified, clean.flagged) == (5, 5, 0)
    assert hit.flagged == 1 and hit.detections[0].site == "fc2" and hit.detections[0].phase == "backward"
    assert not counters["graph_break"]


@pytest.mark.slow  # torch.compile under a drill: see CONTRIBUTING.md
def test_drill_without_a_site_hits_the_in_graph_check_not_the_aten_op():
    # dynamo runs compiled code with the function-mode stack empty: the drill must still
    # leave the graph's aten GEMMs alone and corrupt at the check, with the traced site
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    with drill(compiled, GemmFault(phase="backward", sticky=True)) as injector, sdc_guard.protect(compiled) as guard:
        mlp_step(compiled, torch.randn(4, 16))
    sites = [(i.site, i.phase) for i in injector.injections]
    assert sites == [("fc2", "backward"), ("fc2", "backward"), ("fc1", "backward")]  # once per checked GEMM
    assert {d.site for d in guard.last_report.detections} == {"fc1", "fc2"}


def test_compiled_argument_is_checked():
    with pytest.raises(TypeError, match="compiled: expected a bool or None"):
        sdc_guard.protect(MLP(), compiled="yes")
    assert not sdc_guard.protect(MLP()).compiled
    assert sdc_guard.protect(torch.compile(MLP(), backend="aot_eager")).compiled
    model = MLP()
    model.fc1.compile(backend="aot_eager")  # one compiled submodule is enough
    assert sdc_guard.protect(model).compiled


def test_dispatch_route_runs_new_frames_eagerly_and_cached_code_compiled():
    """``protect(compiled=False)`` (docs/COMPILE.md, "The dispatch route and compiled
    code"): code dynamo compiled before the block runs compiled inside it, the dispatch mode
    verifying the GEMMs that code calls (sites: the module it was called from, ``global``
    in the backward); a frame dynamo has not compiled runs eagerly, every GEMM verified at
    its module."""
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    warm = torch.compile(MLP(), backend="aot_eager")
    mlp_step(warm, x)
    with sdc_guard.protect(warm, compiled=False) as guard:
        mlp_step(warm, x)
    report = guard.last_report
    assert not guard.compiled and (report.seen, report.verified, report.unverified_ops) == (5, 5, {})
    assert counters["frames"]["ok"] == 1 and graphs() == 1  # the cached graph ran: not compiled again
    assert {site for site, _, _ in guard.ledger.sites_seen} == {"_orig_mod", "global"}
    torch._dynamo.reset()
    counters.clear()
    cold = torch.compile(MLP(), backend="aot_eager")
    with sdc_guard.protect(cold, compiled=False) as guard:
        mlp_step(cold, x)
    report = guard.last_report
    assert (report.seen, report.verified, report.unverified_ops) == (5, 5, {})
    assert not counters["frames"]["ok"]  # nothing compiled inside the block: it ran eagerly
    assert {site for site, _, _ in guard.ledger.sites_seen} == {"_orig_mod.fc1", "_orig_mod.fc2"}


@pytest.mark.corpus  # compiled training runs, 5-8 s (CONTRIBUTING.md)
@pytest.mark.slow  # a whole model through torch.compile (10-30 s): see CONTRIBUTING.md
def test_compiled_transformers_gpt2_with_a_fault_drill():
    from hf_models import gpt2

    model = gpt2()
    model.config.use_cache = False
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16), generator=gen)

    def closure():
        opt.zero_grad()
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss

    fault = GemmFault(site="transformer.h.1.mlp.c_fc", phase="forward", step=1)
    with drill(compiled, fault) as injector, sdc_guard.protect(compiled) as guard:
        outcomes = [guard.optimizer_step(opt, closure) for _ in range(2)]
    clean, hit = outcomes
    assert clean.classification is None and clean.report.verified == clean.report.seen > 0
    assert len(injector.injections) == 1
    assert (hit.classification, hit.action) == ("transient", "recompute")
    assert [d.site for d in hit.report.detections] == ["transformer.h.1.mlp.c_fc"]
    # transformers' own logging call breaks the graph (unguarded too); no break is the guard's
    assert not [k for k in counters["graph_break"] if "sdc_guard" in k or "check_gemm" in k or "Checked" in k]


class BreakBlock(torch.nn.Module):
    """A graph break inside a submodule's forward: dynamo compiles this forward as a frame of
    its own, whose graphs every instance of the block then shares."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(h))
        torch._dynamo.graph_break()  # as a print, a data-dependent branch or an unsupported op would
        return h + self.out(h)


class Broken(torch.nn.Module):
    """Graph breaks where real models have them: inside two instances of a block, and a
    data-dependent branch in the model's own forward; a product of two activations after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList([BreakBlock(32), BreakBlock(32)])
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        h = self.blocks[1](self.blocks[0](h))  # (a loop around a graph break would run this frame eagerly)
        if h.sum() > 0:  # data-dependent: a graph break
            h = h * 0.5
        h = h + 0.01 * (h @ h.t()) @ h
        return self.head(h)


#: GEMMs of a ``Broken`` step with an input that needs its gradient: every Linear 1 forward
#: and 2 backward (fc1, 2 x fc and out, head), the two activation products 1 + 2 each
BROKEN_GEMMS = 6 * 3 + 2 * 3
BROKEN_SITES = {(site, phase) for site in ("fc1", "blocks.0.fc", "blocks.0.out", "blocks.1.fc", "blocks.1.out",
                                           "head") for phase in ("forward", "backward")}


def broken_run(backend: str, guarded: bool, faults: tuple = (), steps: int = 1):
    """``steps`` compiled steps of a seeded ``Broken``, dynamo fresh: (output, input
    gradient, parameter gradients) of the last, the guard's reports (empty unguarded) and
    the (site, phase) pairs of the last step's GEMMs."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Broken()
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, generator=gen).requires_grad_()
    reports, sites = [], set()
    with contextlib.ExitStack() as stack:
        if guarded:
            if faults:
                stack.enter_context(drill(compiled, *faults))
            guard = stack.enter_context(sdc_guard.protect(compiled))
        for _ in range(steps):
            x.grad = None
            model.zero_grad()
            y = compiled(x)
            y.square().mean().backward()
            if guarded:
                sites = {site[:2] for site in guard.ledger.sites_seen}
                reports.append(guard.step())
    return (y.detach(), x.grad, *[p.grad for p in model.parameters()]), reports, sites


def check_broken_model(backend: str) -> None:
    clean, _, _ = broken_run(backend, guarded=False)
    assert counters["graph_break"], "the model must break its graph"
    graphs_unguarded = graphs()
    guarded, (report,), sites = broken_run(backend, guarded=True)
    assert all(torch.equal(a, b) for a, b in zip(clean, guarded)), "bit-identical to the unguarded compiled model"
    assert (report.seen, report.verified, report.flagged, report.unverified_ops) == (BROKEN_GEMMS, BROKEN_GEMMS, 0, {})
    assert graphs() == graphs_unguarded  # the same graphs (the blocks share theirs), the checks inside them
    # a graph the two blocks share names the block that ran it (the module of its weight);
    # the activation products in the model's own forward are the model's, as on the eager route
    assert sites == BROKEN_SITES | {("Broken", "forward"), ("Broken", "backward")}
    faults = (GemmFault(site="blocks.1.out", phase="backward", step=1),  # in a graph both blocks share
              GemmFault(site="fc1", phase="forward", step=1))
    _, (first, hit), _ = broken_run(backend, guarded=True, faults=faults, steps=2)
    assert first.flagged == 0
    assert {(d.site, d.phase) for d in hit.detections} == {("blocks.1.out", "backward"), ("fc1", "forward")}


@pytest.mark.slow  # a model with graph breaks, compiled twice (about 7 s): see CONTRIBUTING.md
def test_graph_breaks_inside_a_compiled_model_are_checked_in_every_graph():
    # a check that wrote a shared counter made the backward fail across graphs ("modified by
    # an inplace operation: [torch.LongTensor [1]]"); the check ops write nothing now
    check_broken_model("aot_eager")


@pytest.mark.corpus  # compiled training runs, 5-8 s (CONTRIBUTING.md)
@pytest.mark.slow  # inductor compiles C++ for every graph of the model (about a minute)
def test_graph_breaks_inside_an_inductor_compiled_model_are_checked_in_every_graph():
    check_broken_model("inductor")


def _autocast_step(model: torch.nn.Module, loss_of, backend: str, guarded: bool):
    """One bf16-autocast step of ``model`` compiled with ``backend``, dynamo fresh: the loss,
    the parameter gradients and the guard's report (``None`` unguarded)."""
    torch._dynamo.reset()
    model.zero_grad()
    compiled = torch.compile(model, backend=backend)
    with sdc_guard.protect(compiled) if guarded else contextlib.nullcontext() as guard:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(compiled)
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return loss.detach(), grads, guard.last_report if guarded else None


@pytest.mark.corpus  # compiled training runs, 5-8 s (CONTRIBUTING.md)
@pytest.mark.slow  # whole transformers models through torch.compile: see CONTRIBUTING.md
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_transformers_model_under_bf16_autocast_verifies_every_gemm(arch):
    # autocast casts a GEMM's operands inside the call (a bf16 activation times an fp32
    # weight reached the route); the route makes those casts itself, so the check sees bf16
    pytest.importorskip("transformers")
    if arch == "gpt2":
        from hf_models import gpt2

        model = gpt2()
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        loss_of = lambda m: m(input_ids=tokens, labels=tokens).loss  # noqa: E731
    else:
        from sdc_guard.tools.bench_models import build

        work = build("hf:llama")  # eager attention: its matmuls are GEMMs
        model = work.model
        loss_of = lambda m: work.loss_of(m, 0)  # noqa: E731
    model.eval()  # no dropout: the two runs draw nothing
    clean_loss, clean_grads, _ = _autocast_step(model, loss_of, "aot_eager", guarded=False)
    loss, grads, report = _autocast_step(model, loss_of, "aot_eager", guarded=True)
    assert torch.equal(loss, clean_loss) and len(grads) == len(clean_grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, clean_grads)), "bit-identical to the unguarded autocast run"
    assert report.seen == report.verified > 0 and report.flagged == 0
    assert report.unverified_ops == {}  # no GEMM counted unverified ("linear", "mm[float32]" before)
    assert {key[2] for key in report.by_kind} == {"bfloat16"}  # checked in the dtype the kernels computed in
    with sdc_guard.protect(model, compiled=False) as eager:  # the eager route sees the same GEMMs
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_eager = loss_of(model)
        loss_eager.backward()
    assert eager.last_report.verified == report.verified


def test_inductor_keeps_the_check_ops_and_an_inductor_that_would_not_is_named(monkeypatch):
    # the check ops write nothing: inductor keeps them only because they are registered as
    # side effects, which this inductor honours (older ones kept only ops with a mutable schema)
    assert graph_checks.inductor_keeps(torch.ops.sdc_guard.check_gemm) is True
    assert graph_checks.inductor_keeps(torch.ops.aten.mm) is False  # an op without side effects: dead code
    assert function_mode.warn_if_inductor_drops_checks() is True
    monkeypatch.setattr(function_mode, "inductor_keeps", lambda op: False)
    with pytest.warns(RuntimeWarning, match="inductor removes the compiled route's check ops"):
        assert function_mode.warn_if_inductor_drops_checks.__wrapped__() is False


@pytest.mark.corpus  # compiled training runs, 5-8 s (CONTRIBUTING.md)
@pytest.mark.slow  # a whole model through torch.compile, guarded and not, two backends (about a minute)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_gpt_trains_bit_identical_to_the_unguarded_compiled_gpt(backend):
    # the GEMMs are the user's own calls with autograd's own backward (a batched matmul of
    # heads made as torch.matmul makes it): the guard changes no value, forward or backward
    def run(guarded: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyGPT()
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        reports = []
        for step in range(2):
            with sdc_guard.protect(compiled) if guarded else contextlib.nullcontext() as guard:
                loss = gpt_closure(compiled, opt, step)()
                opt.step()
            if guarded:
                reports.append(guard.last_report)
        return loss.detach(), [p.detach().clone() for p in model.parameters()], reports

    clean_loss, clean_params, _ = run(False)
    loss, params, reports = run(True)
    assert torch.equal(loss, clean_loss) and all(torch.equal(a, b) for a, b in zip(params, clean_params))
    assert [(r.seen, r.verified, r.flagged) for r in reports] == [(GPT_GEMMS, GPT_GEMMS, 0)] * 2


class EveryProduct(torch.nn.Module):
    """Each GEMM function in each shape kind: a vector through a Linear, a vector times a
    matrix, a batch times a matrix, two batches (``@``, ``bmm``, ``baddbmm`` with ``alpha``
    and ``beta``), ``mm`` and ``addmm``, a matrix times a vector, broadcast batch dims."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [2, 3, 8]
        v = self.fc(x[0, 0])                              # linear on a vector
        m = x[0] @ self.w                                 # matrix @ parameter (mm kind via matmul)
        batch = torch.matmul(x, self.w)                   # batch @ matrix: folded
        pair = x @ x.transpose(-2, -1)                    # two batches
        b = torch.baddbmm(x, pair, x, alpha=0.5, beta=2.0)
        b = torch.bmm(b, x.transpose(1, 2)) @ x
        mm = torch.addmm(self.fc.bias, x[1], self.w.t(), beta=0.5, alpha=2.0) + torch.mm(x[1], self.w)
        vec = torch.matmul(v, self.w) + torch.matmul(self.w, v)  # vector @ matrix, matrix @ vector
        broadcast = torch.matmul(x.unsqueeze(0), self.w.expand(4, 1, 8, 8))  # [4, 2, 3, 8]
        return vec.sum() + m.sum() + batch.sum() + b.sum() + mm.sum() + broadcast.sum()


@pytest.mark.slow  # eleven products compiled, guarded and not: see CONTRIBUTING.md
def test_every_product_the_route_takes_is_checked_forward_and_backward():
    def run(compiled: bool, guarded: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = EveryProduct()
        target = torch.compile(model, backend="aot_eager") if compiled else model
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        with sdc_guard.protect(target) if guarded else contextlib.nullcontext() as guard:
            target(x).backward()
        grads = [x.grad, *[p.grad for p in model.parameters()]]
        return grads, guard.last_report if guarded else None

    _, eager = run(False, True)
    clean, _ = run(True, False)
    grads, report = run(True, True)
    assert all(torch.equal(a, b) for a, b in zip(grads, clean))  # the compiled model's own gradients
    # the graphs' GEMMs are the eager route's aten GEMMs: verified alike, and the two
    # matrix-vector products (aten.mv: no 2-D checksum) counted alike
    assert eager.unverified_ops == {"aten.mv": 2} and eager.seen == eager.verified
    expected = compiled_gemms(EveryProduct, lambda m: m(torch.randn(2, 3, 8).requires_grad_()).backward(),
                              "aot_eager")
    assert (report.seen, report.verified, report.flagged, report.unverified_ops) == \
        (expected, expected, 0, {"aten.mv": 2})


class Branchy(torch.nn.Module):
    """``torch.cond`` between two Linear paths, then flex attention over the result, then
    two blocks under activation checkpointing: three higher-order ops."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention
        from torch.utils.checkpoint import checkpoint

        y = torch.cond(x.sum() > 0, lambda t: self.a(t), lambda t: self.b(self.a(t)), (x,))
        y = flex_attention(y.view(1, 1, 4, 8), y.view(1, 1, 4, 8), y.view(1, 1, 4, 8)).view(4, 8)
        for block in self.blocks:
            y = checkpoint(block, y, use_reentrant=False)
        return y


@pytest.mark.slow  # three HOPs through torch.compile, inductor included: see CONTRIBUTING.md
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.corpus)])  # 6-11 s
def test_higher_order_ops_in_a_compiled_model_are_verified_and_flex_attention_counted_under_inductor(backend):
    """In the graphs AOT autograd partitions, ``torch.cond``'s branches are subgraphs the
    pass walks into and activation checkpointing is inlined (ordinary aten GEMMs): verified.
    Flex attention multiplies inside its own kernel: ``aot_eager``'s graph runs its dense
    kernel, which runs there with its two matmuls checked; inductor's is a fused template
    of its own: each call is counted in ``unverified_ops`` as
    ``higher_order.flex_attention``, once, and warned about. The model computes what it
    computes unguarded."""
    torch.manual_seed(0)
    model = Branchy()
    compiled = torch.compile(model, backend=backend)
    x = torch.ones(4, 8)
    counted = backend == "inductor"
    with torch.no_grad():  # CPU flex attention has no backward
        clean = compiled(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sdc_guard.protect(compiled) as guard:  # one block, one report
                out = compiled(x)
    warned = [w for w in caught if "higher_order.flex_attention in a compiled graph" in str(w.message)]
    assert len(warned) == counted
    assert torch.equal(out, clean)
    report = guard.last_report
    # a (the branch taken), the two blocks; under aot_eager flex attention's Q K^T and P V
    assert (report.seen, report.verified, report.flagged) == ((3, 3, 0) if counted else (5, 5, 0))
    assert report.unverified_ops == ({"higher_order.flex_attention": 1} if counted else {})
    sites = {"a", "blocks.0.0", "blocks.1.0"} | (set() if counted else {"Branchy"})
    assert {site for site, _, _ in guard.ledger.sites_seen} == sites


class Checkpointed(torch.nn.Module):
    """Two blocks of two Linears, each under activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


@pytest.mark.slow  # a model through inductor, three times: see CONTRIBUTING.md
def test_activation_checkpointing_under_inductor_is_verified_in_the_graphs():
    """The forward, the recomputation and the backward of a checkpointed model compiled
    with inductor, all checked in its graphs, with the unguarded compiled model's
    gradients; the dispatch route on its compiled code (``compiled=False``, warmed up
    before) sees the same GEMMs, as inductor calls them as extern kernels on CPU."""
    def run(compiled: bool | None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Checkpointed()
        target = torch.compile(model, backend="inductor")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        target(x).sum().backward()  # compiled outside the block (warm-up)
        model.zero_grad()
        with sdc_guard.protect(target, compiled=compiled) if compiled is not None else contextlib.nullcontext() as g:
            target(x).sum().backward()
        return [p.grad for p in model.parameters()], g.last_report if compiled is not None else None

    clean, _ = run(None)
    grads, report = run(True)
    dispatch_grads, dispatch = run(False)
    # 4 Linears forward; the backward recomputes what it needs of each block (its first
    # Linear, whose output the ReLU's gradient reads: 2); 2 gradients each but the first
    # input's, which needs none (7)
    assert (report.seen, report.verified, report.flagged, report.unverified_ops) == (13, 13, 0, {})
    assert (dispatch.seen, dispatch.verified, dispatch.unverified_ops) == (13, 13, {})
    for a, b, c in zip(grads, clean, dispatch_grads):
        assert torch.equal(a, b) and torch.equal(c, b)
