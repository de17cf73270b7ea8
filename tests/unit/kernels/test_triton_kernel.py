"""The fused Triton kernel (``sdc_guard.kernels.vabft_triton``) against the torch reference.

Without a GPU the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set by
``conftest.py``), driven through ``TritonBackend(device_type="cpu")``: the same
``rejects`` / ``check`` path the dispatcher takes on CUDA. Shapes are tiny because the
interpreter is slow, but chosen to hit every edge the kernels mask: M not a multiple of
8 or 16, N not a multiple of 256 (a partial last segment), K not a multiple of the K
tiles, both tilings (decode: M <= SMALL_M; tl.dot: M > SMALL_M).

Agreement is the module's stated contract: identical verdict bits (and so identical
``comp_row`` bytes), T within ``THRESHOLD_RTOL``, D within ``DIFF_TOL_OF_T * max(T, D)``.

One test compiles every kernel variant for sm_90 (the H200) in a subprocess with the
real Triton compiler and ptxas, so a kernel that only works in the interpreter fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sdc_guard import backends
from sdc_guard.core import verify
from sdc_guard.core.abft import AbftCheck, encode_comp_row, weight_side
from sdc_guard.backends import GemmRequest, TorchBackend, TritonBackend
from sdc_guard.kernels import vabft_triton
from sdc_guard.kernels.vabft_triton import DIFF_TOL_OF_T, SMALL_M, THRESHOLD_RTOL
from sdc_guard.core.batching import collapse_batch
from sdc_guard.kernels.vabft_weight import triton_weight_side

from gemm_cases import randn, request  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
M_DECODE, M_DOT = 13, 20  # one per tiling; neither a multiple of 8
#: both tilings, the second left to the full suite (the interpreter takes a second a case)
TILINGS = [M_DECODE, pytest.param(M_DOT, marks=pytest.mark.slow)]
K, N = 70, 300  # K not a multiple of the K tiles; N = one full and one partial segment
assert M_DECODE <= SMALL_M < M_DOT, "the two row counts must exercise both tilings"
TRITON = TritonBackend(device_type="cpu")
TORCH = TorchBackend()


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matmul as the hardware computes it: fp16 GEMMs accumulate in fp32."""
    if a.dtype == torch.float16:
        return torch.matmul(a.float(), b.float()).half()
    return torch.matmul(a, b)


def assert_agrees(req: GemmRequest) -> tuple[AbftCheck, AbftCheck]:
    """Run both backends on ``req`` and assert the module's agreement contract."""
    assert TRITON.rejects(req) is None
    got, want = TRITON.check(req), TORCH.check(req)
    for field in ("ok", "inputs_bad", "possible_overflow"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == torch.bool and g.shape == w.shape, field
        assert torch.equal(g, w), f"{field} differs:\n{g}\n{w}"
    assert torch.equal(encode_comp_row(got.ok), encode_comp_row(want.ok))
    judged = torch.isfinite(want.threshold) & torch.isfinite(want.diff)
    assert torch.equal(judged, torch.isfinite(got.threshold) & torch.isfinite(got.diff))
    t_want, t_got = want.threshold[judged], got.threshold[judged]
    torch.testing.assert_close(t_got, t_want, rtol=THRESHOLD_RTOL, atol=0)
    d_want = want.diff[judged]
    d_err = (got.diff[judged] - d_want).abs()
    scale = torch.maximum(t_want, d_want)
    assert bool((d_err <= DIFF_TOL_OF_T * scale).all()), float((d_err / scale).max())
    return got, want


# --- agreement on clean products ------------------------------------------------------

@pytest.mark.parametrize("m", TILINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_2d_agrees_and_passes(dtype: torch.dtype, m: int) -> None:
    a, b = randn(m, K, dtype=dtype, seed=1), randn(K, N, dtype=dtype, seed=2)
    got, _ = assert_agrees(request(a, b, product(a, b)))
    assert got.ok.shape == (m, 2) and bool(got.ok.all())


@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tight_screen_agrees(dtype: torch.dtype) -> None:
    """The tight screen's terms (squares, the coherent term, the rigorous cap), with a bias
    and a corrupted segment: the same verdicts and thresholds as the torch backend."""
    from sdc_guard.core.precision import screen_terms

    terms = screen_terms("tight", dtype, torch.device("cpu"))
    a, b = randn(M_DECODE, K, dtype=dtype, seed=41), randn(K, N, dtype=dtype, seed=42)
    bias = randn(N, dtype=dtype, seed=43)
    c = (product(a, b).float() + bias.float()).to(dtype)
    c[3, 280] = (c[3, 280].float() + 64 * c[3].float().abs().max()).to(dtype)
    got, _ = assert_agrees(request(a, b, c, bias=bias, rounding=terms))
    assert torch.argwhere(~got.ok).tolist() == [[3, 1]]


@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
@pytest.mark.parametrize("m", [M_DECODE, M_DOT])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_weight_transposed(dtype: torch.dtype, m: int) -> None:
    """nn.Linear: B = W.t(), K-contiguous, read through its strides."""
    a, w = randn(m, K, dtype=dtype, seed=3), randn(N, K, dtype=dtype, seed=4)
    got, _ = assert_agrees(request(a, w.t(), product(a, w.t())))
    assert bool(got.ok.all())


@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
@pytest.mark.parametrize("kind", ["mean_shifted", "row_scaled", "tiny"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hard_distributions_agree(dtype: torch.dtype, kind: str) -> None:
    """Large means (the mean term), wide row scales, and products that underflow (T_abs)."""
    a, b = randn(M_DOT, K, seed=5), randn(K, N, seed=6)
    if kind == "mean_shifted":
        a, b = a + 4.0, b + 4.0
    elif kind == "row_scaled":
        a = a * torch.exp2(torch.arange(M_DOT, dtype=torch.float32) - 10.0)[:, None]
    else:
        a, b = a * 1e-6, b * 1e-6
    a, b = a.to(dtype), b.to(dtype)
    got, _ = assert_agrees(request(a, b, product(a, b)))
    assert bool(got.ok.all())


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
def test_batched_3d() -> None:
    a, b = randn(3, M_DECODE, K, seed=7), randn(3, K, N, seed=8)
    got, _ = assert_agrees(request(a, b, a @ b))
    assert got.ok.shape == (3, M_DECODE, 2) and bool(got.ok.all())


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
def test_batched_broadcast_weight() -> None:
    """A 3-D activation against one 2-D weight: B's encoding is shared by the batch."""
    a, w = randn(2, M_DOT, K, dtype=torch.bfloat16, seed=9), randn(N, K, dtype=torch.bfloat16, seed=10)
    got, _ = assert_agrees(request(a, w.t(), a @ w.t()))
    assert bool(got.ok.all())


@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
def test_batched_two_broadcast_dims() -> None:
    """[3, 1, M, K] @ [1, 2, K, N]: two batch strides that cannot merge."""
    a, b = randn(3, 1, M_DECODE, K, seed=11), randn(1, 2, K, N, seed=12)
    got, _ = assert_agrees(request(a, b, a @ b))
    assert got.ok.shape == (3, 2, M_DECODE, 2) and bool(got.ok.all())


@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
def test_noncontiguous_operands() -> None:
    """A transposed A, a column-sliced C: everything is read through strides."""
    a = randn(K, M_DOT, seed=13).t()
    b = randn(K, N, seed=14)
    c = torch.empty(M_DOT, N + 5)[:, 2 : N + 2]
    c.copy_(a @ b)
    got, _ = assert_agrees(request(a, b, c))
    assert bool(got.ok.all())


@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
@pytest.mark.parametrize("bias_shape", [(N,), (M_DOT, 1), (M_DOT, N)], ids=str)
def test_bias_alpha_beta(bias_shape: tuple[int, ...]) -> None:
    a, b = randn(M_DOT, K, seed=15), randn(K, N, seed=16)
    bias = randn(*bias_shape, seed=17) + 5.0
    c = torch.addmm(bias.expand(M_DOT, N), a, b, alpha=0.5, beta=-2.0)
    got, _ = assert_agrees(request(a, b, c, bias=bias, alpha=0.5, beta=-2.0))
    assert bool(got.ok.all())
    # Verifying the same C without the bias must fail everywhere: the bias is really used.
    bad, _ = assert_agrees(request(a, b, c, alpha=0.5))
    assert not bool(bad.ok.any())


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
def test_bias_bf16_with_beta_zero_is_ignored() -> None:
    a, b = randn(M_DECODE, K, dtype=torch.bfloat16, seed=18), randn(K, N, dtype=torch.bfloat16, seed=19)
    bias = torch.full((N,), float("nan"), dtype=torch.bfloat16)
    got, _ = assert_agrees(request(a, b, a @ b, bias=bias, beta=0.0))
    assert bool(got.ok.all()) and not bool(got.inputs_bad.any())


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
@pytest.mark.parametrize("m", [M_DECODE, M_DOT])
def test_checksum_weight(m: int) -> None:
    a, b = randn(m, K, seed=20), randn(K, N, seed=21)
    r = torch.rand(2 * N, generator=torch.Generator().manual_seed(22))[::2] + 0.5  # strided
    c = a @ b
    got, _ = assert_agrees(request(a, b, c, checksum_weight=r))
    assert bool(got.ok.all())


# --- detection and triage -------------------------------------------------------------

@pytest.mark.parametrize("m", TILINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_corruption_flips_exactly_its_bit(dtype: torch.dtype, m: int) -> None:
    a, b = randn(m, K, dtype=dtype, seed=23), randn(K, N, dtype=dtype, seed=24)
    c = product(a, b)
    row, col = m - 1, 270  # last row (in the padded row block), partial last segment
    c[row, col] += 1000.0
    got, _ = assert_agrees(request(a, b, c))
    expected = torch.ones(m, 2, dtype=torch.bool)
    expected[row, col // 256] = False
    assert torch.equal(got.ok, expected)
    assert not bool(got.inputs_bad.any()) and not bool(got.possible_overflow.any())
    assert got.sdc.nonzero().tolist() == [[row, 1]]


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
def test_corruption_in_one_batch_element() -> None:
    a, b = randn(2, M_DOT, K, seed=25), randn(2, K, N, seed=26)
    c = a @ b
    c[1, 3, 10] -= 500.0
    got, _ = assert_agrees(request(a, b, c))
    assert got.sdc.nonzero().tolist() == [[1, 3, 0]]


@pytest.mark.parametrize("m", TILINGS)
def test_nan_in_a_row_is_unverifiable(m: int) -> None:
    a, b = randn(m, K, seed=27), randn(K, N, seed=28)
    a[4, 33] = float("nan")
    got, _ = assert_agrees(request(a, b, a @ b))
    expected = torch.zeros(m, 2, dtype=torch.bool)
    expected[4] = True
    assert torch.equal(got.inputs_bad, expected)
    assert torch.equal(got.ok, ~expected)
    assert not bool(got.sdc.any())


#: NaN / Inf arithmetic in the interpreter's numpy ops warns; the results are what count.
nonfinite_ok = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
@nonfinite_ok
def test_inf_in_b_marks_its_segment() -> None:
    a, b = randn(M_DOT, K, seed=29), randn(K, N, seed=30)
    b[7, 280] = float("inf")
    got, _ = assert_agrees(request(a, b, a @ b))
    assert torch.equal(got.inputs_bad, torch.tensor([[False, True]]).expand(M_DOT, 2))


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
def test_fp16_overflow_is_possible_overflow_not_sdc() -> None:
    a = torch.full((M_DECODE, K), 40.0, dtype=torch.float16)
    b = torch.full((K, N), 40.0, dtype=torch.float16)
    a[0] = 0.01  # row 0 stays finite
    c = product(a, b)  # 112000 > 65504: inf from row 1 on
    got, _ = assert_agrees(request(a, b, c))
    assert bool(got.possible_overflow[1:].all()) and not bool(got.possible_overflow[0].any())
    assert bool(got.ok[0].all()) and not bool(got.sdc.any())


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
def test_nan_in_c_with_small_inputs_is_sdc() -> None:
    a, b = randn(M_DECODE, K, seed=31), randn(K, N, seed=32)
    c = a @ b
    c[2, 100] = float("nan")
    got, _ = assert_agrees(request(a, b, c))
    assert got.sdc.nonzero().tolist() == [[2, 0]]


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
def test_inputs_are_not_written() -> None:
    a, w = randn(M_DOT, K, seed=33), randn(N, K, seed=34)
    bias, r = randn(N, seed=35), torch.rand(N) + 0.5
    c = torch.addmm(bias, a, w.t())
    before = [t.clone() for t in (a, w, c, bias, r)]
    TRITON.check(request(a, w.t(), c, bias=bias, checksum_weight=r))
    for old, new in zip(before, (a, w, c, bias, r)):
        assert torch.equal(old, new)


# --- the weight-side encoding and its cache -------------------------------------------

@pytest.mark.parametrize(
    "make_b",
    [
        lambda: randn(K, N, seed=36),
        lambda: randn(N, K, dtype=torch.bfloat16, seed=37).t(),
        lambda: randn(3, K, 600, dtype=torch.float16, seed=38),
        lambda: randn(600, 2, K, seed=39).permute(1, 2, 0),
    ],
    ids=["fp32", "bf16_transposed", "fp16_batched", "permuted_batch"],
)
@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
@pytest.mark.parametrize("k_chunk", [None, 32], ids=["one_chunk", "split_k"])
def test_weight_side_matches_reference(make_b, k_chunk) -> None:
    b = make_b()
    r = torch.rand(b.shape[-1], generator=torch.Generator().manual_seed(40)) + 0.5
    for weight in (None, r):
        got, want = triton_weight_side(b, weight, k_chunk=k_chunk), weight_side(b, weight)
        assert (got.k, got.n) == (want.k, want.n)
        assert torch.equal(got.widths, want.widths) and torch.equal(got.bad, want.bad)
        scale = b.float().abs().amax() * 256
        torch.testing.assert_close(got.br, want.br, rtol=1e-5, atol=float(scale) * 1e-6)
        for field in ("p1", "p2", "v", "col_norm"):
            torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-5, atol=0)


@pytest.mark.slow  # the Triton interpreter: see CONTRIBUTING.md
@nonfinite_ok
def test_weight_side_nonfinite_segment_is_bad() -> None:
    b = randn(K, 600, seed=41)
    b[3, 300] = float("nan")
    b[9, 599] = float("-inf")
    ws = triton_weight_side(b, k_chunk=32)
    assert ws.bad.tolist() == [False, True, True]
    assert torch.equal(ws.bad, weight_side(b).bad)


@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
@pytest.mark.parametrize("m", [M_DECODE, M_DOT])
def test_cached_weight_side(m: int) -> None:
    a, w = randn(m, K, dtype=torch.bfloat16, seed=42), randn(N, K, dtype=torch.bfloat16, seed=43)
    c = a @ w.t()
    fresh = TRITON.check(request(a, w.t(), c))
    cached = TRITON.check(request(a, w.t(), c, weight=triton_weight_side(w.t())))
    for field in ("ok", "inputs_bad", "possible_overflow", "diff", "threshold"):
        assert torch.equal(getattr(fresh, field), getattr(cached, field)), field
    # A torch-computed encoding is accepted too (the cache may hold either) ...
    assert_agrees(request(a, w.t(), c, weight=weight_side(w.t())))
    # ... and it is really what is used: a stale encoding (of another W) fails, as in torch.
    other = randn(N, K, dtype=torch.bfloat16, seed=50).t()
    stale, _ = assert_agrees(request(a, w.t(), c, weight=weight_side(other)))
    assert float((~stale.ok).float().mean()) > 0.8


def test_cached_weight_side_batched_broadcast() -> None:
    a, b = randn(3, M_DECODE, K, seed=44), randn(K, N, seed=45)
    assert_agrees(request(a, b, a @ b, weight=weight_side(b)))


# --- coverage (rejects) and the dispatcher --------------------------------------------

def test_collapse_batch_merges_what_one_stride_serves() -> None:
    assert collapse_batch([2, 3, 4], [[12, 4, 1], [12, 4, 1]]) == ([1, 24], [[0, 1], [0, 1]])
    assert collapse_batch([2, 1, 3], [[3, 99, 1]]) == ([1, 6], [[0, 1]])
    assert collapse_batch([2, 3], [[3, 1], [0, 1]]) == ([2, 3], [[3, 1], [0, 1]])
    assert collapse_batch([2, 3, 4], [[12, 4, 1], [0, 4, 0]]) is None


@pytest.mark.slow  # variants under the Triton interpreter (0.3-1.7 s each): CONTRIBUTING.md
def test_rejects_what_needs_a_copy_and_falls_back() -> None:
    a = randn(2, 3, 4, M_DECODE, K, seed=46)
    b = randn(4, 1, 2, K, N, seed=47).permute(2, 1, 0, 3, 4)  # [2, 1, 4, K, N]
    req = request(a, b, a @ b)
    reason = TRITON.rejects(req)
    assert reason is not None and "strides" in reason
    with pytest.raises(ValueError):
        vabft_triton.triton_check(req)
    # The dispatcher then serves the call with the torch backend.
    assert backends.select(req).name in ("torch", "npu")


def test_rejects_empty_and_foreign_device() -> None:
    a, b = torch.empty(0, K), randn(K, N)
    assert "empty" in TRITON.rejects(request(a, b, a @ b))
    a = randn(M_DECODE, K)
    assert TritonBackend().rejects(request(a, b, a @ b)) is not None  # CPU tensors, CUDA kernel


def test_rejects_stale_cache_shape() -> None:
    a, b = randn(M_DECODE, K), randn(K, N)
    ws = weight_side(randn(K, 2 * N))
    assert "cached" in TRITON.rejects(request(a, b, a @ b, weight=ws))
    ws = weight_side(randn(3, K, N))  # batched encoding, 2-D product
    assert "broadcast" in TRITON.rejects(request(a, b, a @ b, weight=ws))


def test_verify_matmul_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify_matmul(..., backend="triton")`` classifies with the kernel's masks."""
    monkeypatch.setattr(backends.registry, "_registry", [TRITON, TORCH])
    a, w = randn(M_DOT, K, dtype=torch.bfloat16, seed=48), randn(N, K, dtype=torch.bfloat16, seed=49)
    c = a @ w.t()
    assert verify.verify_matmul(a, w.t(), c, backend="triton").kind == "ok"
    c[5, 7] = c[5, 7] + 4096
    verdict = verify.verify_matmul(a, w.t(), c, backend="triton")
    assert (verdict.kind, verdict.rows, verdict.backend) == ("sdc", [5], "triton")


# --- the kernels compile for the GPU they are written for ------------------------------

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnly:  # a driver that names an H200 and launches nothing
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)

    driver.set_active(CompileOnly())
    compiled = []
    JITFunction.__getitem__ = lambda self, grid: (
        lambda *args, **kw: compiled.append(self.warmup(*args, grid=grid, **kw)))

    from sdc_guard.backends import GemmRequest
    from sdc_guard.core.precision import screen_terms
    from sdc_guard.kernels import vabft_triton as vt
    tight = screen_terms("tight", torch.bfloat16, torch.device("cuda"))  # the squares' variant
    for m, dtype, extras, terms in ((1, torch.bfloat16, False, None), (40, torch.float16, True, None),
                                    (40, torch.float32, False, None), (40, torch.bfloat16, False, tight)):
        a, w = torch.randn(2, m, 70).to(dtype), torch.randn(300, 70).to(dtype)
        kw = {"bias": torch.randn(300), "checksum_weight": torch.rand(300)} if extras else {}
        vt.triton_check(GemmRequest(a, w.t(), a @ w.t(), 1e-3, rounding=terms, **kw))
    names = sorted({k.name for k in compiled})
    assert all("cubin" in k.asm for k in compiled), "no cubin"
    print(len(compiled), names)
    """
)


@pytest.mark.slow  # integration-heavy (a subprocess, a CLI run, a training loop): see CONTRIBUTING.md
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    count, names = done.stdout.split(" ", 1)
    assert int(count) == 12  # four calls x (two weight-side kernels + one check kernel)
    assert "_check_kernel" in names and "_weight_partials_kernel" in names
