"""Warn once per owner: a monitoring failure warns once and never stops training.

The state lives with the owner (a model, a metrics sink), not with a guard, since the
documented per-step pattern makes a new guard every step.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

#: Warning keys already given, per owner (a metrics sink, a model), by ``id`` with a weak
#: reference, so that sinks that are not hashable (dataclasses) are served too.
_warned_by_owner: dict[int, tuple["weakref.ref[Any]", set[str]]] = {}


def warnings_of(owner: Any) -> set[str] | None:
    """The set of warnings already given for ``owner`` (``None``: not weakly referenceable)."""
    key = id(owner)
    entry = _warned_by_owner.get(key)
    if entry is not None and entry[0]() is owner:
        return entry[1]
    try:
        ref = weakref.ref(owner, lambda _: _warned_by_owner.pop(key, None))
    except TypeError:
        return None
    _warned_by_owner[key] = (ref, set())
    return _warned_by_owner[key][1]


def warn_once(owner: Any, key: str, message: str, *, fallback: set[str], stacklevel: int = 3) -> None:
    """Warn ``message`` (a ``RuntimeWarning``) unless ``key`` was warned for ``owner``
    already; ``fallback``: the set that keeps the keys of an owner that cannot be weakly
    referenced (the caller's own)."""
    warned = warnings_of(owner)
    if warned is None:
        warned = fallback
    if key not in warned:
        warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
