"""Stale weight encodings: every way a weight legitimately changes leaves the weight-side
cache correct, and a bit flipped in a weight at rest is still caught.

The cache keys an encoding by the parameter's version counter. foreach and fused
optimizer kernels, and writes through ``.data``, change a parameter without bumping it,
so the cache served the previous weights' encoding and every GEMM reading a weight was
flagged from the second step on (rolled back, then exit 17 at step 3). Each test here
trains a small transformer for a few steps with every GEMM verified and requires: no
detection, no response, and no screen miss (the cache itself correct, not a stale
encoding hidden by the confirmation).
"""

import inspect

import pytest
import torch


import sdc_guard  # noqa: E402
from respond_helpers import closure_for, make_model, params_of  # noqa: E402
from sdc_guard import Policy  # noqa: E402

STEPS = 6


def _optimizers_with_foreach() -> list[str]:
    """Every optimizer of ``torch.optim`` that takes ``foreach`` (the installed torch's)."""
    names = []
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
                and "foreach" in inspect.signature(cls.__init__).parameters):
            names.append(name)
    return names


def _variants() -> list[tuple[str, str]]:
    cases = []
    for name in _optimizers_with_foreach():
        cases += [(name, "for-loop"), (name, "foreach")]
        if "fused" in inspect.signature(getattr(torch.optim, name).__init__).parameters:
            cases.append((name, "fused"))
    return cases


VARIANT_FLAGS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def make_optimizer(name: str, variant: str, params) -> torch.optim.Optimizer:
    try:
        return getattr(torch.optim, name)(params, lr=1e-2, **VARIANT_FLAGS[variant])
    except RuntimeError as exc:  # a fused implementation this device lacks
        pytest.skip(f"{name}({variant}) is not supported here: {exc}")


def test_the_optimizer_list_covers_the_usual_ones() -> None:
    cases = _variants()
    for must in ("SGD", "Adam", "AdamW"):
        assert {(must, v) for v in VARIANT_FLAGS} <= set(cases)


def _step_problems(outcome: sdc_guard.StepOutcome) -> tuple | None:
    r = outcome.report
    if r.flagged or outcome.classification is not None or outcome.reruns or not outcome.stepped:
        return (r.step, r.flagged, outcome.classification, outcome.action,
                [(d.site, d.phase, d.op, round(d.ratio, 3)) for d in r.detections[:3]])
    return None


def _screen_misses(reports: list[sdc_guard.StepReport]) -> list:
    misses = [getattr(r, "screen_misses", None) for r in reports]
    assert None not in misses, "StepReport has no screen_misses"
    return misses


@pytest.mark.parametrize(("name", "variant"), _variants(), ids=[f"{n}-{v}" for n, v in _variants()])
def test_every_optimizer_variant_trains_without_a_detection(name: str, variant: str) -> None:
    """The default ``Policy()`` (recompute, roll back, exit): a clean run must never
    re-execute, roll back or exit, whatever kernel updated the weights."""
    model = make_model()
    opt = make_optimizer(name, variant, model.parameters())
    start = params_of(model)
    problems, reports = [], []
    with sdc_guard.protect(model) as guard:
        for step in range(STEPS):
            try:
                outcome = guard.optimizer_step(opt, closure_for(model, opt, step))
            except sdc_guard.SDCExit as exc:
                problems.append((step, "exit", exc.code))
                break
            reports.append(outcome.report)
            problem = _step_problems(outcome)
            if problem:
                problems.append(problem)
    assert not problems, f"{name}({variant}): (step, flagged, classification, action, detections): {problems}"
    changed = [not torch.equal(a, b) for a, b in zip(start, params_of(model))]
    assert all(changed), f"{name}({variant}) left {changed.count(False)} parameters unchanged: the test proves nothing"
    assert sum(_screen_misses(reports)) == 0, f"{name}({variant}): the screen flagged a clean weight GEMM (a stale encoding?)"


def _write(how: str, model: torch.nn.Module, step: int) -> None:
    """Change every parameter of ``model`` the way ``how`` says (seeded from ``step``)."""
    gen = torch.Generator().manual_seed(500 + step)
    if how == "no_grad_inplace":
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
    elif how == "data_add":
        for p in model.parameters():
            p.data.add_(torch.randn(p.shape, generator=gen) * 1e-2)
    elif how in ("load_state_dict", "load_state_dict_assign"):
        # A fresh model's state, every entry moved by seeded noise: its LayerNorms start at
        # ones and zeros whatever the seed, and a write that leaves a parameter equal
        # would test nothing for it.
        state = {k: v + torch.randn(v.shape, generator=gen) * 1e-2
                 for k, v in make_model(seed=10 + step).state_dict().items()}
        model.load_state_dict(state, assign=how.endswith("assign"))
    else:
        raise ValueError(how)


WRITES = ("no_grad_inplace", "data_add", "load_state_dict", "load_state_dict_assign")


@pytest.mark.parametrize("loop", ("optimizer_step", "guard_step"))
@pytest.mark.parametrize("how", WRITES)
def test_weights_written_between_steps_of_one_block_are_not_flagged(how: str, loop: str) -> None:
    """One long-lived ``protect()`` block; between its steps every parameter is rewritten
    (in place under ``no_grad``, through ``.data``, or by ``load_state_dict``, also with
    ``assign=True``, which replaces the parameters). Steps run either through
    ``guard.optimizer_step`` (AdamW, the default Policy) or as observation only
    (forward and backward, then ``guard.step()``)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    problems, reports = [], []
    with sdc_guard.protect(model) as guard:
        for step in range(STEPS):
            if loop == "optimizer_step":
                try:
                    outcome = guard.optimizer_step(opt, closure_for(model, opt, step))
                except sdc_guard.SDCExit as exc:
                    problems.append((step, "exit", exc.code))
                    break
                reports.append(outcome.report)
                problem = _step_problems(outcome)
                if problem:
                    problems.append(problem)
            else:
                closure_for(model, opt, step)()
            before = params_of(model)
            _write(how, model, step)
            assert not any(torch.equal(a, b) for a, b in zip(before, params_of(model)))
            if loop == "guard_step":
                report = guard.step()
                reports.append(report)
                if report.flagged:
                    problems.append((report.step, report.flagged,
                                     [(d.site, d.phase, d.op, round(d.ratio, 3)) for d in report.detections[:3]]))
    assert not problems, f"{how} ({loop}): flagged steps: {problems}"
    assert sum(_screen_misses(reports)) == 0, f"{how} ({loop}): the screen flagged a clean weight GEMM"


@pytest.mark.parametrize("variant", ("for-loop", "foreach", "fused"))
@pytest.mark.parametrize("name", ("AdamW", "SGD"))
def test_optimizer_stepped_outside_optimizer_step_is_not_flagged(name: str, variant: str) -> None:
    """The README's observation-only loop: ``opt.step()`` inside one long-lived block,
    ``guard.step()`` at each step boundary; the guard never sees the step coming."""
    model = make_model()
    opt = make_optimizer(name, variant, model.parameters())
    flagged, reports = [], []
    with sdc_guard.protect(model, policy=Policy(on_detection="log")) as guard:
        for step in range(STEPS):
            closure_for(model, opt, step)()
            opt.step()
            report = guard.step()
            reports.append(report)
            if report.flagged:
                flagged.append((report.step, report.flagged, [d.site for d in report.detections[:3]]))
    assert not flagged, f"{name}({variant}): (step, flagged GEMMs, sites): {flagged}"
    assert sum(_screen_misses(reports)) == 0, f"{name}({variant}): the screen flagged a clean weight GEMM"


@pytest.mark.parametrize("variant", ("for-loop", "foreach", "fused"))
def test_a_bit_flipped_in_a_weight_at_rest_is_still_detected(variant: str) -> None:
    """Whatever the cache does about foreach and fused updates, a weight corrupted in
    memory between two steps (no version bump, no Python write the guard could see as a
    deliberate one) must still be caught at its site, reproduce on re-execution
    (PERSISTENT) and be rolled back to the last good snapshot."""
    model = make_model()
    opt = make_optimizer("AdamW", variant, model.parameters())
    store = sdc_guard.SnapshotStore(model, opt, every=1)
    with sdc_guard.protect(model, snapshots=store) as guard:
        clean = [guard.optimizer_step(opt, closure_for(model, opt, step)) for step in range(3)]
        assert [(o.report.flagged, o.classification) for o in clean] == [(0, None)] * 3
        weight = model.blocks[0].fc1.weight
        version = weight._version
        hit = sdc_guard.flip_parameter_bit(model, "blocks.0.fc1.weight", (7, 3), bit=30, direction="on")
        assert hit.changed and weight._version == version
        outcome = guard.optimizer_step(opt, closure_for(model, opt, 3))
        after = guard.optimizer_step(opt, closure_for(model, opt, 4))
    assert outcome.report.flagged >= 1 and "blocks.0.fc1" in {d.site for d in outcome.report.detections}
    assert (outcome.classification, outcome.action, outcome.rolled_back_to) == ("persistent", "rollback", 2)
    assert float(model.blocks[0].fc1.weight.detach()[7, 3].abs()) < 1e3  # the snapshot's value is back
    assert after.classification is None and after.stepped and after.report.flagged == 0
