"""Interception coverage (docs/DESIGN.md, "Interception coverage"): higher-order ops never
stop a protected model, and every GEMM-bearing op is verified or counted."""

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._higher_order_ops.while_loop import while_loop
from torch.nn.attention.flex_attention import flex_attention

import sdc_guard
from sdc_guard.runtime.drills.inject import GemmFault, drill

warnings.filterwarnings("ignore", category=UserWarning)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Eager ``torch.cond`` and flex attention compile torch's own wrapper functions, one
    code object shared by every test, and dynamo caches compiled code per code object:
    each test starts (and ends) with none, so that none depends on the order tests run in."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def halve(score, b, h, q, k):
    return score * 0.5


class FlexBlock(nn.Module):
    """A tiny attention block: flex attention (with a ``score_mod`` or none) between two Linears."""

    def __init__(self, d: int = 16, heads: int = 2, score_mod=None) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.score_mod = score_mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), score_mod=self.score_mod)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def sites(guard) -> set[tuple[str, str]]:
    """(site, phase) of every GEMM the guard's last step saw."""
    return {(site, phase) for site, phase, _ in guard.ledger.sites_seen}


@pytest.mark.parametrize("score_mod", [None, halve], ids=["plain", "score_mod"])
@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("guarded_first", [True, False], ids=["guarded_first", "unguarded_first"])
def test_flex_attention_in_a_module_is_verified(score_mod, ctx, guarded_first):
    torch.manual_seed(0)
    model, x = FlexBlock(score_mod=score_mod), torch.randn(2, 8, 16)
    with ctx():
        ref = None if guarded_first else model(x)
        with sdc_guard.protect(model) as guard:
            out = model(x)
        ref = model(x) if ref is None else ref
    r = guard.last_report
    assert torch.equal(out, ref)
    # two Linears + the body's two matmuls (Q K^T, P V), at the module that called flex attention
    assert (r.seen, r.verified, r.unverified_ops) == (4, 4, {})
    assert sites(guard) == {("qkv", "forward"), ("proj", "forward"), ("FlexBlock", "forward")}


@pytest.mark.parametrize("score_mod", [None, halve], ids=["plain", "score_mod"])
def test_flex_attention_under_a_drill(score_mod):
    torch.manual_seed(0)
    model, x = FlexBlock(score_mod=score_mod), torch.randn(2, 8, 16)
    with torch.no_grad():
        with drill(model, GemmFault(step=10**6)) as idle:  # a drill that never fires changes nothing
            out = model(x)
        assert not idle.injections and torch.equal(out, model(x))
        with drill(model, GemmFault(op="matmul", site="FlexBlock")) as faults, \
                sdc_guard.protect(model) as guard:
            model(x)
    assert len(faults.injections) == 1 and faults.injections[0].changed
    found = guard.last_report.detections
    assert found and (found[0].site, found[0].op) == ("FlexBlock", "matmul")


def test_flex_attention_with_grad_fails_as_without_the_guard():
    """CPU flex attention has no backward in torch: with grad enabled it raises the same
    error under the guard as without it, and the guard's block closes cleanly."""
    torch.manual_seed(0)
    model, x = FlexBlock(), torch.randn(2, 8, 16)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        model(x)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        with sdc_guard.protect(model) as guard:
            model(x)
    assert guard.last_report.seen == 1  # the qkv projection ran before flex attention raised
    assert torch._C._len_torch_dispatch_stack() == 0
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


class Branchy(nn.Module):
    """``torch.cond`` whose branches call submodules (their parameters are closure variables)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: self.a(x), lambda x: self.b(self.a(x)), (x,))


@pytest.mark.parametrize("sign,gemms", [(1.0, 1), (-1.0, 2)])
@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_cond_both_branches(sign, gemms, ctx):
    torch.manual_seed(0)
    model, x = Branchy(), sign * torch.ones(4, 8)
    with ctx():
        with sdc_guard.protect(model) as guard:
            out = model(x)
        ref = model(x)
    r = guard.last_report
    assert torch.equal(out, ref)
    assert (r.seen, r.verified, r.unverified_ops) == (gemms, gemms, {})
    assert sites(guard) == ({("a", "forward")} if gemms == 1 else {("a", "forward"), ("b", "forward")})


def grad_step(model: nn.Module, x: torch.Tensor, guarded: bool):
    """Forward and backward; the output, every gradient (the input's too) and the guard."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    guard = sdc_guard.protect(model) if guarded else None
    with guard if guard is not None else contextlib.nullcontext():
        out = model(x)
        out.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.detach(), {**grads, "input": x.grad.clone()}, guard


@pytest.mark.slow  # compiles torch's HOP wrappers: see CONTRIBUTING.md
@pytest.mark.parametrize("sign,forward_sites", [(1.0, {"a"}), (-1.0, {"a", "b"})], ids=["true", "false"])
@pytest.mark.parametrize("guarded_first", [True, False], ids=["guarded_first", "unguarded_first"])
def test_cond_under_autograd_is_exact_and_verified(sign, forward_sites, guarded_first):
    torch.manual_seed(0)
    model, x = Branchy(), sign * (torch.rand(4, 8) + 0.1)
    if guarded_first:
        out, grads, guard = grad_step(model, x, guarded=True)
        ref, ref_grads, _ = grad_step(model, x, guarded=False)
    else:
        ref, ref_grads, _ = grad_step(model, x, guarded=False)
        out, grads, guard = grad_step(model, x, guarded=True)
    assert torch.equal(out, ref)
    # cond's backward gives every parameter a gradient (zeros for the branch not taken)
    assert set(grads) == set(ref_grads) == {name for name, _ in model.named_parameters()} | {"input"}
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert sign < 0 or not grads["b.weight"].any()
    r = guard.last_report
    n = len(forward_sites)
    # per Linear of the branch: its forward; in cond's backward graph, its forward again and
    # the two gradient GEMMs
    assert (r.seen, r.verified, r.unverified_ops) == (4 * n, 4 * n, {})
    backward = sum(c.seen for (op, phase, dtype), c in r.by_kind.items() if phase == "backward")
    assert backward == 3 * n
    # forward GEMMs at the branch's own modules; the backward ones at the module that called cond
    assert sites(guard) == {(s, "forward") for s in forward_sites} | {("Branchy", "backward")}


class Loop(nn.Module):
    """``while_loop`` whose body calls a submodule (its parameters are closure variables)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = torch.zeros((), dtype=torch.int64)
        return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, self.a(x).tanh()), (i, x))[1]


@pytest.mark.slow  # compiles torch's HOP wrappers: see CONTRIBUTING.md
@pytest.mark.parametrize("guarded_first", [True, False], ids=["guarded_first", "unguarded_first"])
def test_while_loop_under_autograd_is_exact_and_verified(guarded_first):
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(4, 8)
    first, second = grad_step(model, x, guarded=guarded_first), grad_step(model, x, guarded=not guarded_first)
    (out, grads, guard), (ref, ref_grads, _) = (first, second) if guarded_first else (second, first)
    assert torch.equal(out, ref) and set(grads) == set(ref_grads) == {"a.weight", "a.bias", "input"}
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    r = guard.last_report
    # three iterations: the forward's GEMM; in the backward graph, the forward again and two gradients
    assert (r.seen, r.verified, r.unverified_ops) == (12, 12, {})
    # the backward runs a graph built by while_loop's autograd function, which no label reaches
    assert sites(guard) == {("a", "forward"), ("global", "backward")}


@pytest.mark.parametrize("fault,where", [
    (GemmFault(site="b", phase="forward"), ("b", "forward")),
    (GemmFault(site="Branchy", phase="backward", op="mm"), ("Branchy", "backward")),
], ids=["forward", "backward"])
def test_fault_in_a_cond_branch_is_detected(fault, where):
    torch.manual_seed(0)
    model, x = Branchy(), -(torch.rand(4, 8) + 0.1)
    with drill(model, fault) as faults, sdc_guard.protect(model) as guard:
        model(x.requires_grad_()).sum().backward()
    assert len(faults.injections) == 1 and faults.injections[0].changed
    assert (faults.injections[0].site, faults.injections[0].phase) == where
    found = guard.last_report.detections
    assert found and (found[0].site, found[0].phase) == where


@pytest.mark.slow  # compiles torch's HOP wrappers: see CONTRIBUTING.md
def test_hops_compile_once_and_leave_no_trace():
    """The wrappers torch compiles for ``cond`` are compiled once, reused by every later
    guarded step (per-step blocks, whose site hooks are installed afresh) and unguarded
    call; after the blocks nothing of the guard remains and the model compiles as usual."""
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = ((-1.0) ** step * (torch.rand(4, 8) + 0.1)).requires_grad_()
        with sdc_guard.protect(model) as guard:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert guard.last_report.verified == (4 if step % 2 == 0 else 8)
    assert counters["stats"]["unique_graphs"] == 1
    assert torch._C._len_torch_dispatch_stack() == 0
    assert all(not m._forward_pre_hooks and not m._forward_hooks and not m._forward_hooks_always_called
               for m in model.modules())
    x = (torch.rand(4, 8) + 0.1).requires_grad_()
    eager = model(x)  # unguarded: one more capture (dynamo guards on the hooks the first one saw)
    with sdc_guard.protect(model):
        model(x).sum().backward()
    model(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 2  # and no more, guarded or not
    compiled = torch.compile(model, backend="eager")
    assert torch.equal(compiled(x), eager)
    assert counters["frames"]["ok"] >= 1 and not counters["graph_break"]


def test_out_overloads_are_verified():
    """``out=`` GEMMs (a user's, and what a compiled graph's extern GEMM kernels call) are
    verified like the plain call; a fault in one is caught."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    a, b, bias = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4)
    a3, b3 = torch.randn(2, 8, 16), torch.randn(2, 16, 4)
    out, out3 = torch.empty(8, 4), torch.empty(2, 8, 4)
    with sdc_guard.protect(model) as guard:
        torch.mm(a, b, out=out)
        torch.addmm(bias, a, b, out=out)
        torch.bmm(a3, b3, out=out3)
        torch.baddbmm(out3.clone(), a3, b3, out=out3)
    assert torch.equal(out3, torch.baddbmm(torch.bmm(a3, b3), a3, b3))
    r = guard.last_report
    assert (r.seen, r.verified, r.unverified_ops) == (4, 4, {})
    with drill(model, GemmFault(op="mm")) as faults, sdc_guard.protect(model) as guard:
        torch.mm(a, b, out=out)
    assert faults.injections[0].changed and guard.last_report.detections


@pytest.mark.slow  # compiles torch's HOP wrappers: see CONTRIBUTING.md
def test_unknown_hop_runs_and_is_counted():
    from torch._higher_order_ops.scan import scan
    torch.manual_seed(0)
    model, init, xs = nn.Linear(4, 4), torch.eye(4), torch.randn(3, 4, 4)

    def step(c, x):
        n = c @ x
        return n, n.clone()

    ref = scan(step, init, xs)
    with sdc_guard.protect(model) as guard:
        out = scan(step, init, xs)
    assert torch.equal(out[0], ref[0])
    assert guard.last_report.unverified_ops == {"higher_order.scan": 1}


def _composites():
    torch.manual_seed(0)
    a, b, c = torch.randn(4, 8), torch.randn(8, 5), torch.randn(3, 4, 8)
    bil = nn.Bilinear(8, 6, 3)
    x2 = torch.randn(4, 6)
    return {
        # einsum and tensordot decompose to one bmm/mm; _trilinear (bilinear) runs two bmm per
        # output feature
        "einsum": (lambda: torch.einsum("bij,jk->bik", c, b), 1),
        "tensordot": (lambda: torch.tensordot(c, b, dims=([2], [0])), 1),
        "bilinear": (lambda: bil(a, x2), 2 * 3),
    }


@pytest.mark.parametrize("name", ["einsum", "tensordot", "bilinear"])
@pytest.mark.parametrize("ctx", ["inference_mode", "grad"])
def test_composite_ops_verified(name, ctx):
    fn, gemms = _composites()[name]
    model = nn.Linear(2, 2)
    context = torch.inference_mode if ctx == "inference_mode" else torch.enable_grad
    with context():
        ref = fn()
        with sdc_guard.protect(model) as guard:
            out = fn()
    r = guard.last_report
    assert r is not None and torch.equal(out, ref)
    assert (r.seen, r.verified, r.unverified_ops) == (gemms, gemms, {})


def test_einsum_fault_caught_in_inference():
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    c, b = torch.randn(3, 4, 8), torch.randn(8, 5)
    with torch.inference_mode():
        with drill(model, GemmFault(op="bmm")) as faults, sdc_guard.protect(model) as guard:
            torch.einsum("bij,jk->bik", c, b)
    assert len(faults.injections) == 1 and faults.injections[0].changed
    assert guard.last_report.verified == 1 and guard.last_report.detections


def test_sdpa_verified_under_inference_mode():
    """The composite SDPA reaches the mode undecomposed under inference_mode: decomposed,
    its fused kernel is verified like under no_grad, not passed silently."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 16, 8)
    with torch.inference_mode(), sdc_guard.protect(nn.Linear(2, 2)) as guard:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert guard.last_report.attention_checks == 1
    assert guard.last_report.unverified_ops == {}
