"""What a guarded step saw: ``StepReport`` and its ``Detection`` records.

Plain dataclasses, so that metrics, loggers, policies and users read one format; built
once per step by ``Guard`` (one host synchronisation), never per GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Detection:
    """One GEMM whose check found corruption, confirmed by exact recomputation; or one
    collective whose result is not what its senders sent (``kind="collective"``,
    ``runtime/collectives/collective_checks.py``): then ``site`` is its bucket or module, ``op`` the
    collective (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"exchange"``
    for the checksum exchange itself), ``segments`` the flagged segments of
    ``core.collective.SEGMENT`` elements (an all-gather: the flagged shards, by group
    rank), ``shape`` the result's size, and ``senders`` / ``receiver`` the link."""

    step: int
    site: str  #: module path relative to the protected model ("global" outside any module)
    op: str  #: aten op ("addmm", "mm", ...)
    phase: str  #: "forward" or "backward"
    rows: list[int]  #: flagged rows (within the last two dims)
    segments: list[int]  #: flagged 256-column segments
    ratio: float  #: worst D/T of the GEMM (nan where the backend reports no D)
    shape: tuple[int, ...]  #: (*batch, M, K, N)
    dtype: str
    call_index: int  #: position of the GEMM among the step's GEMMs
    rank: int = 0
    #: "gemm": the product disagrees with its operands; "weight": the product is right for
    #: the weight in memory, but the weight changed at rest since its last observed update;
    #: "collective": what this rank received is not what was sent
    kind: str = "gemm"
    #: a collective's sending ranks (global ranks; every rank of the group for a reduction)
    senders: list[int] = field(default_factory=list)
    receiver: int | None = None  #: a collective's receiving rank (this one)


KindKey = tuple[str, str, str]  #: (op, phase, dtype): bounded label set for metrics

_DTYPE_NAMES: dict[object, str] = {}


def dtype_name(dtype: object) -> str:
    """``"float32"`` for ``torch.float32``: the dtype label of ``KindKey``.

    >>> import torch; dtype_name(torch.bfloat16)
    'bfloat16'
    """
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


@dataclass
class GemmCounts:
    """GEMMs of one (op, phase, dtype) in a step."""

    seen: int = 0
    verified: int = 0
    flagged: int = 0


@dataclass
class StepReport:
    """What one step saw.

    ``overhead`` is what the guard cost the step, everything it added, over the step time
    without it: ``guard_seconds / (step_seconds - guard_seconds)``. ``guard_seconds`` is
    what the guard timed itself (verification, bookkeeping, the work since the previous
    report: re-encoding updated weights, snapshots; a calibration replay) plus
    interception (the dispatch mode, the site hooks, the compiled route's function mode:
    ``interception_seconds``). Interception cannot be timed from inside; it is the per-op
    estimate (``interception_estimate_seconds``: a round trip per intercepted op and per
    function-mode call, a hook cost per module call, rates measured once per process)
    scaled by what calibration replays of this model measured (``interception_factor``;
    ``sdc_guard.runtime.lifecycle.calibration``: the step's closure run once bare and once
    guarded, paired). ``overhead_calibrated`` says which: True when ``guard_seconds`` is
    the whole cost (calibrated, or a step that intercepted nothing), False when
    interception is the bare estimate, a lower bound (an observation-only ``protect()``
    block, which has no closure to replay, a model no ``optimizer_step`` has calibrated
    yet, the compiled route, which runs no replays). ``verify_overhead`` counts
    verification alone.
    """

    step: int
    seen: int  #: GEMMs seen
    verified: int
    flagged: int  #: GEMMs with at least one confirmed corrupted segment, and collectives that failed their check
    detections: list[Detection]
    unverified_ops: dict[str, int]  #: GEMM-bearing ops that could not be verified, by op
    verify_seconds: float
    step_seconds: float
    #: guard_seconds / (step_seconds - guard_seconds): the guard's cost (whole where
    #: ``overhead_calibrated``, else interception is a lower-bound estimate)
    overhead: float
    overflow: int = 0  #: GEMMs with a legitimate-overflow segment (not corruption)
    unverifiable: int = 0  #: GEMMs with non-finite inputs (not corruption)
    worst_ratio: float = 0.0  #: worst screen D/T over the step's verified GEMMs
    sites_seen: int = 0
    sites_verified: int = 0
    rank: int = 0
    attempt: int = 0  #: 0 for the step's run, 1.. for re-executions by the recompute response
    by_kind: dict[KindKey, GemmCounts] = field(default_factory=dict)  #: counts by (op, phase, dtype)
    #: False for a step the sampler chose not to watch (no dispatch mode, so no GEMM seen)
    watched: bool = True
    #: (row, segment)s the screen flagged that the exact confirmation did not confirm: a
    #: clean product the screen suspected. Counted and exported, never acted on.
    screen_misses: int = 0
    segments: int = 0  #: (row, segment)s the screen checked
    verify_overhead: float = 0.0  #: verify_seconds / (step_seconds - guard_seconds): verification alone
    guard_seconds: float = 0.0  #: everything the guard added to the step (see the class doc)
    intercepted_ops: int = 0  #: aten ops the dispatch mode saw
    #: torch function calls the compiled route's function mode passed on (each charged a
    #: round trip in ``interception_estimate_seconds``); 0 on the dispatch route
    function_mode_calls: int = 0
    #: True: ``guard_seconds`` is the guard's whole cost (interception calibrated by paired
    #: replays, or nothing intercepted); False: interception is the per-op estimate, a lower bound
    overhead_calibrated: bool = False
    #: interception's share of guard_seconds: interception_factor x the estimate (or the
    #: estimate itself), cut to what the step leaves beside the fastest bare run measured
    interception_seconds: float = 0.0
    #: the per-op estimate of interception, uncalibrated (a lower bound)
    interception_estimate_seconds: float = 0.0
    #: measured interception / its per-op estimate, from this model's calibration replays
    #: (None: no replay yet, the estimate stands); replays timed in CPU time (a CPU model on
    #: one thread) are brought to this step's wall time (its wall over its CPU time)
    interception_factor: float | None = None
    #: what this step's calibration replay took (the closure bare, its effects undone);
    #: 0 without one. Part of guard_seconds.
    calibration_seconds: float = 0.0
    #: guard work done after the previous report and before this step opened (re-encoding
    #: the weights an optimizer step wrote, the responder's bookkeeping), also across
    #: per-step ``protect()`` blocks. Part of guard_seconds and of step_seconds.
    carried_seconds: float = 0.0
    #: the gradient screen (``sampling.Screened``) ran on this step's gradients
    gradient_screened: bool = False
    #: it tripped: the step was re-executed with every GEMM verified (see StepOutcome.screen)
    gradient_screen_tripped: bool = False
    gradient_ratio: float = 0.0  #: largest per-parameter gradient norm over its typical norm
    gradient_total_ratio: float = 0.0  #: norm of all gradients over the typical norms' norm
    #: largest deviation of a parameter's log gradient norm above its running mean, in
    #: running spreads (``Screened.sigmas`` trips it)
    gradient_sigmas: float = 0.0
    nonfinite_grads: int = 0  #: parameters whose gradient held a NaN or an infinity
    #: collectives checked (``runtime/collectives/collective_checks.py``); their detections are in
    #: ``detections`` (kind "collective") and ``flagged``
    collective_checks: int = 0
    #: the same, by op ("all_reduce", "all_gather", "reduce_scatter")
    collective_checks_by_op: dict[str, int] = field(default_factory=dict)
    #: collectives seen but not checked, by ``op[reason]`` (a max reduction, an integer dtype, ...)
    collectives_unchecked: dict[str, int] = field(default_factory=dict)
    collective_seconds: float = 0.0  #: what the collective checks took (part of guard_seconds)
    #: the part of it the checksum exchange took: one small all-reduce per process group
    collective_exchange_seconds: float = 0.0

    @property
    def attention_checks(self) -> int:
        """Fused attention calls verified (``sdpa`` forward and ``sdpa_backward``; they
        are also in ``verified`` and in ``by_kind``)."""
        return sum(c.verified for (op, _, _), c in self.by_kind.items() if op.startswith("sdpa"))

    @property
    def flag(self) -> bool:
        """True if any GEMM of the step was flagged."""
        return self.flagged > 0
