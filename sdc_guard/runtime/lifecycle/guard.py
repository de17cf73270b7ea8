"""``protect(model)``: verify the GEMMs of a training or inference step, report per step.

This module is the per-step half of the guard (steps opened and closed, interception
switched on and off, the optimizer step and its responses); the per-GEMM half, what the
interception hands it, is ``runtime/lifecycle/intake.py``.

Lifecycle: a ``Guard`` opens a step, the dispatch mode hands it every GEMM, the sampler
says which to verify, verification leaves its flags on the device, and closing the step
reads them all with one host synchronisation into a ``StepReport``. A step closes when a
per-step ``with protect(model):`` block exits, or at each ``guard.step()`` of a long-lived
block. Step numbers persist per model, so successive per-step blocks continue one
schedule.

A verification failure (a bug, a backend that rejects a call) is a monitoring failure: it
warns once, counts the GEMM as unverified, and never stops training.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from ...core.torch_private import disable_current_modes as _disable_current_modes, dispatch_stack_depth

from .calibration import DEFAULT_EVERY, Replays
from ..checking.cache import WeightCache, persistent_parameters
from ..compiled.function_mode import is_compiled, note_compiled
from .intake import CheckIntake, active_guards
from ..dispatch.intercept import SiteTracker, current_phase
from .ledger import StepLedger
from ..compiled.module_names import ModuleNames
from ...report import StepReport
from ...respond.events import resolve_events
from ...respond.outcome import StepOutcome
from ...respond.policy import Policy
from ..sampling import Full, GradientScreen, Sampler, sampler_screens, sampler_watches
from ...respond.snapshot import SnapshotStore
from .stats import ScreenStats
from ..checking.checker import Checker
from ..collectives.collective_checks import CollectiveChecks
from .publishing import Publisher
from .config import GuardConfig
from .checks import MetricsSink, check_backend, check_guard_arguments, check_metrics_sink, check_optimizer_step_arguments  # noqa: F401  (also importable here)
from ...respond.distributed import rank as current_rank  # noqa: F401  (also importable here)
from .guarded_step import GuardedStep
from .switch import ModeSwitch, Switch
from .gradient_screening import GradientScreening
from ..sampling.schedule import current_step, set_current_step  # noqa: F401  (also importable here)
from ..sampling.schedule import carry_over, note_block_end, note_sampler_begun, sampler_begun, steps_end_blocks, take_carried


class Guard(CheckIntake):
    """Verifies the GEMMs of ``model``'s steps; see ``protect``.

    Not constructed directly: ``with sdc_guard.protect(model) as guard: ...``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: GuardConfig | None = None,
        *,
        rank: int | None = None,
        snapshots: SnapshotStore | None = None,
        metrics: MetricsSink | None = None,
        **options: Any,
    ) -> None:
        """``config``, or its fields as keyword arguments ``options`` (``GuardConfig.of``);
        ``rank``: this process's (default: its rank in the default process group)."""
        self.config = config = GuardConfig.of(config, **options)
        check_guard_arguments(model, backend=config.backend, rank=rank, snapshots=snapshots, metrics=metrics)
        sampler, e_max, backend, compiled = config.sampler, config.e_max, config.backend, config.compiled
        self.screen = config.screen
        #: the compiled route (docs/COMPILE.md): checks put into the compiled graphs, the
        #: eager frames through the function mode's taps; else the dispatch mode. ``None``
        #: (the default) starts on the dispatch route for a model that is not compiled and
        #: switches when dynamo compiles a frame inside the block (``compiled_code_met``)
        self.compiled = compiled if compiled is not None else is_compiled(model)
        self._compiled_arg = compiled
        #: per-site screen D/T statistics (``protect(stats=True)``), else ``None``
        self.screen_stats: ScreenStats | None = ScreenStats() if config.stats else None
        self.model = model
        self.policy = config.policy if config.policy is not None else Policy()
        self.snapshots = snapshots
        self.metrics = metrics
        #: structured events (``respond/events.py``): ``events``, else ``$SDC_GUARD_EVENTS``
        self.events = resolve_events(config.events, next((p.device for p in model.parameters()), None))
        #: hands reports and outcomes to ``metrics`` and ``events``; warns once
        self.publisher = Publisher(model, metrics, self.events)
        self._warn_once = self.publisher.warn_once
        self.outcomes: deque[StepOutcome] = deque(maxlen=config.history)
        self._driver: GuardedStep | None = None  #: drives ``optimizer_step`` (runtime/lifecycle/guarded_step.py)
        self._attempt = 0
        self.sampler: Sampler = sampler if sampler is not None else Full()
        self.e_max = e_max
        self.backend = backend
        self.cache = WeightCache(config.cache_bytes)
        self.reports: deque[StepReport] = deque(maxlen=config.history)
        self.rank = rank if rank is not None else current_rank()
        self._sites = SiteTracker(model)
        #: module paths by module and parameter, for the compiled route's sites
        self.module_names = ModuleNames(model)
        #: the on/off state and the interception that follows it (``switch.ModeSwitch``)
        self.mode = ModeSwitch(self)
        self._watching = True  #: the open step's GEMMs are to be seen (the sampler's call)
        self._watched_last = False  #: the previous step was watched (its writes were observed)
        self._step_open = False
        self.checker = Checker(self.screen, e_max, backend, self.cache)  #: runs each check
        self._ledger = StepLedger()
        self._carry = 0.0  #: guard seconds spent while no step was open, for the next report
        #: an optimizer step wrote the weights: re-encode them at the next watched step or GEMM
        self._encode_due = False
        self._screening = GradientScreening(self._warn_once)  #: the open step's gradient screen
        self._provisional = False  #: the open step was opened in advance (``begin_step``)
        #: calibration replays, driven by ``optimizer_step`` (``GuardedStep``): interception's
        #: real cost, measured (``sdc_guard.runtime.lifecycle.calibration``)
        self.replays = Replays(self, config.calibrate_every)
        #: check the step's collectives (``runtime/collectives/collective_checks.py``), where they can be
        self.collectives = config.collectives
        self.collective_checks = CollectiveChecks(self._sites, self.module_names, self._warn_once)
        #: the last closed step's flagged and tripped global ranks when its collectives'
        #: exchange carried them (``end_step(tripped=...)``); None on every rank alike else
        self.agreed_flags: tuple[list[int], list[int]] | None = None

    # --- step lifecycle ------------------------------------------------------------------

    @property
    def step_index(self) -> int:
        """Number of the step now open (or next to open)."""
        return current_step(self.model)

    @property
    def last_report(self) -> StepReport | None:
        """The report of the last closed step."""
        return self.reports[-1] if self.reports else None

    def begin_step(self, *, rerun: bool = False, provisional: bool = False) -> None:
        """Open the next step, or (``rerun``) a re-execution of the step just closed.

        ``provisional``: opened in advance by ``optimizer_step`` for whatever comes next;
        if the ``protect()`` block exits with it unwatched (nothing to tell whether
        anything ran in it), it is dropped instead of being reported as a step.

        A re-execution keeps the step number, counts as the next ``attempt`` and verifies
        every GEMM whatever the sampler says: triage must see what the first run saw. A
        step the sampler does not watch (``EveryN`` between its steps, ``Budget`` between
        sweeps) runs without the dispatch mode: it costs nothing and reports no GEMMs.
        """
        if self._step_open:
            raise RuntimeError("begin_step(): a step is already open; call end_step() first")
        started = time.perf_counter()
        self._ledger = StepLedger(carried_seconds=self._carry + take_carried(self.model))
        self._carry = 0.0
        self._screening.reset()
        self._provisional = provisional
        if rerun:
            last = self.last_report
            if last is None:
                raise RuntimeError("begin_step(rerun=True): no step has been closed yet")
            set_current_step(self.model, last.step)
            self._attempt = last.attempt + 1
        else:
            self._attempt = 0
            if not sampler_begun(self.model, self.sampler, self.step_index):  # begun ahead, then dropped
                self.sampler.begin_step(self.step_index)
                note_sampler_begun(self.model, self.sampler, self.step_index)
        self._watching = rerun or sampler_watches(self.sampler)
        if not self._watching:
            self._encode_due = False  # an unwatched step: its next watched one starts cold anyway
        elif not (provisional and steps_end_blocks(self.model)):
            self.encode_due_weights()  # right after the optimizer step that made it due
        # else one block per step: the block's exit would drop the encodings made now, the
        # next activation invalidating them; its next GEMM makes them if the block goes on
        self.mode.optimizers.reset()
        if self._watching:
            if not rerun or not self._watched_last:
                # a re-execution of an unwatched step (a tripped gradient screen) starts
                # cold too: the encodings are from the last watched step, maybe long ago
                self.cache.set_parameters(persistent_parameters(self.model))
                if not self._watched_last:  # writes in unwatched steps went unobserved
                    self.cache.invalidate()
            if not self.compiled:  # compiled graphs know their sites; hooks would recompile them
                self._sites.start()
        self._watched_last = self._watching
        self.collective_checks.begin(requested=self.collectives and self._watching, compiled=self.compiled,
                                     sampler=self.sampler)
        self._step_open = True
        self.mode.step_opened(self._watching)
        self._ledger.hook_seconds += time.perf_counter() - started

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of guard work done outside its hooks (``optimizer_step``'s
        bookkeeping, re-encoding updated weights, snapshots) in the guard's cost: to the
        open step, or, between steps, to the next one's report."""
        if self._step_open:
            self._ledger.hook_seconds += seconds
        else:
            self._carry += seconds

    @contextlib.contextmanager
    def unintercepted(self) -> Iterator[None]:
        """The guard's own work (``optimizer_step`` capturing and restoring a step's state):
        no dispatch mode sees its ops, so they are neither counted as the model's nor
        charged twice."""
        if dispatch_stack_depth() == 0:
            yield
        else:
            with _disable_current_modes():
                yield

    def alone_on_thread(self) -> bool:
        """Whether this is the only guard active on this thread."""
        return active_guards() == [self]

    def end_step(self, *, closure_raised: bool = False, tripped: bool | None = None) -> StepReport:
        """Close the open step: read its flags (one host sync) and report it.
        ``closure_raised``: ``optimizer_step``'s closure raised (the step was not screened
        for that reason, not for a missing ``optimizer_step``). ``tripped``: this rank's
        gradient screen tripped, from ``optimizer_step``: the collectives' exchange then
        carries the step's flags where it can (``agreed_flags``; None: it could not)."""
        if closure_raised:
            self._screening.excuse()
            self.collective_checks.abandon()
        report = self._close_step(keep_empty=True, tripped=tripped)
        assert report is not None
        return report

    def _close_step(self, *, keep_empty: bool, tripped: bool | None = None) -> StepReport | None:
        if not self._step_open:
            raise RuntimeError("end_step(): no step is open (use it inside the protect() block)")
        self.agreed_flags = None
        self._sites.stop()
        self._step_open = False
        if self._provisional:  # opened by optimizer_step: did the block end right after it?
            note_block_end(self.model, after_step=not keep_empty)
        self.mode.interception.retiring = False  # the next step's modes are the compiled route's alone
        self._ledger.ops += self.mode.interception.take_ops()  # the mode goes on for the next step
        self._ledger.function_calls += self.mode.interception.take_function_calls()
        self._ledger.module_calls, self._sites.calls = self._ledger.module_calls + self._sites.calls, 0
        round_trip, module_hook, function_call = self._ledger.rates()
        collectives = None
        if self.collective_checks.pending:  # every rank of a group closes alike
            flags = None if tripped is None else (self._ledger.gemms_flagged(), tripped)  # read once
            collectives = self.collective_checks.close(self.step_index, self.rank, flags)
            self._ledger.hook_seconds += collectives.seconds
            self.agreed_flags = collectives.agreed
        if (not keep_empty and self._watching and self._ledger.seen == 0 and not self._ledger.unverified
                and collectives is None) or \
                (not keep_empty and self._provisional and not self._watching):
            # a block that ran no GEMM (an unwatched step is still a step), or the step
            # optimizer_step opened after the block's last one: what the guard spent in
            # it goes to the next report
            self._carry += self._ledger.guard_seconds(round_trip, module_hook, self.replays.calibration.factor,
                                                      function_call)
            return None
        report = self._ledger.report(self.step_index, self._attempt, self.rank, watched=self._watching,
                                     stats=self.screen_stats, round_trip=round_trip, module_hook=module_hook,
                                     calibration=self.replays.calibration, function_call=function_call)
        started = time.perf_counter()  # what follows the report is charged to the next one
        if collectives is not None:
            collectives.into(report)
        self._screening.into(report, self.sampler)
        self.reports.append(report)
        self.publisher.publish("observe_report", report)
        if report.attempt == 0:
            self.sampler.end_step(self._ledger.costs(report))
            note_sampler_begun(self.model, self.sampler, None)
        set_current_step(self.model, report.step + 1)
        self._carry += time.perf_counter() - started
        return report

    def step(self) -> StepReport:
        """Close the current step (report it) and open the next one.

        >>> model = torch.nn.Linear(4, 3)
        >>> with protect(model) as guard:
        ...     model(torch.randn(2, 4)).sum().backward()
        ...     report = guard.step()
        >>> report.seen, report.verified, report.flagged
        (2, 2, 0)
        """
        report = self.end_step()
        self.begin_step()
        return report

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None,
                       *, step_fn: Callable[[], Any] | None = None, replay: bool = False,
                       loss: Any = None, replay_started: float | None = None) -> StepOutcome:
        """Run ``closure`` (zero_grad, forward, backward; returns the loss) as one guarded
        step, respond to any detection per the policy, then step ``optimizer`` unless the
        response says not to. Closes the step (no ``guard.step()`` needed). GEMMs that ran
        in the step before ``closure`` (earlier micro-batches of gradient accumulation) are
        verified too, but cannot be re-executed: a detection there is answered by ``skip``
        instead of ``recompute``; so is one with ``closure=None``. ``step_fn`` replaces
        ``optimizer.step`` (for integrations that patch it). ``replay``, ``loss`` and
        ``replay_started``: the step's forward and backward already ran (the Hugging Face
        callback's case; ``GuardedStep.run``, runtime/lifecycle/guarded_step.py). On the
        steps calibration picks (``GuardConfig.calibrate_every``), ``closure`` runs once
        more, bare, its effects undone: the report's overhead is then measured.

        >>> model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> def closure():
        ...     opt.zero_grad(); loss = model(torch.ones(2, 4)).sum(); loss.backward(); return loss
        >>> with protect(model) as guard:
        ...     outcome = guard.optimizer_step(opt, closure)
        >>> outcome.stepped, outcome.classification
        (True, None)
        """
        check_optimizer_step_arguments(optimizer, closure, replay_started)
        if self._driver is None or self._driver.optimizer is not optimizer:
            self._driver = GuardedStep(self, optimizer, self.policy, self.snapshots, step_fn)
            self.snapshots = self._driver.snapshots
        return self._driver.run(closure, replay=replay, loss=loss, replay_started=replay_started)

    def on_collective(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Called by the dispatch mode for every collective (``ops.Route.COLLECTIVE``): run
        it, checked when the open step checks collectives (``runtime/collectives/collective_checks.py``)."""
        if not self._step_open:
            return func(*args, **kwargs)
        return self.collective_checks.run(func, args, kwargs, phase=current_phase(), call_index=self._ledger.seen)

    @property
    def screens_gradients(self) -> bool:
        """Whether the sampler screens gradients (``sampling.Screened``): then
        ``optimizer_step`` screens each step and re-executes, verified, a tripped one."""
        return sampler_screens(self.sampler)

    def screen_gradients(self, params: list[Tensor]) -> GradientScreen | None:
        """Screen the gradients of ``params`` for the open step (``None`` if the sampler
        does not screen); the result goes into the step's report. Called by
        ``optimizer_step`` between the backward and the optimizer step."""
        if not self.screens_gradients:
            return None
        if not self._step_open:
            raise RuntimeError("screen_gradients(): no step is open (call it before the step closes)")
        started = time.perf_counter()
        try:
            return self._screening.screen(self.sampler, params)
        finally:
            self._ledger.hook_seconds += time.perf_counter() - started

    def resolve_screen(self, verdict: str, params: list[Tensor] | None = None) -> None:
        """Tell the screening sampler how its trip was resolved (``Screened.resolve_screen``)."""
        if self.screens_gradients:
            grads = None if params is None else [p.grad for p in params if p.grad is not None]
            self.sampler.resolve_screen(verdict, grads)  # type: ignore[attr-defined]

    @property
    def step_open(self) -> bool:
        """Whether a step is open (GEMMs seen now are accounted to it)."""
        return self._step_open

    @property
    def gemms_seen(self) -> int:
        """GEMMs seen so far in the open step."""
        return self._ledger.seen

    def activate(self) -> None:
        """Start intercepting GEMMs (the step lifecycle is separate)."""
        if self.active:
            raise RuntimeError("this Guard is already active")
        started = time.perf_counter()
        active_guards().append(self)
        self.cache.invalidate()  # whatever was written while inactive went unobserved
        self.mode.activate(self._watching)
        self.charge(time.perf_counter() - started)

    def deactivate(self) -> None:
        """Stop intercepting; an open step stays open."""
        self._encode_due = False  # the next activation makes every encoding stale anyway
        guards = active_guards()
        if self in guards:
            guards.remove(self)
        started = time.perf_counter()
        self.mode.deactivate()
        self.charge(time.perf_counter() - started)

    @property
    def intercepting(self) -> bool:
        """Whether interception is on now (active, and the step is watched)."""
        return self.mode.interception.on

    @property
    def switch(self) -> Switch:
        """The on/off state (``Switch``)."""
        return self.mode.state

    @property
    def active(self) -> bool:
        """Whether this guard is active (between ``activate`` and ``deactivate``)."""
        return self.mode.state is not Switch.OFF

    @property
    def attempt(self) -> int:
        """The open step's attempt: 0 for its first run, then one per re-execution."""
        return self._attempt

    @property
    def ledger(self) -> StepLedger:
        """The open step's accounts (a calibration replay keeps its timings there)."""
        return self._ledger

    def op_counts(self) -> tuple[int, int]:
        """The aten ops intercepted and the module calls tracked so far in the open step,
        the dispatch mode's uncollected count included (calibration replays pair them)."""
        return (self._ledger.ops + self.mode.interception.pending_ops,
                self._ledger.module_calls + self._sites.calls)

    @property
    def compiled_argument(self) -> bool | None:
        """``protect``'s ``compiled`` argument (``None``: the guard picks, and may switch)."""
        return self._compiled_arg

    @property
    def site_tracker(self) -> SiteTracker:
        """The dispatch route's site tracker (its module hooks, the autograd nodes' labels)."""
        return self._sites

    def compiled_code_met(self) -> bool:
        """Called by the dispatch mode when dynamo is about to compile a frame inside the
        block (a ``torch.compile(model)`` wrapper, a compiled submodule or training step the
        guard could not see from the model): switch to the compiled route for the rest of
        the block, so that the frame compiles, with the checks in its graphs, and leaves
        nothing behind. Returns whether the frame may compile: not under
        ``protect(compiled=False)``, where it runs eagerly, verified by the dispatch mode.

        The dispatch mode stays on until the step closes, verifying only the backward of
        the GEMMs it verified before (autograd nodes older than now); the eager frames
        are the function mode's from here on. The model is remembered, so its next
        guards start compiled."""
        if self._compiled_arg is False or self.compiled or not self.active:
            return self.compiled
        started = time.perf_counter()
        self.compiled = True
        note_compiled(self.model)
        self.mode.to_compiled()
        self._ledger.hook_seconds += time.perf_counter() - started
        return True

    def __enter__(self) -> "Guard":
        if not self._step_open:
            self.begin_step()
        self.activate()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deactivate()
        if self._step_open:
            self._close_step(keep_empty=False)
        carry_over(self.model, self._carry)  # with a block per step, the next report is another guard's
        self._carry = 0.0


def protect(
    model: nn.Module,
    *,
    sampler: Sampler | None = None,
    e_max: float | None = None,
    backend: str | None = None,
    policy: Policy | None = None,
    snapshots: SnapshotStore | None = None,
    metrics: MetricsSink | None = None,
    history: int = 100,
    cache_bytes: int = 512 << 20,
    stats: bool = False,
    screen: str = "default",
    compiled: bool | None = None,
    calibrate_every: int | None = DEFAULT_EVERY,
    events: Any = None,
    collectives: bool = True,
    config: GuardConfig | None = None,
) -> Guard:
    """Verify the GEMMs ``model`` runs inside the block, forward and backward.

    Use one block per step (the report is ``guard.last_report`` after the block), or one
    long-lived block with ``guard.step()`` at each step boundary, or
    ``guard.optimizer_step(optimizer, closure)`` to have detections answered before the
    optimizer sees corrupted gradients. ``snapshots`` holds the known-good state rollback
    returns to (default: one in memory every 50 steps); ``metrics`` receives every report
    and outcome (``sdc_guard.metrics.GuardMetrics`` exports them to Prometheus). The other
    keywords are the fields of ``sdc_guard.GuardConfig``, each documented there and in
    docs/CONFIGURATION.md (``config``: all of them as one object instead). Pass the same
    sampler, policy and snapshot store to successive per-step blocks so that their state
    carries over.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> with protect(model) as guard:
    ...     model(torch.randn(5, 8)).sum().backward()
    >>> r = guard.last_report; (r.seen, r.verified, r.flagged)
    (5, 5, 0)
    """
    return Guard(model, GuardConfig.of(config, sampler=sampler, e_max=e_max, backend=backend, policy=policy,
                                       history=history, cache_bytes=cache_bytes, stats=stats, screen=screen,
                                       compiled=compiled, calibrate_every=calibrate_every, events=events,
                                       collectives=collectives),
                 snapshots=snapshots, metrics=metrics)
