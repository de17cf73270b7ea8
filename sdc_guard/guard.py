"""``protect(model)``: verify the GEMMs of a training or inference step, report per step.

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

import warnings
import weakref
from collections import deque
from typing import Any, Callable, Protocol

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

from . import backends
from .backends import Backend, GemmRequest
from .cache import WeightCache
from .intercept import Gemm, GemmInterceptor, SiteTracker, current_phase
from .precision import SUPPORTED_DTYPES, resolve_e_max
from .ledger import Pending, StepLedger
from .report import KindKey, StepReport
from .policy import Policy, Responder, StepOutcome
from .sampling import Full, Sampler, SiteKey, sampler_watches
from .snapshot import SnapshotStore

#: Next step number per model, so per-step ``protect()`` blocks continue one schedule.
_next_step: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


def current_step(model: nn.Module) -> int:
    """The step number ``protect(model)`` is on (or opens next): the schedule's clock.

    >>> current_step(torch.nn.Linear(2, 2))
    0
    """
    return _next_step.get(model, 0)


def set_current_step(model: nn.Module, step: int) -> None:
    """Set the step number of ``model``'s schedule (a resumed run continues its count)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    _next_step[model] = step


class MetricsSink(Protocol):
    """Where reports and outcomes go (``sdc_guard.metrics.GuardMetrics``)."""

    def observe_report(self, report: "StepReport") -> None: ...
    def observe_outcome(self, outcome: StepOutcome) -> None: ...


class Guard:
    """Verifies the GEMMs of ``model``'s steps; see ``protect``.

    Not constructed directly: ``with sdc_guard.protect(model) as guard: ...``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        sampler: Sampler | None = None,
        e_max: float | None = None,
        backend: str | None = None,
        history: int = 100,
        cache_bytes: int = 512 << 20,
        rank: int | None = None,
        policy: Policy | None = None,
        snapshots: SnapshotStore | None = None,
        metrics: MetricsSink | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if backend is not None:
            backends.get(backend)
        if e_max is not None:
            resolve_e_max(e_max, torch.float32, torch.device("cpu"))
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history: expected a positive int, got {history!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy: expected a sdc_guard.Policy, got {type(policy).__name__}")
        if snapshots is not None and not isinstance(snapshots, SnapshotStore):
            raise TypeError(f"snapshots: expected a sdc_guard.SnapshotStore, got {type(snapshots).__name__}")
        self.model = model
        self.policy = policy if policy is not None else Policy()
        self.snapshots = snapshots
        self.metrics = metrics
        self.outcomes: deque[StepOutcome] = deque(maxlen=history)
        self._responder: Responder | None = None
        self._attempt = 0
        self.sampler: Sampler = sampler if sampler is not None else Full()
        self.e_max = e_max
        self.backend = backend
        self.cache = WeightCache(cache_bytes)
        self.reports: deque[StepReport] = deque(maxlen=history)
        self.rank = rank if rank is not None else _current_rank()
        self._sites = SiteTracker(model)
        self._mode: GemmInterceptor | None = None
        self._active = False  #: interception asked for (activate/deactivate)
        self._watching = True  #: the open step's GEMMs are to be seen (the sampler's call)
        self._paused = False  #: inside an optimizer step known to run no GEMM
        self._optimizers = OptimizerSteps(self)
        self._step_open = False
        self._warned: set[str] = set()
        self._backend_choice: dict[tuple, Backend] = {}
        self._e_max_choice: dict[tuple, float] = {}
        self._ledger = StepLedger()

    # --- step lifecycle ------------------------------------------------------------------

    @property
    def step_index(self) -> int:
        """Number of the step now open (or next to open)."""
        return current_step(self.model)

    @property
    def last_report(self) -> StepReport | None:
        """The report of the last closed step."""
        return self.reports[-1] if self.reports else None

    def begin_step(self, *, rerun: bool = False) -> None:
        """Open the next step, or (``rerun``) a re-execution of the step just closed.

        A re-execution keeps the step number, counts as the next ``attempt`` and verifies
        every GEMM whatever the sampler says: triage must see what the first run saw. A
        step the sampler does not watch (``EveryN`` between its steps, ``Budget`` between
        sweeps) runs without the dispatch mode: it costs nothing and reports no GEMMs.
        """
        if self._step_open:
            raise RuntimeError("begin_step(): a step is already open; call end_step() first")
        self._ledger = StepLedger()
        if rerun:
            last = self.last_report
            if last is None:
                raise RuntimeError("begin_step(rerun=True): no step has been closed yet")
            _next_step[self.model] = last.step
            self._attempt = last.attempt + 1
        else:
            self._attempt = 0
            self.sampler.begin_step(self.step_index)
        self._watching = rerun or sampler_watches(self.sampler)
        self._optimizers.reset()
        if self._watching:
            if not rerun:
                self.cache.set_parameters(self.model.parameters())
            self._sites.start()
        self._step_open = True
        self._sync_mode()

    def end_step(self) -> StepReport:
        """Close the open step: read its flags (one host sync) and report it."""
        report = self._close_step(keep_empty=True)
        assert report is not None
        return report

    def _close_step(self, *, keep_empty: bool) -> StepReport | None:
        if not self._step_open:
            raise RuntimeError("end_step(): no step is open (use it inside the protect() block)")
        self._sites.stop()
        self._step_open = False
        if not keep_empty and self._watching and self._ledger.seen == 0 and not self._ledger.unverified:
            return None  # a block that ran no GEMM (an unwatched step is still a step)
        report = self._ledger.report(self.step_index, self._attempt, self.rank, watched=self._watching)
        self.reports.append(report)
        self._publish("observe_report", report)
        if report.attempt == 0:
            self.sampler.end_step(self._ledger.costs(report))
        _next_step[self.model] = report.step + 1
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
                       loss: Any = None) -> StepOutcome:
        """Run ``closure`` (zero_grad, forward, backward; returns the loss) as one guarded
        step, respond to any detection per the policy, then step ``optimizer`` unless the
        response says not to. Closes the step (no ``guard.step()`` needed). GEMMs that ran
        in the step before ``closure`` (earlier micro-batches of gradient accumulation) are
        verified too, but cannot be re-executed: a detection there is answered by ``skip``
        instead of ``recompute``; so is one with ``closure=None``. ``step_fn`` replaces
        ``optimizer.step`` (for integrations that patch it). ``replay=True`` says the
        step's forward and backward already ran and gave ``loss``: ``closure`` is then
        called only to re-execute, and re-runs the whole step itself, restoring the RNG
        state and gradients it starts from (the Hugging Face callback's case).

        >>> model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> def closure():
        ...     opt.zero_grad(); loss = model(torch.ones(2, 4)).sum(); loss.backward(); return loss
        >>> with protect(model) as guard:
        ...     outcome = guard.optimizer_step(opt, closure)
        >>> outcome.stepped, outcome.classification
        (True, None)
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if closure is not None and not callable(closure):
            raise TypeError(f"closure: expected a callable or None, got {type(closure).__name__}")
        if self._responder is None or self._responder.optimizer is not optimizer:
            self._responder = Responder(self, optimizer, self.policy, self.snapshots, step_fn)
            self.snapshots = self._responder.snapshots
        return self._responder.run(closure, replay=replay, loss=loss)

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
        if self._active:
            raise RuntimeError("this Guard is already active")
        self._active = True
        self._optimizers.install()
        self._sync_mode()

    def deactivate(self) -> None:
        """Stop intercepting; an open step stays open."""
        self._active = False
        self._optimizers.remove()
        self._sync_mode()

    @property
    def intercepting(self) -> bool:
        """Whether the dispatch mode is on now (active, and the step is watched)."""
        return self._mode is not None

    def _sync_mode(self) -> None:
        """Enter the dispatch mode when active and watching, leave it otherwise.

        Mode stacks are last-in first-out: if another mode was entered above ours (a
        profiler inside ``protect()``), an unwatched step keeps ours in place rather than
        pop the wrong one, and ``on_gemm`` ignores what it sees.
        """
        wanted = self._active and self._watching and not self._paused
        if wanted and self._mode is None:
            self._mode = GemmInterceptor(self)
            self._mode.__enter__()
        elif not wanted and self._mode is not None and (
                not self._active or _get_current_dispatch_mode() is self._mode):
            self._mode.__exit__(None, None, None)
            self._mode = None

    def __enter__(self) -> "Guard":
        if not self._step_open:
            self.begin_step()
        self.activate()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deactivate()
        if self._step_open:
            self._close_step(keep_empty=False)

    # --- per GEMM --------------------------------------------------------------------------

    def on_unverified(self, op: str) -> None:
        """Count a GEMM-bearing op that cannot be verified."""
        self._ledger.unverifiable(op)

    def on_gemm(self, gemm: Gemm) -> None:
        """Called by the dispatch mode for every GEMM: sample, verify, keep flags on device."""
        if not self._watching:
            return
        phase = current_phase()
        kind: KindKey = (gemm.op, phase, str(gemm.a.dtype).removeprefix("torch."))
        call_index = self._ledger.see(kind)
        if not _verifiable(gemm):
            self.on_unverified(f"{gemm.op}[{kind[2]}]")
            return
        site: SiteKey = (self._sites.site(gemm.out, (gemm.a, gemm.b)), phase, gemm.op)
        self._ledger.sites_seen.add(site)
        if self._attempt == 0 and not self.sampler.should_verify(site):
            return
        device = gemm.out.device
        started = self._ledger.clock.start(device)
        try:
            if torch._C._len_torch_dispatch_stack() == 0:  # ours is off while its handler runs
                sdc, summary = self._verify(gemm)
            else:
                with _disable_current_modes():  # modes below ours (a drill, a profiler) too
                    sdc, summary = self._verify(gemm)
        except Exception as exc:  # a monitoring failure never stops training
            self._warn_once(f"verify:{type(exc).__name__}", f"sdc_guard: could not verify a {gemm.op} "
                            f"GEMM ({type(exc).__name__}: {exc}); counting it as unverified")
            self.on_unverified(gemm.op)
            return
        elapsed = self._ledger.clock.stop(device, started)
        shape = (*gemm.out.shape[:-2], gemm.a.shape[-2], gemm.a.shape[-1], gemm.b.shape[-1])
        self._ledger.record(Pending(site, kind, call_index, shape, gemm.a.dtype, sdc, summary), elapsed)

    def _verify(self, gemm: Gemm) -> tuple[Tensor | None, Tensor | list[float]]:
        key = (gemm.a.device, gemm.a.dtype)
        e_max = self._e_max_choice.get(key)
        if e_max is None:
            e_max = self._e_max_choice[key] = resolve_e_max(self.e_max, gemm.a.dtype, gemm.a.device)
        backend = self._choose_backend(gemm, e_max)
        # the operator re-reads B itself; the others take the cached encoding
        weight = self.cache.get(gemm.b, encode=backend.encode) if backend.name != "npu" else None
        req = GemmRequest(gemm.a, gemm.b, gemm.out, e_max, bias=gemm.bias, alpha=gemm.alpha, beta=gemm.beta,
                          weight=weight)
        return backend.summarize(req)

    def _choose_backend(self, gemm: Gemm, e_max: float) -> Backend:
        """The backend for GEMMs like this one, chosen once per kind of call: device,
        dtype, dims, bias and alpha (what the NPU operator's contract depends on). The
        Triton and native kernels also depend on strides; a call of theirs that their
        ``rejects`` would refuse goes to the torch path inside their ``check``."""
        a = gemm.a
        key = (a.device, a.dtype, a.dim(), gemm.b.dim(), gemm.bias is not None, gemm.alpha == 1.0)
        chosen = self._backend_choice.get(key)
        if chosen is None:
            req = GemmRequest(a, gemm.b, gemm.out, e_max, bias=gemm.bias, alpha=gemm.alpha, beta=gemm.beta)
            chosen = self._backend_choice[key] = backends.select(req, self.backend)
        return chosen

    def _publish(self, method: str, item: Any) -> None:
        """Hand a report or outcome to the metrics sink; a failure there warns once."""
        if self.metrics is None:
            return
        try:
            getattr(self.metrics, method)(item)
        except Exception as exc:  # monitoring never stops training
            self._warn_once(f"metrics:{method}", f"sdc_guard: metrics {method} failed "
                            f"({type(exc).__name__}: {exc}); training continues")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # --- end of step ---------------------------------------------------------------------


class OptimizerSteps:
    """Leaves optimizer steps that run no GEMM outside the dispatch mode.

    An SGD or Adam step is elementwise arithmetic over every parameter: on a small model,
    half of a training step's aten ops, each paying the dispatch mode's Python round trip
    with nothing to verify. Each optimizer's first watched step is intercepted as usual
    and its GEMMs counted; one that ran none is from then on stepped with the mode off. One
    that ran GEMMs (Shampoo, Muon, LBFGS evaluating its closure) stays verified. Global
    optimizer-step hooks, installed only while the guard is active.
    """

    def __init__(self, guard: "Guard") -> None:
        self.guard = guard
        self._gemmless: weakref.WeakSet = weakref.WeakSet()
        self._learned: weakref.WeakSet = weakref.WeakSet()
        self._seen_before: dict[int, int] = {}
        #: step calls in progress per optimizer: a subclass's step calling its base class's
        #: step runs the hooks twice, and only the outer call is the optimizer step
        self._depth: dict[int, int] = {}
        self._handles: list[Any] = []

    def install(self) -> None:
        if not self._handles:
            self._handles = [register_optimizer_step_pre_hook(self._pre),
                             register_optimizer_step_post_hook(self._post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        """Forget steps in progress: an optimizer step that raised never ran its post-hook."""
        self._depth.clear()
        self._seen_before.clear()
        self.guard._paused = False

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth = self._depth.get(id(optimizer), 0)
        self._depth[id(optimizer)] = depth + 1
        if depth:
            return
        guard = self.guard
        if optimizer in self._gemmless:
            guard._paused = True
            guard._sync_mode()
        elif optimizer not in self._learned and guard.intercepting and guard.step_open:
            self._seen_before[id(optimizer)] = guard.gemms_seen

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth = self._depth.pop(id(optimizer), 1) - 1
        if depth:
            self._depth[id(optimizer)] = depth
            return
        guard = self.guard
        if guard._paused:
            guard._paused = False
            guard._sync_mode()
            return
        before = self._seen_before.pop(id(optimizer), None)
        if before is not None and guard.step_open:
            self._learned.add(optimizer)
            if guard.gemms_seen == before:
                self._gemmless.add(optimizer)


def _verifiable(gemm: Gemm) -> bool:
    a, b, out = gemm.a, gemm.b, gemm.out
    return (
        a.dtype in SUPPORTED_DTYPES and b.dtype == a.dtype and out.dtype in SUPPORTED_DTYPES
        and a.dim() >= 2 and b.dim() >= 2 and out.dim() >= 2
        and (gemm.bias is None or gemm.bias.is_floating_point())
    )


def _current_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
) -> Guard:
    """Verify the GEMMs ``model`` runs inside the block, forward and backward.

    Use one block per step (the report is ``guard.last_report`` after the block), or one
    long-lived block with ``guard.step()`` at each step boundary, or
    ``guard.optimizer_step(optimizer, closure)`` to have detections answered before the
    optimizer sees corrupted gradients. ``sampler`` decides which GEMMs to verify
    (default ``Full()``); ``e_max`` and ``backend`` are as in ``verify_matmul``;
    ``policy`` says how to respond (default ``Policy()``: recompute, then roll back, then
    exit); ``snapshots`` holds the known-good state rollback returns to (default: one
    in memory every 50 steps). Pass the same sampler, policy and snapshot store to
    successive per-step blocks so that their state carries over; ``metrics`` receives
    every report and outcome (``sdc_guard.metrics.GuardMetrics`` exports them to
    Prometheus); ``cache_bytes`` bounds the weight-side cache.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> with protect(model) as guard:
    ...     model(torch.randn(5, 8)).sum().backward()
    >>> r = guard.last_report; (r.seen, r.verified, r.flagged)
    (5, 5, 0)
    """
    return Guard(model, sampler=sampler, e_max=e_max, backend=backend, history=history,
                 cache_bytes=cache_bytes, policy=policy, snapshots=snapshots, metrics=metrics)
