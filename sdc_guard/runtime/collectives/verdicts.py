"""The verdicts on a step's collectives: what each receiver got against what its senders sent.

``CollectiveChecks`` (``collective_checks.py``) takes the checksums and exchanges them;
this module judges them, from the exchange's numbers alone: ``verdict`` one record (one
receipt), ``suspects`` the records one vectorised pass per kind of collective cannot clear
(the only ones ``verdict`` then judges alone), ``judge_all`` every rank's receipt of every
record where the world's exchange carries them (every rank computes the same verdicts,
so every rank learns who flagged: docs/DISTRIBUTED.md, "One collective per step").

Why a module of its own: the verdicts are the checks' arithmetic (the reduction's rigorous
bound, ``core/collective.reduction_flags``; the all-gather's exact bit sums), read and
tested apart from the records' life on the training and backend threads.

Everything here is host arithmetic in numpy on a few fp64 numbers per segment or shard
(``core/collective.reduction_flags`` says why not torch); the exchange's numbers and the
receivers' checksums are read as numpy arrays (``host``), CPU tensors without a copy.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...core.collective import ArrayLike, host, reduction_clear, reduction_flags, segment_sizes, segments
from ...report import Detection
from ..dispatch.collective_ops import Collective

#: a record's checked receipt, as ``suspect_receipts`` and ``verdict`` judge it: the record, its
#: block of the exchange, the receiver's checksums (fp64, host) and the receiver's rank in the group
Receipt = tuple["Record", np.ndarray, np.ndarray, int]


@dataclass
class Record:
    """One checked collective of the step."""

    call: Collective
    label: str  #: the bucket or module
    phase: str
    call_index: int  #: GEMMs seen before it (``Detection.call_index``)
    slots: int  #: numbers this record adds to the exchange
    numel: int  #: elements of this rank's result
    dtype: torch.dtype
    wide: bool = True  #: all-gather: shards read as 32-bit words
    waited: bool = False  #: its caller waits on the work (FSDP2): checked in the waiting thread
    #: where the sender's tensor was (the exchange goes there): ``call`` keeps no tensor once
    #: the collective is under way (``CollectiveChecks.run``)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sent: Tensor | None = None  #: fp64 [slots]: this rank's part of the exchange
    received: Tensor | None = None  #: this rank's checksums of its result
    #: fp64, where the native kernel writes the receiver's checksums (allocated with the
    #: record, on the training thread, so that the backend's thread runs no torch op)
    landing: Tensor | None = None
    failed: str | None = None
    seconds: float = 0.0  #: the receiver's checksums (on the backend's thread)
    landed: "Latch" = field(default_factory=lambda: Latch())


class Latch:
    """Set once, when a record's result has landed (on the backend's thread, or the
    waiting one); ``wait`` blocks until then. What ``threading.Event`` does for this one
    use, for a tenth of its cost to make (a lock taken at creation, not a condition):
    a step makes one per checked collective."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it was set, within ``timeout`` seconds (``None``: for as long as it takes)."""
        if self._set:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return self._set
        self._lock.release()
        return True


def receipt_slots(r: Record) -> int:
    """Numbers of a receiver's checksums of ``r``: two per shard of an all-gather, two per
    segment of a reduction's result (a reduce-scatter's: this rank's chunk)."""
    return 2 * (r.call.group_size if r.call.op == "all_gather" else segments(r.numel))


def judge_all(records: list[Record], blocks: list[ArrayLike], carried: ArrayLike, step: int, ranks: list[int],
              me: int) -> tuple[list[Detection], tuple[list[int], list[int]]]:
    """The carrier's verdicts: every rank's receipt of every record, judged from the
    exchange alone (the same numbers on every rank, so the same verdicts). Returns this
    rank's own detections (group rank ``me``) and the step's flagged and tripped global
    ranks, identical on every rank (``CollectiveResult.agreed``). A receipt its rank
    could not take (its slot's first number 0) is not judged, as that rank leaves
    it unchecked; nothing local to this rank (its own failures) decides the others'."""
    g = len(ranks)
    carried = host(carried)
    step_flags = (carried[: 2 * g].reshape(g, 2) > 0.5).tolist()  # one read, not one per rank
    flagged = {ranks[k] for k in range(g) if step_flags[k][0]}
    tripped = sorted(ranks[k] for k in range(g) if step_flags[k][1])
    if _all_clear(records, blocks, carried, g):  # nearly every step: nothing to judge alone
        return [], (sorted(flagged), tripped)
    offset, receipts, mine = 2 * g, [], []
    for r, block in zip(records, blocks):
        width = 1 + receipt_slots(r)
        rows = carried[offset: offset + g * width].reshape(g, width)
        offset += g * width
        block = host(block)
        receipts.extend((r, block, rows[k, 1:], k) for k in np.flatnonzero(rows[:, 0] > 0.5).tolist())
    for r, block, received, k in suspect_receipts(receipts):
        detection = verdict(r, block, step, ranks[k], ranks, received=received, me=k)
        if detection is not None:
            flagged.add(ranks[k])
            if k == me:
                mine.append(detection)
    return mine, (sorted(flagged), tripped)


@dataclass(frozen=True)
class _Plan:
    """Where a layout of records puts each number ``judge_all`` compares, as indices into
    the senders' blocks end to end (``sent``) and into the carried part (``carried``):
    every receipt's validity slot, the all-gathers' shard sums as sent and as received,
    and per kind of reduction (dtype, group size, scale) the receivers' segment sums,
    the senders' and their magnitudes, with the segments' sizes."""

    valid: np.ndarray
    gather_sent: np.ndarray
    gather_received: np.ndarray
    reductions: tuple[tuple[tuple[Any, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]


@functools.lru_cache(maxsize=64)
def _plan(layout: tuple[tuple[str, int, int, Any, int], ...], g: int) -> _Plan:
    """The ``_Plan`` of records ``(op, numel, slots, dtype, scale)`` exchanged in a group of
    ``g``: a step's layout comes back every step, so it is worked out once."""
    valid, gather_sent, gather_received = [], [], []
    reductions: dict[tuple[Any, ...], tuple[list, list, list, list]] = {}
    block, offset = 0, 2 * g
    for op, numel, slots, dtype, scale in layout:
        n = 2 * g if op == "all_gather" else 2 * segments(numel)
        width = 1 + n
        for k in range(g):
            row = offset + k * width
            valid.append(row)
            received = np.arange(row + 1, row + 1 + n)
            if op == "all_gather":
                gather_sent.append(np.arange(block, block + n))
                gather_received.append(received)
                continue
            nseg = n // 2
            if op == "all_reduce":
                sums, magnitudes = block, block + 2 * nseg
            else:
                sums, magnitudes = block + 2 * nseg * k, block + 2 * g * nseg + nseg * k
            kind = reductions.setdefault((dtype, g, scale), ([], [], [], []))
            kind[0].append(received)
            kind[1].append(np.arange(sums, sums + 2 * nseg))
            kind[2].append(np.arange(magnitudes, magnitudes + nseg))
            kind[3].append(segment_sizes(numel))
        offset += g * width
        block += slots
    return _Plan(np.array(valid, dtype=np.int64), _joined(gather_sent), _joined(gather_received),
                 tuple((key, _joined(r), _joined(e), _joined(m), np.concatenate(z))
                       for key, (r, e, m, z) in reductions.items()))


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _all_clear(records: list[Record], blocks: list[ArrayLike], carried: np.ndarray, g: int) -> bool:
    """Whether every receipt of the carrier's exchange passes, every rank having taken
    its own: ``judge_all``'s comparisons in one pass over the whole exchange (``_plan``).
    ``False`` sends the step to the record-by-record path, which judges what this pass
    cannot clear (a mismatch, a receipt a rank could not take, numbers that do not line
    up). Why: that path is a few dozen numpy operations per record and receiver, each
    costing its call rather than its arithmetic; this is a few per step (issue 35)."""
    try:
        layout = tuple((r.call.op, r.numel, r.slots, r.dtype, r.call.scale) for r in records)
        sent = np.concatenate([host(b).reshape(-1) for b in blocks]) if blocks else np.zeros(0)
        expected_size = 2 * g + g * sum(1 + receipt_slots(r) for r in records)
        if sent.size != sum(r.slots for r in records) or carried.size != expected_size:
            return False
        return _passes(_plan(layout, g), sent, carried)
    except (ValueError, IndexError, TypeError):  # numbers of another shape: judged one by one
        return False


def _passes(plan: _Plan, sent: np.ndarray, carried: np.ndarray) -> bool:
    if not bool((carried[plan.valid] > 0.5).all()):
        return False
    if plan.gather_sent.size:
        expected = sent[plan.gather_sent]
        if bool(((carried[plan.gather_received] != expected) & np.isfinite(expected)).any()):
            return False
    for (dtype, size, scale), received, sums, magnitudes, sizes in plan.reductions:
        if not reduction_clear(carried[received].reshape(-1, 2), sent[sums].reshape(-1, 2), sent[magnitudes],
                               sizes, dtype, size, scale):
            return False
    return True


def suspects(checked: list[tuple[Record, ArrayLike]]) -> list[tuple[Record, ArrayLike]]:
    """The checked records (each with its block of the exchange) that one vectorised pass
    cannot clear, in their order: those of every kind of collective (the all-gathers; the
    reductions of one dtype, group size and scale) where any segment or shard mismatches,
    or whose checksums do not line up. ``verdict`` then judges each of them
    alone; its verdict on a record the pass cleared would be None, since the pass computes
    the same comparisons, segment by segment, only on the records' rows put end to end.

    Why: the verdicts are a dozen array operations each, and a step checks many
    collectives (FSDP2: two per parameter group and step, plus the backward's
    all-gathers); one pass per kind costs what one record did."""
    receipts = [(r, host(block), host(r.received), r.call.group_rank) for r, block in checked]
    kept = {id(x) for x in suspect_receipts(receipts)}
    return [pair for pair, x in zip(checked, receipts) if id(x) in kept]


def suspect_receipts(receipts: list[Receipt]) -> list[Receipt]:
    """``suspects`` on receipts (``Receipt``): any receiver's, not only this rank's."""
    kinds: dict[tuple[Any, ...], list[Receipt]] = {}
    for x in receipts:
        r = x[0]
        call = r.call
        key = ("all_gather",) if call.op == "all_gather" else (r.dtype, call.group_size, call.scale)
        kinds.setdefault(key, []).append(x)
    flagged: set[int] = set()
    for key, members in kinds.items():
        try:
            clear = _clear(key, members)
        except Exception:  # checksums that do not line up, say: each record judged alone
            clear = False
        if not clear:
            flagged.update(id(x) for x in members)
    return [x for x in receipts if id(x) in flagged]


def _clear(key: tuple[Any, ...], members: list[Receipt]) -> bool:
    """Whether every receipt of one kind passes (``suspects``): ``verdict``'s comparisons
    on all their rows at once (for reductions, ``reduction_clear``: what a clean step needs
    of them; a receipt it does not clear goes to ``verdict``). A receipt whose checksums have not the rows its block
    expects is never cleared here (its rows would shift its neighbours')."""
    rows = [r.call.group_size if r.call.op == "all_gather" else segments(r.numel) for r, _, _, _ in members]
    if any(received.size != 2 * n for (_, _, received, _), n in zip(members, rows)):
        return False
    received = np.concatenate([received.reshape(-1) for _, _, received, _ in members]).reshape(-1, 2)
    if key[0] == "all_gather":
        sent = np.concatenate([block for _, block, _, _ in members]).reshape(-1, 2)
        return not bool(((received != sent) & np.isfinite(sent)).any())
    dtype, g, scale = key
    expected, magnitudes = [], []
    for r, block, _, me in members:
        nseg = segments(r.numel)
        if r.call.op == "all_reduce":
            expected.append(block[: 2 * nseg])
            magnitudes.append(block[2 * nseg:])
        else:
            expected.append(block[2 * nseg * me: 2 * nseg * (me + 1)])
            magnitudes.append(block[2 * g * nseg + nseg * me: 2 * g * nseg + nseg * (me + 1)])
    return reduction_clear(received, np.concatenate(expected).reshape(-1, 2), np.concatenate(magnitudes),
                           _sizes(tuple(r.numel for r, _, _, _ in members)), dtype, g, scale)


@functools.lru_cache(maxsize=256)
def _sizes(numels: tuple[int, ...]) -> np.ndarray:
    """Elements per segment of collectives of ``numels`` elements, end to end (fp64; read
    only): the same layouts come back every step."""
    sizes = np.concatenate([segment_sizes(n) for n in numels])
    sizes.setflags(write=False)
    return sizes


def verdict(r: Record, block: ArrayLike, step: int, rank: int, ranks: list[int], *,
            received: ArrayLike | None = None, me: int | None = None) -> Detection | None:
    """This rank's verdict on one collective: a detection, or None when what it received
    is what was sent. ``ranks``: the group's global ranks, by group rank. ``received`` and
    ``me``: another receipt's checksums and its receiver's group rank (``rank`` then the
    receiver's global rank), instead of this rank's own."""
    call = r.call
    g = call.group_size
    me = call.group_rank if me is None else me
    received = host(r.received if received is None else received).reshape(-1, 2)
    block = host(block)
    if call.op == "all_gather":
        sent = block.reshape(g, 2)
        # a sender whose checksums failed sent NaN: its shard is unverifiable, not corrupt
        shards = np.flatnonzero(((received != sent) & np.isfinite(sent)).any(1)).tolist()
        if not shards:
            return None
        return Detection(step, r.label, call.op, r.phase, [], shards, math.inf, (r.numel,),
                         str(r.dtype).removeprefix("torch."), r.call_index, rank, "collective",
                         [ranks[j] for j in shards], rank)
    nseg = segments(r.numel)
    if call.op == "all_reduce":
        expected, magnitudes = block[: 2 * nseg].reshape(nseg, 2), block[2 * nseg:]
    else:
        expected = block[: 2 * g * nseg].reshape(g, nseg, 2)[me]
        magnitudes = block[2 * g * nseg:].reshape(g, nseg)[me]
    corrupt, _, ratio = reduction_flags(received, expected, magnitudes, segment_sizes(r.numel), r.dtype, g, call.scale)
    flagged = np.flatnonzero(corrupt).tolist()
    if not flagged:
        return None
    worst = float(ratio[corrupt].max()) if bool(np.isfinite(ratio[corrupt]).all()) else math.inf
    return Detection(step, r.label, call.op, r.phase, [], flagged, worst, (r.numel,),
                     str(r.dtype).removeprefix("torch."), r.call_index, rank, "collective", sorted(ranks), rank)
