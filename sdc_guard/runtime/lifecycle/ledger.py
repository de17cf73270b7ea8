"""The accounts of the open step: GEMMs seen, checks pending on the device, timing.

``Guard`` records into a ``StepLedger`` per GEMM (no host synchronisation: flags stay on
the device as small tensors) and turns it into a ``StepReport`` when the step closes,
reading every pending summary in one transfer per device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.precision import SEGMENT
from .calibration import Calibration, Pair, Replay
from ..compiled.function_mode import function_round_trip_seconds
from ..dispatch.intercept import module_hook_seconds, round_trip_seconds
from ...report import Detection, GemmCounts, KindKey, StepReport
from ..sampling import SiteKey, StepCosts
from .stats import ScreenStats


@dataclass
class Pending:
    """A verified GEMM whose flags still sit on the device."""

    site: SiteKey
    kind: KindKey
    call_index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    sdc: Tensor | None  #: bool [..., M, nseg], confirmed corruption; None for a clear check
    #: ``SUMMARY`` numbers: fp32 on the device, or already on the host (a clear CPU check)
    summary: Tensor | list[float]

    @property
    def segments(self) -> int:
        """(row, segment)s the screen checked."""
        *batch, m, _, n = self.shape
        count = m * -(-n // SEGMENT)
        for size in batch:
            count *= size
        return count


class Clock:
    """Verification time: wall clock on CPU, CUDA events (read once per step) on GPU."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def start(self, device: torch.device) -> Any:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start_cuda(self) -> Any:
        """``start`` on a CUDA device."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop_cuda(self, started: Any) -> float:
        """``stop`` on a CUDA device: 0 now, the time once the step synchronises."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((started, end))
        return 0.0

    def add(self, seconds: float) -> float:
        """``stop`` on the host: add ``seconds`` (timed by the caller) and return them."""
        self.seconds += seconds
        return seconds

    def stop(self, device: torch.device, started: Any) -> float:
        """Add the elapsed time; returns it where known now (CPU), else 0."""
        if device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((started, end))
            return 0.0
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        return elapsed

    def total(self) -> float:
        """All verification time of the step (call after synchronising)."""
        return self.seconds + self.gpu_seconds()

    @property
    def events(self) -> int:
        """Accelerator checks timed so far (a mark for ``gpu_seconds``)."""
        return len(self._events)

    def gpu_seconds(self, first: int = 0, stop: int | None = None) -> float:
        """Verification time on accelerators, of the checks ``first`` to ``stop``
        (all by default; call after synchronising)."""
        return sum(start.elapsed_time(end) for start, end in self._events[first:stop]) / 1e3


class StepLedger:
    """Everything ``Guard`` learns during one step (or one re-execution of it)."""

    def __init__(self, carried_seconds: float = 0.0) -> None:
        self.seen = 0
        self.pending: list[Pending] = []
        self.unverified: dict[str, int] = {}
        self.sites_seen: set[SiteKey] = set()
        self.site_seconds: dict[SiteKey, float] = {}
        self.site_calls: dict[SiteKey, int] = {}
        self.by_kind: dict[KindKey, GemmCounts] = {}
        self.clock = Clock()
        self.started = time.perf_counter()
        self.started_cpu = time.thread_time()  #: for a CPU-time calibration (``report``)
        self.ops = 0  #: aten ops the dispatch mode intercepted
        self.hook_seconds = 0.0  #: host time in the guard's per-op hooks (verification on CPU included)
        self.module_calls = 0  #: module calls the site tracker's hooks ran for
        self.function_calls = 0  #: torch function calls the compiled route's function mode passed on
        #: guard work done between the previous report and this step's start (re-encoding
        #: the updated weights, snapshots, the previous outcome's bookkeeping): counted here
        self.carried_seconds = carried_seconds
        #: the step's calibration replay, all of it (the bare run, putting its effects back)
        self.calibration_seconds = 0.0
        self.replay: Replay | None = None
        self._summaries: list[list[float]] | None = None  #: read once (``summaries``)

    def summaries(self) -> list[list[float]]:
        """The verified GEMMs' summaries, read from the device once (the one host
        synchronisation of the step: ``report`` reuses them)."""
        if self._summaries is None:
            self._summaries = read_summaries([p.summary for p in self.pending])
        return self._summaries

    def gemms_flagged(self) -> bool:
        """Whether a verified GEMM of the step was flagged (what ``report`` counts in
        ``flagged``), before the report exists: the step's flag for the collectives'
        exchange (``Guard.end_step``'s ``tripped``)."""
        return any(s[0] > 0 for s in self.summaries())

    def see(self, kind: KindKey) -> int:
        """Count a GEMM; returns its index among the step's GEMMs."""
        self.seen += 1
        counts = self.by_kind.get(kind)
        if counts is None:
            counts = self.by_kind[kind] = GemmCounts()
        counts.seen += 1
        return self.seen - 1

    def unverifiable(self, op: str) -> None:
        """Count a GEMM-bearing op that could not be verified."""
        self.unverified[op] = self.unverified.get(op, 0) + 1

    def record(self, pending: Pending, seconds: float) -> None:
        """A verified GEMM whose flags wait on the device; ``seconds`` it took (CPU)."""
        self.pending.append(pending)
        self.by_kind[pending.kind].verified += 1
        self.site_seconds[pending.site] = self.site_seconds.get(pending.site, 0.0) + seconds
        self.site_calls[pending.site] = self.site_calls.get(pending.site, 0) + 1

    def costs(self, report: StepReport) -> StepCosts:
        """The sampler's feedback for this step."""
        return StepCosts(report.step, report.step_seconds, report.verify_seconds,
                         dict(self.site_seconds), dict(self.site_calls), report.guard_seconds,
                         report.calibration_seconds)

    def rates(self) -> tuple[float, float, float]:
        """What one call of each kind of interception the step has costs on this machine
        (each measured once per process, where the step has such calls): the dispatch
        mode's round trip per aten op, the site tracker's hooks per module call, the
        compiled route's function mode per call (0.0 for a kind the step has none of)."""
        return (round_trip_seconds() if self.ops else 0.0, module_hook_seconds() if self.module_calls else 0.0,
                function_round_trip_seconds() if self.function_calls else 0.0)

    def interception_estimate(self, round_trip: float, module_hook: float = 0.0, function_call: float = 0.0) -> float:
        """The per-op estimate of interception: the dispatch mode's round trip for every
        op intercepted (``round_trip`` seconds each, measured once per process by
        ``intercept.round_trip_seconds``), the site tracker's module hooks
        (``module_hook`` per module call, ``intercept.module_hook_seconds``) and the
        compiled route's function mode (``function_call`` per call it passed on,
        ``function_mode.function_round_trip_seconds``). A lower bound: what the modes and
        the hooks cost the model's ops between them is not in it."""
        return self.ops * round_trip + self.module_calls * module_hook + self.function_calls * function_call

    def measured_seconds(self) -> float:
        """The guard's work it times itself (call after synchronising): host time in its
        hooks (sampling, bookkeeping, and on CPU verification), around the step
        (``carried_seconds``), the step's calibration replay, and verification time on
        an accelerator."""
        return (self.hook_seconds + self.carried_seconds + self.calibration_seconds
                + (self.clock.total() - self.clock.seconds))

    def guard_seconds(self, round_trip: float, module_hook: float = 0.0, factor: float | None = None,
                      function_call: float = 0.0) -> float:
        """Everything the guard added to the step: what it timed itself and interception,
        the per-op estimate scaled by ``factor`` (the model's calibration,
        ``runtime.lifecycle.calibration``; ``None``: the bare estimate, a lower bound)."""
        scale = 1.0 if factor is None else factor
        return self.measured_seconds() + scale * self.interception_estimate(round_trip, module_hook, function_call)

    def pair(self, round_trip: float, module_hook: float) -> Pair | None:
        """The step's calibration replay as a ``Pair`` (after synchronising); ``None``
        without a complete one."""
        replay = self.replay
        if replay is None or replay.guarded <= 0:
            return None
        measured = replay.hooks + self.clock.gpu_seconds(*replay.events)
        estimate = replay.ops * round_trip + replay.module_calls * module_hook
        return Pair(replay.bare, replay.guarded, measured, estimate, replay.bare_cpu, replay.guarded_cpu)

    def report(self, step: int, attempt: int, rank: int, *, watched: bool = True,
               stats: ScreenStats | None = None, round_trip: float = 0.0, module_hook: float = 0.0,
               calibration: Calibration | None = None, function_call: float = 0.0) -> StepReport:
        """Read the flags (the one host synchronisation of the step) into a report; with
        ``stats``, record every verified GEMM's worst D/T and flag in it. ``calibration``
        (the model's) takes the step's calibration pair, if it ran one, and gives the
        interception factor to apply (none yet: the per-op estimate stands)."""
        summaries = self.summaries()  # the one host sync
        if stats is not None:
            for p, s in zip(self.pending, summaries):
                stats.observe(p.site, s[1], s[0] > 0 or s[4] > 0)
        wall = time.perf_counter() - self.started
        step_seconds = wall + self.carried_seconds
        verify_seconds = self.clock.total()
        detections = [
            detection(step, p, s[1], rank, "gemm" if s[5] > 0 else "weight")
            for p, s in zip(self.pending, summaries)
            if s[0] > 0
        ]
        for p, s in zip(self.pending, summaries):
            if s[0] > 0:
                self.by_kind[p.kind].flagged += 1
        ratios = [s[1] for s in summaries if s[1] == s[1]]
        pair = self.pair(round_trip, module_hook)
        if calibration is not None and pair is not None:
            calibration.add(pair)
        scale = calibration.factor if calibration is not None else None
        if scale is not None and calibration is not None and calibration.cpu:
            # a factor in CPU time: this step's interception in its own wall time, as the
            # rest of the account is (on a shared core, wall time runs ahead of CPU time)
            cpu = time.thread_time() - self.started_cpu
            scale *= max(1.0, wall / cpu) if cpu > 0 else 1.0
        estimate = self.interception_estimate(round_trip, module_hook, function_call)
        # the unguarded step takes at least the fastest bare run of its closure measured: a
        # factor a disturbed pool made too large gives way (interception only, what the
        # guard timed itself stands)
        floor = calibration.floor if calibration is not None and scale is not None else 0.0
        measured = self.measured_seconds()
        interception = estimate * (1.0 if scale is None else scale)
        interception = max(0.0, min(interception, step_seconds - floor - measured))
        guard_seconds = min(measured + interception, step_seconds)
        base = max(step_seconds - guard_seconds, 1e-12)  # the step without the guard
        return StepReport(
            step=step, seen=self.seen, verified=len(self.pending), flagged=len(detections),
            detections=detections, unverified_ops=dict(self.unverified),
            verify_seconds=verify_seconds, step_seconds=step_seconds,
            overhead=guard_seconds / base, verify_overhead=verify_seconds / base,
            guard_seconds=guard_seconds, intercepted_ops=self.ops, function_mode_calls=self.function_calls,
            interception_estimate_seconds=estimate,
            interception_seconds=interception,
            interception_factor=scale, overhead_calibrated=scale is not None or estimate == 0.0,
            calibration_seconds=self.calibration_seconds, carried_seconds=self.carried_seconds,
            overflow=sum(1 for s in summaries if s[2] > 0),
            unverifiable=sum(1 for s in summaries if s[3] > 0),
            worst_ratio=max(ratios, default=0.0), sites_seen=len(self.sites_seen),
            screen_misses=int(sum(s[4] for s in summaries)), segments=sum(p.segments for p in self.pending),
            sites_verified=len({p.site for p in self.pending}), rank=rank,
            by_kind=dict(self.by_kind), attempt=attempt, watched=watched,
        )



def read_summaries(summaries: list[Tensor | list[float]]) -> list[list[float]]:
    """All per-GEMM summaries to the host in one transfer per device."""
    if not summaries:
        return []
    by_device: dict[torch.device, list[int]] = {}
    out: list[list[float]] = [[]] * len(summaries)
    for i, s in enumerate(summaries):
        if isinstance(s, list):
            out[i] = s
        else:
            by_device.setdefault(s.device, []).append(i)
    for indices in by_device.values():
        rows = torch.stack([summaries[i] for i in indices]).tolist()
        for i, row in zip(indices, rows):
            out[i] = row
    return out


def detection(step: int, p: Pending, ratio: float, rank: int, kind: str = "gemm") -> Detection:
    assert p.sdc is not None, "a flagged check has its mask"
    mask = p.sdc.reshape(-1, *p.sdc.shape[-2:]).any(0)
    rows = torch.nonzero(mask.any(-1)).flatten().tolist()
    segments = torch.nonzero(mask.any(-2)).flatten().tolist()
    site, phase, op = p.site
    return Detection(step, site, op, phase, rows, segments, ratio, p.shape,
                     str(p.dtype).removeprefix("torch."), p.call_index, rank, kind)
