"""The checks as nodes of the compiled graphs: every GEMM a compiled model runs is verified
(activation checkpointing's recomputation, ``torch.cond`` and ``while_loop`` bodies,
decomposed composites, fused attention), whatever the user compiled, and leaving the block
leaves nothing behind (docs/COMPILE.md).

The count to meet comes from outside the guard: an unguarded compiled step run under a
counting dispatch mode that dynamo compiles through (``gemm_count.GemmCount``) sees every aten GEMM
and attention call the compiled code makes, as ``aot_eager`` runs every op of its graphs
and inductor on CPU calls its GEMMs as extern kernels.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import sdc_guard
from sdc_guard.runtime.compiled import graph_checks, graph_install
from sdc_guard.runtime.drills.inject import GemmFault, drill
from sdc_guard.runtime.sampling import Stateless

from gemm_count import compiled_gemms, fresh  # noqa: E402
from models import MLP, TinyGPT, lm_batch  # noqa: E402
from paths import SUPPORT  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def gpt_step(model: Any, step: int = 0) -> torch.Tensor:
    x, y = lm_batch(step)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach()


def make_gpt(ac: str | None) -> Callable[[], TinyGPT]:
    def make() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(ac=ac)
    return make


class Attn(torch.nn.Module):
    """A projection, fused SDPA (causal) and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 16))


class Composites(torch.nn.Module):
    """``einsum`` and ``tensordot`` (AOT autograd decomposes both into ``bmm`` / ``mm``)
    between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bti,ij->btj", self.a(x), self.w)
        return self.b(torch.tensordot(h, self.w, dims=([2], [1])))


def _x(shape: tuple[int, ...], grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).requires_grad_(grad)


#: name -> (model factory, one step on the model, the eager route's sites that must be found)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[Any], None]]] = {
    "block-ac": (make_gpt("block"), lambda m: gpt_step(m)),
    "selective-ac": (make_gpt("selective"), lambda m: gpt_step(m)),
    "sdpa": (lambda: (torch.manual_seed(0), Attn())[1], lambda m: m(_x((2, 8, 16))).square().sum().backward()),
    "einsum-tensordot": (lambda: (torch.manual_seed(0), Composites())[1],
                         lambda m: m(_x((2, 3, 8))).square().sum().backward()),
}


def _run_guarded(make: Callable[[], torch.nn.Module], step: Callable[[Any], None], backend: str):
    fresh()
    model = make()
    compiled = torch.compile(model, backend=backend)
    with sdc_guard.protect(model) as guard:  # the wrapper called, the module protected
        step(compiled)
    return guard, model


def _eager_sites(make: Callable[[], torch.nn.Module], step: Callable[[Any], None]) -> set:
    model = make()
    with sdc_guard.protect(model, compiled=False) as guard:
        step(model)
    return {(site, phase) for site, phase, _ in guard.ledger.sites_seen}


@pytest.mark.slow  # a model through torch.compile, twice (a few seconds): see CONTRIBUTING.md
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_gemm_the_compiled_code_runs_is_verified(case):
    make, step = CASES[case]
    expected = compiled_gemms(make, step, "aot_eager")
    guard, _ = _run_guarded(make, step, "aot_eager")
    report = guard.last_report
    assert guard.compiled and not counters["graph_break"]
    assert (report.seen, report.verified, report.flagged, report.unverified_ops) == (expected, expected, 0, {})
    # sites from the graphs' own metadata: every module the eager route names, a backward
    # GEMM at its forward module (not "global")
    assert _eager_sites(make, step) <= {(site, phase) for site, phase, _ in guard.ledger.sites_seen}


class Branches(torch.nn.Module):
    """``torch.cond`` between two Linear paths (``a``; ``b`` after ``a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: self.a(t), lambda t: self.b(self.a(t)), (x,))


class Loop(torch.nn.Module):
    """``while_loop`` running a Linear three times."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.while_loop import while_loop
        _, y = while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, torch.tanh(self.a(h))),
                          (torch.zeros((), dtype=torch.int64), x))
        return y


@pytest.mark.slow  # torch.cond and while_loop through torch.compile: see CONTRIBUTING.md
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.corpus)])  # 6-11 s
def test_the_bodies_of_cond_and_while_loop_are_verified(backend):
    torch.manual_seed(0)
    model = Branches()
    compiled = torch.compile(model, backend=backend)
    for sign, forward in ((1.0, 1), (-1.0, 2)):  # the branch taken: a alone, or a then b
        x = (sign * (torch.rand(4, 8) + 0.1)).requires_grad_()
        with sdc_guard.protect(model) as guard:
            compiled(x).sum().backward()
        report = guard.last_report
        by_phase = collections.Counter(phase for (_, phase, _), n in report.by_kind.items() for _ in range(n.seen))
        assert report.unverified_ops == {} and report.verified == report.seen
        # each Linear of the branch: its forward GEMM, and in the backward its two gradients
        # (the first Linear's input gradient too: x needs one)
        assert by_phase["forward"] == forward and by_phase["backward"] >= 2 * forward
        assert {site for site, _, _ in guard.ledger.sites_seen} == ({"a"} if forward == 1 else {"a", "b"})
    torch.manual_seed(0)
    loop = Loop()
    with torch.no_grad(), sdc_guard.protect(loop) as guard:  # while_loop compiles without autograd
        torch.compile(loop, backend=backend)(torch.randn(4, 8))
    report = guard.last_report
    assert (report.seen, report.verified, report.unverified_ops) == (3, 3, {})  # three turns of the body
    assert {s for s, _, _ in guard.ledger.sites_seen} == {"a"}


HOW = ("wrapper-before", "wrapper-inside", "model.compile", "submodule", "train_step")


@pytest.mark.slow  # several compiles (a few seconds): see CONTRIBUTING.md
@pytest.mark.parametrize("how", HOW)
def test_compiled_code_is_verified_inside_and_leaves_no_trace(how):
    """Whatever was compiled, and whenever: inside the block it compiles (no frame runs
    eagerly) and is verified; after it, it runs compiled without checks and without
    ``torch._dynamo.reset()``, and a model the guard never saw compiles as usual."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 16)
    run: Callable[[], None]
    if how == "wrapper-before":
        compiled = torch.compile(model, backend="aot_eager")
        run = lambda: compiled(x).square().mean().backward()  # noqa: E731
        run()  # compiled before the block, outside it
    elif how == "model.compile":
        model.compile(backend="aot_eager")
        run = lambda: model(x).square().mean().backward()  # noqa: E731
    elif how == "submodule":
        model = torch.nn.Sequential(MLP(), torch.nn.Linear(8, 8))
        model[0].compile(backend="aot_eager")
        run = lambda: model(x).square().mean().backward()  # noqa: E731
    elif how == "train_step":
        @torch.compile(backend="aot_eager")
        def train_step(inputs: torch.Tensor) -> torch.Tensor:
            return model(inputs).square().mean()
        run = lambda: train_step(x).backward()  # noqa: E731
    frames = counters["frames"]["ok"]
    for step in range(2):
        before = graph_checks.checks_run()
        with sdc_guard.protect(model) as guard:
            if how == "wrapper-inside" and step == 0:
                compiled = torch.compile(model, backend="aot_eager")
                run = lambda: compiled(x).square().mean().backward()  # noqa: E731
            run()
        report = guard.last_report
        gemms = 8 if how == "submodule" else 5  # (the Linear after the compiled MLP: eager, its taps check it)
        assert guard.compiled and (report.seen, report.verified, report.unverified_ops) == (gemms, gemms, {})
        assert graph_checks.checks_run() - before == gemms
    inside = counters["frames"]["ok"] - frames
    assert inside >= 1  # compiled inside the block, once, and reused by the next guard
    assert not graph_install.installed() and graph_checks.current_sink() is None
    from torch._dynamo.backends import debugging
    from torch._inductor import config as inductor_config
    assert inductor_config.post_grad_custom_pre_pass is None and not hasattr(debugging.boxed_nop, "sdc_guard")
    assert not torch.overrides._get_current_function_mode_stack() and torch._C._len_torch_dispatch_stack() == 0
    before, settled = graph_checks.checks_run(), None
    for _ in range(3):  # outside: compiled without checks, at most once more
        run()
        settled = settled if settled is not None else (counters["frames"]["ok"], graphs())
    assert graph_checks.checks_run() == before
    assert (counters["frames"]["ok"], graphs()) == settled  # no recompile after the first call outside
    assert counters["frames"]["ok"] >= frames + inside  # frames compile after the block (none skipped)
    other = torch.compile(MLP(d_hidden=24), backend="aot_eager")  # never guarded
    ok = counters["frames"]["ok"]
    other(x).sum().backward()
    assert counters["frames"]["ok"] == ok + 1 and graph_checks.checks_run() == before


@pytest.mark.corpus  # inductor training run, about 11 s (CONTRIBUTING.md)
@pytest.mark.slow  # a model through torch.compile, guarded and not, two backends (about a minute)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_guarded_checkpointed_gpt_trains_bit_identical_to_the_unguarded_compiled_one(backend):
    def train(guarded: bool):
        fresh()
        model = make_gpt("block")()
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, reports = [], []
        with sdc_guard.protect(model) if guarded else contextlib.nullcontext() as guard:
            for step in range(2):
                opt.zero_grad()
                losses.append(gpt_step(compiled, step))
                if guarded:
                    reports.append(guard.step())
                opt.step()
        return losses, [p.detach().clone() for p in model.parameters()], reports

    clean_losses, clean_params, _ = train(False)
    losses, params, reports = train(True)
    assert all(torch.equal(a, b) for a, b in zip(losses, clean_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, clean_params))
    assert all(r.verified == r.seen > 0 and r.flagged == 0 and not r.unverified_ops for r in reports)


def _ac_run(faults: tuple, steps: int = 3, policy: sdc_guard.Policy | None = None):
    fresh()
    model = make_gpt("block")()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outcomes = []
    with drill(model, *faults) as injector, sdc_guard.protect(model, policy=policy) as guard:
        for step in range(steps):
            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                return gpt_step(compiled, step)
            outcomes.append(guard.optimizer_step(opt, closure))
    return model, outcomes, injector


@pytest.mark.slow  # a checkpointed model through torch.compile, three runs: see CONTRIBUTING.md
def test_a_fault_in_a_recomputed_gemm_is_caught_and_answered():
    """Activation checkpointing runs a block's forward GEMMs again in the backward; a fault
    there (``phase="backward"``, the forward's op) is caught at its module, re-executed to
    the clean run bit for bit when transient, rolled back when it persists."""
    clean, clean_outcomes, _ = _ac_run(())
    assert all(o.classification is None for o in clean_outcomes)
    fault = GemmFault(site="blocks.1.fc1", phase="backward", op="addmm", step=1)  # the recomputation
    faulted, outcomes, injector = _ac_run((fault,))
    assert len(injector.injections) == 1 and injector.injections[0].changed
    hit = outcomes[1]
    assert (hit.classification, hit.action) == ("transient", "recompute")
    assert [(d.site, d.phase, d.op) for d in hit.report.detections] == [("blocks.1.fc1", "backward", "addmm")]
    assert hit.reruns[0].flagged == 0 and hit.reruns[0].verified == hit.report.verified
    assert all(torch.equal(a, b) for a, b in zip(clean.parameters(), faulted.parameters()))
    sticky = GemmFault(site="blocks.0.attn.qkv", phase="backward", op="addmm", step=1, sticky=True)
    _, outcomes, _ = _ac_run((sticky,), steps=2)
    assert (outcomes[1].classification, outcomes[1].action, outcomes[1].stepped) == ("persistent", "rollback", False)


class Alternate(Stateless):
    """Verifies half of the sites, the other half at the next step: a sampler that changes
    what it watches every step."""

    def __init__(self) -> None:
        self.step = 0
        self.chosen: dict[int, set] = collections.defaultdict(set)

    def begin_step(self, step: int) -> None:
        self.step = step

    def should_verify(self, site: Any) -> bool:
        chosen = (sum(map(ord, site[0] + site[2])) + self.step) % 2 == 0
        if chosen:
            self.chosen[self.step].add(site)
        return chosen


@pytest.mark.slow  # a model through torch.compile over several steps: see CONTRIBUTING.md
def test_a_sampler_that_changes_its_mind_recompiles_nothing_and_weights_stay_cached():
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler, misses = Alternate(), []
    with sdc_guard.protect(model, sampler=sampler) as guard:  # one guard: one weight cache
        for step in range(4):
            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                before = guard.cache.stats.misses
                loss = gpt_step(compiled, step)
                misses.append(guard.cache.stats.misses - before)  # encodings made inside the step
                return loss
            outcome = guard.optimizer_step(opt, closure)
            assert outcome.report.flagged == 0  # the encodings were remade after each update
    assert graphs() == 1  # compiled once, whatever the sampler chose
    verified = [sampler.chosen[step] for step in range(4)]
    assert verified[0] and verified[1] and not verified[0] & verified[1] and verified[0] == verified[2]
    # each weight's encodings are made the first time its GEMMs are verified (steps 0 and 1:
    # the sampler's two halves) and refreshed right after every optimizer step: from then on
    # the steps' GEMMs find every one cached
    assert misses[0] > 0 and misses[1] > 0 and misses[2:] == [0, 0] and guard.cache.stats.hits > 0


@pytest.mark.corpus  # a transformers model through inductor (about 10 s): CONTRIBUTING.md
@pytest.mark.slow  # a transformers model through torch.compile: see CONTRIBUTING.md
def test_hugging_face_gradient_checkpointing_under_model_compile_is_verified():
    """A Llama with ``gradient_checkpointing_enable()`` and ``model.compile()``: every GEMM
    its compiled graphs run is verified (before: 3 of them, the rest counted once as
    ``higher_order.tag_activation_checkpoint``)."""
    pytest.importorskip("transformers")
    import warnings

    from sdc_guard.tools.bench_models import build

    work = build("hf:llama")

    def make() -> torch.nn.Module:
        model = build("hf:llama").model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers renames the method
            model.gradient_checkpointing_enable()
        return model.train()

    def step(model: Any) -> None:
        work.loss_of(model, 0).backward()

    expected = compiled_gemms(make, step, "aot_eager")
    model = make()
    model.compile(backend="aot_eager")
    with sdc_guard.protect(model) as guard:
        step(model)
    report = guard.last_report
    assert (report.seen, report.verified, report.flagged, report.unverified_ops) == (expected, expected, 0, {})
    eager = make()
    with sdc_guard.protect(eager) as eager_guard:
        step(eager)
    # the eager route's checkpointing recomputes until it has what the backward needs; the
    # partitioner's choice differs by a GEMM or so, and every module is a site of both
    assert abs(eager_guard.last_report.verified - expected) <= 2
    assert {s[:2] for s in eager_guard.ledger.sites_seen} <= {s[:2] for s in guard.ledger.sites_seen}


class _CheckpointedBlocks(torch.nn.Module):
    """A compiled input layer, then eager blocks under non-reentrant activation
    checkpointing: what a Hugging Face model with ``gradient_checkpointing_enable()``
    becomes under ``model.compile()`` where a graph break leaves its checkpointed layers to
    eager frames (transformers 5.25)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                              torch.nn.Linear(32, 16)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_eager_checkpointed_blocks_on_the_compiled_route_train_as_unguarded():
    """The compiled route's eager frames inside a non-reentrant checkpoint: the backward's
    recomputation runs without the function mode, so a tap in the forward would save
    tensors the recomputation does not (``CheckpointError``). Their forward GEMMs are
    verified without a tap, each backward GEMM is counted, and the gradients are the
    unguarded ones bit for bit."""
    fresh()
    torch.manual_seed(0)
    plain = _CheckpointedBlocks()
    guarded = _CheckpointedBlocks()
    guarded.load_state_dict(plain.state_dict())
    plain.inp.compile(backend="aot_eager")
    guarded.inp.compile(backend="aot_eager")
    x = torch.randn(4, 16)
    plain(x).square().sum().backward()
    with sdc_guard.protect(guarded) as guard:
        guarded(x).square().sum().backward()
    report = guard.last_report
    assert guard.compiled
    # the compiled layer's forward and weight-gradient GEMMs (x needs no gradient), the
    # blocks' four forward GEMMs
    assert (report.verified, report.flagged) == (6, 0)
    # each block GEMM's backward: its input's gradient and its weight's (the first
    # block's input is the compiled layer's output, which needs a gradient too)
    assert report.unverified_ops == {"backward of a checkpointed eager GEMM": 8}
    for p, q in zip(plain.parameters(), guarded.parameters()):
        assert torch.equal(p.grad, q.grad)
    fresh()


EXIT_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import torch
import sdc_guard
from respond_helpers import make_model, train
model = make_model(ac="block")
fault = sdc_guard.GemmFault(site="blocks.0.fc1", phase="backward", op="addmm", step=2, sticky=True)
train(model, 6, faults=(fault,), policy=sdc_guard.Policy(exit_report_dir={out!r}),
      wrapped=torch.compile(model, backend="aot_eager"))
print("not reached")
"""


@pytest.mark.corpus  # a subprocess compiling a checkpointed model (about 7 s): CONTRIBUTING.md
@pytest.mark.slow  # a subprocess compiling a checkpointed model: see CONTRIBUTING.md
def test_a_persistent_fault_in_a_recomputed_gemm_ends_in_the_documented_exit(tmp_path):
    """Recompute, then roll back, then exit with ``EXIT_PERSISTENT`` when the fault in the
    recomputation comes back: the response chain of eager code, on compiled code."""
    import json
    import subprocess

    script = EXIT_SCRIPT.format(here=str(SUPPORT), out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == sdc_guard.EXIT_PERSISTENT, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "sdc_guard-exit.json").read_text())
    assert report["classification"] == "persistent"
    assert [(d["site"], d["phase"], d["op"]) for d in report["detections"]][:1] == [("blocks.0.fc1", "backward", "addmm")]
