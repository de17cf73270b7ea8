"""Interception coverage (docs/DESIGN.md, "Interception coverage"): higher-order ops never
stop a protected model, and every GEMM-bearing op is verified or counted."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

import sdc_guard
from sdc_guard.runtime.inject import GemmFault, drill

warnings.filterwarnings("ignore", category=UserWarning)


class FlexBlock(nn.Module):
    """A tiny attention block using flex attention between two Linears (no score_mod: with one,
    eager flex attention compiles it with fullgraph=True, which a dispatch mode makes dynamo
    refuse; docs/DESIGN.md, "Interception coverage")."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(q.contiguous(), k.contiguous(), v.contiguous())
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


@pytest.mark.xfail(reason="torch 2.13 eager flex_attention compiles its HOP wrapper with fullgraph=True, "
                   "which dynamo refuses under a non-infra dispatch mode: an open bug, see docs/LIMITS.md "
                   "(higher-order ops)", raises=RuntimeError, strict=False)
@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_flex_attention_body_verified(ctx):
    # CPU flex attention has no backward in torch (guard or not): the block runs forward
    # a flex attention compiled before (unguarded) makes eager flex under a dispatch mode
    # raise in torch 2.13 (fullgraph compile, frame skipped): start from a fresh dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = FlexBlock(), torch.randn(2, 8, 16)
    with ctx():
        with sdc_guard.protect(model) as guard:
            out = model(x)
        torch._dynamo.reset()
        ref = model(x)
    r = guard.last_report
    assert torch.equal(out, ref)
    # two Linears + the body's two matmuls (Q K^T, P V)
    assert (r.seen, r.verified, r.unverified_ops) == (4, 4, {})


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: self.a(x), lambda x: self.b(self.a(x)), (x,))


@pytest.mark.parametrize("sign,gemms", [(1.0, 1), (-1.0, 2)])
def test_cond_both_branches(sign, gemms):
    # eager torch.cond compiles a wrapper; one compiled unguarded before is traced through
    # the mode's handler when reused under it (torch 2.13): start from a fresh dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Branchy(), sign * torch.ones(4, 8)
    with torch.no_grad():
        with sdc_guard.protect(model) as guard:
            out = model(x)
        torch._dynamo.reset()
        ref = model(x)
    r = guard.last_report
    assert torch.equal(out, ref)
    assert (r.seen, r.verified, r.unverified_ops) == (gemms, gemms, {})


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
