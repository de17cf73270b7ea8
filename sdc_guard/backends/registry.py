"""The registry of backends and the dispatch of each call to one (``select``); the package
``sdc_guard.backends`` re-exports it."""

from __future__ import annotations

import os

from .base import Backend, GemmRequest
from .cpu_backend import CpuBackend
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend, _triton_import

ENV_BACKEND = "SDC_GUARD_BACKEND"


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
