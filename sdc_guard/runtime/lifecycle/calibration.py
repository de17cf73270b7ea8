"""What interception really costs a step: calibration replays, paired, in situ.

The guard times its own work (verification, bookkeeping, re-encoding) directly. What it
cannot time from inside is interception: the dispatch mode's Python round trip on every
aten op of a watched step, the site tracker's module hooks, and what both do to the
model's own ops between them (caches, branch predictors, the allocator). A per-op
estimate (``intercept.round_trip_seconds`` per op, ``intercept.module_hook_seconds`` per
module call, each measured once per process on a tiny op) covers the first two and misses
the last: on a 0.6 M-parameter model it reported about half of what the guard really cost.

So the guard measures it. On some watched steps taken through ``Guard.optimizer_step``
(the ones ``Calibration.picks``: the watched steps numbered 1, 2, 4, 8 and 16, so
that the factor settles early, then every ``every``-th), the
step's closure first runs once with interception fully off (no mode, no hooks), timed;
everything it changed is put back (``respond.rerun.StepState``: gradients, the random
generators, buffers, the user's state); then the normal guarded run follows, timed, and
its results are the ones used, so a run with calibration replays ends bit-identical to one
without. The two runs of the same step, minus what the guard timed itself inside the
guarded one, are the interception's real cost in that step, ``residual``. Over the
per-op estimate for the same run, that is the factor every report of the model then
applies to its estimate: ``interception = factor * estimate`` (the median over the last
``POOL`` replays, so that one disturbed pair does not move it, the model's first two
left out once a later one is there: ``Calibration.usable``).

The replay costs about one unguarded run of the closure; it is the guard's cost too, and
is charged to the step that ran it (``StepReport.calibration_seconds``, inside
``guard_seconds``). With ``every=100`` (the default) that is five replays in the first
sixteen watched steps, then about 1 % of the watched steps' unguarded time, and nothing
on steps the sampler does not watch.

The state lives with the model, like the step clock (``runtime.sampling.schedule``), so that
successive per-step ``protect()`` blocks share one calibration.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ...respond import distributed

if TYPE_CHECKING:
    from .guard import Guard

#: Default number of watched guarded steps between calibration replays (after the early ones).
DEFAULT_EVERY = 100
#: Replays pooled into the factor.
POOL = 8
#: The early replays: on the watched steps numbered by the powers of two up to this one.
EARLY_UNTIL = 16
#: A model's first replays, left out of its factor once a later one is pooled
#: (``Calibration.usable``).
WARMUP_PAIRS = 2


def check_calibrate_every(value: object, name: str = "calibrate_every") -> int | None:
    """``value`` if it is a positive int or ``None`` (no calibration replays); else raise
    naming ``name``.

    >>> check_calibrate_every(0)
    Traceback (most recent call last):
    ...
    ValueError: calibrate_every: expected a positive int (watched guarded steps between calibration replays) or None (never replay: the reported overhead stays an estimate), got 0
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value  # type: ignore[return-value]
    raise ValueError(f"{name}: expected a positive int (watched guarded steps between calibration replays) or "
                     f"None (never replay: the reported overhead stays an estimate), got {value!r}")


@dataclass
class Pair:
    """One calibration replay: the same closure bare and guarded."""

    bare: float  #: seconds of the closure with interception off
    guarded: float  #: seconds of the same closure under the guard
    measured: float  #: guard work the guard timed itself inside the guarded run (verification, hooks)
    estimate: float  #: the per-op estimate of interception for the guarded run
    #: the same two runs in this thread's CPU time (``thread_clock``), or ``None`` (wall time only)
    bare_cpu: float | None = None
    guarded_cpu: float | None = None

    @property
    def cpu(self) -> bool:
        """Whether the pair was timed in CPU time too (``residual`` is then in CPU seconds)."""
        return self.bare_cpu is not None and self.guarded_cpu is not None and self.guarded > 0

    @property
    def residual(self) -> float:
        """Interception's real cost in this run (negative only through timing noise). In
        CPU time where the pair has it: another process that takes the core during one
        run of the pair moves its wall time by as much as the interception itself on a
        shared machine, and its CPU time not at all; what the guard timed itself (wall
        time) is brought to the same clock by the guarded run's CPU share."""
        if self.cpu:
            return self.guarded_cpu - self.bare_cpu - self.measured * (self.guarded_cpu / self.guarded)  # type: ignore[operator]
        return self.guarded - self.bare - self.measured


@dataclass
class Replay:
    """A calibration replay of the open step, its timings as taken; the accelerator's
    share of the guarded run is read when the step synchronises (``StepLedger.pair``)."""

    bare: float = 0.0  #: seconds of the closure with interception off (0: not run yet)
    guarded: float = 0.0  #: seconds of the same closure guarded (0: not run yet)
    hooks: float = 0.0  #: host seconds the guard timed itself inside the guarded run
    events: tuple[int, int] = (0, 0)  #: the ledger clock's accelerator checks of the guarded run
    ops: int = 0  #: aten ops intercepted in the guarded run
    module_calls: int = 0  #: module calls tracked in the guarded run
    bare_cpu: float | None = None  #: the bare run in this thread's CPU time (``thread_clock``)
    guarded_cpu: float | None = None  #: the guarded run in this thread's CPU time


class Calibration:
    """A model's calibration: when to replay, and the factor measured so far."""

    def __init__(self, every: int | None = DEFAULT_EVERY) -> None:
        self.every = every
        self.eligible = 0  #: watched guarded steps counted so far
        self.early: list[Pair] = []  #: the first ``WARMUP_PAIRS`` pairs
        self.pairs: deque[Pair] = deque(maxlen=POOL)  #: the last ``POOL`` pairs after them
        self.replays = 0

    def picks(self, index: int) -> bool:
        """Whether the ``index``-th eligible step (or, in a distributed run, step number
        ``index``) gets a replay: 1, 2, 4, 8 and 16 (not 0: the first step pays one-off
        costs, cold encodings and first calls), then every ``every``-th.

        >>> [i for i in range(300) if Calibration(100).picks(i)]
        [1, 2, 4, 8, 16, 100, 200]
        """
        if self.every is None or index < 1:
            return False
        if index % self.every == 0:
            return True
        return index <= EARLY_UNTIL and index & (index - 1) == 0  # a power of two

    def due(self) -> bool:
        """Count one eligible step; whether it gets a replay."""
        self.eligible += 1
        return self.picks(self.eligible - 1)

    def add(self, pair: Pair) -> None:
        if pair.estimate > 0:
            (self.early if len(self.early) < WARMUP_PAIRS else self.pairs).append(pair)
        self.replays += 1

    def usable(self) -> list[Pair]:
        """The pairs the factor is taken from: the last ``POOL`` after the model's first
        ``WARMUP_PAIRS``, or those first ones while there is no other. Why: a model's first
        replays pay one-off costs, mostly in the bare run, which the guarded run right
        after it does not (it reuses what the bare run allocated and warmed): in ``bench
        train`` (the GPT at d_model 256, eight copies in one process) the first bare runs
        of the guarded copies took 270-350 ms, the second often 275-290, the later ones
        195-235, in CPU time, and those pairs came out at -44 to 0.1 times the
        estimate against mostly 6-12 later; pooled, they held a copy's factor at 0, or
        at half its later value, for its first dozen steps. In other runs the first
        guarded runs paid instead (pairs at 17-27 times). Why by their rank and not by
        their time: the costs do not come every time, and a run whose batches differ in
        size (dynamic padding) has bare runs of many lengths, all of them good pairs."""
        return list(self.pairs) or self.early

    @property
    def factor(self) -> float | None:
        """Measured interception over its per-op estimate: the median over the last
        replays' usable pairs (``usable``; ``None`` before the first). A median, because
        one run of a pair that another process preempted moves its pair by as much as the
        interception itself on a loaded machine; the median of a few pairs does not
        follow it."""
        pool = self.usable()
        if not pool:
            return None
        return max(0.0, statistics.median(p.residual / p.estimate for p in pool))

    @property
    def cpu(self) -> bool:
        """Whether the factor is in CPU time (the newest usable pair's clock): a report
        then brings the interception it gives to its step's wall time (``StepLedger.report``)."""
        pool = self.usable()
        return bool(pool) and pool[-1].cpu

    @property
    def floor(self) -> float:
        """The fastest bare run of the closure measured: a lower bound of the unguarded
        step, which keeps a noisy factor from claiming more than the whole step."""
        return min((p.bare for p in (*self.early, *self.pairs)), default=0.0)


_calibrations: "weakref.WeakKeyDictionary[nn.Module, Calibration]" = weakref.WeakKeyDictionary()


def calibration_of(model: nn.Module, every: int | None) -> Calibration:
    """``model``'s calibration, its replay interval set to ``every`` (the newest guard's).

    >>> c = calibration_of(nn.Linear(2, 2), 50); (c.every, c.factor)
    (50, None)
    """
    calibration = _calibrations.get(model)
    if calibration is None:
        calibration = _calibrations[model] = Calibration(every)
    calibration.every = every
    return calibration


def thread_clock(model: nn.Module) -> bool:
    """Whether a replay of ``model``'s step is timed in this thread's CPU time as well as
    in wall time: where that time is the step's own work, a model all on the CPU computing
    on this one thread (one intra-op thread), in one process (a rank waiting for the
    others in a collective spends wall time, not CPU time). Elsewhere (an accelerator,
    intra-op threads, ranks) wall time alone."""
    if torch.get_num_threads() != 1 or distributed.world_size() > 1:
        return False
    return all(p.device.type == "cpu" for p in model.parameters())


def synchronize(model: nn.Module) -> None:
    """Wait for the queued work of every accelerator holding ``model``'s parameters, so
    that a replay's wall time is its work's (a no-op on CPU)."""
    for device in {p.device for p in model.parameters() if p.device.type not in ("cpu", "meta")}:
        backend = getattr(torch, device.type, None)
        sync = getattr(backend, "synchronize", None)
        if sync is not None:
            sync(device) if device.type == "cuda" else sync()


class Replays:
    """The guard's side of calibration replays (``Guard.replays``, which
    ``optimizer_step``'s driver, ``runtime/lifecycle/guarded_step.py``, drives: ``due``, then ``run_bare`` with the step's
    closure, the state put back (``charge`` its time), then ``run_guarded``):
    interception switched off and on again, and the timings and counts of the two runs,
    kept in the open step's ledger."""

    def __init__(self, guard: "Guard", every: int | None) -> None:
        self.guard = guard
        self.calibration = calibration_of(guard.model, every)

    def eligible(self) -> bool:
        """Whether the open step can be replayed bare: its first run, watched, on a route
        that can switch its checks off and on again (``ModeSwitch.replayable``: the dispatch
        route, with this guard's mode the only one on the thread; another mode, a fault
        drill's or a profiler's, would see both runs), this guard alone on its thread."""
        g = self.guard
        return g.step_open and g.watching and g.attempt == 0 and g.mode.replayable and g.alone_on_thread()

    def due(self, possible: bool, first_run_started: float | None = None) -> bool:
        """Whether the step replays now. ``possible``: the caller has a closure to replay.
        ``first_run_started`` (replay mode, the step already ran guarded): when that run
        began; the guarded side of the pair is then that run, from then until now.

        In one process, the eligible steps are counted and ``Calibration.picks`` chooses
        among them. With several ranks, a replay runs the closure's collectives (DDP's
        gradient all-reduce) once more, so every rank must replay the same steps or none:
        the choice is by step number (the same on every rank), and on a chosen step the
        ranks agree (one small collective) that each of them can replay it, else none
        does. A sampler that watches few steps may then never be calibrated there."""
        calibration = self.calibration
        if calibration.every is None:
            return False
        if distributed.world_size() > 1:
            if not calibration.picks(self.guard.step_index):
                return False
            if distributed.agree_max(int(not (possible and self.eligible()))):
                return False
        elif not (possible and self.eligible()) or not calibration.due():
            return False
        ledger = self.guard.ledger
        ledger.replay = Replay()
        if first_run_started is not None:
            synchronize(self.guard.model)
            ledger.replay.guarded = time.perf_counter() - first_run_started
            ledger.replay.hooks = ledger.hook_seconds
            ledger.replay.events = (0, ledger.clock.events)
            ledger.replay.ops, ledger.replay.module_calls = self._counts()
        return True

    def _counts(self) -> tuple[int, int]:
        return self.guard.op_counts()

    def run_bare(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` with interception off (no mode, no hooks), timed; all of it,
        switching included, is the replay's cost."""
        g, ledger = self.guard, self.guard.ledger
        assert ledger.replay is not None, "run_bare() without due()"
        started = time.perf_counter()
        try:
            with g.mode.bare_run():  # the guard's Switch: ON -> BARE -> ON
                synchronize(g.model)
                cpu = thread_clock(g.model)
                began, began_cpu = time.perf_counter(), time.thread_time()
                result = fn()
                synchronize(g.model)
                ledger.replay.bare = time.perf_counter() - began
                ledger.replay.bare_cpu = time.thread_time() - began_cpu if cpu else None
        finally:
            ledger.calibration_seconds += time.perf_counter() - started
        return result

    def run_guarded(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` under the guard, timed, with what the guard timed itself and the
        ops and module calls it intercepted in between: the pair's other side."""
        g, ledger = self.guard, self.guard.ledger
        replay = ledger.replay
        assert replay is not None, "run_guarded() without due()"
        synchronize(g.model)
        hooks, events, (ops, calls) = ledger.hook_seconds, ledger.clock.events, self._counts()
        cpu = replay.bare_cpu is not None
        began, began_cpu = time.perf_counter(), time.thread_time()
        result = fn()
        synchronize(g.model)
        replay.guarded = time.perf_counter() - began
        replay.guarded_cpu = time.thread_time() - began_cpu if cpu else None
        now_ops, now_calls = self._counts()
        replay.hooks = ledger.hook_seconds - hooks
        replay.events = (events, ledger.clock.events)
        replay.ops, replay.module_calls = now_ops - ops, now_calls - calls
        return result

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of the replay's work outside the bare run (putting its effects
        back, capturing the state to put back) in the open step's calibration cost."""
        self.guard.ledger.calibration_seconds += seconds

