"""Backend registry and dispatch: one entry point, the best implementation per call.

Order of preference (VABFT.md, issue "Foundation"): the Ascend operator where it exists,
the fused Triton kernel on CUDA, the native C kernels on CPU (when built), portable
PyTorch everywhere. Each backend says whether
this process can use it (``unavailable_reason``) and whether it accepts a given call
(``rejects``); a call is served by an explicit ``backend=`` / ``SDC_GUARD_BACKEND``, else
by the first backend that is available and accepts it. A call nobody can serve fails with
every backend's reason, never silently.

>>> from sdc_guard import backends
>>> "torch" in backends.available()
True
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from . import native
from .abft import AbftCheck, WeightSide, vabft_check, weight_side
from .ledger import clear_summary, summarize

ENV_BACKEND = "SDC_GUARD_BACKEND"


@dataclass(frozen=True)
class GemmRequest:
    """One validated verification call: ``c == alpha * a @ b + beta * bias``."""

    a: Tensor
    b: Tensor
    c: Tensor
    e_max: float
    checksum_weight: Tensor | None = None
    bias: Tensor | None = None
    alpha: float = 1.0
    beta: float = 1.0
    weight: WeightSide | None = None  #: cached weight-side encoding of ``b``, if any
    rounding: float = 1.0  #: share of C's worst-case rounding term in T (``precision.SCREENS``)

    @property
    def device(self) -> torch.device:
        return self.c.device


class Backend:
    """A verification implementation. Subclasses override the three methods."""

    name: str = "?"

    def unavailable_reason(self) -> str | None:
        """``None`` if this process can use the backend, else why not (one line)."""
        return None

    def rejects(self, req: GemmRequest) -> str | None:
        """``None`` if the backend's contract covers ``req``, else why not (one line)."""
        return None

    def check(self, req: GemmRequest) -> AbftCheck:
        """Verify ``req``; must not write to any input nor synchronise with the host."""
        raise NotImplementedError

    def encode(self, b: Tensor, checksum_weight: Tensor | None = None) -> WeightSide:
        """The weight-side encoding of ``b`` that ``check`` reads fastest (``req.weight``);
        any backend accepts any backend's encoding. Used by the weight cache on a miss."""
        return weight_side(b, checksum_weight)

    def clear_worst(self, req: GemmRequest) -> float | None:
        """The worst ``D / T`` of ``req`` when the backend knows on the host, cheaply, that
        its check came out clear (every segment passed, everything finite), else ``None``
        (not clear, or not known without building the ``AbftCheck``)."""
        return None

    def summarize(self, req: GemmRequest, cached: bool = False) -> tuple[Tensor | None, Tensor | list[float]]:
        """Screen ``req``, confirm its flags and keep what the guard keeps of it
        (``ledger.summarize``): the confirmed-corruption mask (``None`` when clear) and the
        summary. ``cached``: ``req.weight`` came from the weight cache. A clear check known
        on the host (``clear_worst``) skips building its ``AbftCheck``."""
        worst = self.clear_worst(req)
        if worst is not None:
            return None, clear_summary(worst)
        return summarize(req, self.check(req), cached)


class TorchBackend(Backend):
    """Portable PyTorch (``sdc_guard.abft``): any device, any layout; the reference."""

    name = "torch"

    def check(self, req: GemmRequest) -> AbftCheck:
        return vabft_check(
            req.a, req.b, req.c, req.checksum_weight, e_max=req.e_max, bias=req.bias,
            alpha=req.alpha, beta=req.beta, weight=req.weight, rounding=req.rounding,
        )


@functools.cache
def _triton_import() -> str | None:
    """Why the Triton kernel module cannot be imported, or ``None``: tried once per process
    (a failed import is not cached by Python, and compiling the module's source again cost
    2 ms on every call; ``reprobe`` forgets it)."""
    try:
        from .kernels import vabft_triton  # noqa: F401  (imports triton)
    except ImportError as exc:
        return f"triton kernel not importable: {exc}"
    return None


class TritonBackend(Backend):
    """The fused Triton kernel of ``sdc_guard.kernels`` for CUDA tensors.

    ``device_type`` exists so that tests can drive the kernel on CPU tensors under
    ``TRITON_INTERPRET=1``; production use is the default, ``"cuda"``.
    """

    name = "triton"

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type

    def unavailable_reason(self) -> str | None:
        reason = _triton_import()
        if reason is None and self.device_type == "cuda" and not torch.cuda.is_available():
            return "no CUDA device"
        return reason

    def rejects(self, req: GemmRequest) -> str | None:
        if req.device.type != self.device_type:
            return f"tensors are on {req.device.type}, the kernel runs on {self.device_type}"
        from .kernels import vabft_triton

        return vabft_triton.rejects(req)

    def check(self, req: GemmRequest) -> AbftCheck:
        from .kernels import vabft_triton

        if vabft_triton.rejects(req) is not None:  # a caller that chose for a coarser key
            return TorchBackend.check(self, req)  # type: ignore[arg-type]
        return vabft_triton.triton_check(req)


class CpuBackend(Backend):
    """Native C kernels for CPU tensors (``sdc_guard.native``, ``csrc/``): one
    call per verification where the torch path runs dozens of ops.

    Available when the optional extension was built at install time. A call it does not
    cover (``native.rejects``) falls to ``torch``; so does one that reaches ``check``
    anyway (a caller that cached its choice of backend for a coarser key).
    """

    name = "cpu"

    def __init__(self) -> None:
        self._scratch = native.Scratch()

    def unavailable_reason(self) -> str | None:
        return native.unavailable_reason()

    def rejects(self, req: GemmRequest) -> str | None:
        return native.rejects(req)

    def check(self, req: GemmRequest) -> AbftCheck:
        got = native.native_check(req) if native.rejects(req) is None else None
        if got is None:
            return TorchBackend.check(self, req)  # type: ignore[arg-type]
        return got

    def encode(self, b: Tensor, checksum_weight: Tensor | None = None) -> WeightSide:
        return native.native_weight_side(b, checksum_weight)

    def clear_worst(self, req: GemmRequest) -> float | None:
        """A clear check's outputs go to scratch memory (``native.native_clear``); anything
        else is checked again in full by the caller (failures are rare)."""
        return native.native_clear(req, self._scratch)  # None where not covered, too


_registry: list[Backend] = []


def register(backend: Backend, *, first: bool = False) -> None:
    """Add ``backend`` (replacing one of the same name); ``first`` puts it in front.

    Used to plug in an out-of-tree implementation, and by the tests to put a stand-in
    Ascend operator where ``torch_npu`` would be. Forgets every cached choice.
    """
    unregister(backend.name)
    _chosen.clear()
    if first:
        _registry.insert(0, backend)
    else:
        _registry.append(backend)


def unregister(name: str) -> Backend | None:
    """Remove and return the backend called ``name`` (``None`` if there is none)."""
    _chosen.clear()
    for i, backend in enumerate(_registry):
        if backend.name == name:
            _reasons.pop(backend, None)
            return _registry.pop(i)
    return None


def get(name: str) -> Backend:
    """The registered backend called ``name``; ``ValueError`` listing the names if none."""
    for backend in _registry:
        if backend.name == name:
            return backend
    names = ", ".join(repr(b.name) for b in _registry)
    raise ValueError(f"backend: expected one of {names}, got {name!r}")


def registered() -> list[str]:
    """Names of all registered backends, in order of preference."""
    return [b.name for b in _registry]


#: each backend's unavailability reason, probed once per process (``reprobe`` forgets);
#: keyed by the backend object, not its name: two instances of one class (the Triton
#: kernel for ``"cuda"`` and for ``"cpu"`` under the interpreter) answer differently
_reasons: dict[Backend, str | None] = {}
#: the backend chosen per kind of call (``_kind``), for calls that name none
_chosen: dict[tuple, Backend] = {}


def _reason(backend: Backend) -> str | None:
    if backend not in _reasons:
        _reasons[backend] = backend.unavailable_reason()
    return _reasons[backend]


def reprobe() -> None:
    """Forget every backend's availability and every cached choice: after installing or
    removing ``triton`` / ``torch_npu``, or building the native extension, in a running
    process."""
    _reasons.clear()
    _chosen.clear()
    _triton_import.cache_clear()
    for backend in _registry:
        reset = getattr(backend, "reset_probe", None)
        if reset is not None:
            reset()


def status() -> dict[str, str | None]:
    """Each backend's unavailability reason (``None`` = usable in this process), probed
    once per process (``reprobe`` probes again).

    >>> status()["torch"] is None
    True
    """
    return {b.name: _reason(b) for b in _registry}


def available() -> list[str]:
    """Names of the backends this process can use, in order of preference."""
    return [name for name, reason in status().items() if reason is None]


def select(req: GemmRequest, backend: str | None = None) -> Backend:
    """The backend that serves ``req``: explicit, else ``$SDC_GUARD_BACKEND``, else first fit.

    Raises ``RuntimeError`` naming the reasons when no backend can serve the call.
    """
    name = backend if backend is not None else os.environ.get(ENV_BACKEND) or None
    if name is not None:
        chosen = get(name)
        reason = _reason(chosen) or chosen.rejects(req)
        if reason:
            source = "backend" if backend is not None else ENV_BACKEND
            raise RuntimeError(f"{source}={name!r} cannot verify this call: {reason}")
        return chosen
    kind = _kind(req)
    chosen = _chosen.get(kind)
    if chosen is not None and chosen in _registry:  # the registry may have been replaced
        return chosen
    reasons = []
    for candidate in _registry:
        reason = _reason(candidate) or candidate.rejects(req)
        if reason is None:
            _chosen[kind] = candidate
            return candidate
        reasons.append(f"{candidate.name}: {reason}")
    raise RuntimeError("no backend can verify this call: " + "; ".join(reasons))


def _kind(req: GemmRequest) -> tuple:
    """What a backend's contract depends on beyond strides: device, dtypes, dims, bias,
    alpha, a checksum weight. (The native and Triton kernels also depend on strides; a
    call of theirs that their ``rejects`` refuses goes to the torch path inside their
    ``check``.)"""
    a = req.a
    return ("cpu" if a.is_cpu else a.device, a.dtype, req.c.dtype, a.dim(), req.b.dim(), req.bias is not None,
            req.alpha == 1.0, req.checksum_weight is not None)


def _register_defaults() -> None:
    from .npu import NpuBackend

    register(NpuBackend())
    register(TritonBackend())
    register(CpuBackend())
    register(TorchBackend())


_register_defaults()
