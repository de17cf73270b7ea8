"""The native ``cpu`` backend (``sdc_guard.backends.native``, ``csrc/``) against the torch reference.

Agreement is the Triton kernel's contract (``sdc_guard/kernels/vabft_triton.py``): identical verdict
bits, T within ``THRESHOLD_RTOL`` relative, D within ``DIFF_TOL_OF_T * max(T, D)``. Then
what only a native kernel can get wrong: batch invariance bit for bit, thread-count
invariance, inputs left untouched, and the classification of non-finite values.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sdc_guard import backends
from sdc_guard.backends import native
from sdc_guard.core import verify
from sdc_guard.core.abft import AbftCheck, WeightSide, weight_side
from sdc_guard.backends import CpuBackend, GemmRequest, TorchBackend
from sdc_guard.runtime.checking.cache import WeightCache
from sdc_guard.backends import native_call
from sdc_guard.backends.native_call import BufferWeightSide, weight_side_of

from gemm_cases import randn, request  # noqa: E402
from paths import SUPPORT  # noqa: E402

THRESHOLD_RTOL = 1e-4
DIFF_TOL_OF_T = 5e-2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CPU = CpuBackend()
TORCH = TorchBackend()


def test_extension_built_in_ci() -> None:
    """CI must exercise the native kernels: a build that silently fell back fails here."""
    if os.environ.get("CI") and not native.available():
        pytest.fail(f"native extension unavailable in CI: {native.unavailable_reason()}")
    if not native.available():
        pytest.skip(native.unavailable_reason() or "native extension unavailable")


needs_native = pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matmul as the hardware computes it: fp16 / bf16 GEMMs accumulate in fp32."""
    if a.dtype != torch.float32:
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


def assert_agrees(req: GemmRequest) -> tuple[AbftCheck, AbftCheck]:
    assert CPU.rejects(req) is None, CPU.rejects(req)
    got = native.native_check(req)
    assert got is not None
    want = TORCH.check(req)
    for field in ("ok", "inputs_bad", "possible_overflow"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == torch.bool and g.shape == w.shape, (field, g.shape, w.shape)
        assert torch.equal(g, w), f"{field} differs:\n{g}\n{w}"
    judged = torch.isfinite(want.threshold) & torch.isfinite(want.diff)
    assert torch.equal(judged, torch.isfinite(got.threshold) & torch.isfinite(got.diff))
    torch.testing.assert_close(got.threshold[judged], want.threshold[judged], rtol=THRESHOLD_RTOL, atol=0)
    d_want = want.diff[judged]
    scale = torch.maximum(want.threshold[judged], d_want)
    err = (got.diff[judged] - d_want).abs()
    assert bool((err <= DIFF_TOL_OF_T * scale).all()), float((err / scale).max())
    return got, want


def layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values in another memory layout."""
    if kind == "row":
        return x.contiguous()
    if kind == "col":
        return x.t().contiguous().t()
    if kind == "strided":  # neither stride is 1
        big = torch.zeros(x.shape[0] * 2, x.shape[1] * 3, dtype=x.dtype)
        view = big[::2, ::3]
        view.copy_(x)
        return view
    raise ValueError(kind)


# --- agreement on clean products ------------------------------------------------------

@needs_native
@pytest.mark.parametrize("b_layout", ["row", "col", "strided"])
@pytest.mark.parametrize("a_layout", ["row", "col", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_agree(dtype: torch.dtype, a_layout: str, b_layout: str) -> None:
    m, k, n = 21, 70, 300
    a, b = randn(m, k, dtype=dtype, seed=1), randn(k, n, dtype=dtype, seed=2)
    c = product(a, b)
    got, _ = assert_agrees(request(layout(a, a_layout), layout(b, b_layout), c))
    assert bool(got.ok.all())


@needs_native
@pytest.mark.parametrize("shape", [(1, 70, 300), (1, 4096, 512), (7, 8, 256), (16, 3, 513), (33, 1000, 257),
                                   (64, 256, 1024), (5, 1, 40)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shapes_agree(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """M = 1, K small and large, N not a multiple of 256, K = 1."""
    m, k, n = shape
    a, b = randn(m, k, dtype=dtype, seed=3), randn(k, n, dtype=dtype, seed=4)
    for bb in (b, layout(b, "col")):
        got, _ = assert_agrees(request(a, bb, product(a, bb)))
        assert got.ok.shape == (m, -(-n // 256)) and bool(got.ok.all())


@needs_native
@pytest.mark.parametrize("terms", ["tight", "earlier", "share"])
@pytest.mark.parametrize("c_layout", ["row", "col"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_screen_terms_agree(dtype: torch.dtype, c_layout: str, terms: str) -> None:
    """Every combination of C's terms the kernel takes (``precision.ScreenTerms``): the
    tight screen (squares, the coherent term, the rigorous cap), the earlier screen (no
    term that reads C: the kernel must not read the sums it did not fill) and a share of
    the rigorous term, on row- and column-major C, with a bias."""
    from sdc_guard.core.precision import ScreenTerms, screen_terms

    chosen = {"tight": screen_terms("tight", dtype, torch.device("cpu")),
              "earlier": ScreenTerms(acc=2.0**-8, bounded=0.0),
              "share": ScreenTerms(bounded=0.5, coherent=0.25)}[terms]
    a, b = randn(37, 70, dtype=dtype, seed=3), randn(70, 300, dtype=dtype, seed=4)
    bias = randn(300, dtype=dtype, seed=5)
    c = layout((product(a, b).float() + bias.float()).to(dtype), c_layout)
    got, want = assert_agrees(request(a, b, c, bias=bias, rounding=chosen))
    assert bool(want.ok.all())


@needs_native
def test_column_major_c() -> None:
    a, b = randn(20, 64, seed=5), randn(64, 300, seed=6)
    c = layout(a @ b, "col")
    got, _ = assert_agrees(request(a, b, c))
    assert bool(got.ok.all())


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_agrees(dtype: torch.dtype) -> None:
    a, b = randn(3, 13, 70, dtype=dtype, seed=7), randn(3, 70, 300, dtype=dtype, seed=8)
    got, _ = assert_agrees(request(a, b, product(a, b)))
    assert got.ok.shape == (3, 13, 2) and bool(got.ok.all())
    # attention-like: a transposed batched B
    kt = randn(3, 300, 70, dtype=dtype, seed=9).mT
    assert_agrees(request(a, kt, product(a, kt)))


@needs_native
def test_broadcast_weight_and_two_batch_dims() -> None:
    a, w = randn(2, 20, 70, dtype=torch.bfloat16, seed=10), randn(300, 70, dtype=torch.bfloat16, seed=11)
    got, _ = assert_agrees(request(a, w.t(), product(a, w.t())))
    assert bool(got.ok.all())
    a4, b4 = randn(3, 1, 13, 70, seed=12), randn(1, 2, 70, 300, seed=13)
    got, _ = assert_agrees(request(a4, b4, a4 @ b4))
    assert got.ok.shape == (3, 2, 13, 2) and bool(got.ok.all())
    # with a cached, batched weight side
    req = request(a4, b4, a4 @ b4)
    assert_agrees(replace(req, weight=native.native_weight_side(b4)))


@needs_native
def test_heads_sliced_from_one_projection_are_encoded_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's ``k`` and ``v`` as a function-level ``matmul`` hands them over: heads of one
    projection, ``[B, H, T, D]`` views whose batch no single stride walks. The kernels encode
    a contiguous copy (the torch encoding took dozens of passes), agree with the torch
    backend, and never write the view."""
    qkv = randn(2, 24, 3 * 32, seed=60)
    k, v = (z.view(2, 24, 4, 8).transpose(1, 2) for z in qkv.split(32, -1)[1:])
    q = randn(2, 4, 24, 8, seed=61)
    torch_encodings = []
    for module in (native, native_call):
        monkeypatch.setattr(module, "weight_side", lambda *a: torch_encodings.append(a) or weight_side(*a))
    for a, b in ((q, k.mT), (randn(2, 4, 24, 24, seed=62).softmax(-1), v)):
        got, _ = assert_agrees(request(a, b, a @ b))
        assert bool(got.ok.all())
        assert native.native_clear(request(a, b, a @ b), native.Scratch()) is not None
        ws, want = native.native_weight_side(b), weight_side(b)
        assert isinstance(ws, BufferWeightSide) and ws.br.shape == want.br.shape
        torch.testing.assert_close(ws.br, want.br, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ws.babs, want.babs, rtol=1e-5, atol=1e-5)
    assert torch_encodings == []
    assert torch.equal(qkv, randn(2, 24, 3 * 32, seed=60))


@needs_native
@pytest.mark.parametrize("bias_shape", [(300,), (20, 1), (20, 300), ()], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_alpha_beta(dtype: torch.dtype, bias_shape: tuple[int, ...]) -> None:
    a, b = randn(20, 70, dtype=dtype, seed=14), randn(70, 300, dtype=dtype, seed=15)
    bias = (randn(*bias_shape, seed=16) + 2.0).to(dtype)
    c = torch.addmm(bias.expand(20, 300).float(), a.float(), b.float(), alpha=0.5, beta=-2.0).to(dtype)
    got, _ = assert_agrees(request(a, b, c, bias=bias, alpha=0.5, beta=-2.0))
    assert bool(got.ok.all())


@needs_native
def test_checksum_weight() -> None:
    a, b = randn(20, 70, seed=17), randn(70, 300, seed=18)
    r = randn(300, seed=19).abs() + 0.5
    got, _ = assert_agrees(request(a, b, a @ b, checksum_weight=r))
    assert bool(got.ok.all())
    got, _ = assert_agrees(request(a, layout(b, "col"), a @ b, checksum_weight=r, bias=randn(300, seed=20)))


@needs_native
@pytest.mark.parametrize("b_layout", ["row", "col", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_side_matches(dtype: torch.dtype, b_layout: str) -> None:
    b = layout(randn(70, 600, dtype=dtype, seed=21) + 0.3, b_layout)
    got, want = native.native_weight_side(b), weight_side(b)
    assert got.br.shape == want.br.shape and got.br.stride(-2) == 1
    torch.testing.assert_close(got.br, want.br, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.babs, want.babs, rtol=1e-5, atol=1e-5)
    for field in ("p1", "p2", "v", "col_norm"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-5, atol=0)
    assert torch.equal(got.bad, want.bad)
    assert len(got.factors) == len(want.factors) == 4
    for g, w in zip(got.factors, want.factors):
        assert g.dtype == w.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=1e-5, atol=0)


@needs_native
def test_buffer_weight_side_reads_like_the_views_it_stands_for() -> None:
    """The native encoding is a ``WeightSide`` whose tensors are made on first use: a
    warm check reads only its addresses, and every field, when read, is the buffer's view."""
    b = randn(3, 70, 600, seed=22)  # batched, as a bmm's operand
    ws = native.native_weight_side(b)
    assert isinstance(ws, BufferWeightSide) and isinstance(ws, WeightSide)
    a = randn(3, 5, 70, seed=23)
    s = native.Scratch()
    assert native.native_clear(request(a, b, a @ b, weight=ws), s) is not None
    assert "_views" not in ws.__dict__  # the check read addresses only
    views = weight_side_of(tuple(b.shape), ws._buf)
    assert ws.nbytes == ws._buf.numel() >= views.nbytes
    assert (ws.k, ws.n) == (70, 600) and ws.br.data_ptr() == ws._buf.data_ptr()
    for field in ("br", "babs", "p1", "p2", "v", "col_norm", "bad", "widths"):
        got, want = getattr(ws, field), getattr(views, field)
        assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want), field
    assert all(torch.equal(g, w) for g, w in zip(ws.factors, views.factors))
    check = native.native_check(request(a, b, a @ b, weight=ws))  # a fresh Prepared.of(views) agrees
    again = native.native_check(request(a, b, a @ b, weight=views))
    assert torch.equal(check.diff, again.diff) and torch.equal(check.threshold, again.threshold)


# --- zero false positives, detection --------------------------------------------------

@needs_native
@pytest.mark.parametrize("dist", ["gaussian", "uniform", "mean_shifted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_false_positives(dtype: torch.dtype, dist: str) -> None:
    g = torch.Generator().manual_seed(22)
    for m, k, n in ((64, 512, 1024), (128, 64, 300)):
        if dist == "gaussian":
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        elif dist == "uniform":
            a, b = torch.rand(m, k, generator=g), torch.rand(k, n, generator=g)
        else:
            a, b = torch.randn(m, k, generator=g) + 3.0, torch.randn(k, n, generator=g) + 3.0
        a, b = a.to(dtype), b.to(dtype)
        for bb in (b, layout(b, "col")):
            v = verify.verify_matmul(a, bb, product(a, bb), backend="cpu")
            assert v.backend == "cpu" and v.kind == "ok", (v.kind, v.ratio)
            assert v.ratio < 0.5


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_detects_injected_error(dtype: torch.dtype) -> None:
    a, b = randn(40, 128, dtype=dtype, seed=23), randn(128, 600, dtype=dtype, seed=24)
    c = product(a, b)
    bad = c.clone()
    bad[17, 300] = bad[17, 300].float() + 1e3 * c.float().abs().mean()
    for bb in (b, layout(b, "col")):
        v = verify.verify_matmul(a, bb, bad, backend="cpu")
        assert v.kind == "sdc" and v.rows == [17]
        expected = torch.zeros_like(v.flags)
        expected[17, 1] = True
        assert torch.equal(v.flags, expected)


# --- non-finite values: classified like the torch backend -----------------------------

def _verdicts(a, b, c, **kw) -> tuple[verify.Verdict, verify.Verdict]:
    return (verify.verify_matmul(a, b, c, backend="cpu", **kw), verify.verify_matmul(a, b, c, backend="torch", **kw))


def _same_verdict(got: verify.Verdict, want: verify.Verdict) -> None:
    assert got.kind == want.kind, (got.kind, want.kind)
    for field in ("flags", "overflow", "unverifiable"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


@needs_native
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("where", ["a", "b", "c", "b_col"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_classified_like_torch(dtype: torch.dtype, where: str, value: float) -> None:
    a, b = randn(20, 70, dtype=dtype, seed=25), randn(70, 600, dtype=dtype, seed=26)
    c = product(a, b)
    if where == "a":
        a = a.clone()
        a[3, 5] = value
    elif where in ("b", "b_col"):
        b = b.clone()
        b[5, 400] = value
        c = product(a, b)
        if where == "b_col":
            b = layout(b, "col")
    else:
        c = c.clone()
        c[3, 5] = value
    got, want = _verdicts(a, b, c)
    _same_verdict(got, want)
    assert got.kind == ("sdc" if where == "c" else "unverifiable")
    req = request(a, b, c)
    assert_agrees(req)


@needs_native
def test_fp16_overflow_classified_like_torch() -> None:
    a = torch.full((4, 64), 60.0, dtype=torch.float16)
    b = torch.full((64, 300), 40.0, dtype=torch.float16)  # 64 * 2400 > 65504: a legitimate overflow
    c = product(a, b)
    assert not bool(torch.isfinite(c).all())
    got, want = _verdicts(a, b, c)
    _same_verdict(got, want)
    assert got.kind == "overflow"
    assert_agrees(request(a, b, c))


# --- invariances ----------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("a_layout", ["row", "col"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_invariance(dtype: torch.dtype, a_layout: str) -> None:
    """Each row's D and T are bit-identical whatever the other rows (M = 2..37)."""
    a = layout(randn(37, 300, dtype=dtype, seed=27), a_layout)
    b = randn(300, 520, dtype=dtype, seed=28)
    c = product(a, b)
    ws = native.native_weight_side(b)
    full = native.native_check(request(a, b, c, weight=ws))
    for m in (2, 3, 5, 16, 17, 20, 33):
        part = native.native_check(request(a[:m], b, c[:m], weight=ws))
        assert torch.equal(part.diff, full.diff[:m]) and torch.equal(part.threshold, full.threshold[:m]), m
        assert torch.equal(part.ok, full.ok[:m])
    # rows at an offset: their own block boundaries move, their values do not
    tail = native.native_check(request(a[5:], b, c[5:], weight=ws))
    assert torch.equal(tail.diff, full.diff[5:]) and torch.equal(tail.threshold, full.threshold[5:])
    if a_layout == "row":  # a single row through the same path
        one = native.native_check(request(a[9:10], b, c[9:10], weight=ws))
        assert torch.equal(one.diff, full.diff[9:10]) and torch.equal(one.threshold, full.threshold[9:10])


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wide_blocks_agree(dtype: torch.dtype) -> None:
    """Column-major A with a K tail, and a column-major weight
    side over several K blocks with a tail and a checksum weight: agreement with torch,
    rows bit-identical at an offset and across forced threads."""
    a = layout(randn(300, 1100, dtype=dtype, seed=41), "col")
    w = randn(520, 1100, dtype=dtype, seed=42)
    r = torch.rand(520, generator=torch.Generator().manual_seed(43)) + 0.5
    c = product(a, w.t())
    ws = native.native_weight_side(w.t(), r)
    for b_ws in (ws, native.native_weight_side(w.t(), r, threads=3, force_threads=True)):
        for f in ("br", "p1", "p2", "v", "col_norm", "bad"):
            assert torch.equal(getattr(ws, f), getattr(b_ws, f)), f
    assert_agrees(request(a, w.t(), c, checksum_weight=r))
    req = request(a, w.t(), c, checksum_weight=r, weight=ws)
    one, many = native.native_check(req, threads=1), native.native_check(req, threads=3, force_threads=True)
    assert torch.equal(one.diff, many.diff) and torch.equal(one.threshold, many.threshold)
    tail = native.native_check(request(a[77:], w.t(), c[77:], checksum_weight=r, weight=ws))
    assert torch.equal(tail.diff, one.diff[77:]) and torch.equal(tail.threshold, one.threshold[77:])


@needs_native
@pytest.mark.parametrize("n", [200, 700, 1200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_major_blocks_bit_identical(dtype: torch.dtype, n: int) -> None:
    """Column-major A over several row blocks (fp32 blocks of whole vectors are read in
    place, the rest through a converted copy; 1, 3 and 5 segments take the fused and
    the unfused loops): a row's D and T do not depend on its block, its lane or the
    path, whatever slice of A it comes in."""
    a = layout(randn(1100, 300, dtype=dtype, seed=44), "col")
    b = randn(300, n, dtype=dtype, seed=45)
    c = product(a, b)
    ws = native.native_weight_side(b)
    full = native.native_check(request(a, b, c, weight=ws), threads=1)
    many = native.native_check(request(a, b, c, weight=ws), threads=3, force_threads=True)
    assert torch.equal(full.diff, many.diff) and torch.equal(full.threshold, many.threshold)
    for lo, hi in ((16, 1100), (5, 1100), (0, 512), (3, 531), (512, 1024)):
        part = native.native_check(request(a[lo:hi], b, c[lo:hi], weight=ws), threads=1)
        assert torch.equal(part.diff, full.diff[lo:hi]), (lo, hi)
        assert torch.equal(part.threshold, full.threshold[lo:hi]), (lo, hi)
        assert torch.equal(part.ok, full.ok[lo:hi]), (lo, hi)
    assert bool(full.ok.all())


@needs_native
@pytest.mark.parametrize("k", [64, 300, 1100])
@pytest.mark.parametrize("n", [200, 520])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_major_and_strided_a_bit_identical(dtype: torch.dtype, n: int, k: int) -> None:
    """A row-major A is read in place: with one segment (n = 200) its statistics and its
    dot in one pass per row, with more (n = 520) in two; a strided A is gathered into
    blocks first. A row's D and T must not depend on which: the same lanes, the same
    order, K tails of 0, 12 and 44 elements past the last block of 64."""
    a = randn(37, k, dtype=dtype, seed=46)
    b = randn(k, n, dtype=dtype, seed=47)
    c = product(a, b)
    ws = native.native_weight_side(b)
    row = native.native_check(request(layout(a, "row"), b, c, weight=ws))
    strided = native.native_check(request(layout(a, "strided"), b, c, weight=ws))
    assert torch.equal(row.diff, strided.diff) and torch.equal(row.threshold, strided.threshold)
    assert bool(row.ok.all())
    one = native.native_check(request(a[7:8], b, c[7:8], weight=ws))  # a single row too
    assert torch.equal(one.diff, row.diff[7:8]) and torch.equal(one.threshold, row.threshold[7:8])


@needs_native
@pytest.mark.parametrize("n", [200, 520])
def test_zero_row_max_and_min_are_plus_zero_in_every_layout(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """A row whose max (or min) is a zero met as both -0 and +0: which zero a tie keeps
    depends on how a path groups the lanes (the one-segment row pass keeps one max for
    all lanes, the strided and column-major paths four or one per row), so the kernel
    reports every zero max / min as +0. The row statistics leave the kernel with a failed
    check (an Inf in C), as explain_failures' arguments."""
    import inspect

    k = 300
    a = -torch.rand(6, k, generator=torch.Generator().manual_seed(67)) - 0.5  # max < 0 ...
    a[0, 5], a[0, 21] = -0.0, 0.0  # ... but where a zero sits: -0 first, then +0, 16 apart
    a[1, 3], a[1, 11] = 0.0, -0.0  # +0 first, 8 apart (the other AVX2 half)
    a[2] = 0.0
    a[2, ::7] = -0.0  # all zeros, both signs
    a[3] = -a[0]  # min a zero
    a[3, 5], a[3, 21] = -0.0, 0.0
    a[4] = -0.0  # all -0: max and min -0 in every path before the rule
    b = randn(k, n, seed=68)
    c = a @ b
    c[0, 0] = float("inf")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    explain = native.explain_failures

    def capture(*args, **kwargs):
        bound = inspect.signature(explain).bind(*args, **kwargs)
        seen.append((bound.arguments["hi"].clone(), bound.arguments["lo"].clone()))
        return explain(*args, **kwargs)

    monkeypatch.setattr(native, "explain_failures", capture)
    ws = native.native_weight_side(b)
    for kind in ("row", "strided", "col"):
        native.native_check(request(layout(a, kind), b, c, weight=ws))
    assert len(seen) == 3
    (hi, lo), *others = seen
    for row in (0, 1, 2, 4):
        assert hi.flatten()[row].item() == 0.0 and math.copysign(1.0, hi.flatten()[row].item()) == 1.0, row
    for row in (2, 3, 4):
        assert lo.flatten()[row].item() == 0.0 and math.copysign(1.0, lo.flatten()[row].item()) == 1.0, row
    for other_hi, other_lo in others:  # bit for bit, signs of zeros included
        assert torch.equal(hi.view(torch.int32), other_hi.view(torch.int32))
        assert torch.equal(lo.view(torch.int32), other_lo.view(torch.int32))


@needs_native
def test_threads_do_not_change_bits() -> None:
    """Work split over threads (forced: these shapes are below the threshold), the same
    bits as one thread."""
    a, w = randn(300, 2048, seed=29), randn(2048, 2048, seed=30)
    c = a @ w.t()
    req = request(a, w.t(), c, weight=native.native_weight_side(w.t()))
    one, many = native.native_check(req, threads=1), native.native_check(req, threads=3, force_threads=True)
    assert torch.equal(one.diff, many.diff) and torch.equal(one.threshold, many.threshold)
    assert torch.equal(one.ok, many.ok) and bool(one.ok.all())
    for b in (w.t(), w):
        ws1 = native.native_weight_side(b, threads=1)
        ws2 = native.native_weight_side(b, threads=3, force_threads=True)
        for f in ("br", "p1", "p2", "v", "col_norm", "bad"):
            assert torch.equal(getattr(ws1, f), getattr(ws2, f)), f
    old = torch.get_num_threads()
    try:  # the default follows torch's thread count
        torch.set_num_threads(1)
        ws1 = native.native_weight_side(w.t())
        torch.set_num_threads(2)
        ws2 = native.native_weight_side(w.t())
    finally:
        torch.set_num_threads(old)
    for f in ("br", "p1", "p2", "v", "col_norm", "bad"):
        assert torch.equal(getattr(ws1, f), getattr(ws2, f)), f


@needs_native
def test_inputs_never_modified() -> None:
    a, b = randn(20, 70, dtype=torch.bfloat16, seed=31), randn(70, 300, dtype=torch.bfloat16, seed=32)
    bias, r = randn(300, seed=33), randn(300, seed=34)
    c = product(a, b)
    c[2, 3] = float("nan")
    before = [t.clone() for t in (a, b, c, bias, r)]
    ws = native.native_weight_side(b, r)
    native.native_check(request(a, b, c, bias=bias, checksum_weight=r, weight=ws))
    native.native_check(request(a, layout(b, "col"), c, bias=bias))
    for t, old in zip((a, b, c, bias, r), before):
        assert torch.equal(t, old) or (torch.isnan(t) == torch.isnan(old)).all()
        assert torch.equal(torch.nan_to_num(t), torch.nan_to_num(old))


# --- dispatch and cache ---------------------------------------------------------------

@needs_native
def test_dispatch_prefers_cpu_and_env_forces_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = randn(4, 64, seed=35), randn(64, 300, seed=36)
    req = verify.make_request(a, b, a @ b)
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    assert backends.select(req).name == "cpu"
    assert verify.verify_matmul(a, b, a @ b).backend == "cpu"
    monkeypatch.setenv(backends.ENV_BACKEND, "torch")
    assert backends.select(req).name == "torch"
    assert verify.verify_matmul(a, b, a @ b).backend == "torch"
    # what the kernels do not cover falls to torch, with a reason
    assert "dtype" in (CPU.rejects(GemmRequest(a.double(), b.double(), (a @ b).double(), 1e-5)) or "")


@needs_native
def test_cache_uses_and_refreshes_with_encoder() -> None:
    w = torch.nn.Parameter(randn(300, 64, seed=37))
    cache = WeightCache(max_bytes=1 << 20)
    cache.set_parameters([w])
    calls: list[int] = []

    def encode(b: torch.Tensor):
        calls.append(1)
        return CPU.encode(b)

    ws = cache.get(w.t(), encode=encode)
    assert ws is not None and len(calls) == 1 and "_views" not in ws.__dict__  # no tensor made yet
    assert cache.get(w.t(), encode=encode) is ws and len(calls) == 1
    with torch.no_grad():
        w.mul_(2.0)
    assert cache.refresh() == 1 and len(calls) == 2
    a = randn(8, 64, seed=38)
    fresh = cache.get(w.t())
    assert_agrees(request(a, w.detach().t(), a @ w.detach().t(), weight=fresh))


@needs_native
def test_kernels_borrow_torchs_openmp_pool() -> None:
    """Where torch runs on OpenMP, the kernels split work on that same runtime (a second
    pool, or threads started beside torch's spinning workers, fight them for the cores)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not run on OpenMP here")
    runtime = native.thread_runtime()
    assert runtime and "omp" in Path(runtime).name, runtime
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "omp" in line}
    assert os.path.realpath(runtime) in {os.path.realpath(p) for p in loaded}, (runtime, loaded)


@pytest.mark.corpus  # two subprocesses, about 10 s (CONTRIBUTING.md)
@needs_native
@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_pthreads_fallback_same_bits(tmp_path: Path) -> None:
    """With SDC_GUARD_NATIVE_OPENMP=0 the kernels split work on their own threads, with
    the same bits as the OpenMP split and as one thread."""
    script = tmp_path / "split.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(SUPPORT)!r})\n"
        "from gemm_cases import randn, request\n"
        "from sdc_guard.backends import native\n"
        "a, w = randn(300, 1024, seed=31), randn(700, 1024, seed=32)\n"
        "req = request(a, w.t(), a @ w.t(), weight=native.native_weight_side(w.t(), threads=3, force_threads=True))\n"
        "got = native.native_check(req, threads=3, force_threads=True)\n"
        "torch.save({'runtime': native.thread_runtime(), 'diff': got.diff.clone(), 'threshold': got.threshold.clone(),\n"
        "            'br': req.weight.br.clone()}, sys.argv[1])\n")
    out = {}
    for flag in ("0", "1"):
        env = {**os.environ, "SDC_GUARD_NATIVE_OPENMP": flag}
        subprocess.run([sys.executable, str(script), str(tmp_path / f"{flag}.pt")], env=env, check=True)
        out[flag] = torch.load(tmp_path / f"{flag}.pt")
    assert out["0"]["runtime"] == ""
    assert out["1"]["runtime"] == native.thread_runtime()
    a, w = randn(300, 1024, seed=31), randn(700, 1024, seed=32)
    ws = native.native_weight_side(w.t(), threads=1)
    one = native.native_check(request(a, w.t(), a @ w.t(), weight=ws), threads=1)
    for got in out.values():
        assert torch.equal(got["br"], ws.br)
        assert torch.equal(got["diff"], one.diff) and torch.equal(got["threshold"], one.threshold)


@needs_native
def test_clear_check_into_scratch_agrees_with_the_full_check() -> None:
    """``native_clear`` (the guard's path: outputs into reused scratch) gives the full
    check's worst D/T for clear checks of every shape kind, in any order (the scratch
    grows and is reused), and ``None`` wherever the full check is not clear."""
    scratch = native.Scratch()
    a, w = randn(70, 300, seed=51), randn(600, 300, seed=52)
    ab, bb = randn(3, 40, 64, seed=53), randn(3, 64, 90, seed=54)
    bias = randn(600, seed=55)
    cases = [
        request(a, w.t(), a @ w.t()),  # cold
        request(a, w.t(), a @ w.t(), weight=native.native_weight_side(w.t())),  # warm
        request(ab, bb, ab @ bb),  # batched, cold
        request(a[:5], w.t(), a[:5] @ w.t()),  # smaller after larger: scratch reused
        request(a, w.t(), torch.addmm(bias, a, w.t()), bias=bias),
    ]
    for req in cases * 2:
        full = native.native_check(req)
        assert full.clear
        assert native.native_clear(req, scratch) == full.worst_ratio
    for req in cases:
        c = req.c.clone()
        c.view(-1)[7] += 1e3
        assert native.native_clear(replace(req, c=c), scratch) is None
        c.view(-1)[7] = float("nan")
        assert native.native_clear(replace(req, c=c), scratch) is None
    a_nan = a.clone()
    a_nan[3, 4] = float("inf")
    assert native.native_clear(request(a_nan, w.t(), a @ w.t()), scratch) is None
    fresh = (randn(70, 300, seed=51), randn(600, 300, seed=52), randn(3, 40, 64, seed=53), randn(3, 64, 90, seed=54),
             randn(600, seed=55))
    assert all(torch.equal(t, f) for t, f in zip((a, w, ab, bb, bias), fresh))  # inputs never written


@needs_native
def test_flat_fast_path_builds_the_calls_arguments() -> None:
    """``flat_args`` (the clear check's shortcut for 2-D calls with a warm weight) gives
    exactly the arguments ``Call`` builds, for every dtype, layout and bias form it takes,
    and declines everything else (which ``Call`` and ``rejects`` then handle)."""
    from sdc_guard.backends.native_call import Call, flat_args

    ext = native._load()
    taken = 0
    for dtype in DTYPES:
        a, w = randn(21, 70, dtype=dtype, seed=58), randn(300, 70, dtype=dtype, seed=59)
        c = product(a, w.t())
        ws = native.native_weight_side(w.t())
        torch_ws = weight_side(w.t())  # another backend's encoding: Prepared.of
        bias1, bias2 = randn(300, dtype=dtype, seed=60), randn(21, 300, dtype=dtype, seed=61)
        for req in (
            request(a, w.t(), c, weight=ws),
            request(layout(a, "col"), w.t(), layout(c, "col"), weight=torch_ws),
            request(a, w.t(), c, weight=ws, bias=bias1),
            replace(request(a, w.t(), c, weight=ws, bias=bias2), alpha=0.5, beta=2.0),
            replace(request(a, w.t(), c, weight=ws, bias=bias1), beta=0.0),
            request(a, w.t(), c, weight=ws, bias=torch.tensor(0.25, dtype=dtype)),
        ):
            got = flat_args(req)
            assert got is not None
            assert got == Call.of(ext, req, 1).args(0)
            taken += 1
    a, w = randn(21, 70, seed=62), randn(300, 70, seed=63)
    ab, bb = randn(3, 21, 70, seed=64), randn(70, 300, seed=65)
    r = torch.rand(300, generator=torch.Generator().manual_seed(66)) + 0.5
    for declined in (
        request(a, w.t(), a @ w.t()),  # cold
        request(a, w.t(), a @ w.t(), weight=native.native_weight_side(w.t(), r), checksum_weight=r),
        request(ab, bb, ab @ bb, weight=native.native_weight_side(bb)),  # batched
        GemmRequest(a.double(), w.t().double(), (a @ w.t()).double(), 1e-5, weight=weight_side(w.t().double())),
        request(a[:0], w.t(), (a @ w.t())[:0], weight=native.native_weight_side(w.t())),  # empty
    ):
        assert flat_args(declined) is None
    assert taken == 18


@needs_native
def test_cpu_backend_summary_locates_corruption() -> None:
    """``CpuBackend.summarize``: no mask when clear; a corrupted element gives the full
    check's mask and summary (the check is rerun in full)."""
    a, w = randn(33, 128, seed=56), randn(520, 128, seed=57)
    c = a @ w.t()
    sdc, summary = CPU.summarize(request(a, w.t(), c))
    assert sdc is None and summary[0] == 0 and 0 < summary[1] < 1
    c[17, 300] += 1e3
    sdc, summary = CPU.summarize(request(a, w.t(), c))
    assert sdc.nonzero().tolist() == [[17, 1]]
    assert summary[0] == 1 and summary[1] > 1


@needs_native
def test_converted_checksum_weight_outlives_the_call() -> None:
    """A checksum weight that must be converted (float64, strided) gives the same results
    as its fp32 copy: the converted copy stays alive until the kernel has read it (the
    outputs allocated after it must not land on its memory)."""
    a, w = randn(64, 96, seed=61), randn(300, 96, seed=62)
    c = a @ w.t()
    r64 = (torch.rand(600, dtype=torch.float64, generator=torch.Generator().manual_seed(63)) + 0.5)[::2]
    r32 = r64.float().contiguous()
    for weight in (None, native.native_weight_side(w.t(), r32)):
        want = native.native_check(request(a, w.t(), c, checksum_weight=r32, weight=weight))
        for _ in range(3):
            got = native.native_check(request(a, w.t(), c, checksum_weight=r64, weight=weight))
            assert torch.equal(got.diff, want.diff) and torch.equal(got.threshold, want.threshold)
        scratch = native.Scratch()
        assert native.native_clear(request(a, w.t(), c, checksum_weight=r64, weight=weight), scratch) \
            == want.worst_ratio


@needs_native
def test_clear_checks_from_two_threads_keep_their_own_scratch() -> None:
    """The kernels run with the GIL released: two threads verifying at once through one
    ``Scratch`` (as the cpu backend's) each get their own memory and their own results."""
    import threading

    scratch = native.Scratch()
    cases = []
    for i, (m, k, n) in enumerate(((200, 300, 700), (37, 512, 300))):
        a, w = randn(m, k, seed=70 + i), randn(n, k, seed=80 + i)
        req = request(a, w.t(), a @ w.t())
        cases.append((req, native.native_check(req).worst_ratio))
    results: list[list[float | None]] = [[], []]

    def verify(i: int) -> None:
        req = cases[i][0]
        for _ in range(40):
            results[i].append(native.native_clear(req, scratch))

    threads = [threading.Thread(target=verify, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (_, want), got in zip(cases, results):
        assert got == [want] * 40


class _Recorder:
    """A stand-in for the extension that records the arguments it is called with (and
    answers a check as clear): what a planned call passes the kernels."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def weight_side(self, *args: int) -> None:
        self.calls.append(("weight_side", args))

    def check(self, *args: object) -> tuple[bool, float]:
        self.calls.append(("check", args))
        return True, 0.0


def _plan_cases() -> list[GemmRequest]:
    """Warm and cold, 2-D and batched, bias forms, alpha / beta, the dtypes."""
    cases = []
    for dtype in DTYPES:
        a, w = randn(21, 70, dtype=dtype, seed=90), randn(300, 70, dtype=dtype, seed=91)
        c = product(a, w.t())
        bias1, bias2 = randn(300, dtype=dtype, seed=92), randn(21, 300, dtype=dtype, seed=93)
        ab, bb = randn(3, 21, 70, dtype=dtype, seed=94), randn(3, 70, 90, dtype=dtype, seed=95)
        def plus(alpha: float, beta: float, bias: torch.Tensor) -> torch.Tensor:
            return (alpha * product(a, w.t()).float() + beta * bias.float()).to(dtype)

        cases += [
            request(a, w.t(), c, weight=native.native_weight_side(w.t())),
            request(layout(a, "col"), w.t(), layout(c, "col"), weight=weight_side(w.t())),
            request(a, w.t(), plus(1.0, 1.0, bias1), bias=bias1),  # cold
            replace(request(a, w.t(), plus(0.5, 2.0, bias2), weight=native.native_weight_side(w.t()), bias=bias2),
                    alpha=0.5, beta=2.0),
            replace(request(a, w.t(), c, bias=bias1), beta=0.0),
            request(ab, bb, product(ab, bb)),  # cold, batched
            request(ab, bb, product(ab, bb), weight=native.native_weight_side(bb)),  # warm, batched
            request(ab, w.t(), product(ab, w.t()), weight=native.native_weight_side(w.t())),  # broadcast weight
        ]
    return cases


@needs_native
def test_a_planned_call_passes_the_kernels_the_calls_arguments() -> None:
    """``native_plan.Plan`` (the guard's clear checks, planned once per layout) passes the
    kernels exactly what ``Call`` does, pointers included, for a second call of the same
    layout on other tensors too (the plan made from the first), and encodes a cold ``b``
    with the same arguments ``Call`` does."""
    from sdc_guard.backends.native_call import Call
    from sdc_guard.backends.native_plan import Plans

    plans = Plans()
    for req in _plan_cases():
        args = (req.a, req.b, req.c, req.bias, req.alpha, req.beta, req.weight, req.e_max, req.rounding)
        key = plans.key(*args)
        plan = plans.get(key, native.extension(), *args, native.rejects)
        assert plan is not None
        twin = replace(req, a=req.a.clone(memory_format=torch.preserve_format) if req.a.is_contiguous() else req.a,
                       c=req.c.clone() if req.c.is_contiguous() else req.c)
        for r in (req, twin):
            if plans.key(r.a, r.b, r.c, r.bias, r.alpha, r.beta, r.weight, r.e_max, r.rounding) != key:
                continue  # a clone of another layout: planned on its own
            got, want = _Recorder(), _Recorder()
            p = 1 << 20  # where the scratch memory would be: never read by the recorder
            plan.run(got, p, r.a, r.b, r.c, r.bias if r.beta != 0.0 else None, r.weight, 3)
            call = Call.of(want, r, 3)
            rows = call.nb * call.m
            enc = call.enc_bytes + (-call.enc_bytes % 64)
            want.check(*call.args(p), p + enc, p + enc + 8 * rows * call.nseg,
                       p + enc + 8 * rows * call.nseg + 12 * rows, 3)
            assert got.calls == want.calls[:-1] + [("check", want.calls[-1][1])]
            assert plan.nbytes >= enc + 10 * rows * call.nseg + 12 * rows


@needs_native
def test_clear_gemm_answers_as_native_clear_does() -> None:
    """``CpuBackend.clear_gemm`` (what the guard calls) gives ``native_clear``'s answer:
    the same worst ratio for a clear check, ``None`` for a corrupted or non-finite one,
    on every planned layout, twice (the second call through the plan made by the first)."""
    backend = CpuBackend()
    for req in _plan_cases():
        want = native.native_clear(req, native.Scratch())
        assert want is not None
        for _ in range(2):
            assert backend.clear_gemm(req.a, req.b, req.c, req.e_max, bias=req.bias, alpha=req.alpha, beta=req.beta,
                                      weight=req.weight, rounding=req.rounding) == want
        c = req.c.clone()
        c[..., 3, 5] += 1e3 * float(c.abs().max())
        assert backend.clear_gemm(req.a, req.b, c, req.e_max, bias=req.bias, alpha=req.alpha, beta=req.beta,
                                  weight=req.weight, rounding=req.rounding) is None
