"""Fault drills: corrupt chosen GEMM outputs or parameters, reproducibly.

A drill proves, on the user's own model, that a corruption is caught, attributed and
handled. ``drill(model, GemmFault(...))`` is a dispatch mode that flips chosen bits of
chosen elements in the output of chosen GEMMs (by site, op, phase, step and call index),
once (``sticky=False``: a transient upset) or on every matching call (``sticky=True``: a
faulty unit). ``flip_parameter_bit`` corrupts a weight in memory, the way a bad DRAM cell
or a stray write would: without bumping the tensor's version counter.

Order matters when stacking with ``protect()``: the injector must be entered first, so
the guard sees the corrupted output the model sees::

    with sdc_guard.drill(model, GemmFault(site="fc1", step=3)), sdc_guard.protect(model):
        ...

Entering it inside an active ``protect()`` raises, because the guard would verify the
clean output and the drill would silently prove nothing.
"""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from .attention import ATTENTION_HANDLERS, BACKWARD_OP, FORWARD_OP, fault_target, op_name
from .function_mode import function_mode_active
from .graph_checks import add_drill, current_sink, remove_drill
from .schedule import current_step
from .intercept import GEMM_HANDLERS, GLOBAL_SITE, GemmInterceptor, SiteTracker, current_phase
from .ops import Route, RoutingMode

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_TOP_EXPONENT_BIT = {torch.float32: 30, torch.float16: 14, torch.bfloat16: 14}
DIRECTIONS = ("on", "off", "flip")
#: Bits of the widest dtype a GEMM output can have (float32).
MAX_BIT_WIDTH = 32


@dataclass
class GemmFault:
    """Which GEMM outputs to corrupt, and how. ``None`` fields match anything.

    ``site`` is a module path relative to the model ("blocks.0.attn.proj", "global"; one
    that names no site of the drilled model is an error when the drill is entered);
    ``call`` counts matching calls within the step from 0 (re-executions of the step by
    the recompute response included); ``element`` indexes the output (if omitted: drawn
    from the injector's seed, once for a sticky fault, which like a faulty unit then hits
    the same position every time; clipped to smaller outputs); ``bit`` defaults to the
    highest exponent bit and ``direction`` to ``"on"`` (0 -> 1; ``"off"`` is 1 -> 0,
    ``"flip"`` toggles). A bit already in the requested state leaves the value unchanged
    and the event is recorded as a no-op.

    Fused attention (``scaled_dot_product_attention``'s kernels) is targeted with
    ``op="sdpa"`` (the forward output ``O``, ``[B, H, L, Dv]``) or ``op="sdpa_backward"``
    with ``output`` 0 (grad_query, the default), 1 (grad_key) or 2 (grad_value).
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
    before: float
    after: float
    changed: bool  #: False when the bit was already in the requested state


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
    with _disable_current_modes():  # as hardware would: no dispatch mode sees the write
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

    def __init__(self, model: nn.Module, *faults: GemmFault, seed: int = 0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        super().__init__(SiteTracker(model))
        for f in faults:
            if not isinstance(f, GemmFault):
                raise TypeError(f"faults: expected GemmFault objects, got {type(f).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__} {seed!r}")
        self.model = model
        self.faults = list(faults)
        self.injections: list[Injection] = []
        self._rng = random.Random(seed)
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
        if any(isinstance(m, GemmInterceptor) for m in _get_current_dispatch_mode_stack()) or function_mode_active():
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

    def remove(self, fault: GemmFault) -> None:
        """Stop applying ``fault`` (a replaced node no longer has the faulty unit)."""
        self.faults = [f for f in self.faults if f is not fault]

    def after(self, func: Any, route: Route, args: tuple, kwargs: dict, out: Any) -> None:
        """Routed like the guard's mode (``sdc_guard.runtime.ops``): the GEMMs inside composite
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
            bit = fault.bit if fault.bit is not None else _TOP_EXPONENT_BIT[out.dtype]
            before, after, changed = flip_bit(out, element, bit, fault.direction)
            self.injections.append(Injection(step, site, op, phase, call, element, bit, before, after, changed))
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


def drill(model: nn.Module, *faults: GemmFault, seed: int = 0) -> FaultInjector:
    """A fault drill on ``model``'s GEMMs; enter it before ``protect()``.

    A sticky fault with a ``step`` starts at that step and stays (a unit that failed).

    >>> model = torch.nn.Linear(4, 3)
    >>> with drill(model, GemmFault(op="addmm")) as faults:
    ...     _ = model(torch.randn(2, 4))
    >>> len(faults.injections)
    1
    """
    return FaultInjector(model, *faults, seed=seed)
