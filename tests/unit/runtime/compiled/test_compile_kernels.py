"""Ops whose GEMMs run inside their own kernel, in compiled graphs: ``bilinear``
(``aten._trilinear``, forward and backward) is verified as the eager route verifies it, the
compiled results bit-identical to the unguarded compiled model's, and a drilled fault in
its GEMMs is caught and answered (docs/COMPILE.md, "Ops whose GEMMs are inside their
kernel")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import sdc_guard
from sdc_guard.runtime.compiled import graph_checks
from sdc_guard.runtime.drills.inject import GemmFault, drill

from gemm_count import fresh  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


class Bil(nn.Module):
    """A Linear, ``nn.Bilinear`` (``aten._trilinear``) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bil, self.head = nn.Linear(6, 6), nn.Bilinear(6, 4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bil(self.a(x), y)))


def _make() -> Bil:
    torch.manual_seed(0)
    return Bil()


def _inputs(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g).requires_grad_(), torch.randn(8, 4, generator=g)


def _step(model: Any, step: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward; the output and every gradient (the input's too)."""
    x, y = _inputs(step)
    out = model(x, y)
    out.square().sum().backward()
    return out.detach(), [x.grad]


def _grads(model: nn.Module, extra: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()] + [t.clone() for t in extra]


def _eager_seen() -> int:
    model = _make()
    with sdc_guard.protect(model, compiled=False) as guard:
        _step(model)
    report = guard.last_report
    assert report.unverified_ops == {} and report.verified == report.seen
    return report.seen


@pytest.mark.slow  # a model through torch.compile, guarded and not (about 4 s): see CONTRIBUTING.md
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.corpus)])  # 20 s
def test_compiled_bilinear_is_verified_and_bit_identical_to_the_unguarded_model(backend):
    expected = _eager_seen()  # the Linears' GEMMs and the bmm calls of _trilinear's kernel
    fresh()
    model = _make()
    compiled = torch.compile(model, backend=backend)
    clean_out, extra = _step(compiled)
    clean = _grads(model, extra)
    model.zero_grad()
    with sdc_guard.protect(model) as guard:
        out, extra = _step(compiled)
    report = guard.last_report
    assert guard.compiled
    assert torch.equal(out, clean_out)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, extra), clean, strict=True))
    assert (report.seen, report.verified, report.flagged, report.unverified_ops) == (expected, expected, 0, {})
    # the GEMMs of _trilinear's kernel, forward and backward, at the Bilinear module
    assert {("bil", "forward", "bmm"), ("bil", "backward", "bmm")} <= guard.ledger.sites_seen


@pytest.mark.slow  # a model through torch.compile: see CONTRIBUTING.md
@pytest.mark.parametrize("backend,phase", [("aot_eager", "forward"), ("aot_eager", "backward"),
                                           pytest.param("inductor", "forward", marks=pytest.mark.corpus)])
def test_drilled_fault_in_a_compiled_bilinear_is_detected(backend, phase):
    fresh()
    model = _make()
    compiled = torch.compile(model, backend=backend)
    fault = GemmFault(site="bil", op="bmm", phase=phase, call=1)
    with drill(model, fault) as injector, sdc_guard.protect(model) as guard:
        _step(compiled)
    report = guard.last_report
    assert [(i.site, i.op, i.phase) for i in injector.injections] == [("bil", "bmm", phase)]
    assert injector.injections[0].changed
    assert (report.detections[0].site, report.detections[0].phase, report.detections[0].op) == ("bil", phase, "bmm")
    assert report.flagged >= 1 and report.unverified_ops == {}
    assert graph_checks.active_drills() == ()


def _train(faults: tuple, steps: int = 2):
    fresh()
    model = _make()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outcomes = []
    with drill(model, *faults) as injector, sdc_guard.protect(model) as guard:
        for i in range(steps):
            def closure(i: int = i) -> torch.Tensor:
                opt.zero_grad()
                x, y = _inputs(i)
                loss = compiled(x, y).square().mean()
                loss.backward()
                return loss.detach()
            outcomes.append(guard.optimizer_step(opt, closure))
    return model, outcomes, injector


@pytest.mark.slow  # three training runs through torch.compile: see CONTRIBUTING.md
def test_a_fault_in_a_compiled_bilinear_is_recomputed_bit_exact_or_rolled_back():
    clean, clean_outcomes, _ = _train(())
    assert all(o.classification is None and not o.report.unverified_ops for o in clean_outcomes)
    faulted, outcomes, injector = _train((GemmFault(site="bil", op="bmm", phase="backward", step=1),))
    assert len(injector.injections) == 1 and injector.injections[0].changed
    hit = outcomes[1]
    assert (hit.classification, hit.action) == ("transient", "recompute")
    assert (hit.report.detections[0].site, hit.report.detections[0].op) == ("bil", "bmm")
    assert hit.reruns[0].flagged == 0 and hit.reruns[0].verified == hit.report.verified
    assert all(torch.equal(a, b) for a, b in zip(clean.parameters(), faulted.parameters(), strict=True))
    sticky = GemmFault(site="bil", op="bmm", phase="forward", step=1, sticky=True)
    _, outcomes, _ = _train((sticky,))
    assert (outcomes[1].classification, outcomes[1].action, outcomes[1].stepped) == ("persistent", "rollback", False)
