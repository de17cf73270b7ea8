"""The collective checks in one process: the checksums and the rounding bound of a reduction
(sdc_guard/core/collective.py) on gradients of a real training step, the all-gather's exact
bit checksums, the drill's and protect()'s arguments, the route of the collective ops, the
metrics, and one real (single-rank gloo) all-reduce caught under protect().

The multi-rank runs (DDP, FSDP2, tensor parallelism) are tests/test_collectives.py.
"""

from __future__ import annotations

import functools
import math
import socket
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from prometheus_client import CollectorRegistry
from torch.multiprocessing.reductions import StorageWeakRef


import sdc_guard  # noqa: E402
from sdc_guard.backends import native  # noqa: E402
from models import TinyGPT, lm_batch  # noqa: E402
from sdc_guard.core.collective import (  # noqa: E402
    SEGMENT, bit_checksums, pairs_bits, reduction_bound, reduction_clear, reduction_flags, segment_sizes,
    segment_sums,
)
from sdc_guard.metrics import GuardMetrics  # noqa: E402
from sdc_guard.runtime.collectives.collective_checks import CollectiveChecks, CollectiveResult, _carried  # noqa: E402
from sdc_guard.runtime.collectives.verdicts import Record, _all_clear, judge_all, suspects  # noqa: E402
from sdc_guard.runtime.collectives.verdicts import verdict as collective_verdict  # noqa: E402
from sdc_guard.runtime.dispatch.collective_ops import Collective  # noqa: E402
from sdc_guard.runtime.dispatch.ops import Route, route_of  # noqa: E402
from sdc_guard.runtime.report import Detection, StepReport  # noqa: E402
from sdc_guard.runtime.sampling import Budget, EveryN, Full, Rotating, Screened, sampler_shared  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@functools.lru_cache(maxsize=None)
def _gradients(ranks: int) -> tuple[torch.Tensor, ...]:
    """Each simulated rank's flat gradient of one real step of the tiny GPT (its own batch),
    divided by the rank count as DDP divides its buckets."""
    out = []
    for rank in range(ranks):
        torch.manual_seed(0)
        model = TinyGPT(layers=1)
        x, y = lm_batch(rank)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]) / ranks)
    return tuple(out)


def _reduce(xs: list[torch.Tensor], order: list[int], average: bool) -> torch.Tensor:
    """A correct reduction in the inputs' dtype, adding in ``order`` and rounding after each
    addition (what a ring or a tree of ranks does, hop by hop)."""
    r = xs[order[0]].clone()
    for j in order[1:]:
        r = r + xs[j]
    return r / len(xs) if average else r


def _verdict(xs: list[torch.Tensor], result: torch.Tensor, dtype: torch.dtype, average: bool):
    sent = [segment_sums(x, with_abs=True) for x in xs]
    expected = sum(s for s, _ in sent)
    magnitudes = sum(a for _, a in sent)
    received = segment_sums(result, with_abs=False)[0]
    return reduction_flags(received, expected, magnitudes, segment_sizes(result.numel()), dtype, len(xs),
                           len(xs) if average else 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("average", [False, True], ids=["sum", "avg"])
def test_correct_reductions_of_real_gradients_stay_within_the_bound(dtype: torch.dtype, ranks: int,
                                                                    average: bool) -> None:
    """No false positive: real gradients reduced in every order a ring or a tree may use
    (and with the average's division), in fp32, bf16 and fp16, never exceed the bound."""
    xs = [x.to(dtype) for x in _gradients(ranks)]
    orders = [list(range(ranks)), list(reversed(range(ranks))), [r for r in range(ranks) if r % 2] +
              [r for r in range(ranks) if not r % 2]]
    worst = 0.0
    for order in orders:
        corrupt, unverifiable, ratio = _verdict(xs, _reduce(xs, order, average), dtype, average)
        assert not corrupt.any() and not unverifiable.any(), (order, ratio.max())
        worst = max(worst, float(ratio.max()))
    assert 0 < worst < 0.25  # measured: below 0.04 everywhere (the bound is a worst case)


def test_the_bound_holds_under_cancellation() -> None:
    """An adversarial reduction: two ranks send x and -x(1 - 2^-22), whose exact sum is tiny,
    so that every rounding is at its largest relative to the result."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3 * SEGMENT + 5, generator=gen) * 1e3
    xs = [x, -(x * (1 - 2.0 ** -22))]
    corrupt, _, ratio = _verdict(xs, xs[0] + xs[1], torch.float32, False)
    assert not corrupt.any() and float(ratio.max()) < 1


@pytest.mark.parametrize("dtype, ranks, largest", [
    (torch.float32, 2, 0.1), (torch.float32, 8, 0.1), (torch.bfloat16, 2, 50.0), (torch.bfloat16, 8, 400.0),
    (torch.float16, 2, 10.0), (torch.float16, 8, 50.0)], ids=str)
def test_a_single_wrong_element_is_caught(dtype: torch.dtype, ranks: int, largest: float) -> None:
    """Detection power on real gradients: one element of the result off by ``largest`` times
    the result's mean magnitude is caught wherever it falls (measured, 20 positions: fp32
    catches 0.6-3 % of the mean, bf16 6-24x at 2 ranks and 50-190x at 8, fp16 1-3x and
    7-24x; the bound grows with the ranks' roundings), and so is a flipped top exponent bit."""
    xs = [x.to(dtype) for x in _gradients(ranks)]
    result = _reduce(xs, list(range(ranks)), False)
    mean = float(result.abs().double().mean())
    for i in range(0, result.numel(), result.numel() // 20):
        wrong = result.clone()
        wrong[i] = wrong[i] + largest * mean
        corrupt, _, _ = _verdict(xs, wrong, dtype, False)
        assert np.flatnonzero(corrupt).tolist() == [i // SEGMENT], i
        flipped = result.clone()
        bits = flipped.view(torch.int32 if dtype == torch.float32 else torch.int16)
        bits[i] ^= 1 << (30 if dtype == torch.float32 else 14)
        assert _verdict(xs, flipped, dtype, False)[0].any(), i


def test_non_finite_values() -> None:
    """A sender's inf propagates legitimately (unverifiable, never a detection); a NaN in the
    result of finite senders is corruption; an fp16 sum that may overflow is not."""
    xs = [torch.ones(SEGMENT + 3), torch.ones(SEGMENT + 3)]
    bad = xs[0].clone()
    bad[SEGMENT + 1] = math.inf
    corrupt, unverifiable, _ = _verdict([bad, xs[1]], bad + xs[1], torch.float32, False)
    assert not corrupt.any() and unverifiable.tolist() == [False, True]
    result = xs[0] + xs[1]
    result[5] = math.nan
    corrupt, unverifiable, _ = _verdict(xs, result, torch.float32, False)
    assert corrupt.tolist() == [True, False] and not unverifiable.any()
    big = [torch.full((8,), 40000.0, dtype=torch.float16)] * 2
    corrupt, unverifiable, _ = _verdict(big, big[0] + big[1], torch.float16, False)  # inf, legitimately
    assert not corrupt.any() and unverifiable.all()


def test_the_clearing_comparison_clears_only_what_the_flags_pass() -> None:
    """``reduction_clear`` (the verdicts' pass over a clean step): true on a correct
    reduction of real gradients, false wherever ``reduction_flags`` finds a corrupt segment
    (one wrong element, a NaN) and where a sender's overflow leaves a segment unverifiable
    (never cleared unseen: ``reduction_flags`` then decides)."""
    xs = [x.to(torch.float32) for x in _gradients(2)]

    def both(senders: list[torch.Tensor], result: torch.Tensor) -> tuple[bool, np.ndarray, np.ndarray]:
        sent = [segment_sums(x, with_abs=True) for x in senders]
        args = (segment_sums(result, with_abs=False)[0], sum(s for s, _ in sent), sum(a for _, a in sent),
                segment_sizes(result.numel()), torch.float32, 2, 1)
        corrupt, unverifiable, _ = reduction_flags(*args)
        return reduction_clear(*args), corrupt, unverifiable

    clear, corrupt, _ = both(xs, xs[0] + xs[1])
    assert clear and not corrupt.any()
    wrong = xs[0] + xs[1]
    wrong[SEGMENT + 5] += 0.1 * float(wrong.abs().mean())
    clear, corrupt, _ = both(xs, wrong)
    assert not clear and np.flatnonzero(corrupt).tolist() == [1]
    nan = xs[0] + xs[1]
    nan[3] = math.nan
    clear, corrupt, _ = both(xs, nan)
    assert not clear and np.flatnonzero(corrupt).tolist() == [0]
    bad = xs[0].clone()
    bad[7] = math.inf
    clear, corrupt, unverifiable = both([bad, xs[1]], bad + xs[1])
    assert not clear and not corrupt.any() and np.flatnonzero(unverifiable).tolist() == [0]


def test_the_bound_in_numbers() -> None:
    """The bound's scale: two fp32 ranks, one full segment of unit magnitudes: the two
    roundings of the checksums' fp32 partials dominate the reduction's own (2^-24)."""
    bound = reduction_bound(torch.tensor([2.0 * SEGMENT], dtype=torch.float64), segment_sizes(SEGMENT),
                            torch.float32, 2, 1)
    assert 2.0 ** -24 * 2 * SEGMENT < float(bound[0]) < 3e-5 * 2 * SEGMENT


def test_segment_sums_are_exact_to_their_own_rounding() -> None:
    x = _gradients(2)[0]
    sums, magnitudes = segment_sums(x, with_abs=True)
    chunks = x.split(SEGMENT)
    assert sums.shape == (len(chunks), 2) and magnitudes.shape == (len(chunks),)
    for (even, odd), m, chunk in zip(sums.tolist(), magnitudes.tolist(), chunks):
        a = math.fsum(chunk.abs().double().tolist())
        assert abs(even - math.fsum(chunk[0::2].double().tolist())) <= 32 * 2.0 ** -24 * a
        assert abs(odd - math.fsum(chunk[1::2].double().tolist())) <= 32 * 2.0 ** -24 * a
        assert abs(m - a) <= 64 * 2.0 ** -24 * a
    rows, _ = segment_sums(torch.cat([x, x]), with_abs=False, rows=2)  # a reduce-scatter's chunks
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], sums)


def test_a_zeroed_segment_that_sums_to_zero_is_caught() -> None:
    """The gradient of a LayerNorm's input sums to zero over each token's row, and so do
    the token embedding's: a plain segment sum cannot tell such a segment from zeros.
    The even and odd halves can (fp32 and bf16, two ranks)."""
    for dtype in (torch.float32, torch.bfloat16):
        xs = [x.to(dtype) for x in _gradients(2)]
        result = xs[0] + xs[1]
        first = result[:SEGMENT]  # the token embedding's gradient: 64 rows of 32, each summing to ~0
        assert abs(float(first.double().sum())) < 1e-3 * float(first.double().abs().sum())
        zeroed = result.clone()
        zeroed[:SEGMENT] = 0
        corrupt, _, _ = _verdict(xs, zeroed, dtype, False)
        assert np.flatnonzero(corrupt).tolist() == [0], dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bit_checksums_see_every_flipped_bit_and_misplaced_segment(dtype: torch.dtype) -> None:
    shard = _gradients(2)[0][: 3 * SEGMENT + 7].to(dtype)
    wide = pairs_bits(dtype, shard.numel())
    clean = bit_checksums(shard, wide)
    width = 32 if dtype == torch.float32 else 16
    view = torch.int32 if width == 32 else torch.int16
    for bit in range(width):
        flipped = shard.clone()
        flipped.view(view)[1234] ^= (1 << bit) if bit < width - 1 else -(1 << bit)
        assert bit_checksums(flipped, wide)[0, 0] != clean[0, 0], bit
    moved = torch.cat([shard[SEGMENT: 2 * SEGMENT], shard[:SEGMENT], shard[2 * SEGMENT:]])
    assert bit_checksums(moved, wide)[0, 0] == clean[0, 0] and bit_checksums(moved, wide)[0, 1] != clean[0, 1]
    # an all-gather's shards at any offset read the same words as their sender's copy
    gathered = torch.cat([shard[:-1], shard[:-1]])  # odd shards: 2-byte words at odd offsets
    odd = pairs_bits(dtype, shard.numel() - 1)
    rows = bit_checksums(gathered, odd, rows=2)
    assert torch.equal(rows[0], bit_checksums(shard[:-1].clone(), odd)[0]) and torch.equal(rows[0], rows[1])


def test_collective_fault_arguments_are_checked_and_named() -> None:
    with pytest.raises(ValueError, match="op: expected one of 'all_reduce', 'all_gather', 'reduce_scatter'"):
        sdc_guard.CollectiveFault(op="broadcast")
    with pytest.raises(ValueError, match="corruption: expected one of 'zero', 'flip', 'stale', got 'garbage'"):
        sdc_guard.CollectiveFault(op="all_reduce", corruption="garbage")
    with pytest.raises(ValueError, match="rank: expected a non-negative int or None, got -1"):
        sdc_guard.CollectiveFault(op="all_reduce", rank=-1)
    with pytest.raises(ValueError, match="shard: expected None for op='all_reduce'"):
        sdc_guard.CollectiveFault(op="all_reduce", shard=0)
    with pytest.raises(TypeError, match="sticky: expected a bool"):
        sdc_guard.CollectiveFault(op="all_gather", sticky=1)
    with pytest.raises(TypeError, match="faults: expected GemmFault or CollectiveFault objects, got str"):
        sdc_guard.drill(torch.nn.Linear(2, 2), "all_reduce")
    with pytest.raises(TypeError, match="collectives: expected a bool"):
        sdc_guard.protect(torch.nn.Linear(2, 2), collectives="yes")


def test_only_samplers_that_watch_the_same_steps_everywhere_check_collectives() -> None:
    assert [sampler_shared(s) for s in (Full(), EveryN(3), Rotating(4), Screened(), Screened(EveryN(2)))] == [True] * 5
    assert [sampler_shared(s) for s in (Budget(0.05), Screened(Budget(0.05)), object())] == [False] * 3


def test_collective_ops_take_the_collective_route() -> None:
    for op in (torch.ops.c10d.allreduce_.default, torch.ops.c10d._allgather_base_.default,
               torch.ops.c10d._reduce_scatter_base_.default, torch.ops._c10d_functional.all_reduce.default,
               torch.ops._c10d_functional.wait_tensor.default, torch.ops.c10d.broadcast_.default):
        assert route_of(op) is Route.COLLECTIVE, op  # a broadcast: counted as unchecked


def test_metrics_count_collective_checks_and_detections_by_op_and_link() -> None:
    registry = CollectorRegistry()
    metrics = GuardMetrics(registry, rank=1)
    gather = Detection(4, "blocks.0", "all_gather", "forward", [], [0, 3], math.inf, (64,), "bfloat16", 9, 1,
                       "collective", [0, 3], 1)
    reduce = Detection(4, "bucket 0", "all_reduce", "backward", [], [2], 7.0, (64,), "float32", 9, 1,
                       "collective", [0, 1, 2, 3], 1)
    report = StepReport(step=4, seen=0, verified=0, flagged=2, detections=[gather, reduce], unverified_ops={},
                        verify_seconds=0.0, step_seconds=1.0, overhead=0.0, collective_checks=3,
                        collective_checks_by_op={"all_gather": 2, "all_reduce": 1},
                        collectives_unchecked={"all_reduce[reduce op]": 1})
    metrics.observe_report(report)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"rank": "1", **labels})

    assert value("sdc_guard_collective_checks_total", op="all_gather") == 2
    assert value("sdc_guard_collective_checks_total", op="reduce_scatter") == 0  # exported from the start
    assert value("sdc_guard_collective_detections_total", op="all_gather", link="0->1") == 1
    assert value("sdc_guard_collective_detections_total", op="all_gather", link="3->1") == 1
    assert value("sdc_guard_collective_detections_total", op="all_reduce", link="*->1") == 1
    assert value("sdc_guard_collectives_unchecked_total", op="all_reduce[reduce op]") == 1
    assert value("sdc_guard_flagged_steps_total") == 1
    assert value("sdc_guard_site_gemms_flagged_total", site="blocks.0") is None  # not a GEMM


@pytest.fixture
def one_rank_group():
    """A real single-rank gloo process group for the test, destroyed after it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_a_corrupted_all_reduce_is_caught_under_protect(one_rank_group: None, monkeypatch: pytest.MonkeyPatch,
                                                        kernel: str) -> None:
    """The whole path in one process: a plain ``dist.all_reduce`` of real gradients under
    protect(), its result flipped by a drill at step 1; the step's report names the op, the
    link and the segment, the drill's stale and zero corruptions are caught too, and a
    clean step checks the collective and finds nothing; with the native checksums and
    with torch's (where the native kernel does not cover a tensor)."""
    import sdc_guard.runtime.collectives.collective_checks as checks

    if kernel == "torch":
        monkeypatch.setattr(checks, "collective_sums_into", lambda *args, **kwargs: False)
        monkeypatch.setattr(checks, "collective_bits_into", lambda *args, **kwargs: False)
    else:
        if not native.available():
            pytest.skip(native.unavailable_reason())
        calls = []
        real = checks.collective_sums_into
        monkeypatch.setattr(checks, "collective_sums_into", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = torch.nn.Linear(4, 4)
    grads = _gradients(1)[0][: 3 * SEGMENT]
    faults = [sdc_guard.CollectiveFault(op="all_reduce", step=1, element=SEGMENT + 5, bit=30),
              sdc_guard.CollectiveFault(op="all_reduce", step=2, corruption="zero"),
              sdc_guard.CollectiveFault(op="all_reduce", step=3, corruption="stale")]
    reports = []
    with sdc_guard.drill(model, *faults) as drill:
        for step in range(4):
            with sdc_guard.protect(model) as guard:
                model(torch.randn(2, 4)).sum().backward()
                buffer = grads * (step + 1)
                dist.all_reduce(buffer)
            reports.append(guard.last_report)
    assert [r.collective_checks for r in reports] == [1, 1, 1, 1]
    assert [[(d.kind, d.op, d.senders, d.receiver, d.segments) for d in r.detections] for r in reports] == [
        [], [("collective", "all_reduce", [0], 0, [1])], [("collective", "all_reduce", [0], 0, [0, 1, 2])],
        [("collective", "all_reduce", [0], 0, [0, 1, 2])]]
    assert [i.corruption for i in drill.injections] == ["flip", "zero", "stale"]
    assert reports[1].flagged == 1 and reports[0].flagged == 0
    if kernel == "native":  # the sender's and the receiver's checksums, every step
        assert [k["with_abs"] for k in calls] == [True, False] * 4


def test_the_checks_keep_no_collective_buffer_past_its_use(one_rank_group: None) -> None:
    """The checks take what they need of a collective's tensors (the sender's checksums
    before it runs, the receiver's when its result lands) and keep none of them: a buffer
    its caller lets go is freed while the step is still open, as without the guard. Kept
    to the step's close, FSDP2's all-gather outputs (the unsharded parameters) and
    reduce-scatter inputs (the unsharded gradients) of every layer would be alive at once.
    Both ways a result lands: through the work's future (the all-gather) and in its wait
    (gloo's reduce-scatter has no future)."""
    model = torch.nn.Linear(4, 4)
    grads = _gradients(1)[0][: 2 * SEGMENT]
    gen = torch.Generator().manual_seed(5)
    with sdc_guard.protect(model, calibrate_every=None) as guard:
        model(torch.randn(2, 4, generator=gen)).sum().backward()
        shard, gathered = grads.clone(), torch.empty_like(grads)
        work = dist.all_gather_into_tensor(gathered, shard, async_op=True)
        work.wait()
        assert torch.equal(gathered, grads)
        unreduced, scattered = grads * 2, torch.empty_like(grads)
        dist.reduce_scatter_tensor(scattered, unreduced)
        assert torch.equal(scattered, grads * 2)
        # the memory itself, not the tensor objects (a view keeps its base's storage alive)
        buffers = [StorageWeakRef(t.untyped_storage()) for t in (shard, gathered, unreduced, scattered)]
        del shard, gathered, work, unreduced, scattered
        assert [ref.expired() for ref in buffers] == [True] * 4
    report = guard.last_report
    assert report.collective_checks_by_op == {"all_gather": 1, "reduce_scatter": 1}
    assert report.detections == [] and report.collectives_unchecked == {}


def test_no_collective_is_checked_without_a_process_group() -> None:
    model = torch.nn.Linear(4, 4)
    with sdc_guard.protect(model) as guard:
        model(torch.randn(2, 4)).sum().backward()
    assert not dist.is_initialized()
    assert guard.last_report.collective_checks == 0 and not guard.collective_checks.enabled


def test_a_sampler_whose_schedule_differs_between_ranks_leaves_the_collectives_unchecked_and_says_so(
        one_rank_group: None) -> None:
    model = torch.nn.Linear(4, 4)
    buffer = _gradients(1)[0][:SEGMENT].clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with sdc_guard.protect(model, sampler=Budget(0.05)) as guard:
                model(torch.randn(2, 4)).sum().backward()
                dist.all_reduce(buffer)
            assert guard.last_report.collective_checks == 0
    said = [str(w.message) for w in caught if "the collectives are not checked under Budget" in str(w.message)]
    assert len(said) == 1, said  # once per model, not once per step
    with sdc_guard.protect(model, collectives=False) as guard:
        model(torch.randn(2, 4)).sum().backward()
        dist.all_reduce(buffer)
    assert guard.last_report.collective_checks == 0 and not guard.last_report.collectives_unchecked


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_a_failing_check_warns_once_and_leaves_the_collective_alone(one_rank_group: None,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   kernel: str) -> None:
    """A monitoring failure (here: the sender's checksums raise, in the native kernel or,
    without it, in torch's) never breaks the collective or stops training: the all-reduce
    gives its result, the check is counted as failed, one warning says why."""
    import sdc_guard.runtime.collectives.collective_checks as checks

    def broken(*args, **kwargs):
        raise RuntimeError("checksum kernel unavailable")

    if kernel == "native":
        monkeypatch.setattr(checks, "collective_sums_into", broken)
    else:  # no native kernel: torch's sums
        monkeypatch.setattr(checks, "collective_sums_into", lambda *args, **kwargs: False)
        monkeypatch.setattr(checks, "segment_sums", broken)
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            buffer = torch.full((10,), float(step + 1))
            with sdc_guard.protect(model) as guard:
                model(torch.randn(2, 4)).sum().backward()
                dist.all_reduce(buffer)
            assert torch.equal(buffer, torch.full((10,), float(step + 1)))  # one rank: the sum is itself
            assert guard.last_report.collectives_unchecked == {"all_reduce[failed]": 1}
            assert guard.last_report.detections == []
    said = [str(w.message) for w in caught if "checksum kernel unavailable" in str(w.message)]
    assert len(said) == 1, said


# --- the native checksums (csrc/coll_sums.c) and the vectorised verdicts ----------------


def _native_sums(x: torch.Tensor, *, with_abs: bool, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``segment_sums`` through the native kernel, shaped as ``segment_sums`` returns it."""
    n = x.numel() // rows
    segs = -(-n // SEGMENT)
    out = torch.full((rows * segs * (3 if with_abs else 2),), math.nan, dtype=torch.float64)
    assert native.collective_sums_into(x, out, with_abs=with_abs, rows=rows)
    sums = out[: 2 * rows * segs].view(rows, segs, 2)
    mags = out[2 * rows * segs:].view(rows, segs) if with_abs else None
    return (sums[0], None if mags is None else mags[0]) if rows == 1 else (sums, mags)


needs_native = pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ranks", [2, 8])
@pytest.mark.parametrize("average", [False, True], ids=["sum", "avg"])
def test_native_sums_stay_within_the_bound_and_catch_a_wrong_element(dtype: torch.dtype, ranks: int,
                                                                     average: bool) -> None:
    """The native kernel adds in another order than torch (csrc/coll_sums.c): its sums agree
    with torch's to their rounding, a correct reduction of real gradients stays within the
    bound whichever kernel the senders and the receiver used, and a wrong element is
    still caught in its segment."""
    xs = [x.to(dtype) for x in _gradients(ranks)]
    result = _reduce(xs, list(reversed(range(ranks))), average)
    for x in xs[:2]:
        (s, a), (ns, na) = segment_sums(x, with_abs=True), _native_sums(x, with_abs=True)
        assert s.shape == ns.shape and a.shape == na.shape
        assert float((s - ns).abs().max()) <= 64 * 2.0 ** -24 * float(a.max())
        assert float((a - na).abs().max()) <= 64 * 2.0 ** -24 * float(a.max())
    sizes, scale = segment_sizes(result.numel()), ranks if average else 1
    mixes = [(_native_sums, _native_sums), (_native_sums, segment_sums), (segment_sums, _native_sums)]
    for senders, receiver in mixes:
        sent = [senders(x, with_abs=True) for x in xs]
        expected, magnitudes = sum(s for s, _ in sent), sum(a for _, a in sent)
        corrupt, _, ratio = reduction_flags(receiver(result, with_abs=False)[0], expected, magnitudes, sizes,
                                            dtype, ranks, scale)
        assert not corrupt.any() and float(ratio.max()) < 1, (senders, receiver)
        wrong = result.clone()
        i = SEGMENT + 17
        wrong[i] = wrong[i] + 400.0 * float(result.abs().double().mean())
        corrupt, _, _ = reduction_flags(receiver(wrong, with_abs=False)[0], expected, magnitudes, sizes, dtype,
                                        ranks, scale)
        assert np.flatnonzero(corrupt).tolist() == [1], (senders, receiver)


@needs_native
def test_native_sums_of_rows_short_tails_and_adversarial_cancellation() -> None:
    """A reduce-scatter's rows, segments cut short, single elements, and the cancellation
    of ``test_the_bound_holds_under_cancellation``: native and torch agree, and the
    bound holds with the native sums."""
    gen = torch.Generator().manual_seed(5)
    for n in (1, 2, 3, SEGMENT - 1, SEGMENT, SEGMENT + 1, 3 * SEGMENT + 5):
        for rows in (1, 2, 4):
            x = torch.randn(n * rows, generator=gen) * 100
            (s, a), (ns, na) = segment_sums(x, with_abs=True, rows=rows), _native_sums(x, with_abs=True, rows=rows)
            assert s.shape == ns.shape and a.shape == na.shape, (n, rows)
            assert torch.allclose(s, ns, rtol=0, atol=1e-5 * float(a.max())) and torch.allclose(a, na, rtol=1e-6)
    x = torch.randn(3 * SEGMENT + 5, generator=gen) * 1e3
    xs = [x, -(x * (1 - 2.0 ** -22))]
    sent = [_native_sums(v, with_abs=True) for v in xs]
    corrupt, _, ratio = reduction_flags(_native_sums(xs[0] + xs[1], with_abs=False)[0], sent[0][0] + sent[1][0],
                                        sent[0][1] + sent[1][1], segment_sizes(x.numel()), torch.float32, 2, 1)
    assert not corrupt.any() and float(ratio.max()) < 1


@needs_native
def test_native_kernels_decline_what_they_do_not_cover() -> None:
    """``False`` and the output untouched, so that the caller takes torch's path: fp16 and
    fp64 sums, a strided tensor, an empty one, rows that do not divide it, an output of
    the wrong size or dtype."""
    out = torch.full((30,), 7.0, dtype=torch.float64)
    x = torch.randn(2 * SEGMENT)
    assert not native.collective_sums_into(x.half(), out[:6], with_abs=True)
    assert not native.collective_sums_into(x.double(), out[:3], with_abs=True)
    assert not native.collective_sums_into(x[::2], out[:3], with_abs=True)
    assert not native.collective_sums_into(x[:0], out[:3], with_abs=True)
    assert not native.collective_sums_into(x[:5], out[:6], with_abs=True, rows=2)
    assert not native.collective_sums_into(x, out[:5], with_abs=True)
    assert not native.collective_sums_into(x, out[:6].float(), with_abs=True)
    assert not native.collective_bits_into(x[::2], True, out[:2])
    assert not native.collective_bits_into(x[:3], True, out[:4], rows=2)
    assert bool((out == 7.0).all())


def test_an_extension_built_before_the_collective_kernels_falls_back_to_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension without ``coll_sums`` / ``coll_bits`` (built before them) declines,
    so that the checks take torch's checksums instead of failing."""
    import types

    stale = types.SimpleNamespace(check=None)  # an extension of an older build
    monkeypatch.setattr(native, "extension", lambda: stale)
    out = torch.empty(3, dtype=torch.float64)
    assert not native.collective_sums_into(torch.randn(SEGMENT), out, with_abs=True)
    assert not native.collective_bits_into(torch.randn(SEGMENT), True, out[:2])


@needs_native
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_native_bit_checksums_equal_torch_exactly(dtype: torch.dtype) -> None:
    """Integer sums: the native kernel's numbers are torch's bit for bit, for every dtype,
    pairs of 2-byte elements and single ones (sign-extended 16-bit words), shards at odd
    offsets, one row or an all-gather's rows."""
    gen = torch.Generator().manual_seed(7)
    base = (torch.randn(7 * SEGMENT + 20, generator=gen) * 1e4).to(dtype)
    for n in (0, 1, 2, 7, SEGMENT, SEGMENT + 1, 2 * SEGMENT + 3):
        for rows in (1, 2, 3):
            for start in (0, 1):
                x = base[start: start + n * rows]
                wide = pairs_bits(dtype, n)
                out = torch.empty(rows, 2, dtype=torch.float64)
                assert native.collective_bits_into(x, wide, out, rows=rows), (n, rows, start)
                assert torch.equal(out.to(torch.int64), bit_checksums(x, wide, rows=rows)), (n, rows, start)


class _Group:
    """A process group's size and this rank's place in it: what a record reads."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _records(g: int = 2, me: int = 0) -> list[tuple[Record, torch.Tensor]]:
    """Clean checked records of every kind as one rank holds them, each with its block of
    the exchange (what every rank sent, added): two all-reduces (one averaged), a
    reduce-scatter, two all-gathers, from real gradients."""
    xs = [x.to(torch.float32) for x in _gradients(g)]
    group = _Group(g, me)
    out = []
    for numel, average in ((3 * SEGMENT + 11, False), (SEGMENT, True)):
        parts = [x[:numel] for x in xs]
        sent = [segment_sums(p, with_abs=True) for p in parts]
        block = torch.cat([sum(s for s, _ in sent).reshape(-1), sum(a for _, a in sent)])
        result = _reduce(parts, list(range(g)), average)
        call = Collective("all_reduce", parts[me], result, group, g if average else 1)
        record = Record(call, "bucket", "backward", 0, block.numel(), numel, torch.float32)
        record.received = segment_sums(result, with_abs=False)[0]
        out.append((record, block))
    numel = 2 * SEGMENT + 6  # reduce-scatter: each rank gets one chunk of numel
    parts = [x[: g * numel] for x in xs]
    sent = [segment_sums(p, with_abs=True, rows=g) for p in parts]
    block = torch.cat([sum(s for s, _ in sent).reshape(-1), sum(a for _, a in sent).reshape(-1)])
    result = _reduce(parts, list(range(g)), False).view(g, numel)[me]
    record = Record(Collective("reduce_scatter", parts[me], result, group), "block", "backward", 0,
                    block.numel(), numel, torch.float32)
    record.received = segment_sums(result, with_abs=False)[0]
    out.append((record, block))
    for numel in (SEGMENT + 3, 10):
        shards = [x[:numel] for x in xs]
        block = torch.cat([bit_checksums(s, True)[0].to(torch.float64) for s in shards])
        gathered = torch.cat(shards)
        record = Record(Collective("all_gather", shards[me], gathered, group), "block", "forward", 0,
                        2 * g, numel * g, torch.float32)
        record.received = bit_checksums(gathered, True, rows=g)
        out.append((record, block))
    return out


def test_one_vectorised_pass_clears_clean_records_and_leaves_every_suspect_to_its_verdict() -> None:
    """``suspects``: every clean record of the step is cleared at once (no verdict to run),
    and a wrong segment or shard in any one record sends all records of its kind, and only
    them, to ``verdict``, which finds the one that is wrong."""
    clean = _records()
    assert suspects(clean) == []
    assert all(collective_verdict(r, block, 1, 0, [0, 1]) is None for r, block in clean)
    for k in range(len(clean)):
        records = _records()
        r, block = records[k]
        if r.call.op == "all_gather":
            r.received = r.received.clone()
            r.received[1, 0] += 1
        else:
            r.received = r.received.clone()
            r.received[-1, 1] += 1.0
        found = suspects(records)
        same_kind = [id(s) for s, _ in records if (s.call.op == "all_gather") == (r.call.op == "all_gather")
                     and s.call.scale == r.call.scale]
        assert id(r) in same_kind and [id(s) for s, _ in found] == same_kind, k
        verdicts = [(s, collective_verdict(s, b, 1, 0, [0, 1])) for s, b in found]
        assert [id(s) for s, d in verdicts if d is not None] == [id(r)], k


def test_records_that_cannot_be_compared_at_once_go_to_their_own_verdicts() -> None:
    """A failure of the vectorised pass (checksums it cannot put end to end) leaves the
    records to ``_verdict`` one by one, never cleared unseen."""
    records = _records()
    records[0][0].received = torch.zeros(3)  # not [segments, 2]: the pass cannot use it
    found = [id(r) for r, _ in suspects(records)]
    assert id(records[0][0]) in found and id(records[3][0]) not in found
    # rows that would still line up end to end: one record a segment short, the next one
    # a segment long (each clean up to then); the pass must not compare them shifted
    records = _records()
    first, second = records[0][0], records[2][0]  # an all-reduce and the reduce-scatter, one kind
    second.received = torch.cat([first.received[-1:], second.received])
    first.received = first.received[:-1]
    found = [id(r) for r, _ in suspects(records)]
    assert id(first) in found and id(second) in found


def _merged_exchange(g: int, flags: list[tuple[bool, bool]], corrupt: dict[int, int] | None = None
                     ) -> tuple[list[list[tuple[Record, torch.Tensor]]], np.ndarray]:
    """Each of ``g`` ranks' records and blocks, and the carried part of the world's
    exchange as the all-reduce gives it to every rank (every rank's ``_carried`` added).
    ``corrupt``: record index -> the rank whose receipt of it is wrong."""
    held = [_records(g, me) for me in range(g)]
    for k, rank in (corrupt or {}).items():
        r = held[rank][k][0]
        r.received = r.received.clone()
        r.received.view(-1)[-1] += 1.0 if r.call.op != "all_gather" else 1
    return held, sum(_carried([r for r, _ in held[me]], me, flags[me]) for me in range(g))


def _merged(g: int, flags: list[tuple[bool, bool]], corrupt: dict[int, int] | None = None) -> list[CollectiveResult]:
    """The carrier's verdicts as each of ``g`` ranks makes them: every rank's ``_carried``
    part added (what the all-reduce gives every rank), then judged by each. ``corrupt``:
    record index -> the rank whose receipt of it is wrong."""
    held, carried = _merged_exchange(g, flags, corrupt)
    results = []
    for me in range(g):
        result = CollectiveResult()
        result.detections, result.agreed = judge_all([r for r, _ in held[me]], [b for _, b in held[me]], carried, 3,
                                                     list(range(g)), me)
        results.append(result)
    return results


@pytest.mark.parametrize("g", [2, 4])
def test_every_rank_judges_every_ranks_receipts_alike_from_the_merged_exchange(g: int) -> None:
    """The world's exchange carries each rank's flags and receipts (``close``'s ``flags``):
    every rank then agrees who flagged (a GEMM flag, a tripped screen, a wrong receipt of
    any kind of collective, on any rank), and reports only its own detections, as it would
    have judged them alone."""
    quiet = [(False, False)] * g
    assert [r.agreed for r in _merged(g, quiet)] == [([], [])] * g
    assert all(r.detections == [] for r in _merged(g, quiet))
    flags = [(False, False)] * g
    flags[0], flags[g - 1] = (True, False), (False, True)
    assert [r.agreed for r in _merged(g, flags)] == [([0], [g - 1])] * g
    for k in range(len(_records(g))):
        results = _merged(g, quiet, corrupt={k: g - 1})
        assert [r.agreed for r in results] == [([g - 1], [])] * g, k
        found = [[(d.op, d.receiver) for d in r.detections] for r in results]
        op = _records(g)[k][0].call.op
        assert found == [[]] * (g - 1) + [[(op, g - 1)]], (k, found)
    # a receipt its rank could not take is not judged by anyone (that rank leaves it unchecked)
    held = [_records(g, me) for me in range(g)]
    held[1][0][0].failed = "checksums raised"
    carried = sum(_carried([r for r, _ in held[me]], me, quiet[me]) for me in range(g))
    assert carried.size == 2 * g + g * sum(1 + (2 * g if r.call.op == "all_gather" else r.received.numel())
                                              for r, _ in held[0])
    mine, agreed = judge_all([r for r, _ in held[0]], [b for _, b in held[0]], carried, 3, list(range(g)), 0)
    assert (mine, agreed) == ([], ([], []))


@pytest.mark.parametrize("g", [2, 4])
def test_one_pass_over_the_merged_exchange_clears_a_clean_step_and_nothing_else(g: int) -> None:
    """``judge_all``'s one pass over the whole exchange (``_all_clear``, on the layout's
    cached indices) clears a clean step, with every kind of collective in it, and
    declines a wrong receipt of any record on any rank, a receipt a rank could not take,
    and an exchange whose size does not match its records: each goes to the
    record-by-record verdicts (which the test above checks find them)."""
    quiet = [(False, False)] * g
    held, carried = _merged_exchange(g, quiet)
    records, blocks = [r for r, _ in held[0]], [b for _, b in held[0]]
    assert {r.call.op for r in records} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert _all_clear(records, blocks, carried, g) is True
    assert _all_clear(records, blocks, carried, g) is True  # the cached layout, a second step
    for k in range(len(records)):
        for rank in (0, g - 1):
            held, carried = _merged_exchange(g, quiet, corrupt={k: rank})
            assert _all_clear([r for r, _ in held[0]], [b for _, b in held[0]], carried, g) is False, (k, rank)
        held, carried = _merged_exchange(g, quiet)  # a sender's block wrong: every receipt of it disagrees
        wrong = [b.clone() for _, b in held[0]]
        wrong[k].view(-1)[0] += 1.0
        assert _all_clear(records, wrong, carried, g) is False, k
    held = [_records(g, me) for me in range(g)]
    held[1][0][0].failed = "checksums raised"
    carried = sum(_carried([r for r, _ in held[me]], me, quiet[me]) for me in range(g))
    assert _all_clear([r for r, _ in held[0]], [b for _, b in held[0]], carried, g) is False
    held, carried = _merged_exchange(g, quiet)
    assert _all_clear([r for r, _ in held[0]], [b for _, b in held[0]], carried[:-1], g) is False


def _all_reducing_closure(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """A training step's closure that also all-reduces a buffer of real gradients (one
    checked collective a step), its inputs drawn from a seeded generator."""
    buffer = _gradients(1)[0][: 2 * SEGMENT].clone()
    gen = torch.Generator().manual_seed(11)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(2, 4, generator=gen)).sum()
        loss.backward()
        dist.all_reduce(buffer)
        return loss

    return closure


@pytest.mark.parametrize("route", ["own verdicts", "carrier"])
def test_a_failing_verdict_warns_and_leaves_the_step_unchecked(one_rank_group: None, monkeypatch: pytest.MonkeyPatch,
                                                              route: str) -> None:
    """The verdicts themselves raising (a bug, checksums of a shape they cannot read) is a
    monitoring failure too: the step closes, its collectives count as unchecked
    (``[verdict]``), one warning says why, and training goes on. Both routes: a step closed
    by the block judges its own receipts (``suspects``), one run by ``optimizer_step`` the
    world's (``judge_all``)."""
    import sdc_guard.runtime.collectives.collective_checks as checks

    def broken(*args, **kwargs):
        raise ValueError("cannot read these checksums")

    monkeypatch.setattr(checks, "suspects" if route == "own verdicts" else "judge_all", broken)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    closure = _all_reducing_closure(model, opt)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with sdc_guard.protect(model, calibrate_every=None) as guard:
                if route == "carrier":
                    outcome = guard.optimizer_step(opt, closure)
                    assert outcome.flagged_ranks == [] and guard.agreed_flags is None
                else:
                    closure()
            assert guard.last_report.collectives_unchecked == {"all_reduce[verdict]": 1}
            assert guard.last_report.detections == []
    said = [str(w.message) for w in caught if "could not judge" in str(w.message)]
    assert len(said) == 1 and "cannot read these checksums" in said[0]


def test_optimizer_step_agrees_its_flags_in_the_exchange_in_one_process(one_rank_group: None) -> None:
    """A step driven by ``optimizer_step`` whose collectives are checked carries its flags
    in the exchange (``Guard.agreed_flags``), a flagged all-reduce among them; one closed
    by the ``protect()`` block (no flags to agree) or unchecked does not."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    closure = _all_reducing_closure(model, opt)
    fault = sdc_guard.CollectiveFault(op="all_reduce", step=1, corruption="zero")
    with sdc_guard.drill(model, fault), sdc_guard.protect(model, calibrate_every=None) as guard:
        outcomes = [guard.optimizer_step(opt, closure) for _ in range(2)]
        assert guard.agreed_flags is None  # the re-execution's exchange carries none
    assert [o.flagged_ranks for o in outcomes] == [[], [0]]
    assert [o.action for o in outcomes] == [None, "recompute"]
    assert outcomes[1].report.detections[0].op == "all_reduce"
    with sdc_guard.protect(model, calibrate_every=None) as guard:
        guard.optimizer_step(opt, closure)
        assert guard.agreed_flags == ([], [])
        guard.end_step()
        guard.begin_step()
        closure()  # a step the block closes: no flags to agree
        guard.step()
        assert guard.agreed_flags is None
    with sdc_guard.protect(model, collectives=False, calibrate_every=None) as guard:
        assert not guard.optimizer_step(opt, closure).flagged_ranks
        assert guard.agreed_flags is None


def test_a_records_landing_latch_waits_until_set_from_another_thread() -> None:
    """``Record.landed`` (a ``Latch``): ``close`` waits on it for a result landing on the
    backend's thread; unset it times out, set it releases every wait, at once after."""
    import threading
    import time

    from sdc_guard.runtime.collectives.verdicts import Latch

    latch = Latch()
    assert not latch.is_set() and latch.wait(0.01) is False
    setter = threading.Timer(0.05, latch.set)
    setter.start()
    started = time.perf_counter()
    assert latch.wait(5.0) is True and latch.is_set()
    assert 0.03 < time.perf_counter() - started < 4.0
    latch.set()  # a second set changes nothing
    assert latch.wait(0.0) is True and latch.wait() is True
    setter.join()
