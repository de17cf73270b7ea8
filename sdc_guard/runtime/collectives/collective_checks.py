"""Check the collectives of a guarded step: what each rank sent against what each received.

The guard's dispatch mode hands every collective of a watched step to ``CollectiveChecks.run``
(``ops.Route.COLLECTIVE``). Before the collective runs, the sender's checksums of what this
rank contributes are taken (``core/collective.py``: per segment sums and sums of magnitudes
for a reduction, exact integer sums of the bits for an all-gather); when its result has
landed (``collective_ops.run_then``), the receiver's checksums of what arrived. When the step
closes, ``close`` exchanges every sender's checksums in one small all-reduce per process
group (sum: each rank adds its own into the slots only it fills, or into the shared slots of
a reduction) and every rank checks what it received:

- all-reduce: the sum of the result's segment checksums must equal the senders' within the
  reduction's rigorous rounding bound (``core.collective.reduction_bound``);
- reduce-scatter: likewise for this rank's chunk, against the senders' chunk checksums;
- all-gather: every shard's bits must match its sender's exactly.

The checksums are one call each of the native kernel where it covers the tensor (CPU,
fp32 / bf16 sums, any dtype's bits: ``backends/native.collective_sums_into`` and
``collective_bits_into``), else torch's (``core/collective.py``); the verdicts are one
vectorised pass per kind of collective (``suspects``), ``verdict`` judging a record alone
only where that pass finds a mismatch. Why: the checks' cost was their fixed cost per
collective (dozens of small torch operations, some on the backend's thread, where each
gives the GIL back), not their arithmetic (issue 35; docs/PERFORMANCE.md, "Collectives").

**One collective per step** (``close``'s ``flags``; ``GuardedStep.run``): on the first run
of a step driven by ``optimizer_step``, the exchange of the group that spans the whole
world (the default group under DDP or FSDP2 on one mesh dimension) also carries, in
per-rank slots, each rank's step flags (a GEMM or an earlier group's collective flagged;
its gradient screen tripped) and its receiver's checksums of every record. After the one
all-reduce every rank holds the same numbers and judges every rank's receipts with the
same functions (``verdicts.py``: ``judge_all``, per record and receiving rank), so every rank
learns who flagged without the separate all-gather of ``respond/distributed.step_flags``
(``CollectiveResult.agreed``). Each rank still reports only its own detections, judged
from the exchange's copy of its receipts, the numbers the others judge. Where no such
group checked a collective, the exchange failed or its header does not add up (facts
every rank sees alike, the header being a sum), or the receipts would make the exchange
large (``MERGE_LIMIT``), ``agreed`` is None on every rank and the flags take their own
collective, as before. Why: the second collective cost a round trip and a wait for the
slowest rank every step (issue 35; benchmarks/collectives_xeon-2vcpu-shared_2026-12-07.md).

A mismatch is a ``Detection`` of kind ``"collective"``: the op, the step, the sending and
receiving ranks, the bucket or module. It goes to the responder like a GEMM's (re-execution
first). The exchange's header (one per rank, the step, the number of records and a digest
of their layout, all summed) must add up: an exchange that arrives zeroed or stale is a
detection too, never a silent pass.

Every rank of a group must check the same collectives, or the exchange would wait for a rank
that never joins it: the guard checks collectives only on the steps it intercepts, and only
with a sampler that watches the same steps on every rank (``sampler_base.sampler_shared``).
A failure of the checking itself (a bug, a broken group) warns once and leaves the
collectives unchecked; it never stops training.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from ...core.torch_private import DisableTorchFunction, disable_current_modes

from ...backends.native import collective_bits_into, collective_sums_into
from ...core.collective import (
    bit_checksums, exchange_layout_digest, host, pairs_bits, segment_sums, segments,
)
from ..dispatch.collective_ops import OPS, Collective, Pending, describe, is_wait, run_then
from .fsdp_groups import fsdp_module
from .verdicts import Record, judge_all, receipt_slots, suspects, verdict
from ..dispatch.intercept import SiteTracker
from ..compiled.module_names import ModuleNames
from ...report import Detection, StepReport
from ..sampling.sampler_base import sampler_shared
from ...respond.distributed import is_distributed

#: record kinds, in the exchange's digest
_KIND = {op: i for i, op in enumerate(OPS)}
#: how long ``close`` waits for a result that has not landed yet before giving up on it
LANDING_TIMEOUT = 300.0
#: the most fp64 numbers the step's flags and every rank's receipts may add to the world's
#: exchange (they grow with the world's size times the checksums): beyond, the exchange
#: carries the senders' checksums alone and the flags take their own small collective
MERGE_LIMIT = 1 << 16


@dataclass
class CollectiveResult:
    """What the step's collective checks found."""

    detections: list[Detection] = field(default_factory=list)
    checks: int = 0  #: collectives checked
    by_op: dict[str, int] = field(default_factory=dict)  #: collectives checked, by op
    unchecked: dict[str, int] = field(default_factory=dict)  #: by ``op[reason]``
    seconds: float = 0.0  #: the checks' time: checksums, the exchange, the verdicts
    exchange_seconds: float = 0.0  #: the part the exchange's all-reduces took
    exchanged: int = 0  #: fp64 numbers this rank sent in them
    #: the step's flagged and tripped global ranks, identical on every rank, when the
    #: world's exchange carried the flags (``close``'s ``flags``); else None (every rank alike)
    agreed: tuple[list[int], list[int]] | None = None

    def into(self, report: StepReport) -> None:
        """Add what the checks found to the step's report (a detection flags the step)."""
        report.detections.extend(self.detections)
        report.flagged += len(self.detections)
        report.collective_checks = self.checks
        report.collective_checks_by_op = dict(self.by_op)
        report.collectives_unchecked = dict(self.unchecked)
        report.collective_seconds = self.seconds
        report.collective_exchange_seconds = self.exchange_seconds


class CollectiveChecks:
    """The collective checks of one guard: records per step, the exchange, the verdicts.

    ``sites`` (the guard's site tracker) names the module running when a collective is
    issued, ``names`` (its ``ModuleNames``) an FSDP2 group's module; ``warn(key, message)``
    warns once (the guard's)."""

    def __init__(self, sites: SiteTracker, names: ModuleNames, warn: Callable[[str, str], None]) -> None:
        self._sites = sites
        self._names = names
        self._warn = warn
        self._buckets = 0
        self.enabled = False
        self.last_exchanged = 0  #: fp64 numbers the last closed step exchanged (``sdc-guard bench collectives``)
        self._records: list[Record] = []
        self._unchecked: dict[str, int] = {}
        self._seconds = 0.0
        self._pending = Pending()

    # --- during the step ---------------------------------------------------------------

    def begin(self, *, requested: bool, compiled: bool, sampler: Any) -> None:
        """A step opens: drop what the last one left; check its collectives if
        ``requested`` (``protect(collectives=True)`` and a watched step) and a process group
        exists, on the dispatch route, under a sampler that watches the same steps on
        every rank (else warn once why not)."""
        enabled = requested and is_distributed()
        if enabled and (compiled or not sampler_shared(sampler)):
            why = ("on the compiled route (protect(compiled=True) or a compiled model): compiled graphs run "
                   "without the dispatch mode that sees the collectives" if compiled else
                   f"under {type(sampler).__name__}, whose watched steps differ from rank to rank (the checks "
                   "exchange checksums in a collective every rank must join); use a sampler that watches the same "
                   "steps on every rank (Full, EveryN, Rotating) or set its shared_schedule = True")
            self._warn("collectives:off", f"sdc_guard: the collectives are not checked {why} "
                       "(docs/DISTRIBUTED.md, 'Collectives')")
            enabled = False
        self.enabled = enabled
        self._records = []
        self._unchecked = {}
        self._seconds = 0.0
        self._buckets = 0
        self._pending.clear()

    def _label(self, call: Collective, phase: str) -> tuple[str, bool]:
        """The bucket or module of a collective, and whether FSDP2 issued it (it waits on
        its works and never asks for their futures: ``run_then``'s ``waited``): an FSDP2
        group's module, by its path (the model's class name for the model itself), else a
        DDP bucket (an all-reduce its reducer runs during the backward: ``"bucket k"``, in
        launch order), else the module running (``SiteTracker.site``: ``"global"`` outside
        every module)."""
        module = fsdp_module()
        if module is not None:
            path = self._names.of_module_id(id(module))
            return (type(self._names.model).__name__ if not path else path) if path is not None else "global", True
        if call.op == "all_reduce" and phase == "backward" and not call.functional:
            self._buckets += 1
            return f"bucket {self._buckets - 1}", False
        assert call.send is not None
        return self._sites.site(call.send, ()), False

    def run(self, func: Any, args: tuple, kwargs: dict, *, phase: str, call_index: int) -> Any:
        """Run one collective op of the step, checked where it can be."""
        if not self.enabled:
            return func(*args, **kwargs)
        if is_wait(func):  # functional results are waited for when they are issued (run_then)
            return func(*args, **kwargs)
        started = time.perf_counter()
        record = None
        try:
            # the checks' own tensor operations pass no function mode (the guard's
            # GemmFunctionMode would run Python for each; they are not the model's)
            with DisableTorchFunction():
                call = describe(func, args, kwargs)
                if call is not None and call.unchecked is not None:
                    key = f"{call.op}[{call.unchecked}]"
                    self._unchecked[key] = self._unchecked.get(key, 0) + 1
                elif call is not None:
                    record = self._record(call, phase, call_index)
        except Exception as exc:  # monitoring never breaks the op
            self._warn(f"collective:{type(exc).__name__}", f"sdc_guard: could not check a collective "
                       f"({type(exc).__name__}: {exc}); it runs unchecked")
            record = None
        self._seconds += time.perf_counter() - started
        if record is None:
            return func(*args, **kwargs)
        self._records.append(record)
        # the record keeps the call without its tensors: the sender's checksums are taken and
        # the result reaches ``_landed`` as an argument, so that neither buffer outlives the
        # caller's use of it (held to the step's close, every layer's FSDP2 all-gather output
        # and reduce-scatter input, its unsharded parameters and gradients, were alive at once)
        record.call = Collective(call.op, None, None, call.group, call.scale, call.functional, call.unchecked)
        try:
            return run_then(func, args, kwargs, call, lambda result: self._landed(record, result), self._pending,
                            waited=record.waited)
        except BaseException:  # the collective itself failed: nothing to check
            self._records.remove(record)
            raise

    def _record(self, call: Collective, phase: str, call_index: int) -> Record:
        """The sender's checksums of a collective about to run. Their size in the exchange
        is fixed by the collective's shape alone, so that a rank whose checksums fail (a
        monitoring failure) still sends as many numbers as the others (NaN: unverifiable)."""
        assert call.send is not None
        op, g, me, send = call.op, call.group_size, call.group_rank, call.send
        sent_numel, device = send.numel(), send.device
        if op == "all_gather":
            numel, slots = sent_numel * g, 2 * g
        else:
            numel = sent_numel // g if op == "reduce_scatter" else sent_numel
            slots = 3 * segments(numel) * (g if op == "reduce_scatter" else 1)
        label, waited = self._label(call, phase)
        record = Record(call, label, phase, call_index, slots, numel, send.dtype,
                        wide=pairs_bits(send.dtype, sent_numel), waited=waited, device=device)
        try:
            # one native call where it covers the tensor (backends/native.py), else torch
            native = device.type == "cpu"
            if op != "all_gather":
                # all-reduce: [sums (segments x 2), magnitudes (segments)]; reduce-scatter:
                # [sums (g x segments x 2), magnitudes (g x segments)]
                rows = g if op == "reduce_scatter" else 1
                sent = torch.empty(slots, dtype=torch.float64) if native else None
                if sent is None or not collective_sums_into(send, sent, with_abs=True, rows=rows):
                    sums, absolute = segment_sums(send, with_abs=True, rows=rows)
                    sent = torch.cat([sums.reshape(-1), absolute.reshape(-1)])
                if native:
                    record.landing = torch.empty((segments(numel), 2), dtype=torch.float64)
            else:  # [g x 2], flat: this rank's shard in its own row, zeros elsewhere
                sent = torch.zeros(slots, dtype=torch.float64, device=device)
                mine = sent[2 * me: 2 * me + 2]
                if not (native and collective_bits_into(send, record.wide, mine)):
                    mine.copy_(bit_checksums(send, record.wide)[0].to(torch.float64))
                if native:
                    record.landing = torch.empty((g, 2), dtype=torch.float64)
            assert sent.numel() == slots, (call.op, sent.numel(), slots)
            record.sent = sent
        except Exception as exc:  # monitoring never breaks the op: this rank sends NaN
            record.failed = f"{type(exc).__name__}: {exc}"
        return record

    def _landed(self, record: Record, result: Tensor) -> None:
        """The receiver's checksums, once the result is there (on the backend's thread for
        ``c10d`` ops). Never raises: a failure leaves the record unchecked."""
        started = time.perf_counter()
        try:
            landing, op = record.landing, record.call.op
            # the native kernel: one call, no torch op, the GIL kept (csrc/coll_sums.c)
            with DisableTorchFunction():
                native = landing is not None and (
                    collective_bits_into(result, record.wide, landing, landing.shape[0]) if op == "all_gather"
                    else collective_sums_into(result, landing, with_abs=False))
            if native:
                record.received = landing
            else:
                with disable_current_modes(), DisableTorchFunction():
                    flat = result.reshape(-1)
                    if op == "all_gather":
                        record.received = bit_checksums(flat, record.wide, rows=record.call.group_size)
                    else:
                        record.received = segment_sums(flat, with_abs=False)[0]
        except Exception as exc:
            record.failed = f"{type(exc).__name__}: {exc}"
        finally:
            record.seconds = time.perf_counter() - started
            record.landed.set()

    # --- when the step closes ------------------------------------------------------------

    def abandon(self) -> None:
        """The step's closure raised: its collectives are not exchanged (a rank that
        raised alone would otherwise wait in the exchange for ranks that never come)."""
        self._records = []
        self._unchecked = {}
        self._pending.clear()
        self.enabled = False

    @property
    def pending(self) -> bool:
        """Whether the open step has collectives to check (or counted unchecked)."""
        return bool(self._records or self._unchecked)

    def close(self, step: int, rank: int, flags: tuple[bool, bool] | None = None) -> CollectiveResult:
        """Exchange the senders' checksums (one all-reduce per process group, in the order
        of the groups' names, so that no two ranks wait on each other) and check what this
        rank received. Every rank of a group calls it at the same step with the same records.

        ``flags``: this rank's (GEMM flagged, gradient screen tripped), to be agreed across
        ranks: the exchange of the group spanning the world (``_carrier``), run last,
        carries them with every rank's receipts, and ``agreed`` says who flagged (this
        rank's flag includes its detections in the groups exchanged before)."""
        started = time.perf_counter()
        result = CollectiveResult(unchecked=dict(self._unchecked))
        records, self._records = self._records, []
        self._unchecked = {}
        self.enabled = False  # a collective after the step closed (the responder's) is not the step's
        if records:
            with disable_current_modes(), DisableTorchFunction():
                self._finish(records)
                by_group: dict[str, list[Record]] = {}
                for r in records:
                    by_group.setdefault(r.call.group.group_name, []).append(r)
                carrier = _carrier(by_group) if flags is not None else None
                # the carrier last (every rank picks the same one): its flags then include
                # the detections of every other group
                for name in sorted(by_group, key=lambda n: (n == carrier, n)):
                    mine = None
                    if name == carrier:
                        assert flags is not None
                        mine = (flags[0] or bool(result.detections), flags[1])
                    self._exchange(by_group[name], step, rank, result, mine)
        result.seconds = self._seconds + sum(r.seconds for r in records) + time.perf_counter() - started
        self.last_exchanged = result.exchanged
        self._seconds = 0.0
        return result

    def _finish(self, records: list[Record]) -> None:
        """Every result landed: functional ones waited for, the others awaited."""
        try:
            self._pending.flush()
        except Exception as exc:
            self._warn(f"collective-wait:{type(exc).__name__}", f"sdc_guard: could not wait for a collective's "
                       f"result ({type(exc).__name__}: {exc}); it goes unchecked")
        for r in records:
            if not r.landed.wait(LANDING_TIMEOUT):
                r.failed = f"its result did not land within {LANDING_TIMEOUT:.0f} s"

    def _exchange(self, records: list[Record], step: int, rank: int, result: CollectiveResult,
                  flags: tuple[bool, bool] | None = None) -> None:
        """One group's exchange and this rank's verdicts; with ``flags`` (the carrier's),
        every rank's flags and receipts too, and ``result.agreed``."""
        group = records[0].call.group
        size = group.size()
        device = records[0].device
        layout = [(_KIND[r.call.op], r.slots) for r in records]
        carried = _carried(records, group.rank(), flags) if flags is not None else None
        if carried is not None:  # a layout of its own: ranks that disagree on merging see it
            layout.append((len(_KIND), carried.size))
        digest = exchange_layout_digest(layout)
        began = time.perf_counter()
        try:
            exchanged = _gathered(records, [1.0, float(step), float(len(records)), digest], carried, device)
            dist.all_reduce(exchanged, group=group)
            values = exchanged.cpu().numpy()
            result.exchange_seconds += time.perf_counter() - began
            result.exchanged += exchanged.numel()
        except Exception as exc:  # a broken group: the step's collectives go unchecked
            self._warn(f"collective-exchange:{type(exc).__name__}", f"sdc_guard: the collectives' checksum "
                       f"exchange failed ({type(exc).__name__}: {exc}); they go unchecked")
            for r in records:
                key = f"{r.call.op}[exchange]"
                result.unchecked[key] = result.unchecked.get(key, 0) + 1
            return
        expected = [float(size), float(size * step), float(size * len(records)), size * digest]
        if values[:4].tolist() != expected:
            senders = sorted(dist.get_process_group_ranks(group))
            result.detections.append(Detection(
                step, f"checksum exchange ({group.group_name})", "exchange", records[0].phase, [], [],
                math.inf, (len(values),), "float64", records[0].call_index, rank, "collective", senders, rank))
            result.checks += len(records)
            for r in records:
                result.by_op[r.call.op] = result.by_op.get(r.call.op, 0) + 1
            return
        offset = 4
        ranks = dist.get_process_group_ranks(group)
        checked: list[tuple[Record, np.ndarray]] = []
        blocks: list[np.ndarray] = []
        for r in records:
            block = values[offset: offset + r.slots]
            offset += r.slots
            blocks.append(block)
            if r.failed is not None or r.received is None:
                key = f"{r.call.op}[failed]"
                result.unchecked[key] = result.unchecked.get(key, 0) + 1
                if r.failed is not None:
                    self._warn(f"collective-failed:{r.failed[:40]}", f"sdc_guard: could not check a "
                               f"{r.call.op} ({r.failed}); it goes unchecked")
                continue
            result.checks += 1
            result.by_op[r.call.op] = result.by_op.get(r.call.op, 0) + 1
            checked.append((r, block))
        if carried is not None:
            try:  # the same numbers and code on every rank: a failure here fails everywhere alike
                mine, result.agreed = judge_all(records, blocks, values[offset:], step, ranks, group.rank())
                result.detections.extend(mine)
            except Exception as exc:  # monitoring never stops training: the flags take their collective
                result.agreed = None
                self._warn(f"collective-verdict:{type(exc).__name__}", f"sdc_guard: could not judge the "
                           f"collectives' checksums ({type(exc).__name__}: {exc}); they go unchecked")
                for r, _ in checked:
                    key = f"{r.call.op}[verdict]"
                    result.unchecked[key] = result.unchecked.get(key, 0) + 1
            return
        try:  # this rank's own verdicts (its flags then take their collective, as every rank's)
            for r, block in suspects(checked):
                detection = verdict(r, block, step, rank, ranks)
                if detection is not None:
                    result.detections.append(detection)
        except Exception as exc:  # monitoring never stops training
            self._warn(f"collective-verdict:{type(exc).__name__}", f"sdc_guard: could not judge the "
                       f"collectives' checksums ({type(exc).__name__}: {exc}); they go unchecked")
            for r, _ in checked:
                key = f"{r.call.op}[verdict]"
                result.unchecked[key] = result.unchecked.get(key, 0) + 1


def _carrier(by_group: dict[str, list[Record]]) -> str | None:
    """The group whose exchange carries the step's flags: the first by name of those that
    span the whole world (every rank exchanges in it, so every rank learns every flag),
    unless every rank's receipts would make it larger than ``MERGE_LIMIT``. Every rank
    picks the same one: it depends on the records' layout and the world's size alone."""
    world = dist.get_world_size()
    for name in sorted(by_group):
        records = by_group[name]
        if records[0].call.group.size() == world:
            size = 2 * world + world * sum(1 + receipt_slots(r) for r in records)
            return name if size <= MERGE_LIMIT else None
    return None


def _gathered(records: list[Record], header: list[float], carried: np.ndarray | None,
              device: torch.device) -> Tensor:
    """The exchange as this rank sends it, on ``device``: the header, what this rank sent
    for each record (NaN where its checksums failed: the others need its part even then),
    then ``carried``. Put together in numpy on the host (one concatenation, not a tensor
    per part)."""
    parts = [np.array(header)] + [host(r.sent) if r.sent is not None else np.full(r.slots, math.nan)
                                  for r in records]
    if carried is not None:
        parts.append(carried)
    return torch.from_numpy(np.concatenate(parts)).to(device)


def _carried(records: list[Record], me: int, flags: tuple[bool, bool]) -> np.ndarray:
    """This rank's part of what the carrier's exchange carries beyond the senders'
    checksums, zeros in every other rank's slots: [g x 2] step flags, then per record
    [g x (1 + receipt)] (1 and this rank's receiver checksums where it has them, else 0)."""
    g = records[0].call.group_size
    carried = np.zeros(2 * g + g * sum(1 + receipt_slots(r) for r in records))
    carried[2 * me], carried[2 * me + 1] = float(flags[0]), float(flags[1])
    offset = 2 * g
    for r in records:
        n = receipt_slots(r)
        received = r.received if r.failed is None else None
        start = offset + me * (1 + n)
        offset += g * (1 + n)
        try:  # never raises: every rank must join the exchange with a part of this size
            if received is not None and received.numel() == n:
                carried[start + 1: start + 1 + n] = host(received).reshape(-1)
                carried[start] = 1.0
        except Exception:  # left invalid (0): unjudged, as this rank leaves it unchecked
            carried[start: start + 1 + n] = 0.0
    return carried
