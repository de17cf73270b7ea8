"""Fault drills: corrupt chosen GEMM outputs or parameters, reproducibly.

A drill proves, on the user's own model, that a corruption is caught, attributed and
handled. ``drill(model, GemmFault(...))`` is a dispatch mode that corrupts chosen elements
of the output of chosen GEMMs (by site, op, phase, step and call index), once
(``sticky=False``: a transient upset) or on every matching call (``sticky=True``: a faulty
unit), with one of the fault models of ``sdc_guard.runtime.drills.fault_models`` (``kind``: one
or several flipped bits, a stuck bit, tile-aligned periodic patterns, a zeroed tile,
swapped rows, NaN or Inf). ``flip_parameter_bit`` corrupts a weight in memory, the way a
bad DRAM cell or a stray write would: without bumping the tensor's version counter.

Order matters when stacking with ``protect()``: the injector must be entered first, so
the guard sees the corrupted output the model sees::

    with sdc_guard.drill(model, GemmFault(site="fc1", step=3)), sdc_guard.protect(model):
        ...

Entering it inside an active ``protect()`` raises, because the guard would verify the
clean output and the drill would silently prove nothing. Another kind of drill (a fault in
a collective, say) is a dataclass of its own in a module of its own, beside this one.
"""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from ...core.torch_private import disable_current_modes, get_current_dispatch_mode_stack

from ..collectives.collective_faults import CollectiveFault, CollectiveInjection, CollectiveInjector
from . import fault_models
from ..dispatch.attention import ATTENTION_HANDLERS, BACKWARD_OP, FORWARD_OP, fault_target, op_name
from ..compiled.function_mode import function_mode_active
from ..compiled.graph_checks import add_drill, current_sink, remove_drill
from ..sampling.schedule import current_step
from ..dispatch.intercept import GEMM_HANDLERS, GLOBAL_SITE, GemmInterceptor, SiteTracker, current_phase
from ..dispatch.ops import Route, RoutingMode

_INT_VIEW = fault_models.INT_VIEW
_TOP_EXPONENT_BIT = {torch.float32: 30, torch.float16: 14, torch.bfloat16: 14}
DIRECTIONS = ("on", "off", "flip")
#: Bits of the widest dtype a GEMM output can have (float32).
MAX_BIT_WIDTH = 32
#: The tile (rows, columns) of the tile-aligned fault models, and the stride of the periodic ones.
DEFAULT_TILE = (64, 64)
DEFAULT_PERIOD = 8


@dataclass
class GemmFault:
    """Which GEMM outputs to corrupt, and how. ``None`` fields match anything.

    ``site`` is a module path relative to the model ("blocks.0.attn.proj", "global"; one
    that names no site of the drilled model is an error when the drill is entered);
    ``call`` counts matching calls within the step from 0 (re-executions of the step by
    the recompute response included); ``element`` indexes the output (if omitted: drawn
    from the injector's seed, once for a sticky fault, which like a faulty unit then hits
    the same position every time; clipped to smaller outputs).

    ``kind`` is the fault model (``sdc_guard.runtime.drills.fault_models``), ``"bit"`` by default:
    ``bit`` (default the highest exponent bit) or several ``bits`` of the element are set
    (``direction="on"``, the default: 0 -> 1), cleared (``"off"``) or toggled (``"flip"``); a
    bit already in the requested state leaves the value unchanged and the event is
    recorded as a no-op. ``"stuck"``: those bits stuck at 1 (``"on"``) or 0 (``"off"``) at
    one position on every matching call (always sticky: a faulty lane). ``"rows"`` /
    ``"columns"``: the bits changed at every ``period``-th row (default 8) of the element's
    column, or column of its row, within the ``tile`` (default 64 x 64, aligned) that holds
    it. ``"zero_tile"``: that tile zeroed; ``"swap_rows"``: the element's row exchanged
    with row ``row ^ 1`` within the tile's columns; ``"nan"``, ``"inf"``: the element
    replaced by NaN or by an infinity of its sign.

    Fused attention (``scaled_dot_product_attention``'s kernels) is targeted with
    ``op="sdpa"`` (the forward output ``O``, ``[B, H, L, Dv]``) or ``op="sdpa_backward"``
    with ``output`` 0 (grad_query, the default), 1 (grad_key) or 2 (grad_value).

    >>> GemmFault(kind="stuck", bits=(3, 4), direction="off").sticky
    True
    """

    site: str | None = None
    op: str | None = None
    phase: str | None = None
    step: int | None = None
    call: int | None = None
    element: tuple[int, ...] | None = None
    bit: int | None = None
    direction: str = "on"
    sticky: bool = False
    output: int | None = None
    kind: str = "bit"
    bits: tuple[int, ...] | None = None
    period: int | None = None
    tile: int | tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.site is not None and (not isinstance(self.site, str) or not self.site):
            raise TypeError(f"site: expected a module path such as 'layers.0.mlp.fc1' or None, got {self.site!r}")
        if not isinstance(self.direction, str) or self.direction not in DIRECTIONS:
            raise ValueError(f"direction: expected one of {DIRECTIONS}, got {self.direction!r}")
        if self.phase not in (None, "forward", "backward"):
            raise ValueError(f"phase: expected 'forward', 'backward' or None, got {self.phase!r}")
        ops = sorted({str(p).split(".")[-1] for p in GEMM_HANDLERS}) + [FORWARD_OP, BACKWARD_OP]
        if self.op is not None and (not isinstance(self.op, str) or self.op not in ops):
            raise ValueError(f"op: expected a GEMM op such as 'mm' or 'addmm' ({', '.join(ops)}), got {self.op!r}")
        if self.output is not None and (isinstance(self.output, bool) or self.output not in (0, 1, 2)):
            raise ValueError(f"output: expected 0 (grad_query), 1 (grad_key), 2 (grad_value) or None, "
                             f"got {self.output!r}")
        for name in ("step", "call", "bit"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}: expected a non-negative int or None, got {value!r}")
        if self.bit is not None and self.bit >= MAX_BIT_WIDTH:
            raise ValueError(f"bit: expected 0..{MAX_BIT_WIDTH - 1} (float32; 0..15 for bfloat16 and float16) "
                             f"or None, got {self.bit!r}")
        if self.element is not None:
            if not isinstance(self.element, (tuple, list)) or not self.element or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.element):
                raise ValueError(f"element: expected a tuple of non-negative ints (an index into the output) "
                                 f"or None, got {self.element!r}")
            self.element = tuple(self.element)
        if not isinstance(self.sticky, bool):
            raise TypeError(f"sticky: expected a bool, got {type(self.sticky).__name__} {self.sticky!r}")
        self._check_model()

    def _check_model(self) -> None:
        """The fault model's own fields: each one only where its ``kind`` reads it."""
        kinds = fault_models
        if not isinstance(self.kind, str) or self.kind not in kinds.KINDS:
            raise ValueError(f"kind: expected one of {', '.join(map(repr, kinds.KINDS))}, got {self.kind!r}")
        if self.bits is not None:
            if not isinstance(self.bits, (tuple, list)) or not self.bits or any(
                    isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < MAX_BIT_WIDTH for b in self.bits) \
                    or len(set(self.bits)) != len(self.bits):
                raise ValueError(f"bits: expected a non-empty tuple of distinct bit positions 0..{MAX_BIT_WIDTH - 1} "
                                 f"(0..15 for bfloat16 and float16) or None, got {self.bits!r}")
            if self.bit is not None:
                raise ValueError(f"bits: expected bit or bits, not both, got bit={self.bit!r} and bits={self.bits!r}")
            self.bits = tuple(self.bits)
        if self.kind not in kinds.BIT_KINDS and (self.bit is not None or self.bits is not None):
            raise ValueError(f"bit: expected None for kind {self.kind!r}, which changes no chosen bit "
                             f"(bit and bits are for kinds {', '.join(map(repr, kinds.BIT_KINDS))}), "
                             f"got bit={self.bit!r}, bits={self.bits!r}")
        if self.kind == "stuck":
            if self.direction == "flip":
                raise ValueError("direction: expected 'on' (stuck at 1) or 'off' (stuck at 0) for kind 'stuck', "
                                 "got 'flip'")
            self.sticky = True  # a stuck bit stays: every matching call, the same position
        if self.period is not None:
            if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
                raise ValueError(f"period: expected a positive int (every period-th row or column) or None, "
                                 f"got {self.period!r}")
            if self.kind not in kinds.PERIODIC_KINDS:
                raise ValueError(f"period: expected None for kind {self.kind!r} (period is for 'rows' and "
                                 f"'columns'), got {self.period!r}")
        if self.tile is not None:
            tile = (self.tile, self.tile) if isinstance(self.tile, int) and not isinstance(self.tile, bool) \
                else self.tile
            if not isinstance(tile, (tuple, list)) or len(tile) != 2 or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tile):
                raise ValueError(f"tile: expected a positive int or a (rows, columns) pair of them, or None, "
                                 f"got {self.tile!r}")
            if self.kind not in kinds.TILE_KINDS:
                raise ValueError(f"tile: expected None for kind {self.kind!r} (tile is for "
                                 f"{', '.join(map(repr, kinds.TILE_KINDS))}), got {self.tile!r}")
            self.tile = (int(tile[0]), int(tile[1]))

    def bits_for(self, dtype: torch.dtype) -> tuple[int, ...]:
        """The bits this fault changes in an output of ``dtype`` (``()`` for a kind that
        changes no chosen bit)."""
        if self.kind not in fault_models.BIT_KINDS:
            return ()
        if self.bits is not None:
            return self.bits
        return (self.bit if self.bit is not None else _TOP_EXPONENT_BIT[dtype],)


@dataclass
class Injection:
    """One corruption that happened (or was a no-op)."""

    step: int
    site: str
    op: str
    phase: str
    call: int
    element: tuple[int, ...]
    bit: int
    before: float  #: the element's value before (for a pattern: the anchor element's)
    after: float
    changed: bool  #: False when nothing changed (the bits were already in the requested state)
    kind: str = "bit"  #: the fault model (``GemmFault.kind``)
    bits: tuple[int, ...] = ()  #: the bits a bit-changing model changed
    elements: int = 1  #: elements whose value changed


def flip_bit(x: Tensor, element: tuple[int, ...], bit: int, direction: str = "flip") -> tuple[float, float, bool]:
    """Set/clear/toggle ``bit`` of ``x[element]`` in place, bypassing autograd and the
    version counter (as hardware would). Returns (value before, value after, changed).

    >>> t = torch.tensor([1.0]); flip_bit(t, (0,), 30, "on")[1] > 1e38
    True
    """
    if x.dtype not in _INT_VIEW:
        raise TypeError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    width = 32 if x.dtype == torch.float32 else 16
    if not 0 <= bit < width:
        raise ValueError(f"bit: expected 0..{width - 1} for {x.dtype}, got {bit}")
    raw = x.detach().view(_INT_VIEW[x.dtype])
    before_bits = int(raw[element])
    mask = 1 << bit if bit < width - 1 else -(1 << bit)  # the sign bit of a signed int view
    if direction == "on":
        after_bits = before_bits | mask
    elif direction == "off":
        after_bits = before_bits & ~mask
    else:
        after_bits = before_bits ^ mask
    before = float(x.detach()[element])
    with disable_current_modes():  # as hardware would: no dispatch mode sees the write
        raw[element] = after_bits
    return before, float(x.detach()[element]), after_bits != before_bits


def flip_parameter_bit(
    model: nn.Module, name: str, element: tuple[int, ...] | None = None, bit: int | None = None,
    *, direction: str = "flip", seed: int = 0,
) -> Injection:
    """Corrupt parameter ``name`` of ``model`` in memory (no version bump: invisible to
    autograd and to in-place tracking, like a real memory fault).

    >>> model = torch.nn.Linear(4, 3)
    >>> flip_parameter_bit(model, "weight", (1, 2), 30, direction="on").changed
    True
    """
    params = dict(model.named_parameters())
    if name not in params:
        raise ValueError(f"name: expected a parameter of the model ({', '.join(params)}), got {name!r}")
    p = params[name]
    element = element if element is not None else _random_element(p.shape, random.Random(seed))
    bit = bit if bit is not None else _TOP_EXPONENT_BIT[p.dtype]
    before, after, changed = flip_bit(p.data, element, bit, direction)
    return Injection(current_step(model), name, "parameter", "memory", 0, element, bit, before, after, changed)


def _random_element(shape: torch.Size, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(s) for s in shape)


class FaultInjector(RoutingMode):
    """Dispatch mode applying ``faults`` to the GEMMs of ``model``; see the module doc.

    ``injections`` lists what was done, in order.
    """

    def __init__(self, model: nn.Module, *faults: GemmFault | CollectiveFault, seed: int = 0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        super().__init__(SiteTracker(model))
        for f in faults:
            if not isinstance(f, (GemmFault, CollectiveFault)):
                raise TypeError(f"faults: expected GemmFault or CollectiveFault objects, got {type(f).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__} {seed!r}")
        self.model = model
        self.faults = [f for f in faults if isinstance(f, GemmFault)]
        #: GEMM corruptions (``Injection``) and collective ones (``CollectiveInjection``), in order
        self.injections: list[Injection | CollectiveInjection] = []
        self._rng = random.Random(seed)
        #: the collective faults, applied to the collectives this mode sees (runtime/collectives/collective_faults.py)
        self._collectives = CollectiveInjector(model, [f for f in faults if isinstance(f, CollectiveFault)],
                                               self._rng, self.injections)
        self._sites: SiteTracker = self.sites  # type: ignore[assignment]
        self._spent: set[int] = set()  #: indices of non-sticky faults already fired
        self._counts: dict[int, int] = {}
        self._count_step = -1
        self._positions: dict[tuple[int, int], tuple[int, ...]] = {}  #: element of each sticky fault

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let dynamo compile under a drill: on the compiled route the drill corrupts each
        GEMM's output where the in-graph check reads it (``_at_check``), so compiled
        frames must compile for it to test what runs (docs/COMPILE.md)."""
        return True

    def __enter__(self) -> "FaultInjector":
        if any(isinstance(m, GemmInterceptor) for m in get_current_dispatch_mode_stack()) or function_mode_active():
            raise RuntimeError(
                "drill(): enter the injector before protect(), e.g. "
                "`with drill(model, fault), protect(model):`; inside protect() the guard "
                "would verify the clean output and the drill would prove nothing"
            )
        for fault in self.faults:
            check_site(self.model, fault.site)
        self._sites.start()
        add_drill(self._at_check)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        remove_drill(self._at_check)
        self._sites.stop()

    def remove(self, fault: GemmFault | CollectiveFault) -> None:
        """Stop applying ``fault`` (a replaced node no longer has the faulty unit)."""
        self.faults = [f for f in self.faults if f is not fault]
        self._collectives.remove(fault)  # type: ignore[arg-type]

    def collective(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A collective (``ops.Route.COLLECTIVE``): its result corrupted where a
        ``CollectiveFault`` says so (``runtime/collectives/collective_faults.py``)."""
        return self._collectives.run(func, args, kwargs)

    def after(self, func: Any, route: Route, args: tuple, kwargs: dict, out: Any) -> None:
        """Routed like the guard's mode (``sdc_guard.runtime.dispatch.ops``): the GEMMs inside composite
        ops and the eager bodies of ``torch.cond`` and flex attention are drilled too, and
        fused attention kernels (``op="sdpa"`` / ``"sdpa_backward"``). On the compiled route
        the drill corrupts at the in-graph check instead (``_at_check``): while a
        compiled-route guard collects this thread's checks, aten ops are left alone. (The
        function mode alone does not say so: dynamo runs compiled code with the
        function-mode stack empty, and the aten ops of the graph then reach this mode.)"""
        if current_sink() is not None:
            return
        if route is Route.GEMM and isinstance(out, Tensor) and out.dtype in _INT_VIEW:
            self._maybe_corrupt(str(func.overloadpacket).split(".")[-1], out, args)
        elif route is Route.ATTENTION and func.overloadpacket in ATTENTION_HANDLERS \
                and func is func.overloadpacket.default:
            self._maybe_corrupt_attention(func.overloadpacket, out, args)

    def _maybe_corrupt_attention(self, packet: Any, out: Any, args: tuple) -> None:
        """A fused attention call: its output (forward) or one gradient (backward) per
        fault, chosen by ``GemmFault.output``."""
        op = op_name(packet)
        for fault in self.faults:
            if fault.op != op:
                continue
            target = fault_target(packet, out, fault.output)
            if target is not None and target.dtype in _INT_VIEW:
                self._maybe_corrupt(op, target, args, only=fault)

    def _at_check(self, op: str, out: Any, site: str, phase: str) -> None:
        """The compiled route's injection point (``check_gemm``, ``check_attention``):
        corrupt ``out`` in place just before the in-graph check reads it, as a faulty unit
        would have written it; ``site`` and ``phase`` are those the graph was traced with.
        For ``sdpa_backward`` ``out`` is ``(grad_query, grad_key, grad_value)``, and each
        fault picks one by its ``output``, as on the eager route."""
        site = site or GLOBAL_SITE
        if op in (FORWARD_OP, BACKWARD_OP):
            for fault in self.faults:
                if fault.op != op:
                    continue
                target = out if op == FORWARD_OP else out[fault.output or 0]
                if isinstance(target, Tensor) and target.numel() and target.dtype in _INT_VIEW:
                    self._maybe_corrupt(op, target, (), site=site, phase=phase, only=fault)
        elif out.dtype in _INT_VIEW:
            self._maybe_corrupt(op, out, (), site=site, phase=phase)

    def _maybe_corrupt(self, op: str, out: Tensor, args: tuple, *, site: str | None = None,
                       phase: str | None = None, only: GemmFault | None = None) -> None:
        step = current_step(self.model)
        if step != self._count_step:
            self._counts, self._count_step = {}, step
        if site is None:
            site = self._sites.site(out, tuple(a for a in args if isinstance(a, Tensor)))
        phase = phase or current_phase()
        for i, fault in enumerate(self.faults):
            key = id(fault)
            if key in self._spent or (only is not None and fault is not only) or not _matches(fault, site, op, phase, step):
                continue
            call = self._counts.get(key, 0)
            self._counts[key] = call + 1
            if fault.call is not None and call != fault.call:
                continue
            element = fault.element
            if element is None:
                # a faulty unit corrupts the same position every time: draw it once
                position = (key, out.dim())  # one position per output rank (mm vs bmm)
                element = self._positions.get(position) or _random_element(out.shape, self._rng)
                if fault.sticky:
                    self._positions[position] = element
            element = tuple(min(i, s - 1) for i, s in zip(element, out.shape))
            bits = fault.bits_for(out.dtype)
            done = fault_models.corrupt(out, fault.kind, element, bits=bits, direction=fault.direction,
                                        tile=fault.tile or DEFAULT_TILE, period=fault.period or DEFAULT_PERIOD)
            self.injections.append(Injection(step, site, op, phase, call, element, bits[0] if bits else -1,
                                             done.before, done.after, done.elements > 0, fault.kind, bits,
                                             done.elements))
            if not fault.sticky:
                self._spent.add(key)


def sites_of(model: nn.Module) -> list[str]:
    """The sites ``model``'s GEMMs can have: its module paths, its class name (the model
    itself) and ``"global"`` (a GEMM outside every module)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile(model): the sites are the model's
    root = type(model).__name__
    return [name or root for name, _ in model.named_modules()] + ["global"]


def check_site(model: nn.Module, site: str | None) -> None:
    """Raise ``ValueError`` if ``site`` names no site of ``model``: a drill that can never
    fire would otherwise prove nothing, silently. The message lists the nearest sites.

    >>> check_site(torch.nn.Sequential(torch.nn.Linear(2, 2)), "1")
    Traceback (most recent call last):
    ...
    ValueError: site: expected a module path of the model (such as '0'), got '1'
    """
    if site is None:
        return
    known = sites_of(model)
    if site in known:
        return
    near = [s for s in known if s.endswith("." + site) or site.endswith("." + s)]
    near += [s for s in difflib.get_close_matches(site, known, n=5, cutoff=0.6) if s not in near]
    if not near:  # the model's first few paths, for a sense of their shape
        near = [s for s in known if s != "global"][1:4] or known[:1]
    raise ValueError(f"site: expected a module path of the model (such as {', '.join(map(repr, near[:5]))}), "
                     f"got {site!r}")


def _matches(fault: GemmFault, site: str, op: str, phase: str, step: int) -> bool:
    return (
        (fault.site is None or fault.site == site)
        and (fault.op is None or fault.op == op)
        and (fault.phase is None or fault.phase == phase)
        and (fault.step is None or fault.step == step or (fault.sticky and step >= fault.step))
    )


def drill(model: nn.Module, *faults: GemmFault | CollectiveFault, seed: int = 0) -> FaultInjector:
    """A fault drill on ``model``'s GEMMs (``GemmFault``) and on the collectives its
    training runs (``CollectiveFault``, ``runtime/collectives/collective_faults.py``); enter it before
    ``protect()``.

    A sticky fault with a ``step`` starts at that step and stays (a unit that failed).

    >>> model = torch.nn.Linear(4, 3)
    >>> with drill(model, GemmFault(op="addmm")) as faults:
    ...     _ = model(torch.randn(2, 4))
    >>> len(faults.injections)
    1
    """
    return FaultInjector(model, *faults, seed=seed)
