"""The compiled route's per-check plumbing (issue 31): ``check_node``'s arguments are one
tensor list and one plan string, decoded once per node (``graph_ops.NodePlan``), and the
function mode passes what compiled code calls at run time (aten overloads, ``out=``
calls) without routing it. Fast: no ``torch.compile``; the check op is called as a
compiled graph calls it, with a recording sink."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sdc_guard.runtime.compiled import graph_checks, graph_ops
from sdc_guard.runtime.compiled.function_mode import GemmFunctionMode
from sdc_guard.runtime.compiled.module_names import ModuleNames
from sdc_guard.runtime.dispatch.ops import Gemm


def _is_tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


class RecordingSink:
    """A ``CheckSink`` that keeps what it is handed."""

    def __init__(self, model: nn.Module) -> None:
        self.gemms: list[tuple[Gemm, str | None, str | None]] = []
        self.unverified: list[str] = []
        self.charged = 0.0
        self.module_names = ModuleNames(model)

    def on_gemm(self, gemm: Gemm, site: str | None = None, phase: str | None = None) -> None:
        self.gemms.append((gemm, site, phase))

    def on_attention(self, call: Any, site: str | None = None, phase: str | None = None) -> None:
        raise AssertionError("no attention here")

    def on_unverified(self, op: str) -> None:
        self.unverified.append(op)

    def charge(self, seconds: float) -> None:
        self.charged += seconds


def _sinking(sink: Any):
    class Scope:
        def __enter__(self) -> Any:
            self.previous = graph_checks.set_sink(sink)
            return sink

        def __exit__(self, *exc: Any) -> None:
            graph_checks.set_sink(self.previous)
    return Scope()


def test_a_node_plan_rebuilds_the_call_its_outputs_and_anchors() -> None:
    bias, x, wt, out, w = torch.randn(4), torch.randn(3, 5), torch.randn(5, 4), torch.randn(3, 4), torch.randn(4, 5)
    (op, tensors, plan), kwargs = graph_ops.encode_node("aten.addmm.default", (bias, x, wt), {}, [out], [bias, w],
                                                         "fc", "Model", _is_tensor)
    assert kwargs == {} and op == "aten.addmm.default" and isinstance(plan, str)
    assert [t is u for t, u in zip(tensors, (bias, x, wt, out, bias, w))] == [True] * 6
    node = graph_ops.node_plan(op, plan)
    assert node is graph_ops.node_plan(op, plan)  # decoded once per node
    assert node.func is torch.ops.aten.addmm.default and node.positions == (0, 1, 2)
    assert (node.site, node.fallback, node.n_in, node.n_out) == ("fc", "Model", 3, 1)
    args, kw, got_out, anchors = node.call(tensors)
    assert kw == {} and [a is b for a, b in zip(args, (bias, x, wt))] == [True] * 3
    assert got_out is out and len(anchors) == 2 and anchors[0] is bias and anchors[1] is w


def test_a_node_plan_with_literals_keywords_and_a_tuple_of_outputs() -> None:
    bias, x, wt, out = torch.randn(4), torch.randn(3, 5), torch.randn(5, 4), torch.randn(3, 4)
    (op, tensors, plan), _ = graph_ops.encode_node("aten.addmm.default", (bias, x, wt), {"beta": 0.5, "alpha": 2},
                                                    [out, None], [], "", "global", _is_tensor)
    node = graph_ops.node_plan(op, plan)
    assert node.positions is None  # keywords: the template is filled in
    args, kwargs, got_out, anchors = node.call(tensors)
    assert [a is b for a, b in zip(args, (bias, x, wt))] == [True] * 3 and kwargs == {"beta": 0.5, "alpha": 2}
    assert isinstance(got_out, tuple) and got_out[0] is out and got_out[1] is None and anchors == []


def test_check_node_hands_the_gemm_to_the_sink_at_its_site_and_drills_only_when_entered() -> None:
    model = nn.Sequential(nn.Linear(5, 4))
    lin = model[0]
    x = torch.randn(3, 5)
    with torch.no_grad():
        out = torch.addmm(lin.bias, x, lin.weight.t())
    (op, tensors, plan), _ = graph_ops.encode_node("aten.addmm.default", (lin.bias, x, lin.weight.t()), {}, [out],
                                                    [lin.bias, lin.weight], "", "Sequential", _is_tensor)
    before = graph_checks.checks_run()
    assert torch.ops.sdc_guard.check_node.default(op, tensors, plan) is None  # no sink: nothing
    assert graph_checks.checks_run() == before
    sink = RecordingSink(model)
    with _sinking(sink):
        torch.ops.sdc_guard.check_node.default(op, tensors, plan)
        hits: list[str] = []

        def corrupt(name: str, t: Any, site: str, phase: str) -> None:
            hits.append(site)

        graph_checks.add_drill(corrupt)
        try:
            torch.ops.sdc_guard.check_node.default(op, tensors, plan)
        finally:
            graph_checks.remove_drill(corrupt)
    assert graph_checks.checks_run() == before + 2
    assert len(sink.gemms) == 2 and hits == ["0"]  # the module owning the weight names the site
    gemm, site, phase = sink.gemms[0]
    assert (gemm.op, site, phase) == ("addmm", "0", "forward")
    assert gemm.a is x and gemm.bias is lin.bias and gemm.out is out
    assert torch.equal(gemm.b, lin.weight.t()) and sink.charged > 0.0


def test_the_function_mode_passes_aten_overloads_and_out_calls_and_routes_the_rest() -> None:
    model = nn.Sequential(nn.Linear(5, 4))
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    c = torch.empty(3, 4)
    sink = RecordingSink(model)
    before = graph_checks.checks_run()
    with _sinking(sink), GemmFunctionMode(compiled=True):
        torch.mm(a, b, out=c)  # inductor's extern kernel: its graph holds the check
        d = torch.ops.aten.mm.default(a, b)  # an aot_eager graph's op: the same
        assert graph_checks.checks_run() == before and sink.gemms == [] and sink.unverified == []
        e = torch.mm(a, b)  # eager code: checked
    assert graph_checks.checks_run() == before + 1 and len(sink.gemms) == 1
    assert torch.equal(c, a @ b) and torch.equal(d, a @ b) and torch.equal(e, a @ b)
