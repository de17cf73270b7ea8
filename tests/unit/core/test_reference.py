"""The torch backend (``sdc_guard.core.abft.vabft_check``) computes docs/ALGORITHM.md: checked in float64.

``tests/vabft_reference.py`` implements the specification a second time, in float64
NumPy and without sdc_guard's code. The torch backend must agree with it:

- ``T`` to a relative ``T_RTOL = 1e-5``: both sides evaluate the same formula on the same
  statistics; fp32 rounding of those statistics is ~1e-7 relative (measured <= 2e-7).
- ``D`` to ``D_RTOL = 1e-5`` relative plus the worst-case fp32 accumulation error of the
  three sums that make it (``(n + 2) u_32 sum |terms|``): docs/ALGORITHM.md ("Checksum") has ``D``
  accumulated in fp32 sums, so the bound is part of the specification, not slack.
  Where every sum is exact (integer-valued data) ``D`` must agree exactly.
- the OK bits exactly, on inputs whose ``D / T`` keeps clear of 1 (asserted).

sdc_guard's screen departs from the NPU operator's formula where docs/ALGORITHM.md says
(C's rounding read from C, one accumulator rounding, a flush-aware floor), so the
reference is called with ``roundoff_floor=True`` here, for both screens; the NPU
stand-in uses the bare formula, as the operator does.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torch import Tensor


from vabft_reference import SEGMENT, ReferenceCheck, as_f64, reference_check, segments  # noqa: E402

from sdc_guard.core.abft import AbftCheck, vabft_check  # noqa: E402
from sdc_guard.core.precision import element_floor, screen_terms  # noqa: E402

T_RTOL = 1e-5
D_RTOL = 1e-5
U32 = 2.0**-24
#: the defaults with fp32 accumulation (CPU)
E_MAX = {torch.bfloat16: 2e-5, torch.float16: 2e-5, torch.float32: 2e-5}
SCREENS = ("default", "tight")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: (M, K, N): M % 8 != 0 and N % 256 != 0 throughout, one short last segment each.
SHAPES = [(13, 100, 300), (5, 1000, 520), (1, 33, 257), (20, 64, 40)]


def gemm(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` stored in ``dtype``; fp16 through fp32 because CPU fp16 GEMMs crawl."""
    if dtype == torch.float16:
        return (a.float() @ b.float()).half()
    return a @ b


def operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    """Gaussian ``a [m, k]``, ``b [k, n]`` in ``dtype`` with a mean shift, so that every
    term of the threshold (mean, cross, spread) contributes."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen) + 0.3
    b = torch.randn(k, n, generator=gen) - 0.2
    return a.to(dtype), b.to(dtype)


def signed_weight(n: int, seed: int) -> Tensor:
    """A checksum weight far from all ones: magnitudes 0.5..2 with random signs (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 0.5 + 1.5 * torch.rand(n, generator=gen)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return magnitude * sign


def accumulation_bound(a: Tensor, b: Tensor, c: Tensor, weight: Tensor | None, *,
                       bias: Tensor | None = None, alpha: float = 1.0,
                       beta: float = 1.0) -> np.ndarray:
    """Worst-case error ``[M, nseg]`` of computing ``D`` with fp32 sums (as docs/ALGORITHM.md, "Checksum", has it).

    Each of the three sums in ``D`` (``sum r C``, ``A @ Br`` with ``Br`` itself a sum, and
    ``sum r bias``) is off by at most ``(terms + 2) u_32 sum |terms|``.
    """
    a64, b64, c64 = as_f64(a), as_f64(b), as_f64(c)
    n = b64.shape[1]
    r = np.ones(n) if weight is None else np.abs(as_f64(weight))
    k = a64.shape[1]
    bias64 = None if bias is None else np.broadcast_to(np.abs(as_f64(bias)), c64.shape)
    bounds = []
    for cols in segments(n):
        n_s = cols.stop - cols.start
        c_part = (n_s + 2) * (np.abs(c64[:, cols]) * r[cols]).sum(1)
        ab_part = (k + n_s + 2) * abs(alpha) * (np.abs(a64) @ (np.abs(b64[:, cols]) * r[cols]).sum(1))
        bound = c_part + ab_part
        if bias64 is not None:
            bound = bound + (n_s + 2) * abs(beta) * (bias64[:, cols] * r[cols]).sum(1)
        bounds.append(U32 * bound)
    return np.stack(bounds, axis=1)


def assert_agrees(check: AbftCheck, ref: ReferenceCheck, bound: np.ndarray) -> None:
    """``T`` to ``T_RTOL``, ``D`` to ``D_RTOL`` + the fp32 bound, OK bits exactly."""
    threshold, diff = as_f64(check.threshold), as_f64(check.diff)
    np.testing.assert_allclose(threshold, ref.threshold, rtol=T_RTOL, atol=0, err_msg="T")
    excess = np.abs(diff - ref.diff) - (D_RTOL * ref.diff + bound)
    assert (excess <= 0).all(), f"D off by up to {excess.max():.3g} beyond tolerance"
    np.testing.assert_array_equal(check.ok.numpy(), ref.ok, err_msg="OK bits")


def assert_clear_of_threshold(ref: ReferenceCheck) -> None:
    """Guard of the test data: bits compared only where rounding cannot flip them."""
    ratio = ref.diff / ref.threshold
    assert ((ratio < 0.5) | (ratio > 2.0)).all(), f"test data too close to T: {ratio}"


def corrupt(c: Tensor, ref: ReferenceCheck, weight: Tensor | None, m: int, col: int,
            factor: float) -> Tensor:
    """``c`` with ``c[m, col]`` moved by ``factor`` times its segment's reference ``T``."""
    scale = 1.0 if weight is None else abs(float(weight[col]))
    bad = c.clone()
    delta = factor * ref.threshold[m, col // SEGMENT] / scale
    bad[m, col] = (c[m, col].double() + delta).to(c.dtype)
    return bad


def reference(a: Tensor, b: Tensor, c: Tensor, weight: Tensor | None, screen: str = "default",
              **kw: object) -> ReferenceCheck:
    """The float64 reference of sdc_guard's ``screen``, at the dtype's ``e_max``."""
    return reference_check(a, b, c, weight, e_max=E_MAX[a.dtype], c_dtype=c.dtype,
                           roundoff_floor=True, screen=screen, **kw)


def torch_check(a: Tensor, b: Tensor, c: Tensor, weight: Tensor | None, screen: str = "default",
                **kw: object) -> AbftCheck:
    """The torch backend's screen ``screen`` on CPU (fp32 accumulation)."""
    terms = screen_terms(screen, a.dtype, torch.device("cpu"))
    return vabft_check(a, b, c, weight, e_max=E_MAX[a.dtype], rounding=terms, **kw)


@pytest.mark.parametrize("screen", SCREENS)
@pytest.mark.parametrize("weighted", [False, True], ids=["ones", "weighted"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_backend_matches_float64_reference(dtype: torch.dtype, shape: tuple[int, int, int],
                                                 weighted: bool, screen: str) -> None:
    """D, T and bits agree on a correct product and on one corrupted element.

    The corruption (50 T, in the last row and the short last segment) must fail in the
    reference and in torch alike while every other segment passes.
    """
    m, k, n = shape
    a, b = operands(m, k, n, dtype, seed=m * k + n)
    weight = signed_weight(n, seed=n) if weighted else None
    c = gemm(a, b, dtype)
    clean = reference(a, b, c, weight, screen)
    assert clean.ok.all()
    bad = corrupt(c, clean, weight, m - 1, n - 1, factor=50.0)
    for candidate in (c, bad):
        ref = reference(a, b, candidate, weight, screen)
        assert_clear_of_threshold(ref)
        check = torch_check(a, b, candidate, weight, screen)
        assert_agrees(check, ref, accumulation_bound(a, b, candidate, weight))
    assert not ref.ok[m - 1, -1] and ref.ok.sum() == ref.ok.size - 1


@pytest.mark.parametrize("screen", SCREENS)
@pytest.mark.parametrize("bias_rows", [1, 13], ids=["bias[N]", "bias[M,N]"])
@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (-0.5, 2.0), (3.0, -0.25)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_alpha_beta_match_reference(dtype: torch.dtype, alpha: float, beta: float,
                                         bias_rows: int, screen: str) -> None:
    """``out = beta * bias + alpha * a @ b``: D, T (with the bias rounding term) and bits.

    A non-unit weight is used too, so that a bias term weighted differently from the
    checksum would show in T. A corruption of 20 T is caught in both.
    """
    m, k, n = 13, 48, 300
    a, b = operands(m, k, n, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    bias = (4.0 * torch.randn(bias_rows, n, generator=gen)).to(dtype)
    bias_arg = bias[0] if bias_rows == 1 else bias
    weight = signed_weight(n, seed=9)
    c = (beta * bias.float() + alpha * (a.float() @ b.float())).to(dtype)
    kw = dict(bias=bias_arg, alpha=alpha, beta=beta)
    clean = reference(a, b, c, weight, screen, **kw)
    bad = corrupt(c, clean, weight, 4, 10, factor=20.0)
    for candidate in (c, bad):
        ref = reference(a, b, candidate, weight, screen, **kw)
        assert_clear_of_threshold(ref)
        check = torch_check(a, b, candidate, weight, screen, **kw)
        assert_agrees(check, ref, accumulation_bound(a, b, candidate, weight, **kw))
    assert np.argwhere(~ref.ok).tolist() == [[4, 0]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_k_zero_threshold_is_the_underflow_floor(dtype: torch.dtype) -> None:
    """K = 0: C must be exactly 0; T is ``n_s * element_floor(0)`` alone, so any nonzero
    above it is caught. The corrupted element raises its own segment's T by the
    self-bounded term, ``u_C / (1 - u_C)`` of its error, and nothing else."""
    a, b = torch.zeros(5, 0, dtype=dtype), torch.zeros(0, 300, dtype=dtype)
    c = torch.zeros(5, 300, dtype=dtype)
    bad = c.clone()
    bad[2, 260] = 1e-3
    refs = {}
    for name, candidate in (("clean", c), ("bad", bad)):
        ref = refs[name] = reference(a, b, candidate, None)
        check = vabft_check(a, b, candidate, e_max=E_MAX[dtype])
        assert_agrees(check, ref, accumulation_bound(a, b, candidate, None))
    tiny = element_floor(0, dtype)  # sdc_guard's floor: a flushed device's loss near zero
    floor = np.broadcast_to([256 * tiny, 44 * tiny], (5, 2))
    np.testing.assert_allclose(refs["clean"].threshold, floor)
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]
    raised = floor.copy()
    raised[2, 1] += u / (1 - u) * float(bad[2, 260])
    np.testing.assert_allclose(refs["bad"].threshold, raised)
    assert np.argwhere(~refs["bad"].ok).tolist() == [[2, 1]]


def test_d_equal_to_t_is_ok() -> None:
    """Only ``D > T`` is an error. K = 0 and a last segment one column wide make the
    threshold ``element_floor(0) + u_C / (1 - u_C) |c|`` in fp32 (fp32 C): a function of
    ``c`` with slope 2^-24, whose fp32 value is a fixed point one step away, found by
    checking once. An element at that value is ``D == T`` (OK), twice it is not. (The
    float64 reference puts ``T`` a hair below that fp32 value: equality exists only after
    T's one rounding to fp32, so the bits are compared with ``D <= T`` in fp32 here.)"""
    tiny = element_floor(0, torch.float32)
    a, b = torch.zeros(3, 0), torch.zeros(0, 257)
    c = torch.zeros(3, 257)
    c[0, 256] = tiny
    fixed = float(vabft_check(a, b, c, e_max=E_MAX[torch.float32]).threshold[0, 1])
    c[0, 256], c[1, 256] = fixed, 2 * fixed
    ref = reference(a, b, c, None)
    check = vabft_check(a, b, c, e_max=E_MAX[torch.float32])
    assert float(check.diff[0, 1]) == float(check.threshold[0, 1]) == fixed
    np.testing.assert_allclose(as_f64(check.threshold), ref.threshold, rtol=T_RTOL, err_msg="T")
    assert torch.argwhere(~check.ok).tolist() == [[1, 1]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_d_is_exact_when_every_sum_is_exact(dtype: torch.dtype) -> None:
    """Small integers and power-of-two weights: no sum rounds, so D must match bit for bit.

    This pins D without any tolerance: the segment boundaries, the weighting of C and of
    B, and the sign convention all have to be exactly right.
    """
    gen = torch.Generator().manual_seed(3)
    m, k, n = 11, 8, 300
    a = torch.randint(-4, 5, (m, k), generator=gen).to(dtype)
    b = torch.randint(-4, 5, (k, n), generator=gen).to(dtype)
    weight = torch.tensor([0.5, 1.0, 2.0, -1.0])[torch.randint(0, 4, (n,), generator=gen)]
    c = gemm(a, b, dtype)
    bad = c.clone()
    bad[3, 5] += 32
    bad[10, 299] -= 16
    check = vabft_check(a, b, bad, weight, e_max=E_MAX[dtype])
    ref = reference(a, b, bad, weight)
    expected = np.zeros((m, 2))
    expected[3, 0] = 32 * abs(float(weight[5]))
    expected[10, 1] = 16 * abs(float(weight[299]))
    np.testing.assert_array_equal(ref.diff, expected)
    np.testing.assert_array_equal(as_f64(check.diff), expected)
    np.testing.assert_allclose(as_f64(check.threshold), ref.threshold, rtol=T_RTOL)
    np.testing.assert_array_equal(check.ok.numpy(), ref.ok)


def test_fp32_threshold_stays_finite_for_large_finite_inputs() -> None:
    """Inputs of magnitude 1e9 give products ~3e19, far inside fp32; T must stay finite.

    The reference's T is ~6e16. A threshold that overflows to inf passes every C, even
    an Inf planted in it, which docs/ALGORITHM.md ("What it can see") says is always caught (D non-finite = error).
    The threshold reads C for its rounding, so the segment holding the planted Inf has an
    infinite T, and is flagged all the same: its D is not finite.
    """
    gen = torch.Generator().manual_seed(11)
    a = 1e9 * torch.randn(8, 64, generator=gen)
    b = 1e9 * torch.randn(64, 256, generator=gen)
    c = a @ b
    bad = c.clone()
    bad[0, 0] = float("inf")
    for candidate in (c, bad):
        ref = reference(a, b, candidate, None)
        check = vabft_check(a, b, candidate, e_max=E_MAX[torch.float32])
        finite = np.isfinite(as_f64(candidate)).reshape(8, 1, 256).all(-1)
        assert (np.isfinite(ref.threshold) == finite).all()
        np.testing.assert_allclose(as_f64(check.threshold), ref.threshold, rtol=T_RTOL, err_msg="T")
        np.testing.assert_array_equal(check.ok.numpy(), ref.ok, err_msg="OK bits")
    assert np.argwhere(~ref.ok).tolist() == [[0, 0]]


@pytest.mark.parametrize("backend", __import__("sdc_guard").backends.available())
@pytest.mark.parametrize("screen", SCREENS)
def test_c_reading_terms_stay_in_range(screen: str, backend: str) -> None:
    """The threshold reads C, so C's sums must not carry it out of range. bf16 C of
    magnitude 1e20 (its fp32 squares overflow): the clean product passes, no segment
    suspected (the tight screen falls back to the rigorous term there). A value of order
    1e38 planted in a C of order 1 (a top exponent bit turned on): its squares overflow
    and its absolute value dominates the rigorous term, yet ``D`` is 256 times that term:
    caught at its row, on every backend, by both screens."""
    import sdc_guard

    gen = torch.Generator().manual_seed(21)
    a = torch.randn(16, 256, generator=gen).bfloat16()
    b = torch.randn(256, 512, generator=gen).bfloat16()
    huge = (a.float() * 1e10).bfloat16()
    v = sdc_guard.verify_matmul(huge, b * 1e9, (huge.float() @ (b * 1e9).float()).bfloat16(), screen=screen,
                                backend=backend)
    assert v.kind == "ok" and not bool(v.screen_flags.any()), (v.kind, v.ratio)
    c = a @ b
    bad = c.clone()
    bad[5, 100] = 3e37
    bad[9, 300] = -1e38
    v = sdc_guard.verify_matmul(a, b, bad, screen=screen, backend=backend)
    assert v.kind == "sdc" and torch.argwhere(v.flags).tolist() == [[5, 0], [9, 1]]
