"""What an intercepted collective is, and how to learn when its result has landed.

The dispatch modes of sdc_guard (``ops.Route.COLLECTIVE``) see the collectives as aten
ops: ``c10d`` ops for ``torch.distributed``'s own calls (DDP's gradient buckets, which its
reducer all-reduces through the process group whatever comm hook runs them; a plain
``dist.all_reduce``; FSDP2's ``all_gather_single`` and ``reduce_scatter_single``) and
``_c10d_functional`` ops for the functional collectives DTensor runs (tensor parallelism).
``describe`` turns one call into a :class:`Collective`: which tensor this rank sends,
where its result lands, the process group, and whether it is a sum or an average.

A collective's result is written asynchronously: after the op returns, by the backend's
own thread (gloo) or stream (NCCL). ``run_then`` runs the op and calls ``done(result)``
once the result is there, before anyone waiting on the collective sees it:

- a ``c10d`` op's work is replaced by one whose future first runs ``done`` (DDP's reducer,
  FSDP2 and ``work.wait()`` get the result after it);
- a work without a future (gloo's reduce-scatter, whose result is copied out in
  ``wait()``) by one whose ``wait`` runs ``done`` after the original's;
- a functional op's result is waited for at once (DTensor waits later on its own
  wrapper, where no mode sees it; on a GPU the wait only orders the current stream after
  the collective), then ``done`` runs.

``Pending.flush`` waits, when the step closes, for whatever nobody waited for.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from ...core.torch_private import disable_current_modes

from ...core.collective import REDUCIBLE

#: ``ReduceOp.RedOpType`` values: sum and average are checked; the rest (max, min,
#: product, bitwise, a pre-multiplied sum) keep no linear checksum and pass unchecked
_SUM, _AVG = int(dist.ReduceOp.SUM), int(dist.ReduceOp.AVG)
#: the op names of checked collectives, as reports and metrics name them
OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass
class Collective:
    """One collective call, as this rank takes part in it."""

    op: str  #: one of ``OPS``, or the aten op's name when ``unchecked`` says why not
    send: Tensor | None  #: what this rank contributes (flat)
    recv: Tensor | None  #: where its result lands (flat; the same tensor for an in-place all-reduce)
    group: Any  #: the ``torch.distributed.ProcessGroup``
    scale: int = 1  #: the result is the sum over ``scale`` (an average: the group's size)
    functional: bool = False  #: a ``_c10d_functional`` op (DTensor's): ``run_then`` waits for it at once
    unchecked: str | None = None  #: why it is not checked (a reduce op, a dtype, a layout), else None

    @property
    def group_size(self) -> int:
        return self.group.size()

    @property
    def group_rank(self) -> int:
        return self.group.rank()


def _functional() -> Any:
    return getattr(torch.ops, "_c10d_functional", None)


def collective_packets() -> frozenset[Any]:
    """The op packets the modes route as collectives (``ops.Route.COLLECTIVE``): those
    ``describe`` knows, the ones it counts as unchecked, and ``wait_tensor``."""
    names = {"c10d": ("allreduce_", "_allgather_base_", "_reduce_scatter_base_", "allgather_", "reduce_scatter_",
                      "allreduce_coalesced_", "allgather_into_tensor_coalesced_",
                      "reduce_scatter_tensor_coalesced_", "alltoall_", "alltoall_base_", "broadcast_"),
             "_c10d_functional": ("all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
                                  "all_reduce_coalesced", "all_reduce_coalesced_", "all_gather_into_tensor_coalesced",
                                  "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_out",
                                  "reduce_scatter_tensor_out", "all_to_all_single", "broadcast", "broadcast_",
                                  "wait_tensor")}
    packets = []
    for namespace, ops in names.items():
        space = getattr(torch.ops, namespace, None)
        for name in ops:
            try:
                packets.append(getattr(space, name))
            except (AttributeError, RuntimeError):  # an op this build lacks
                continue
    return frozenset(packets)


def is_wait(func: Any) -> bool:
    """Whether ``func`` is ``_c10d_functional.wait_tensor`` (a functional result is ready)."""
    return _kinds().get(func.overloadpacket) == "wait_tensor"


def _reduce_kind(op: Any) -> int | None:
    """The ``RedOpType`` of a ``c10d`` op's ``ReduceOp`` argument (a script object), or of a
    functional op's name ("sum", "avg", ...)."""
    if isinstance(op, str):
        return {"sum": _SUM, "avg": _AVG}.get(op.lower(), -1)
    try:
        return int(op.op())
    except Exception:  # an object of another shape: not one we can check
        return None


def _group(value: Any) -> Any:
    """The ``ProcessGroup`` a ``c10d`` op's script object boxes, or a functional op's group
    name resolves to (``None`` when neither works)."""
    try:
        if isinstance(value, str):
            from ...core.torch_private import resolve_process_group
            return resolve_process_group(value)
        return dist.ProcessGroup.unbox(value)
    except Exception:  # monitoring never breaks the op: it goes unchecked
        return None


def _why_not(tensors: list[Tensor], kind: int | None) -> str | None:
    if kind is not None and kind not in (_SUM, _AVG):
        return "reduce op"
    for t in tensors:
        if t.dtype not in REDUCIBLE:
            return str(t.dtype).removeprefix("torch.")
        if not t.is_contiguous():
            return "layout"
    return None


def describe(func: Any, args: tuple, kwargs: dict) -> Collective | None:
    """The collective ``func(*args, **kwargs)`` is (``None``: ``wait_tensor`` or an op this
    function does not know). Reads no tensor's data."""
    packet = func.overloadpacket
    kind = _kinds().get(packet)
    try:
        if kind == "allreduce_":
            tensors, group, op = args[0], _group(args[1]), _reduce_kind(args[2])
            sparse = args[3] if len(args) > 3 else kwargs.get("sparse_indices")
            if len(tensors) != 1 or sparse is not None:
                return Collective(_name(packet), None, None, group, unchecked="tensor list")
            t = _flat(tensors[0])
            return _made("all_reduce", t, t, group, op, [tensors[0]])
        if kind == "_allgather_base_":
            out, inp, group = args[0], args[1], _group(args[2])
            return _made("all_gather", _flat(inp), _flat(out), group, None, [out, inp])
        if kind == "_reduce_scatter_base_":
            out, inp, group, op = args[0], args[1], _group(args[2]), _reduce_kind(args[3])
            return _made("reduce_scatter", _flat(inp), _flat(out), group, op, [out, inp])
        if kind == "all_reduce":
            inp = args[0]
            return _made("all_reduce", _flat(inp), None, _group(args[2]), _reduce_kind(args[1]), [inp], functional=True)
        if kind == "all_gather_into_tensor":
            return _made("all_gather", _flat(args[0]), None, _group(args[2]), None, [args[0]], functional=True)
        if kind == "reduce_scatter_tensor":
            return _made("reduce_scatter", _flat(args[0]), None, _group(args[3]), _reduce_kind(args[1]), [args[0]],
                         functional=True)
    except (IndexError, TypeError, AttributeError):  # a schema this build changed: unchecked
        return Collective(_name(packet), None, None, None, unchecked="schema")
    if kind == "wait_tensor":
        return None
    return Collective(_name(packet), None, None, None, unchecked="op")


def _name(packet: Any) -> str:
    return str(packet).split(".")[-1]


@functools.cache
def _kinds() -> dict[Any, str]:
    """The packets ``describe`` knows, by what it does with them (``wait_tensor``'s too):
    one dict lookup per collective instead of a chain of comparisons (the packets exist
    for the whole process, so they are looked up once)."""
    known = {"c10d": ("allreduce_", "_allgather_base_", "_reduce_scatter_base_"),
             "_c10d_functional": ("all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
                                  "wait_tensor")}
    kinds = {}
    for namespace, names in known.items():
        space = getattr(torch.ops, namespace, None)
        for name in names:
            try:
                kinds[getattr(space, name)] = "all_reduce" if name == "all_reduce_" else name
            except (AttributeError, RuntimeError):  # an op this build lacks
                continue
    return kinds


def _flat(t: Tensor) -> Tensor:
    # a flat tensor as it is: FSDP2's buffers are, and a reshape costs microseconds
    return t if t.dim() == 1 or not t.is_contiguous() else t.reshape(-1)


def _made(op: str, send: Tensor, recv: Tensor | None, group: Any, kind: int | None, tensors: list[Tensor],
          *, functional: bool = False) -> Collective:
    why = _why_not(tensors, kind) if group is not None else "group"
    if why is None and not _sizes_agree(op, send, recv, group.size()):
        why = "sizes"
    scale = group.size() if kind == _AVG and group is not None else 1
    return Collective(op, send, recv, group, scale, functional, why)


def _sizes_agree(op: str, send: Tensor, recv: Tensor | None, size: int) -> bool:
    """An all-gather's result is ``size`` shards of the input; a reduce-scatter's input is
    ``size`` chunks of the result (a functional op's result is not known yet)."""
    if op == "all_gather":
        return recv is None or recv.numel() == send.numel() * size
    if op == "reduce_scatter":
        return send.numel() % size == 0 and (recv is None or send.numel() == recv.numel() * size)
    return recv is None or recv.numel() == send.numel()


# --- when the result has landed ---------------------------------------------------------


def _unbox_work(value: Any) -> Any:
    try:
        return dist.Work.unbox(value)
    except Exception:
        return value if isinstance(value, dist.Work) else None


Done = Callable[[Tensor], None]


def run_then(func: Any, args: tuple, kwargs: dict, call: Collective, done: Done, pending: "Pending",
             *, waited: bool = False) -> Any:
    """Run the collective and call ``done(result)`` once its result has landed, before
    anyone who waits on it proceeds (``done`` must not raise; a failure of the collective
    itself still reaches its waiters).

    ``waited``: the caller is known to wait on the work (FSDP2, which never asks for its
    future): ``done`` then runs in the waiting thread, after the wait, instead of on the
    backend's thread through the future. Python code on the backend's thread contends
    for the GIL with the training thread's (each contention can cost a switch interval,
    milliseconds); a wait-driven work has no such callback, but its future completes only
    once it is waited for (at the latest when the step closes, ``Pending.flush``), so it is
    used only where nobody waits on the future."""
    out = func(*args, **kwargs)
    if call.functional:
        if isinstance(out, Tensor):
            # waited for now: what the caller waits on later is DTensor's wrapper, whose
            # wait no mode sees; on a GPU this only orders the current stream after it
            with disable_current_modes():
                _functional().wait_tensor(out)
            done(out)
        return out
    recv = call.recv
    assert recv is not None, "a c10d collective names its result tensor"
    boxed = out[-1] if isinstance(out, tuple) else out
    work = _unbox_work(boxed)
    if work is None:  # an op of another shape: done now, after the fact
        done(recv)
        return out
    once = _Once(lambda: done(recv))
    PythonCallbackWork, _create_work_from_future = _works()
    future = None
    if not waited and not isinstance(work, PythonCallbackWork):  # ours (a drill below): its future waits for wait()
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's reduce-scatter: no future, and its result lands in wait()
            future = None
    if future is None:
        answers: list[bool] = []
        # the finisher outlives the wait (``Pending`` keeps it to the step's close) but not
        # the work: once waited for, the work and the tensors it holds are let go
        held: list[Any] = [work]

        def wait(timeout: Any = None) -> bool:
            if answers:  # gloo copies the result out at every wait: once is enough
                return answers[0]
            inner = held[0]
            # PythonCallbackWork passes 0 for "no timeout"
            ok = inner.wait(timeout) if timeout is not None and timeout.total_seconds() > 0 else inner.wait()
            once()
            answers.append(ok)
            held[0] = None
            return ok

        pending.add_finisher(wait)
        wrapped = PythonCallbackWork(wait)
    else:
        # the step's close waits for the chained future only until its callback has run:
        # held longer, its value (the collective's result) would outlive the caller's use
        lock = threading.Lock()
        unfinished: list[Any] = []
        finished = [False]

        def then(fut: Any) -> Any:
            once()
            with lock:
                finished[0] = True
                unfinished.clear()
            return fut.value()  # the collective's own error, if any, reaches its waiters

        chained = future.then(then)
        with lock:
            if not finished[0]:
                unfinished.append(chained)

        def finish() -> None:
            with lock:
                left = unfinished[0] if unfinished else None
            if left is not None:
                left.wait()

        pending.add_finisher(finish)
        wrapped = _create_work_from_future(chained)
    boxed = dist.Work.boxed(wrapped)
    return (*out[:-1], boxed) if isinstance(out, tuple) else boxed


@functools.cache
def _works() -> tuple[Any, Any]:
    """``PythonCallbackWork`` and ``_create_work_from_future`` (``core.torch_private``
    imports them on first use), looked up once rather than at every collective."""
    from ...core.torch_private import PythonCallbackWork, create_work_from_future
    return PythonCallbackWork, create_work_from_future


class _Once:
    """Calls ``fn`` the first time it is called (a result is checked once)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class Pending:
    """The waits of the collectives whose results are still on their way (per owner: a
    guard's checks, a drill's faults): ``flush`` waits for each one nobody waited for, so
    that every result is checked (or corrupted) once, when the step closes at the latest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finishers: list[Callable[..., Any]] = []

    def add_finisher(self, wait: Callable[..., Any]) -> None:
        with self._lock:
            self._finishers.append(wait)

    def flush(self) -> None:
        with self._lock:
            finishers, self._finishers = self._finishers, []
        for wait in finishers:
            wait()

    def clear(self) -> None:
        with self._lock:
            self._finishers.clear()
