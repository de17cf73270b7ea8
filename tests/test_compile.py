"""protect() on torch.compile'd models: GEMMs checked inside the graphs, no graph break, no trace left.

Most tests compile with ``backend="aot_eager"`` (dynamo + AOT autograd, the graph structure
inductor receives, without C++ compilation); one compiles with inductor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.overrides import _get_current_function_mode_stack

import pytest

import sdc_guard
from sdc_guard.runtime import function_mode, graph_checks
from sdc_guard.runtime.inject import GemmFault, drill
from sdc_guard.runtime.sampling import EveryN

sys.path.insert(0, str(Path(__file__).parent))
from models import MLP, TinyGPT, lm_batch  # noqa: E402

#: GEMMs of one TinyGPT training step (2 blocks: 4 linear + 2 matmul forward, two
#: gradients each backward; the head 1 forward, 2 backward); the token embedding is no GEMM
GPT_GEMMS = 2 * (6 + 12) + 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


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
    before = int(function_mode.CHECKS)
    with sdc_guard.protect(compiled) as guard:
        mlp_step(compiled, x)
    report = guard.last_report
    assert guard.compiled
    assert (report.seen, report.verified, report.flagged) == (5, 5, 0)  # 2 forward, 3 backward
    assert int(function_mode.CHECKS) - before == 5  # the in-graph checks ran
    assert graphs() == 1 and counters["frames"]["ok"] == 1
    assert not counters["graph_break"]
    phases = {site[1] for site in guard._ledger.sites_seen}
    assert phases == {"forward", "backward"}
    modules = {site[0] for site in guard._ledger.sites_seen}
    assert modules == {"fc1", "fc2"}  # sites from the module stack dynamo traced


def test_sites_of_a_compiled_sequential_are_its_module_paths():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    compiled = torch.compile(model, backend="aot_eager")
    with sdc_guard.protect(compiled) as guard:
        mlp_step(compiled, torch.randn(4, 16))
    assert {site[0] for site in guard._ledger.sites_seen} == {"0", "2"}  # dynamo calls the root "fn" here


def test_explain_counts_one_graph_and_no_break_and_the_checks_inside_it():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 16)
    with sdc_guard.protect(model, compiled=True):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    graph = explained.graphs[0]
    checks = {"fwd": 0, "bwd": 0}
    for name, body in graph.named_children():  # the CheckedGemm forward and backward bodies
        for node in body.graph.nodes:
            if node.target in (torch.ops.sdc_guard.check_gemm, torch.ops.sdc_guard.check_gemm.default):
                checks[name[:3]] += 1
    assert checks == {"fwd": 2, "bwd": 3}  # fc1's input needs no gradient: 2 + 3 GEMMs


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


def test_leaving_protect_leaves_no_trace():
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 16)
    with sdc_guard.protect(compiled):
        mlp_step(compiled, x)
    assert not _get_current_function_mode_stack() and function_mode.current_sink() is None
    before = int(function_mode.CHECKS)
    frames = counters["frames"]["ok"]
    for _ in range(3):
        mlp_step(compiled, x)  # outside: the graph without checks, compiled once
    assert int(function_mode.CHECKS) == before
    assert counters["frames"]["ok"] == frames + 1 and graphs() == 2
    later = torch.compile(MLP(d_hidden=24), backend="aot_eager")  # a model compiled after the block
    mlp_step(later, x)
    assert counters["frames"]["ok"] == frames + 2 and graphs() == 3 and int(function_mode.CHECKS) == before
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
        before = int(function_mode.CHECKS)
        with sdc_guard.protect(compiled, sampler=sampler) as guard:
            mlp_step(compiled, x)
        seen.append((guard.last_report.verified, int(function_mode.CHECKS) - before))
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
    assert [(d.site, d.phase, d.op) for d in hit.report.detections] == [("blocks.1.fc1", "forward", "linear")]
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
    assert {site for site, _, _ in guard._ledger.sites_seen} == {"_orig_mod", "global"}
    torch._dynamo.reset()
    counters.clear()
    cold = torch.compile(MLP(), backend="aot_eager")
    with sdc_guard.protect(cold, compiled=False) as guard:
        mlp_step(cold, x)
    report = guard.last_report
    assert (report.seen, report.verified, report.unverified_ops) == (5, 5, {})
    assert not counters["frames"]["ok"]  # nothing compiled inside the block: it ran eagerly
    assert {site for site, _, _ in guard._ledger.sites_seen} == {"_orig_mod.fc1", "_orig_mod.fc2"}


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
