"""See every GEMM: a ``TorchDispatchMode`` plus a registry from aten op to a small handler.

Like ``torch.utils.flop_counter.FlopCounterMode``: each handler turns one aten call into
the GEMM it computed, ``out = beta * bias + alpha * (a @ b)``; adding an op is adding one
handler. ``mm``/``addmm``/``bmm``/``baddbmm`` are what ``nn.Linear`` and ``torch.matmul``
decompose into when autograd records; ``linear`` and ``matmul`` arrive undecomposed under
``torch.inference_mode()``.

The mode runs the op first and hands the untouched output to the guard: verification
reads the GEMM's tensors and never writes them, and, since PyTorch disables a dispatch
mode while its handler runs, verification's own ops are never intercepted. It also tells
the guard which tensors an op wrote (the arguments its schema marks ``Tensor(a!)``), so
that a weight written by the program (``p.data.add_()``, an optimizer step, a
``load_state_dict``) gets its cached encoding remade, while one changed by hardware keeps
the encoding of its good value (``sdc_guard.runtime.checking.cache``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
from torch import Tensor
from torch import nn
from torch.compiler import is_compiling
from ...core.torch_private import (
    BaseTorchDispatchMode, disable_current_modes, DisableTorchFunction, current_graph_task_id,
    current_autograd_node,
)

from .attention import ATTENTION_HANDLERS, AttentionCall
from .hops import ModuleRef, branch_modules, hidden_from_dynamo
from .site_hooks import SlotHooks
from .ops import (  # noqa: F401  (the registry's former home: these names stay importable here)
    ATTENTION_OPS, GEMM_HANDLERS, UNVERIFIED_GEMM_OPS, Gemm, Handler, Route, RoutingMode, defer_to_dtensor,
    gemm_overloads,
    on_fake_tensors,
)

GLOBAL_SITE = "global"


def current_phase() -> str:
    """``"backward"`` while the autograd engine runs a backward pass, else ``"forward"``."""
    return "backward" if current_graph_task_id() != -1 else "forward"


class SiteTracker:
    """Which module of ``model`` a GEMM comes from: its site, in ``model.named_modules()``
    terms ("blocks.0.attn.proj"), the model's class name for the model itself, ``"global"``
    outside any of its modules.

    - Forward (and a checkpointed forward recomputed during backward): the innermost of
      the running modules, kept on a stack by forward pre/post hooks on the model's own
      modules, installed by ``start`` and removed by ``stop``.
    - Backward: the GEMMs of a backward run inside the autograd node of the forward op
      (``AddmmBackward0`` computes both gradients of an ``addmm``). The site of each forward
      GEMM is written into its node's ``metadata`` once autograd has attached the node to
      the output (by the next GEMM seen, or at latest when the backward asks), and read back
      from ``torch._C._current_autograd_node()``. Nothing here holds a node or a saved
      tensor past its use.

    Why not ``torch.utils.module_tracker.ModuleTracker``: its global hooks and per-call
    multi-grad hooks cost about 4 % of a small model's CPU step, as much as the dispatch
    mode itself. A GEMM in the backward of a custom ``autograd.Function`` (no forward GEMM
    of its own) is attributed to ``"global"``.

    Module hooks fire on every thread that calls the model, so the stack of running
    modules is kept per thread: two guards on one shared model in two threads (each
    guard's dispatch mode sees only its own thread) never see each other's modules.

    Higher-order ops (``runtime/dispatch/hops.py``): the hooks do nothing while dynamo traces (a
    write to the stack inside a traced ``torch.cond`` branch is a side effect dynamo
    refuses there; a compiled frame's sites are known at trace time anyway). A captured
    HOP body runs without module calls, publishing the modules each of its nodes came from
    (``hops.branch_modules``): the innermost of them that belongs to the model is the site.
    The GEMMs of a ``cond``'s backward take the site of the module that called it
    (``label_outputs``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._key = f"sdc_guard.site.{id(self)}"  #: node metadata key (one per tracker)
        self._stack: list[str] = []  #: running modules on the thread that called ``start``
        self._stacks: dict[int, list[str]] = {}  #: running modules, per thread
        self._hooks: list[SlotHooks] = []  #: same keys every step (``runtime/dispatch/site_hooks.py``)
        self._pending: list[tuple[Tensor, str]] = []  #: forward outputs awaiting their grad_fn
        self._pending_hop: list[tuple[Tensor, str]] = []  #: HOP outputs awaiting theirs (``label_outputs``)
        self._paths: dict[int, tuple[str, type]] = {}  #: id of each module -> (site, class)
        self.calls = 0  #: module calls that ran the hooks (each paid ``module_hook_seconds``)

    def start(self) -> None:
        """Install the module hooks (once per step: modules added since are seen too)."""
        self.stop()
        self._stacks[threading.get_ident()] = self._stack
        root = type(self.model).__name__
        for name, module in self.model.named_modules():
            self._paths[id(module)] = (name or root, type(module))
            self._hooks.append(SlotHooks(module, self._pusher(name or root), self._pop))

    def stop(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._stack.clear()
        self._stacks.clear()
        self._pending.clear()
        self._pending_hop.clear()
        self._paths.clear()

    def _pusher(self, name: str) -> Callable[..., None]:
        def push(module: nn.Module, args: Any) -> None:
            if is_compiling():  # traced: no side effect (class doc)
                return
            self.calls += 1
            self._thread_stack().append(name)
        return push

    def _thread_stack(self) -> list[str]:
        """The calling thread's stack."""
        return self._stacks.setdefault(threading.get_ident(), [])

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if is_compiling():
            return
        stack = self._thread_stack()
        if stack:
            stack.pop()

    def _label_pending(self) -> None:
        """Write the site of each forward GEMM seen into its (now attached) autograd node."""
        for out, site in self._pending:
            node = out.grad_fn
            if node is not None:
                node.metadata[self._key] = site
        self._pending.clear()
        for out, site in self._pending_hop:  # never over a GEMM's own label
            node = out.grad_fn
            if node is not None:
                node.metadata.setdefault(self._key, site)
        self._pending_hop.clear()

    def _branch_site(self, modules: tuple[ModuleRef, ...]) -> str | None:
        """The innermost of a captured HOP node's modules that belongs to the model."""
        for ident, cls in reversed(modules):
            known = self._paths.get(ident)
            if known is not None and (cls is None or known[1] is cls):
                return known[0]
        return None

    def label_outputs(self, outputs: Any) -> None:
        """Give the autograd node that will own ``outputs`` (a ``cond`` run under autograd:
        its autograd function attaches the node once they are returned) the site of the
        running module, for the GEMMs of its backward."""
        stack = self._stacks.get(threading.get_ident())
        site = self._branch_site(branch_modules()) or (stack[-1] if stack else GLOBAL_SITE)
        for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
            if isinstance(out, Tensor):
                self._pending_hop.append((out, site))

    def inside(self) -> bool:
        """Whether the GEMM running now on this thread is the model's: inside one of its
        modules' forward, or in the backward of one of its forward GEMMs."""
        if self._pending or self._pending_hop:
            self._label_pending()
        if self._stacks.get(threading.get_ident()):
            return True
        modules = branch_modules()
        if modules and self._branch_site(modules) is not None:
            return True
        if current_graph_task_id() == -1:
            return False
        node = current_autograd_node()
        return node is not None and node.metadata.get(self._key, GLOBAL_SITE) != GLOBAL_SITE

    def site(self, out: Tensor, operands: tuple[Tensor, ...], backward: bool | None = None) -> str:
        """The site of the GEMM that produced ``out`` from ``operands`` (see the class doc).
        ``backward``: whether the autograd engine runs it (``current_phase``), when the
        caller knows already."""
        if self._pending or self._pending_hop:
            self._label_pending()
        modules = branch_modules()
        site = self._branch_site(modules) if modules else None  # a node of a captured HOP body
        if site is None:
            stack = self._stacks.get(threading.get_ident())
            if not stack:
                if backward is None:
                    backward = current_graph_task_id() != -1
                if backward:  # a backward GEMM
                    node = current_autograd_node()
                    return node.metadata.get(self._key, GLOBAL_SITE) if node is not None else GLOBAL_SITE
                site = GLOBAL_SITE
            else:  # a forward, or one recomputed by activation checkpointing during backward
                site = stack[-1]
        for t in operands:
            if t.requires_grad:
                if torch.is_grad_enabled():
                    self._pending.append((out, site))
                break
        return site


_round_trip: list[float] = []


def round_trip_seconds() -> float:
    """What a dispatch mode's Python round trip adds to one aten op on this machine, in
    seconds: measured once per process (a 16-element ``add``, bare and under an empty mode
    in turn, ``extra_call_seconds``). The guard charges it per op it
    intercepts, so that its reported cost includes interception, not only verification
    (docs/ALGORITHM.md is silent on costs; sdc_guard.runtime.lifecycle.ledger says how they are added).
    Measured with every mode on the stack set aside (the guard's own among them: it is
    first called while a step closes), so that neither side runs under one."""
    if not _round_trip:
        with disable_current_modes():
            _round_trip.append(_measure_round_trip())
    return _round_trip[0]


def median_call_seconds(call: Callable[[], object], reps: int = 300) -> float:
    """The median time of ``reps`` calls of ``call``, in seconds: each side of
    ``extra_call_seconds``, which the per-call rates of interception
    (``round_trip_seconds``, ``module_hook_seconds``,
    ``function_mode.function_round_trip_seconds``) are measured by."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def extra_call_seconds(call: Callable[[], object], context: Callable[[], ContextManager[object]],
                       blocks: int = 15, reps: int = 40) -> float:
    """What running ``call`` inside ``context()`` adds to it, in seconds, never below 0:
    the median over ``blocks`` rounds of (the median of ``reps`` calls inside a fresh
    ``context()``) minus (the median of ``reps`` bare calls), the two sides taken in turn.
    Why in turn: a VM's clock changes speed for seconds at a time (a bare 16-element add
    measured at 3.8 us, then at 7.7 us on a 2-vCPU VM); measured one side after the other,
    300 calls each, a slow spell on one side only made the rate 0 or three times too large
    in about one process of five there."""
    differences = []
    for _ in range(blocks):
        bare = median_call_seconds(call, reps)
        with context():
            inside = median_call_seconds(call, reps)
        differences.append(inside - bare)
    differences.sort()
    return max(0.0, differences[len(differences) // 2])


def _measure_round_trip() -> float:
    x = torch.ones(16)
    # torch's mode that only runs each op
    return extra_call_seconds(lambda: torch.add(x, 1.0), BaseTorchDispatchMode)


_module_hook: list[float] = []


def module_hook_seconds() -> float:
    """What the site tracker's pair of forward hooks adds to one module call on this
    machine, in seconds: measured once per process (an ``nn.Identity`` called bare and
    with a site tracker's hooks on it in turn, ``extra_call_seconds``). A module with hooks leaves ``nn.Module``'s fast call path, which costs more
    than the hooks' own bodies; the guard charges this per module call it tracked
    (``SiteTracker.calls``)."""
    if not _module_hook:
        module, x = nn.Identity(), torch.ones(16)
        tracker = SiteTracker(module)

        @contextlib.contextmanager
        def hooked() -> Iterator[None]:
            tracker.start()
            try:
                yield
            finally:
                tracker.stop()

        _module_hook.append(extra_call_seconds(lambda: module(x), hooked))
    return _module_hook[0]


class GemmSink(Protocol):
    """What an interception route reports each call to: the ``Guard``'s intake
    (``runtime/lifecycle/intake.py``, ``CheckIntake``). The dispatch mode needs these four; the
    compiled route's check ops need a little more (``graph_checks.CheckSink``)."""

    def on_gemm(self, gemm: Gemm) -> None: ...
    def on_attention(self, call: AttentionCall) -> None: ...
    def on_unverified(self, op: str) -> None: ...
    def on_write(self, tensors: list[Tensor]) -> None: ...


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument ``func``'s schema says it writes (``Tensor(a!)``,
    ``Tensor(a!)[]``, ``out=``): empty for a functional op."""
    return tuple((i, arg.name) for i, arg in enumerate(func._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


#: per overload id, what it writes (``written_arguments``): its schema never changes;
#: with the overload itself, kept alive so that its id is never another op's
_WRITES: dict[int, tuple[tuple[tuple[int, str], ...], Any]] = {}


def _writes_of(func: Any) -> tuple[tuple[int, str], ...]:
    known = _WRITES.get(id(func))
    if known is None:
        known = _WRITES[id(func)] = (written_arguments(func), func)
    return known[0]


def _written_tensors(args: tuple, kwargs: dict, where: tuple[tuple[int, str], ...]) -> list[Tensor]:
    out: list[Tensor] = []
    for i, name in where:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(t for t in value if isinstance(t, Tensor))
    return out


class GemmInterceptor(RoutingMode):
    """Dispatch mode that reports every GEMM (and every unverifiable GEMM-bearing op), routed
    by the op registry (``sdc_guard.runtime.dispatch.ops``: composite ops decomposed, the bodies of
    ``torch.cond`` and flex attention run under the mode, unknown HOPs counted).

    A call on ``DTensor`` s is handed to ``DTensor`` (``ops.defer_to_dtensor``): its local
    op, on the local shards, comes back to this mode and is verified. A call on
    ``FakeTensor`` s runs unaccounted (``ops.on_fake_tensors``).

    >>> seen = []
    >>> class Sink:
    ...     def on_gemm(self, g): seen.append(g.op)
    ...     def on_unverified(self, op): pass
    ...     def on_write(self, tensors): pass
    >>> with GemmInterceptor(Sink()):
    ...     _ = torch.randn(2, 3) @ torch.randn(3, 4)
    >>> seen
    ['mm']
    """

    def __init__(self, sink: GemmSink, sites: SiteTracker | None = None) -> None:
        super().__init__(sites)
        self.sink = sink
        #: set by ``retire``: only the backward of GEMMs whose autograd node is older than this
        #: (autograd's sequence number) is still this mode's (docs/COMPILE.md, "The two routes")
        self._cutoff: int | None = None
        # Built per activation, so a handler added to GEMM_HANDLERS since is seen.
        self._handlers = {id(overload): handler for packet, handler in GEMM_HANDLERS.items()
                          for overload in gemm_overloads(packet)}
        # fused attention: one handler per SDPA kernel (sdc_guard.runtime.dispatch.attention)
        self._attention = {id(packet.default): handler for packet, handler in ATTENTION_HANDLERS.items()}

    def quiet(self, func: Any, route: Route) -> bool:
        """A plain op that writes no tensor: nothing to hand the guard."""
        return route is Route.PLAIN and not _writes_of(func)

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        """As ``RoutingMode``'s, and yes when dynamo is about to compile any other frame and
        the guard switches to the compiled route for it (``Guard.compiled_code_met``): the
        frame then compiles with the checks in its graphs instead of running eagerly and
        staying skipped by dynamo after the block."""
        if hidden_from_dynamo():
            return True
        met = getattr(self.sink, "compiled_code_met", None)
        return bool(met()) if met is not None else False

    def retire(self, cutoff: int | None) -> None:
        """From now on verify only the backward GEMMs of autograd nodes numbered below
        ``cutoff`` (``autograd_sequence_number``): the forward GEMMs this mode verified
        before the guard switched routes. ``None``: verify everything again."""
        self._cutoff = cutoff

    def _retired_here(self) -> bool:
        if current_graph_task_id() == -1:
            return True
        node = current_autograd_node()
        return node is None or node._sequence_nr() >= self._cutoff  # type: ignore[operator]

    def after(self, func: Any, route: Route, args: tuple, kwargs: dict, out: Any) -> None:
        writes = _writes_of(func)
        if writes:
            self.sink.on_write(_written_tensors(args, kwargs, writes))
        if self._cutoff is not None and route is not Route.PLAIN and self._retired_here():
            return
        if route is Route.GEMM:
            gemm = self._handlers[id(func)](args, kwargs, out)
            if gemm is not None:
                self.sink.on_gemm(gemm)
                return
            self.sink.on_unverified(str(func.overloadpacket))
        elif route is Route.ATTENTION:
            self.on_attention(func, args, kwargs, out)
        elif route is Route.UNVERIFIED:
            self.sink.on_unverified(str(func.overloadpacket))

    def on_attention(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A fused attention kernel ran (``ops.ATTENTION_OPS``): handed to attention
        verification (``sdc_guard.runtime.dispatch.attention``) where a handler knows the kernel's
        schema; counted as unverified otherwise (a backward without a handler, an overload)."""
        handler = self._attention.get(id(func))
        call = handler(args, kwargs, out) if handler is not None else None
        if isinstance(call, AttentionCall):
            self.sink.on_attention(call)
        else:
            self.sink.on_unverified(str(func.overloadpacket))

    def on_opaque(self, name: str) -> None:
        if self._cutoff is not None and self._retired_here():
            return
        self.sink.on_unverified(name)

    def collective(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A collective (``ops.Route.COLLECTIVE``): run by the sink, which checks it
        (``Guard.on_collective``); a sink without ``on_collective`` just runs it."""
        on_collective = getattr(self.sink, "on_collective", None)
        return func(*args, **kwargs) if on_collective is None else on_collective(func, args, kwargs)


def autograd_sequence_number() -> int:
    """The sequence number autograd gives the next node made on this thread (nodes made
    before have smaller ones): read off a node made for it, with every mode set aside."""
    with disable_current_modes(), DisableTorchFunction(), torch.enable_grad():
        node = torch.zeros((), requires_grad=True).view(()).grad_fn
    return node._sequence_nr() if node is not None else 0
