"""``sdc_guard.backends.npu``: the bridge to ``torch_npu._npu_matmul_abft_verify``, through a stand-in.

``tests/npu_standin.py`` plays ``torch_npu`` (installed in ``sys.modules`` per test) and
follows the operator's documented contract, quirks included: it rejects what the real
kernel rejects, returns garbage in the padding bits and records what it was handed. The
backend under test is a real ``NpuBackend(device_type="cpu")`` registered first; only
``torch_npu`` is replaced. The registry and ``SDC_GUARD_BACKEND`` are restored after
every test.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor


import npu_standin  # noqa: E402
from sdc_guard.backends import native  # noqa: E402

#: what serves a CPU call the operator does not take: the native kernels when built
CPU_FALLBACK = "cpu" if native.available() else "torch"
from npu_standin import NpuOperator, make_module  # noqa: E402

from sdc_guard import backends  # noqa: E402
from sdc_guard.backends import ENV_BACKEND  # noqa: E402
from sdc_guard.backends.npu import NpuBackend  # noqa: E402
from sdc_guard.core.verify import Verdict, abft_verify, matmul_checksum, verify_matmul  # noqa: E402

PROBE_SHAPES = ((8, 16), (16, 256), (8, 256), (256,))
FAILURE = "aclnnMatmulAbftVerify failed: ACL error 507015"


@dataclass
class Bridge:
    """The backend under test and the stand-in operator behind it."""

    backend: NpuBackend
    op: NpuOperator | None


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Restore the backend registry (objects and order) and unset ``SDC_GUARD_BACKEND``."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    saved = [backends.get(name) for name in backends.registered()]
    yield
    for name in backends.registered():
        backends.unregister(name)
    for backend in saved:
        backends.register(backend)


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch, registry: None) -> Callable[..., Bridge]:
    """``install(op)`` puts ``torch_npu`` (with ``op``; ``absent=True``: no module at all)
    in ``sys.modules`` and registers a fresh CPU ``NpuBackend`` first."""

    def _install(op: NpuOperator | None, *, absent: bool = False) -> Bridge:
        monkeypatch.setitem(sys.modules, "torch_npu", None if absent else make_module(op))
        backend = NpuBackend(device_type="cpu")
        backends.register(backend, first=True)
        return Bridge(backend, op)

    return _install


@pytest.fixture
def bridge(install: Callable[..., Bridge]) -> Bridge:
    """A working stand-in operator behind the backend."""
    return install(NpuOperator(seed=0))


def gemm(m: int, k: int, n: int, dtype: torch.dtype = torch.float32,
         seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Gaussian ``a``, ``b`` and their product ``c`` in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    return a, b, a @ b


def flagged(verdict: Verdict) -> list[list[int]]:
    """(row, segment) pairs flagged as corruption."""
    return torch.nonzero(verdict.flags).tolist()


# --- the stand-in itself follows the contract --------------------------------------------

def _illegal_calls() -> dict[str, tuple[tuple[Tensor, ...], float]]:
    a, b = torch.ones(8, 16), torch.ones(16, 300)
    c, w = torch.ones(8, 300), torch.ones(300)
    bf = torch.bfloat16
    return {
        "3-D a": ((a[None], b, c, w), 1e-3),
        "K mismatch": ((a, torch.ones(15, 300), c, w), 1e-3),
        "c shape": ((a, b, torch.ones(8, 299), w), 1e-3),
        "weight shape": ((a, b, c, torch.ones(299)), 1e-3),
        "a/b dtypes differ": ((a.to(bf), b, c, w.to(bf)), 1e-3),
        "float64 inputs": ((a.double(), b.double(), c, w.double()), 1e-3),
        "c not float32": ((a.to(bf), b.to(bf), c.to(bf), w.to(bf)), 1e-3),
        "weight dtype": ((a.to(bf), b.to(bf), c, w), 1e-3),
        "e_max < 0": ((a, b, c, w), -1e-3),
        "non-contiguous b": ((a, torch.ones(300, 16).t(), c, w), 1e-3),
        "non-contiguous c": ((a, b, torch.ones(300, 8).t(), w), 1e-3),
    }


@pytest.mark.parametrize("case", list(_illegal_calls()))
def test_standin_fails_fast_on_illegal_arguments(case: str) -> None:
    """The stand-in rejects what RFC 3.5.2.1 says the kernel rejects, so a sloppy bridge
    cannot pass these tests by accident."""
    args, e_max = _illegal_calls()[case]
    with pytest.raises(RuntimeError, match="_npu_matmul_abft_verify"):
        NpuOperator()(*args, e_max=e_max)


def test_standin_stream_layout_is_the_rfc_layout() -> None:
    """Hand-derived bytes: M=10, N=300 gives ceil(10/8)*ceil(300/256) = 4 bytes, byte
    ``s*2 + m//8``, bit ``m%8``; row 9 of segment 1 is byte 3 bit 1 (padding zeroed)."""
    a, b, c = gemm(10, 16, 300, torch.float16)
    c = c.float()
    c[9, 299] += 1e3
    op = NpuOperator(padding="zeros")
    stream = op(a, b, c, torch.ones(300, dtype=torch.float16))
    assert stream.dtype == torch.uint8
    assert stream.tolist() == [0xFF, 0b11, 0xFF, 0b01]
    assert op.calls[0].zero_padding_bits == 12


# --- probe ------------------------------------------------------------------------------

def test_probe_runs_once_is_cached_and_queryable(bridge: Bridge) -> None:
    """One tiny legal call decides availability; later calls and queries reuse it."""
    assert bridge.op.calls == []  # registering does not probe
    result = bridge.backend.probe()
    assert result.available
    assert backends.status()["npu"] is None and "npu" in backends.available()
    probe = bridge.op.calls[0]
    assert probe.shapes == PROBE_SHAPES and probe.stream is not None  # legal, answered
    for seed in range(3):
        assert verify_matmul(*gemm(13, 32, 300, seed=seed)).backend == "npu"
    assert bridge.backend.probe() is result
    assert [call.shapes for call in bridge.op.calls].count(PROBE_SHAPES) == 1
    assert len(bridge.op.calls) == 4


@pytest.mark.parametrize("absent", [True, False], ids=["no-torch_npu", "stock-CANN"])
def test_without_the_operator_the_cpu_path_serves(install: Callable[..., Bridge], absent: bool) -> None:
    """No ``torch_npu`` (or one without the symbol): unavailable, with a reason; the CPU path runs."""
    bridge = install(None, absent=absent)
    result = bridge.backend.probe()
    assert not result.available and "torch_npu" in result.reason
    assert backends.status()["npu"] == result.reason
    assert "npu" not in backends.available()
    a, b, c = gemm(13, 32, 300)
    verdict = verify_matmul(a, b, c)
    assert verdict.backend == CPU_FALLBACK and verdict.ok


def test_probe_failure_makes_the_backend_unavailable_with_the_reason(
    install: Callable[..., Bridge],
) -> None:
    """An operator that raises on the probe is unavailable, says why, and is not retried."""
    bridge = install(NpuOperator(fail_from_call=0, failure=FAILURE))
    reason = backends.status()["npu"]
    assert reason is not None and "RuntimeError" in reason and FAILURE in reason
    for seed in range(2):
        assert verify_matmul(*gemm(13, 32, 300, seed=seed)).backend == CPU_FALLBACK
    assert len(bridge.op.calls) == 1


def test_probe_flagging_a_correct_product_makes_the_backend_unavailable(
    install: Callable[..., Bridge],
) -> None:
    """An operator that answers but calls the probe's correct product wrong is not trusted."""

    def says_all_wrong(a: Tensor, b: Tensor, c: Tensor, w: Tensor, *, e_max: float = 1e-3) -> Tensor:
        npu_standin.check_contract(a, b, c, w, e_max)
        return torch.zeros(npu_standin.expected_stream_length(a.shape[0], b.shape[1]), dtype=torch.uint8)

    bridge = install(None)
    setattr(sys.modules["torch_npu"], npu_standin.OP_NAME, says_all_wrong)
    result = bridge.backend.probe()
    assert not result.available and "flagged" in result.reason
    assert verify_matmul(*gemm(13, 32, 300)).backend == CPU_FALLBACK


def test_reset_probe_reprobes(bridge: Bridge, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached answer is only forgotten on request (after torch_npu changes)."""
    assert bridge.backend.probe().available
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert bridge.backend.probe().available  # still cached
    bridge.backend.reset_probe()
    assert not bridge.backend.probe().available


@pytest.mark.parametrize("entry", ["verify_matmul", "abft_verify", "matmul_checksum"])
def test_a_real_call_error_propagates(install: Callable[..., Bridge], entry: str) -> None:
    """After a good probe, the operator's error surfaces; no silent fallback to torch."""
    bridge = install(NpuOperator(fail_from_call=1, failure=FAILURE))
    call = {"verify_matmul": verify_matmul, "abft_verify": abft_verify,
            "matmul_checksum": matmul_checksum}[entry]
    for seed in range(2):  # a second call fails too: the first did not switch paths
        with pytest.raises(RuntimeError, match="507015"):
            call(*gemm(13, 32, 300, seed=seed))
    assert bridge.backend.probe().available
    assert len(bridge.op.real_calls()) == 2


# --- what the bridge hands the operator -------------------------------------------------

def test_bridge_passes_contiguous_operands_fp32_c_and_the_screens_e_max(bridge: Bridge) -> None:
    """``A``, ``B = W.t()`` and C non-contiguous: the operator (which rejects anything
    else) gets contiguous copies of the same values, ``c.float()`` and the portable
    screen's own ``e_max`` (its T is then never above the portable T)."""
    dtype, e_max = torch.float32, 2e-5
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(64, 13, generator=gen).to(dtype).t()
    w = torch.randn(300, 64, generator=gen).to(dtype)
    b = w.t()
    c = (w @ a.t()).t()  # = a @ b, laid out transposed
    assert not any(t.is_contiguous() for t in (a, b, c)) and c.dtype == dtype
    verdict = verify_matmul(a, b, c)
    assert verdict.backend == "npu" and verdict.ok
    (call,) = bridge.op.real_calls()
    assert call.contiguous == (True, True, True, True)
    assert call.c_dtype == torch.float32 and torch.equal(call.c, c.float())
    assert torch.equal(call.a, a) and torch.equal(call.b, b)
    assert call.e_max == e_max
    assert call.checksum_weight.dtype == dtype and bool((call.checksum_weight == 1).all())


def test_all_ones_weight_is_cached_per_n_and_dtype(bridge: Bridge) -> None:
    """One all-ones weight per (N, dtype, device), reused across calls; a user weight is
    cast to the operands' dtype as the contract requires. (Only CPU exists here, and the
    operator takes fp32 only, so the device and dtype parts of the key are not exercised.)"""
    verify_matmul(*gemm(13, 32, 300))
    verify_matmul(*gemm(5, 16, 300, seed=1))
    verify_matmul(*gemm(13, 32, 40))
    first, again, short = (call.checksum_weight for call in bridge.op.real_calls())
    assert again is first
    assert short is not first and tuple(short.shape) == (40,)
    assert all(bool((w == 1).all()) for w in (first, short))
    user = torch.linspace(0.5, 2.0, 300, dtype=torch.float64)
    a, b, c = gemm(13, 32, 300)
    assert verify_matmul(a, b, c, checksum_weight=user).backend == "npu"
    passed = bridge.op.real_calls()[-1].checksum_weight
    assert passed.dtype == torch.float32 and torch.equal(passed, user.float())


# --- the bitstream ----------------------------------------------------------------------

@pytest.mark.parametrize("padding", ["random", "zeros"])
def test_garbage_padding_bits_are_masked(install: Callable[..., Bridge], padding: str) -> None:
    """M % 8 != 0: padding bits are undefined; a correct product must still be OK."""
    bridge = install(NpuOperator(seed=5, padding=padding))
    for seed in range(25):
        verdict = verify_matmul(*gemm(13, 24, 300, seed=seed))
        assert verdict.backend == "npu" and verdict.ok, f"seed {seed}: {flagged(verdict)}"
    zeros = [call.zero_padding_bits for call in bridge.op.real_calls()]
    assert len(zeros) == 25 and sum(zeros) > 25  # the garbage really was there


def test_a_corrupted_element_is_detected_on_the_npu_path(bridge: Bridge) -> None:
    """One element off by a lot: exactly its (row, segment) is flagged, by the npu backend."""
    a, b, c = gemm(13, 64, 300, seed=3)
    c[9, 270] += 1e3
    verdict = verify_matmul(a, b, c)
    assert verdict.backend == "npu"
    assert verdict.kind == "sdc" and not verdict.ok
    assert flagged(verdict) == [[9, 1]] and verdict.rows == [9]


def test_abft_verify_on_the_npu_path_sets_padding_bits(install: Callable[..., Bridge]) -> None:
    """sdc_guard's own stream has padding bits 1 even when the operator's were 0."""
    bridge = install(NpuOperator(padding="zeros"))
    a, b, c = gemm(10, 32, 300)
    assert abft_verify(a, b, c).tolist() == [0xFF] * 4
    c[9, 299] += 1e3
    assert abft_verify(a, b, c).tolist() == [0xFF, 0xFF, 0xFF, 0xFD]
    assert len(bridge.op.real_calls()) == 2  # the npu backend answered both


# --- dispatch ---------------------------------------------------------------------------

def _rejected_inputs() -> dict[str, tuple[tuple[Tensor, ...], dict[str, object], str]]:
    """Calls the npu backend must decline, with the reason it must give."""
    a, b, c = gemm(13, 32, 300)
    a3, b3 = torch.stack([a, -a]), torch.stack([b, b])
    bias = torch.randn(300)
    ah, bh = a.half(), b.half()
    return {
        "3-D": ((a3, b3, a3 @ b3), {}, "2-D"),
        "bias": ((a, b, c + bias), {"bias": bias}, "bias"),
        "alpha": ((a, b, 2 * c), {"alpha": 2.0}, "alpha"),
        "fp16": ((ah, bh, (ah.float() @ bh.float()).half()), {}, "float16"),
        "bf16": ((a.bfloat16(), b.bfloat16(), a.bfloat16() @ b.bfloat16()), {}, "C's rounding from C"),
    }


@pytest.mark.parametrize("case", list(_rejected_inputs()))
def test_inputs_outside_the_contract_fall_back_to_the_cpu_path(bridge: Bridge, case: str) -> None:
    """3-D, bias, alpha != 1, fp16 and bf16 are served on the CPU, and never reach the operator."""
    args, kw, _ = _rejected_inputs()[case]
    verdict = verify_matmul(*args, **kw)
    assert verdict.backend == CPU_FALLBACK and verdict.ok
    assert bridge.op.real_calls() == []


@pytest.mark.parametrize("case", list(_rejected_inputs()))
def test_forcing_npu_on_a_rejected_input_raises_clearly(
    bridge: Bridge, monkeypatch: pytest.MonkeyPatch, case: str,
) -> None:
    """``SDC_GUARD_BACKEND=npu`` is a demand: refuse with the variable and the reason."""
    monkeypatch.setenv(ENV_BACKEND, "npu")
    args, kw, reason = _rejected_inputs()[case]
    with pytest.raises(RuntimeError, match=rf"{ENV_BACKEND}='npu' cannot verify this call: .*{reason}"):
        verify_matmul(*args, **kw)
    assert verify_matmul(*gemm(13, 32, 300)).backend == "npu"  # an accepted call still works


def test_forcing_npu_without_the_operator_raises_clearly(
    install: Callable[..., Bridge], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forced but unavailable: the probe's reason is in the error."""
    install(None, absent=True)
    monkeypatch.setenv(ENV_BACKEND, "npu")
    with pytest.raises(RuntimeError, match=rf"{ENV_BACKEND}='npu' cannot verify this call: .*torch_npu"):
        verify_matmul(*gemm(13, 32, 300))


# --- npu and torch agree ----------------------------------------------------------------

def _nan(t: Tensor, index: tuple[int, ...]) -> Tensor:
    t = t.clone()
    t[index] = float("nan")
    return t


def _agreement_cases() -> dict[str, Callable[[], tuple[Tensor, Tensor, Tensor]]]:
    """Inputs on which both backends must reach the same verdict, segment by segment."""

    def clean(dtype: torch.dtype) -> Callable[[], tuple[Tensor, Tensor, Tensor]]:
        return lambda: gemm(13, 64, 300, dtype, seed=4)

    def corrupted(dtype: torch.dtype, index: tuple[int, int], delta: float) -> Callable[[], tuple]:
        def make() -> tuple[Tensor, Tensor, Tensor]:
            a, b, c = gemm(13, 64, 300, dtype, seed=4)
            c[index] += delta
            return a, b, c
        return make

    def planted(value: float, dtype: torch.dtype) -> Callable[[], tuple]:
        def make() -> tuple[Tensor, Tensor, Tensor]:
            a, b, c = gemm(13, 64, 300, dtype, seed=4)
            c[6, 100] = value
            return a, b, c
        return make

    def ulp() -> tuple[Tensor, Tensor, Tensor]:
        a, b, c = gemm(13, 64, 300, seed=4)
        c[2, 2] = torch.nextafter(c[2, 2], torch.tensor(float("inf")))
        return a, b, c

    def bad_input(which: str) -> Callable[[], tuple]:
        def make() -> tuple[Tensor, Tensor, Tensor]:
            a, b, _ = gemm(13, 64, 300, seed=4)
            a = _nan(a, (3, 5)) if which == "a" else a
            b = _nan(b, (7, 260)) if which == "b" else b
            return a, b, a @ b
        return make

    return {
        "clean-fp32": clean(torch.float32),
        "large-fp32": corrupted(torch.float32, (12, 299), 50.0),
        "small-fp32": corrupted(torch.float32, (0, 0), 1e-3),
        "one-ulp-fp32": ulp,
        "nan-in-c": planted(float("nan"), torch.float32),
        "inf-in-c": planted(float("inf"), torch.float32),
        "nan-in-a": bad_input("a"),
        "nan-in-b": bad_input("b"),
    }


def assert_same_verdict(npu: Verdict, torch_: Verdict) -> None:
    """Same kind and the same masks, segment by segment."""
    assert (npu.backend, torch_.backend) == ("npu", "torch")
    assert (npu.ok, npu.kind) == (torch_.ok, torch_.kind)
    for mask in ("flags", "overflow", "unverifiable"):
        assert torch.equal(getattr(npu, mask), getattr(torch_, mask)), mask


@pytest.mark.parametrize("case", list(_agreement_cases()))
def test_npu_and_torch_verdicts_agree(bridge: Bridge, case: str) -> None:
    """The same ``e_max`` means the same thing on both backends (docs/ALGORITHM.md, "The NPU operator")."""
    a, b, c = _agreement_cases()[case]()
    assert_same_verdict(verify_matmul(a, b, c, backend="npu"), verify_matmul(a, b, c, backend="torch"))


@pytest.mark.parametrize("case", ["clean-fp32", "large-fp32", "nan-in-c", "inf-in-c", "nan-in-a"])
def test_matmul_checksum_agrees_between_backends(
    bridge: Bridge, monkeypatch: pytest.MonkeyPatch, case: str,
) -> None:
    """The synchronisation-free drop-in must flag the same anomalies on both paths: a NaN
    or Inf planted in C (an exponent-bit SDC) is corruption, not an overflow, when the
    inputs are small (docs/ALGORITHM.md, "What it can see": "Inf, NaN ... is always caught")."""
    a, b, c = _agreement_cases()[case]()
    answers = {}
    for name in ("npu", "torch"):
        monkeypatch.setenv(ENV_BACKEND, name)
        answers[name] = bool(matmul_checksum(a, b, c))
    assert answers["npu"] == answers["torch"], answers
    assert answers["torch"] == (case in ("large-fp32", "nan-in-c", "inf-in-c"))


def test_the_operators_flags_contain_the_portable_screens_on_structured_fp32(bridge: Bridge) -> None:
    """Sparse rows (the transposed causal attention matrix) meeting large rows of B, fp32:
    where the bracket underestimates C, the portable screen's extra terms (one fp32
    rounding of ``|A| @ |B| r``, C's own rounding) keep segments the operator flags. The
    operator's flags must contain the portable screen's (its T is never above the
    portable T), and the confirmation must clear what it adds: the verdicts agree, on
    clean and on corrupted products."""
    from fp_models import causal_attention_t

    extra = 0
    for trial in range(10):
        gen = torch.Generator().manual_seed(trial)
        a = causal_attention_t(1, 64, generator=gen)[0]
        b = torch.randn(64, 256, generator=gen)
        b[-4:] = (torch.rand(4, 1, generator=gen) + 1) * 30
        c = a @ b
        bad = c.clone()
        bad[60, 7] += 1e-2 * float(c[60].abs().max())
        for candidate in (c, bad):
            npu, torch_ = verify_matmul(a, b, candidate, backend="npu"), verify_matmul(a, b, candidate, backend="torch")
            assert_same_verdict(npu, torch_)
            assert bool((npu.screen_flags | ~torch_.screen_flags).all()), f"trial {trial}: a flag the operator missed"
            extra += int((npu.screen_flags & ~torch_.screen_flags).sum())
    print(f"[npu] segments only the operator flagged (cleared by the confirmation): {extra}")


def test_bf16_on_the_npu_is_served_by_the_portable_screen(bridge: Bridge) -> None:
    """The operator's threshold cannot read C: a bf16 call never reaches it, and the
    dispatcher's next backend (the portable screen) sees an error of one segment RMS that
    the operator at the ``e_max`` the bridge used to pass for bf16 (1e-3, raised to keep
    ``e_eff`` at bf16's unit roundoff: D/T 0.9 here) would miss."""
    k = 64
    a, b, c = gemm(13, k, 300, torch.bfloat16, seed=4)
    rms = c.float()[3, :256].square().mean().sqrt()
    bad = c.clone()
    bad[3, 10] = (bad[3, 10].float() + rms).bfloat16()
    verdict = verify_matmul(a, b, bad)
    assert verdict.backend == CPU_FALLBACK and verdict.rows == [3]
    assert bridge.op.real_calls() == []
    earlier = max(1e-3, 2.0**-8 / (6 * (k / 1024) ** 0.5))
    standin = npu_standin.reference_check(a, b, bad.float(), torch.ones(300), e_max=earlier, c_dtype=torch.float32)
    assert standin.ok[3, 0], "the operator at its earlier bf16 e_max would have missed it"
