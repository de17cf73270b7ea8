"""What the interception hands a guard: GEMMs, fused attention calls, the tensors an op
wrote, and GEMM-bearing ops it cannot verify.

Both routes call these methods: the dispatch mode (``runtime/dispatch/intercept.py``) for every
aten op it sees, the compiled route's check ops (``runtime/compiled/graph_checks.py``) from inside
``torch.compile``'s graphs, with the site and phase they knew at trace time. Each call is
sampled, verified on the guard's checker and recorded in the open step's ledger, with its
flags left on the device until the step closes (``Guard`` in ``runtime/lifecycle/guard.py``). The
intake is a part of ``Guard`` (a base class it inherits), kept in its own module because
it is the per-GEMM half of the guard, where the rest is the per-step half.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from torch import Tensor
from ...core.torch_private import disable_current_modes, dispatch_stack_depth, current_graph_task_id

from ..dispatch.attention import AttentionCall, verify as verify_attention
from ..checking.cache import WeightCache, storage_address, storage_addresses
from ..checking.checker import Checker, verifiable
from ..dispatch.intercept import GLOBAL_SITE, Gemm, SiteTracker, current_phase
from ...report import dtype_name
from .ledger import Pending, StepLedger
from ...report import KindKey
from ..sampling import Sampler, SiteKey

if TYPE_CHECKING:
    from .guard import Guard

#: The guards active on each thread, outermost first (``CheckIntake.owns_outside_gemm``).
_thread_guards = threading.local()


def active_guards() -> list["Guard"]:
    """The guards active on this thread, outermost first (``Guard.activate`` appends)."""
    guards = getattr(_thread_guards, "guards", None)
    if guards is None:
        guards = _thread_guards.guards = []
    return guards


class CheckIntake:
    """The per-GEMM methods of ``Guard`` (which inherits them): they read the guard's
    ledger, cache, sampler, checker and site tracker, set up by ``Guard.__init__``."""

    # what Guard.__init__ sets and these methods read
    _ledger: StepLedger
    _sites: SiteTracker
    _watching: bool
    _attempt: int
    _encode_due: bool
    cache: WeightCache
    sampler: Sampler
    checker: Checker
    backend: str | None
    compiled: bool

    # --- per GEMM --------------------------------------------------------------------------

    def on_unverified(self, op: str) -> None:
        """Count a GEMM-bearing op that cannot be verified. A higher-order op in a compiled
        graph (flex attention under inductor: its fused kernel multiplies inside one call)
        also warns once per model, naming the routes that verify it."""
        self._ledger.unverifiable(op)
        if self.compiled and op.startswith("higher_order."):
            self._warn_once(f"hop:{op}", f"sdc_guard: {op} in a compiled graph: the GEMMs inside its kernel are "
                            "counted in unverified_ops, not verified (docs/COMPILE.md, 'Limits'); eager code "
                            "and backend='aot_eager' verify them (protect(model, compiled=False) runs the "
                            "model's frames eagerly)")

    def note_intercepted(self, calls: int = 1) -> None:
        """Count ``calls`` a route made into the guard's Python without timing them
        (each is a round trip into the guard: a dispatch-mode op, which the mode counts
        itself, or a compiled graph's check op, which calls this): the per-op estimate of
        interception, which calibration replays scale to its measured cost
        (``StepLedger.interception_estimate``)."""
        self._ledger.ops += calls

    def on_write(self, tensors: list[Tensor]) -> None:
        """Called by the dispatch mode with the tensors an op wrote: a parameter written by
        the program needs its cached encoding remade (``sdc_guard.runtime.checking.cache``)."""
        started = time.perf_counter()
        try:
            self._note_writes(tensors)
        finally:
            self._ledger.hook_seconds += time.perf_counter() - started

    def _note_writes(self, tensors: list[Tensor]) -> None:
        cache = self.cache
        stale = []
        for t in tensors:
            ptr = storage_address(t)  # None: a tensor without a storage of its own
            if ptr is not None and cache.holds(ptr):
                stale.append(ptr)
        if stale:
            cache.invalidate(stale)

    @property
    def watching(self) -> bool:
        """Whether the open (or last closed) step is watched by the sampler."""
        return self._watching

    def refresh_weights(self, params: list[Tensor] | None = None) -> None:
        """Make the cached weights of ``params`` (all with ``None``) stale and, after a
        watched step, have them re-encoded while their value is known good: right after
        an optimizer step wrote them. The re-encoding runs when this guard next opens a
        watched step or sees its next GEMM, whichever comes first (``encode_due_weights``):
        in a long-lived block that is right after the optimizer step (the step
        ``optimizer_step`` opens next), before the next batch is even loaded. A block that
        exits first drops it (the next activation makes every encoding stale anyway), and
        so does a next step the sampler does not watch: with one ``protect()`` block per
        step, or between ``Budget`` sweeps, the work would be thrown away. So where the
        model's blocks end right after ``optimizer_step`` (``schedule.steps_end_blocks``)
        the step opened next leaves it to its first GEMM. After an unwatched step it does
        nothing."""
        if not self._watching:  # the next watched step invalidates every encoding anyway
            return
        started = time.perf_counter()
        if params is not None:
            self.cache.invalidate(storage_addresses(params))
        self._encode_due = True
        self.charge(time.perf_counter() - started)

    def encode_due_weights(self) -> None:
        """Run the re-encoding ``refresh_weights`` left due (the caller times it)."""
        if not self._encode_due:
            return
        self._encode_due = False
        if dispatch_stack_depth() == 0:
            self.cache.refresh()
        else:
            with disable_current_modes():  # the encoding's own ops are not the model's
                self.cache.refresh()

    def on_gemm(self, gemm: Gemm, site: str | None = None, phase: str | None = None) -> None:
        """Called by the dispatch mode (or the compiled route's ``check_gemm``, with the
        site and phase it knew at trace time) for every GEMM: sample, verify, keep flags
        on device."""
        if not self._watching:
            return
        started = time.perf_counter()
        try:
            if self._encode_due:  # a long-lived block without a step boundary since the optimizer step
                self.encode_due_weights()
            self._on_gemm(gemm, site, phase)
        finally:
            self._ledger.hook_seconds += time.perf_counter() - started

    def owns_outside_gemm(self) -> bool:
        """Whether a GEMM running outside this guard's model is accounted here: only by
        the outermost guard active on this thread, and only if no other active guard
        there places it inside its own model. So each guard accounts the GEMMs of its
        own model (nested guards both account the inner model's), and a GEMM outside
        every guarded model (a loss's matmul) is accounted once, by the outermost."""
        guards = active_guards()
        if not guards or guards[0] is not self:
            return not guards  # no guard registered on this thread: an autograd worker
        return not any(g.site_tracker.inside() for g in guards[1:])

    def _on_gemm(self, gemm: Gemm, module: str | None = None, phase: str | None = None) -> None:
        # Every GEMM of a watched step comes here, right after its kernel has left the
        # caches cold: each line costs its misses, so the path is kept short (one lookup
        # per table, no object beyond the ledger's record).
        backward = None  # given a phase, the site tracker asks the engine itself, as ever
        if phase is None:
            backward = current_graph_task_id() != -1
            phase = "backward" if backward else "forward"
        a, op = gemm.a, gemm.op
        site_name = module if module is not None else self._sites.site(gemm.out, (a, gemm.b), backward)
        if site_name == GLOBAL_SITE and not self.owns_outside_gemm():
            return  # another guarded model's GEMM
        ledger = self._ledger
        kind: KindKey = (op, phase, dtype_name(a.dtype))
        call_index = ledger.see(kind)
        if not verifiable(gemm):
            self.on_unverified(f"{op}[{kind[2]}]")
            return
        site: SiteKey = (site_name, phase, op)
        ledger.sites_seen.add(site)
        if self._attempt == 0 and not self.sampler.should_verify(site):
            return
        out = gemm.out
        cuda = out.is_cuda
        clock = ledger.clock
        started = clock.start_cuda() if cuda else time.perf_counter()
        try:
            if dispatch_stack_depth() == 0:  # ours is off while its handler runs
                sdc, summary = self.checker.verify(gemm)
            else:
                with disable_current_modes():  # modes below ours (a drill, a profiler) too
                    sdc, summary = self.checker.verify(gemm)
        except Exception as exc:  # a monitoring failure never stops training
            self._warn_once(f"verify:{type(exc).__name__}", f"sdc_guard: could not verify a {op} "
                            f"GEMM ({type(exc).__name__}: {exc}); counting it as unverified")
            self.on_unverified(op)
            return
        elapsed = clock.stop_cuda(started) if cuda else clock.add(time.perf_counter() - started)
        m, k = a.shape[-2:]
        shape = (*out.shape[:-2], m, k, gemm.b.shape[-1])
        ledger.record(Pending(site, kind, call_index, shape, a.dtype, sdc, summary), elapsed)

    def on_attention(self, call: AttentionCall, site: str | None = None, phase: str | None = None) -> None:
        """Called by the dispatch mode (or the compiled route's ``check_attention``, with the
        site and phase it knew at trace time) for every fused attention call (``sdpa``
        forward, ``sdpa_backward``): counted, sampled and verified like a GEMM, at the site
        of the module that ran it (sdc_guard.runtime.dispatch.attention, docs/ATTENTION.md)."""
        if not self._watching:
            return
        started = time.perf_counter()
        try:
            phase = phase or current_phase()
            ops = call.operands
            where = site if site is not None or ops is None else self._sites.site(call.site_tensor, (ops.q, ops.k, ops.v))
            if where == GLOBAL_SITE and not self.owns_outside_gemm():
                return  # another guarded model's call
            kind: KindKey = (call.op, phase, str(call.dtype).removeprefix("torch.") if call.out is not None else "?")
            call_index = self._ledger.see(kind)
            if ops is None or where is None:
                self.on_unverified(f"{call.kernel}[{call.reason}]")
                return
            site_key: SiteKey = (where, phase, call.op)
            self._ledger.sites_seen.add(site_key)
            if self._attempt == 0 and not self.sampler.should_verify(site_key):
                return
            device = call.site_tensor.device
            began = self._ledger.clock.start(device)
            try:
                with disable_current_modes():
                    sdc, summary = verify_attention(call, self.backend)
            except Exception as exc:  # a monitoring failure never stops training
                self._warn_once(f"verify:{type(exc).__name__}", f"sdc_guard: could not verify an {call.op} call "
                                f"({type(exc).__name__}: {exc}); counting it as unverified")
                self.on_unverified(call.kernel)
                return
            elapsed = self._ledger.clock.stop(device, began)
            self._ledger.record(Pending(site_key, kind, call_index, call.shape, call.dtype, sdc, summary), elapsed)
        finally:
            self._ledger.hook_seconds += time.perf_counter() - started
