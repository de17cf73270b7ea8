"""The exact confirmation, the screens, the statistics mode, and what the one-call path skips.

Every flag of the screen is settled by ``sdc_guard.core.confirm`` before anything acts on it:
these tests drive the confirmation with every segment flagged (as a screen gone wrong
would), on correctly computed products of structured operands, and check that it clears
them all and still confirms a corruption of one element.
"""

from __future__ import annotations

import math

import pytest
import torch

import sdc_guard
from sdc_guard import backends
from sdc_guard.backends import GemmRequest, TorchBackend
from sdc_guard.core.confirm import Accumulation, confirm, element_bounds, gamma
from sdc_guard.core.precision import SCREENS, resolve_screen

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def everywhere(shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """(ok, inputs_bad) of a screen that flagged every segment."""
    flagged = torch.zeros(shape, dtype=torch.bool)
    return flagged, torch.zeros_like(flagged)


def structured(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-gradient rows times column-shifted B: the operands the bracket misjudges."""
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(96, 700, generator=gen) * 0.5).softmax(-1)
    p[torch.arange(96), torch.randint(0, 700, (96,), generator=gen)] -= 1
    a = (p.t() / 96).contiguous().to(dtype)  # [700, 96]
    b = (torch.randn(96, 520, generator=gen) + 3 * torch.randn(520, generator=gen)).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
def test_correct_products_are_cleared_and_one_wrong_element_is_confirmed(dtype: torch.dtype, on_host: bool) -> None:
    a, b = structured(dtype, 1)
    c = a @ b  # torch's own product, as training computes it
    nseg = 3
    ok, bad_in = everywhere(torch.Size((700, nseg)))
    if on_host:  # every segment examined
        conf = confirm(GemmRequest(a, b, c, 1e-3), ok, bad_in, on_host=True, limit=None)
        assert conf.examined.all() and not conf.sdc.any() and not conf.stale.any()
    scale = c.float().abs().mean()
    wrong = c.clone()
    wrong[123, 300] = (wrong[123, 300].float() + 0.5 * scale).to(dtype)
    score = torch.zeros(700, nseg)
    score[123, 1] = 10.0  # what a screen's D/T would say: the device path examines the worst first
    conf = confirm(GemmRequest(a, b, wrong, 1e-3), ok, bad_in, score, on_host=on_host)
    assert conf.sdc.nonzero().tolist() == [[123, 1]]


def test_a_legitimate_fp16_overflow_is_not_corruption_but_nan_from_finite_inputs_is() -> None:
    a = torch.full((4, 64), 60.0, dtype=torch.float16)
    b = torch.full((64, 8), 30.0, dtype=torch.float16)
    c = a @ b  # 115200 > 65504: inf, legitimately
    assert torch.isinf(c).all()
    ok, bad_in = everywhere(torch.Size((4, 1)))
    conf = confirm(GemmRequest(a, b, c, 1e-3), ok, bad_in)
    assert conf.overflow.all() and not conf.sdc.any()
    small = torch.ones(4, 64, dtype=torch.float16)
    c2 = small @ small.t()
    c2[2, 1] = float("nan")
    conf = confirm(GemmRequest(small, small.t(), c2, 1e-3), *everywhere(torch.Size((4, 1))))
    assert conf.sdc.flatten().tolist() == [False, False, True, False] and not conf.overflow.any()


@pytest.mark.slow  # large products: see CONTRIBUTING.md
def test_reduced_fp32_matmul_precision_is_within_the_bound() -> None:
    """With ``set_float32_matmul_precision("medium")`` a device may multiply fp32 in bf16:
    the bound assumes operand rounding of 2^-8 then, and clears what such a device makes."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(64, 512, generator=gen), torch.randn(512, 300, generator=gen)
    c = (a.bfloat16().float() @ b.bfloat16().float())  # the worst a bf16-internal device does
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        conf = confirm(GemmRequest(a, b, c, 1e-3), *everywhere(torch.Size((64, 2))), limit=None)
        assert not conf.sdc.any()
    finally:
        torch.set_float32_matmul_precision(previous)
    conf = confirm(GemmRequest(a, b, c, 2e-5), *everywhere(torch.Size((64, 2))), limit=None)
    assert conf.sdc.any()  # at full precision the same C is wrong: the model is not vacuous


def test_element_bound_terms() -> None:
    """Each term of the bound is there: accumulation, C's rounding, the floor."""
    exact = torch.tensor([100.0], dtype=torch.float64)
    absprod = torch.tensor([1000.0], dtype=torch.float64)
    model = Accumulation()
    bound = float(element_bounds(exact, absprod, None, 512, torch.bfloat16, model, epilogue=False))
    acc = 1000.0 * gamma(512, 2.0**-24)
    assert bound > acc + 2.0**-8 * 100.0 and bound < 1.01 * (acc + 2.0**-8 * (100.0 + acc)) + 1e-30
    assert math.isinf(gamma(2**24, 2.0**-24))


def test_both_screens_see_one_rms_in_bf16_and_the_tight_one_half_of_it() -> None:
    """bf16, K = 1024: the default screen's rigorous rounding term is at most one RMS of
    a full segment (``u_C sum |C| <= u_C n_s rms = rms``), so an error of one RMS is seen in
    every row; the tight screen's probabilistic term sits about three times lower and
    sees half an RMS where the default sees nothing."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(64, 1024, generator=gen).bfloat16(), torch.randn(1024, 512, generator=gen).bfloat16()
    c = a @ b
    rms = c.float().pow(2).mean(-1).sqrt()
    cols = torch.randint(0, 512, (64,), generator=gen)
    seen = {}
    for factor in (0.5, 1.0):
        bad = c.clone()
        bad[torch.arange(64), cols] = (bad[torch.arange(64), cols].float() + factor * rms).bfloat16()
        seen[factor] = (len(sdc_guard.verify_matmul(a, b, bad, screen="tight").rows),
                        len(sdc_guard.verify_matmul(a, b, bad).rows))
    assert seen == {0.5: (64, 0), 1.0: (64, 64)}, seen
    for screen in SCREENS:
        clean = sdc_guard.verify_matmul(a, b, c, screen=screen)
        assert clean.ok and clean.screen_misses == 0 and clean.ratio < 0.5
    terms = resolve_screen("tight", None, torch.bfloat16, torch.device("cpu"))[1]
    assert (terms.bounded, terms.sigmas, terms.coherent) == (1.0, 6.0, 1.0)
    with pytest.raises(ValueError, match="screen"):
        sdc_guard.verify_matmul(a, b, c, screen="loose")
    assert set(SCREENS) == {"default", "tight"}


def test_stats_mode_records_every_verified_gemm_per_site() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    with sdc_guard.protect(model, stats=True) as guard:
        for _ in range(3):
            model(torch.randn(16, 32)).sum().backward()
            guard.step()
    rows = guard.screen_stats.summary()
    assert sum(r.calls for r in rows) == sum(r.verified for r in guard.reports)
    assert {(r.site, r.phase) for r in rows} == {("0", "forward"), ("2", "forward"), ("0", "backward"),
                                                 ("2", "backward")}
    assert all(r.flagged == 0 and 0 <= r.p50 <= r.p99 <= r.max < 1 for r in rows)
    assert guard.screen_stats.overall().calls == sum(r.calls for r in rows)
    with sdc_guard.protect(model) as plain:
        model(torch.randn(2, 32)).sum().backward()
    assert plain.screen_stats is None


def test_program_writes_to_weights_are_not_flagged_but_a_flipped_bit_is() -> None:
    """``p.data`` writes and a foreach optimizer inside a long-lived block remake the
    cached encodings; a bit flipped in memory does not, and is confirmed as a weight
    corrupted at rest."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    x, y = torch.randn(16, 32), torch.randn(16, 8)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    with sdc_guard.protect(model, policy=sdc_guard.Policy(on_detection="log")) as guard:
        for _ in range(3):
            assert guard.optimizer_step(opt, closure).report.flagged == 0
            model[0].weight.data.mul_(0.5)  # a program's write that bypasses the version counter
        assert sdc_guard.flip_parameter_bit(model, "2.weight", (3, 5), bit=27, direction="flip").changed
        report = guard.optimizer_step(opt, closure).report
    kinds = {(d.site, d.kind) for d in report.detections}
    assert ("2", "weight") in kinds and report.flagged >= 1


class CountingTorchBackend(TorchBackend):
    """The torch backend under another name, counting its availability probes."""

    name = "counting"
    probes = 0

    def unavailable_reason(self) -> str | None:
        type(self).probes += 1
        return None


def test_backend_availability_is_probed_once_until_reprobe() -> None:
    counting = CountingTorchBackend()
    backends.register(counting, first=True)
    try:
        a = torch.randn(8, 64)
        for _ in range(5):
            assert sdc_guard.verify_matmul(a, a.t(), a @ a.t()).backend == "counting"
        assert backends.status()["counting"] is None
        assert CountingTorchBackend.probes == 1
        backends.reprobe()
        assert sdc_guard.verify_matmul(a, a.t(), a @ a.t()).backend == "counting"
        assert CountingTorchBackend.probes == 2
    finally:
        backends.unregister("counting")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_call_fast_path_answers_as_the_full_path(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(40, 300, generator=gen).to(dtype), torch.randn(300, 600, generator=gen).to(dtype)
    c = a @ b
    fast = sdc_guard.verify_matmul(a, b, c)  # the native backend's clear path where built
    full = sdc_guard.verify_matmul(a, b, c, backend="torch")
    assert (fast.ok, fast.kind, fast.rows) == (full.ok, full.kind, full.rows) == (True, "ok", [])
    assert fast.flags.shape == full.flags.shape == (40, 3)
    # D of a clean product is rounding residue, and each backend sums in its own order
    # (fp32: 0.94e-3 against 0.82e-3 on an AVX-512 host): the same T, a residue of the same size
    assert 0.5 < fast.ratio / full.ratio < 2.0, (fast.ratio, full.ratio)
    assert not bool(sdc_guard.matmul_checksum(a, b, c))
    assert sdc_guard.abft_verify(a, b, c).tolist() == [255] * 15
    bad = c.clone()
    bad[7, 400] = (bad[7, 400].float() * 1e4 + 1e4).to(dtype)
    assert bool(sdc_guard.matmul_checksum(a, b, bad)) and sdc_guard.verify_matmul(a, b, bad).rows == [7]
