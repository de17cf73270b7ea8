"""Fused attention (SDPA) on the compiled route: checked inside the graphs, forward and backward,
with the eager route's screen, confirmation, reports and drills; the results bit-identical
to the unguarded compiled model's. Most tests compile with ``backend="aot_eager"``."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import pytest

import sdc_guard
from sdc_guard.runtime.compiled import function_mode, graph_checks
from sdc_guard.runtime.drills.inject import GemmFault, drill


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


class Attn(nn.Module):
    """Self-attention through ``F.scaled_dot_product_attention`` between two Linears. ``kv_heads``
    below ``heads``: grouped-query attention (``enable_gqa``); ``mask``: ``None``, ``"causal"``,
    ``"bool"`` or ``"float"`` (a padding-style mask); ``upcast``: q, k, v in fp32 (under autocast
    the call then casts them itself)."""

    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 4, mask: str | None = "causal",
                 scale: float | None = None, upcast: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * kv_heads * self.hd)
        self.o = nn.Linear(d, d)
        self.mask, self.scale, self.upcast, self.dropout = mask, scale, upcast, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        if self.upcast:
            q, k, v = q.float(), k.float(), v.float()
        options: dict = {"scale": self.scale, "dropout_p": self.dropout}
        if self.kv_heads != self.heads:
            options["enable_gqa"] = True
        if self.mask == "causal":
            options["is_causal"] = True
        elif self.mask == "bool":
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            keep[:, 0] = True
            options["attn_mask"] = keep
        elif self.mask == "float":
            pad = torch.zeros(b, 1, 1, t, device=x.device, dtype=q.dtype)
            pad[0, ..., -3:] = float("-inf")  # the first sequence's last three keys are padding
            options["attn_mask"] = pad
        y = F.scaled_dot_product_attention(q, k, v, **options)
        return self.o(y.transpose(1, 2).reshape(b, t, d).to(x.dtype))


class Net(nn.Module):
    def __init__(self, **attn: object) -> None:
        super().__init__()
        self.attn = Attn(**attn)  # type: ignore[arg-type]
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.attn(x)))


def attention_op(name: str) -> bool:
    """Whether an ``unverified_ops`` key names an attention call."""
    return "attention" in name or name.startswith(("sdpa", "flash", "math", "efficient", "cudnn"))


def step(model: nn.Module, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    y.float().square().mean().backward()
    return y.detach()


class Core(nn.Module):
    """Nothing but the SDPA call on its inputs (``alias``: pass one tensor as two or three of
    q, k, v); ``Wrapped`` adds only elementwise ops around it, so that the whole difference a
    guarded compiled step can make is the attention route's."""

    def __init__(self, alias: str = "", **options: object) -> None:
        super().__init__()
        self.alias, self.options = alias, options

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.alias == "qkv":
            k = v = q
        elif self.alias == "kv":
            v = k
        return F.scaled_dot_product_attention(q, k, v, **self.options)


class Wrapped(nn.Module):
    def __init__(self, **core: object) -> None:
        super().__init__()
        self.attn = Core(**core)  # type: ignore[arg-type]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn(q * 1.5, k, v).sin()


def sdpa_run(guarded: bool, dtype: torch.dtype = torch.float32, autocast: bool = False, kv_heads: int = 4,
             backend: str = "aot_eager", **core: object):
    """A compiled step of ``Wrapped`` on seeded leaf q, k, v ``[2, 4 | kv_heads, 12, 8]``:
    (output, dq, dk, dv, guard or None)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, generator=gen).to(dtype).requires_grad_() for h in (4, kv_heads, kv_heads))
    torch.manual_seed(0)  # dropout's random stream
    compiled = torch.compile(Wrapped(**core), backend=backend)
    guard = sdc_guard.protect(compiled) if guarded else None
    with guard if guard is not None else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = compiled(q, k, v)
        y.float().square().sum().backward()
    return y.detach(), q.grad, k.grad, v.grad, guard


def bool_mask() -> torch.Tensor:
    keep = torch.rand(12, 12, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[:, 0] = True
    return keep


def padding_mask() -> torch.Tensor:
    pad = torch.zeros(2, 1, 1, 12)
    pad[0, ..., -3:] = float("-inf")  # the first sequence's last three keys are padding
    return pad


CONFIGS = {
    "causal": dict(is_causal=True),
    "gqa-bool-mask": dict(kv_heads=2, enable_gqa=True, attn_mask=bool_mask()),
    "float-mask-scale": dict(attn_mask=padding_mask(), scale=0.3),
    "bf16": dict(dtype=torch.bfloat16, is_causal=True),
    "fp32-operands-under-bf16-autocast": dict(autocast=True, attn_mask=padding_mask()),
    "one-tensor-as-q-k-v": dict(alias="qkv", is_causal=True),
    "one-tensor-as-k-v-gqa": dict(alias="kv", kv_heads=2, enable_gqa=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_sdpa_is_verified_and_bit_identical_to_the_unguarded_model(name):
    config = dict(CONFIGS[name])
    clean = sdpa_run(False, **config)
    torch._dynamo.reset()
    before = function_mode.checks_run()
    *guarded, guard = sdpa_run(True, **config)
    for a, b in zip(clean[:4], guarded):  # the output and every input gradient, bit for bit
        assert (a is None and b is None) or torch.equal(a, b)
    report = guard.last_report
    assert (report.seen, report.verified, report.attention_checks) == (2, 2, 2)  # forward, backward
    assert (report.flagged, report.screen_misses, report.unverified_ops) == (0, 0, {})
    assert function_mode.checks_run() - before == 2  # the checks ran in the graphs
    assert guard.ledger.sites_seen == {("attn", "forward", "sdpa"), ("attn", "backward", "sdpa_backward")}
    assert not counters["graph_break"]


def test_compiled_model_with_sdpa_reports_like_eager():
    torch.manual_seed(0)
    model = Net(kv_heads=2)
    x = torch.randn(2, 12, 32)
    with sdc_guard.protect(model) as eager:
        step(model, x, False)
    compiled = torch.compile(model, backend="aot_eager")
    with sdc_guard.protect(compiled) as guard:
        step(compiled, x, False)
    e, c = eager.last_report, guard.last_report
    assert (c.seen, c.verified, c.attention_checks, c.flagged) == (e.seen, e.seen, 2, 0)
    assert c.unverified_ops == e.unverified_ops == {}
    assert {s for s in guard.ledger.sites_seen if s[2].startswith("sdpa")} == \
        {s for s in eager.ledger.sites_seen if s[2].startswith("sdpa")}  # the module that called SDPA


@pytest.mark.corpus  # inductor compiles C++ (about 20 s): CONTRIBUTING.md
@pytest.mark.slow  # inductor compiles C++: see CONTRIBUTING.md
def test_the_attention_checks_are_nodes_of_the_forward_and_backward_graphs():
    """The checks are put into the graphs AOT autograd partitions, on the fused attention
    kernel (forward and backward) as on every GEMM; inductor runs a pass the user set
    after them, unchanged (``post_grad_custom_post_pass``, which sees them here)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen: list[tuple[str, int]] = []

    class Capture(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            checks = [n for n in graph.nodes if n.target is torch.ops.sdc_guard.check_node.default]
            kinds = {n.args[0].split(".")[1] for n in checks}
            backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
            seen.append(("backward" if backward else "forward", len(checks), frozenset(kinds)))

        def uuid(self) -> str:
            return "test-capture"

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 12, 32)
    with inductor_config.patch(post_grad_custom_post_pass=Capture(), fx_graph_cache=False):
        with sdc_guard.protect(model) as guard:
            step(torch.compile(model), x, False)
    forward, backward = sorted(seen, key=lambda s: s[0] != "forward")
    assert forward == ("forward", 5, frozenset({"addmm", "_scaled_dot_product_flash_attention_for_cpu"}))
    assert backward[0] == "backward" and "_scaled_dot_product_flash_attention_for_cpu_backward" in backward[2]
    report = guard.last_report
    assert report.attention_checks == 2 and report.verified == report.seen == forward[1] + backward[1]


@pytest.mark.parametrize("op,output", [("sdpa", None), ("sdpa_backward", 0), ("sdpa_backward", 1),
                                       ("sdpa_backward", 2)])
def test_drilled_attention_fault_is_detected_and_confirmed_on_the_compiled_route(op, output):
    torch.manual_seed(0)
    model = Net(kv_heads=2, mask="causal")
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 12, 32)
    fault = GemmFault(op=op, output=output)
    with drill(compiled, fault) as injector, sdc_guard.protect(compiled) as guard:
        step(compiled, x, False)
    report = guard.last_report
    assert [(i.site, i.op) for i in injector.injections] == [("attn", op)] and injector.injections[0].changed
    (d,) = report.detections
    assert (d.site, d.op, d.phase, d.segments) == ("attn", op, "forward" if op == "sdpa" else "backward",
                                                   [output or 0])
    assert report.flagged == 1 and report.screen_misses == 0
    assert graph_checks.active_drills() == ()  # the finished drill left no injection point


def _train(faults: tuple, steps: int = 2):
    torch.manual_seed(0)
    model = Net(kv_heads=2, mask="causal")
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outcomes = []
    with drill(compiled, *faults) as injector, sdc_guard.protect(compiled) as guard:
        for i in range(steps):
            x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(i))

            def closure(x=x):
                opt.zero_grad()
                loss = compiled(x).square().mean()
                loss.backward()
                return loss
            outcomes.append(guard.optimizer_step(opt, closure))
    return model, outcomes, injector


@pytest.mark.parametrize("op,output", [pytest.param("sdpa", None, marks=pytest.mark.slow), ("sdpa_backward", 1)])
def test_transient_attention_fault_is_recomputed_to_the_clean_compiled_run(op, output):
    clean, clean_outcomes, _ = _train(())
    assert all(o.classification is None and o.report.attention_checks == 2 for o in clean_outcomes)
    faulted, outcomes, injector = _train((GemmFault(op=op, output=output, step=1),))
    assert len(injector.injections) == 1 and injector.injections[0].changed
    hit = outcomes[1]
    assert (hit.classification, hit.action) == ("transient", "recompute")
    # a corrupted O is also what the backward kernel reads (as on the eager route): its
    # gradients can be flagged too, after the forward's detection
    assert (hit.report.detections[0].site, hit.report.detections[0].op) == ("attn", op)
    assert {(d.site, d.op) for d in hit.report.detections} <= {("attn", "sdpa"), ("attn", "sdpa_backward")}
    assert hit.reruns[0].flagged == 0 and hit.reruns[0].attention_checks == 2
    for a, b in zip(clean.parameters(), faulted.parameters()):
        assert torch.equal(a, b)  # the run went on bit-identical to the clean one


def test_calls_the_screen_cannot_cover_run_as_called_and_are_counted():
    # dropout > 0: on CPU the call takes the math kernel, whose batched matmuls AOT
    # autograd decomposes into the graph: verified as GEMMs, as on the eager route
    clean = sdpa_run(False, dropout_p=0.5)
    torch._dynamo.reset()
    *guarded, guard = sdpa_run(True, dropout_p=0.5)
    assert all(torch.equal(a, b) for a, b in zip(clean[:4], guarded))
    report = guard.last_report
    assert (report.seen, report.verified, report.attention_checks, report.flagged, report.unverified_ops) == \
        (6, 6, 0, 0, {})
    assert {op for _, _, op in guard.ledger.sites_seen} == {"bmm"}

    # non-4-D operands: the call runs unchanged, counted as a layout it does not cover
    def three_d(q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.randn(3, 8, 16, requires_grad=True)
    ref = torch.compile(three_d, backend="aot_eager")(q)
    torch._dynamo.reset()
    with sdc_guard.protect(nn.Linear(1, 1), compiled=True) as guard:
        out = torch.compile(three_d, backend="aot_eager")(q)
    assert torch.equal(out, ref)
    with sdc_guard.protect(nn.Linear(1, 1), compiled=False) as eager:
        three_d(q)
    # a non-4-D call takes the math kernel: its matmuls verified as GEMMs, as on the eager route
    assert (guard.last_report.seen, guard.last_report.verified, guard.last_report.unverified_ops) == \
        (eager.last_report.seen, eager.last_report.seen, {}) and eager.last_report.seen > 0


def test_a_math_kernel_is_verified_as_its_gemms():
    # a last dimension with stride != 1: the dispatcher runs the math kernel, whose batched
    # matmuls are nodes of the graph: verified as GEMMs, as on the eager route
    def strided(q: torch.Tensor) -> torch.Tensor:
        t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, last-dim stride 8
        return F.scaled_dot_product_attention(t, t, t)

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    assert torch._fused_sdp_choice(q.transpose(-1, -2).contiguous().transpose(-1, -2), q, q) == 0
    with sdc_guard.protect(nn.Linear(1, 1), compiled=True) as guard:
        torch.compile(strided, backend="aot_eager")(q).sum().backward()
    r = guard.last_report
    assert (r.seen, r.verified, r.unverified_ops, r.attention_checks) == (6, 6, {}, 0)


@pytest.mark.corpus  # inductor compiles C++ (about 6 s): CONTRIBUTING.md
@pytest.mark.slow  # inductor compiles C++ (about a minute here): see CONTRIBUTING.md
def test_inductor_compiled_sdpa_is_bit_identical_and_a_fault_caught():
    for config in (dict(is_causal=True, kv_heads=2, enable_gqa=True), dict(autocast=True, attn_mask=padding_mask())):
        clean = sdpa_run(False, backend="inductor", **config)
        torch._dynamo.reset()
        *guarded, guard = sdpa_run(True, backend="inductor", **config)
        assert all(torch.equal(a, b) for a, b in zip(clean[:4], guarded))
        report = guard.last_report
        assert (report.attention_checks, report.flagged, report.unverified_ops) == (2, 0, {})
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model)
    with drill(compiled, GemmFault(op="sdpa_backward", output=2)), sdc_guard.protect(compiled) as guard:
        step(compiled, torch.randn(2, 12, 32), False)
    assert [(d.site, d.op, d.segments) for d in guard.last_report.detections] == [("attn", "sdpa_backward", [2])]
    assert not counters["graph_break"]


@pytest.mark.slow  # whole transformers models through torch.compile: see CONTRIBUTING.md
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "bert"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_transformers_sdpa_trains_clean(arch, precision):
    pytest.importorskip("transformers")
    from sdc_guard.tools.bench_models import build

    work = build(f"hf:{arch}", attn="sdpa")
    work.model.eval()  # no dropout: the fused kernel runs (dropout takes the math path on CPU)
    compiled = torch.compile(work.model, backend="aot_eager")
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-3)
    with sdc_guard.protect(compiled, policy=sdc_guard.Policy(on_detection="log")) as guard:
        for i in range(3):
            def closure(i: int = i) -> torch.Tensor:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = work.loss_of(compiled, i)
                loss.backward()
                return loss.detach()
            r = guard.optimizer_step(opt, closure).report
            assert (r.flagged, r.screen_misses) == (0, 0)
            assert r.attention_checks == 4  # 2 layers, forward and backward: every call verified
            assert not [op for op in r.unverified_ops if attention_op(op)]
    assert not [k for k in counters["graph_break"] if "sdc_guard" in k or "check_" in k or "Tap" in k]


class FlexAttn(nn.Module):
    """Flex attention (a soft-capping ``score_mod``, a causal block mask) between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = create_block_mask(_causal, None, None, t, t, device=x.device)
        return self.o(flex_attention(q, k, v, score_mod=_softcap, block_mask=mask).transpose(1, 2).reshape(b, t, 16))


class FlexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = FlexAttn(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.attn(x)))


def _causal(b, h, q, kv):  # noqa: ANN001, ANN202  (flex attention's mask_mod signature)
    return q >= kv


def _softcap(score, b, h, q, kv):  # noqa: ANN001, ANN202  (flex attention's score_mod signature)
    return torch.tanh(score / 5) * 5 + (q - kv) * 0.01


def _flex_model() -> FlexNet:
    torch.manual_seed(0)
    return FlexNet()


def _flex_x() -> torch.Tensor:
    return torch.randn(2, 128, 16, generator=torch.Generator().manual_seed(3))


@pytest.mark.corpus  # flex attention through torch.compile, guarded and not, two backends (about 40 s)
@pytest.mark.slow
def test_compiled_flex_attention_is_verified_with_aot_eager_and_counted_with_inductor():
    """CPU flex attention has no backward in torch 2.13: forward only (``no_grad``)."""
    x = _flex_x()
    with torch.no_grad():
        eager_model = _flex_model()
        with sdc_guard.protect(eager_model, compiled=False) as eager:
            eager_model(x)
        expected = eager.last_report
        # three Linears and the two matmuls of the dense kernel
        assert expected.unverified_ops == {} and expected.verified == expected.seen == 5
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            model = _flex_model()
            compiled = torch.compile(model, backend=backend)
            clean = compiled(x)
            with sdc_guard.protect(model) as guard:
                out = compiled(x)
            report = guard.last_report
            assert torch.equal(out, clean)
            if backend == "aot_eager":  # the dense kernel the graph runs, its two matmuls checked
                assert (report.seen, report.verified, report.flagged, report.unverified_ops) == (5, 5, 0, {})
                assert guard.ledger.sites_seen == eager.ledger.sites_seen
                assert ("attn", "forward", "matmul") in guard.ledger.sites_seen
            else:  # inductor's fused flex kernel: counted (docs/COMPILE.md, "Limits")
                assert (report.seen, report.verified, report.unverified_ops) == \
                    (3, 3, {"higher_order.flex_attention": 1})


@pytest.mark.corpus  # flex attention through torch.compile (about 10 s)
@pytest.mark.slow
def test_drilled_fault_in_compiled_flex_attention_is_detected():
    model = _flex_model()
    compiled = torch.compile(model, backend="aot_eager")
    fault = GemmFault(site="attn", op="matmul", call=1)  # P V, the second of the kernel's matmuls
    with torch.no_grad(), drill(model, fault) as injector, sdc_guard.protect(model) as guard:
        compiled(_flex_x())
    report = guard.last_report
    assert [(i.site, i.op) for i in injector.injections] == [("attn", "matmul")] and injector.injections[0].changed
    assert [(d.site, d.phase, d.op) for d in report.detections] == [("attn", "forward", "matmul")]
    assert report.flagged == 1 and report.unverified_ops == {}
    assert graph_checks.active_drills() == ()
