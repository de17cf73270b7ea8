"""Fused attention (SDPA) under protect(): the screen holds on clean kernels, drilled faults are confirmed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sdc_guard
from sdc_guard.backends import native_attention
from sdc_guard.core.attention import AttentionOperands, default_scale, backward_screen, forward_screen

aten = torch.ops.aten


def _screens(path: str):
    """(forward, backward) screen of ``path``: the torch reference or the native kernels
    (what protect() runs on CPU when the extension is built)."""
    if path == "torch":
        return forward_screen, backward_screen
    if not native_attention.available():
        pytest.skip(str(native_attention.unavailable_reason()))
    return native_attention.native_forward_screen, native_attention.native_backward_screen


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,causal,mask", [(4, 4, False, None), (4, 2, True, None), (4, 4, False, "float"),
                                                (4, 1, False, "bool")])
def test_clean_kernel_passes_the_screen(dtype, hq, hkv, causal, mask, path) -> None:
    forward_screen, backward_screen = _screens(path)
    torch.manual_seed(0)
    b, l, d = 2, 40, 16
    q, k, v = (torch.randn(b, h, l, d).mul(2).to(dtype) for h in (hq, hkv, hkv))
    m = None
    if mask == "float":
        m = torch.randn(b, 1, l, l).to(dtype)
    elif mask == "bool":
        m = torch.rand(l, l) > 0.3
        m[:, 0] = True
    additive = torch.zeros(l, l, dtype=dtype).masked_fill(~m, float("-inf")) if mask == "bool" else m
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=additive, scale=0.3)
    ops = AttentionOperands(q, k, v, m, causal, default_scale(d, 0.3))
    assert bool(forward_screen(ops, out).ok.all())
    do = torch.randn_like(out)
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal,
                                                                       attn_mask=additive, scale=0.3)
    check = backward_screen(ops, do, out, *grads)
    assert all(bool(c.ok.all()) for c in (check.dq, check.dk, check.dv))
    bad = out.clone()
    bad[1, 2, 5, 3] += 0.05 * out.abs().max()
    assert (~forward_screen(ops, bad).ok).nonzero().tolist() == [[1, 2, 5]]


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32))


def test_confirmation_examines_at_most_limit_heads_on_the_host() -> None:
    """HOST_HEADS (16) heads by default, worst D/T first; ``limit=None`` every flagged head
    (what ``bench detect --attention`` asks for). One row corrupted in each of 20 heads."""
    from sdc_guard.core.attention_confirm import HOST_HEADS, confirm_backward, confirm_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 20, 8, 16) for _ in range(3))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
    ops = AttentionOperands(q, k, v, None, False, default_scale(16, None))
    bad = out.clone()
    # head h off by 10 (h + 1) of its row's clean threshold: the last heads are the worst
    bad[0, :, 3, 0] += torch.arange(1, 21.0) * 10 * forward_screen(ops, out).threshold[0, :, 3]
    check = forward_screen(ops, bad)
    assert int((~check.ok).sum()) == 20
    default = confirm_forward(ops, bad, check, on_host=True)
    assert default.sdc[0, :, 3].nonzero().flatten().tolist() == list(range(20 - HOST_HEADS, 20))
    assert bool(confirm_forward(ops, bad, check, on_host=True, limit=None).sdc[0, :, 3].all())
    do = torch.randn_like(out)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, False)
    dv = dv.clone()
    dv[0, :, 3, 0] += torch.arange(1, 21.0) * 10 * backward_screen(ops, do, out, dq, dk, dv).dv.threshold[0, :, 3]
    bcheck = backward_screen(ops, do, out, dq, dk, dv)
    assert int((~bcheck.dv.ok).sum()) == 20
    assert int(confirm_backward(ops, do, out, dq, dk, dv, bcheck, on_host=True)[2].sdc.sum()) == HOST_HEADS
    assert bool(confirm_backward(ops, do, out, dq, dk, dv, bcheck, on_host=True, limit=None)[2].sdc[0, :, 3].all())


def test_sdpa_is_verified_and_counted() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Attn(), nn.Linear(32, 4))
    with sdc_guard.protect(model) as guard:
        model(torch.randn(2, 16, 32)).sum().backward()
    r = guard.last_report
    assert (r.flagged, r.unverified_ops, r.attention_checks, r.screen_misses) == (0, {}, 2, 0)


@pytest.mark.parametrize("op,output", [("sdpa", None), ("sdpa_backward", 0), ("sdpa_backward", 1),
                                       ("sdpa_backward", 2)])
def test_drilled_attention_fault_is_confirmed(op, output) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Attn(), nn.Linear(32, 4))
    with sdc_guard.drill(model, sdc_guard.GemmFault(op=op, output=output)), sdc_guard.protect(model) as guard:
        model(torch.randn(2, 16, 32)).sum().backward()
    (d,) = [x for x in guard.last_report.detections if x.op == op]
    assert (d.site, d.phase, d.segments) == ("0", "forward" if op == "sdpa" else "backward", [output or 0])


@pytest.mark.slow  # trains transformers models: see CONTRIBUTING.md
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "bert"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_transformers_sdpa_trains_clean(arch, precision) -> None:
    pytest.importorskip("transformers")
    from sdc_guard.tools.bench_models import build

    work = build(f"hf:{arch}", attn="sdpa")
    work.model.eval()  # no dropout: the fused kernel runs (dropout takes the math path on CPU)
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-3)
    with sdc_guard.protect(work.model, policy=sdc_guard.Policy(on_detection="log")) as guard:
        for step in range(2):
            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = work.loss_of(work.model, step)
                loss.backward()
                return loss.detach()
            outcome = guard.optimizer_step(opt, closure)
            r = outcome.report
            assert (r.flagged, r.screen_misses) == (0, 0)
            assert r.attention_checks == 4 and not any("sdpa" in op or "flash" in op for op in r.unverified_ops)
