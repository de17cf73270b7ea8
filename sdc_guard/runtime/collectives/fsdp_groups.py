"""Which FSDP2 parameter group issued a collective: the module a detection names.

FSDP2 (``fully_shard``) all-gathers a parameter group's shards in
``FSDPParamGroup.unshard`` and reduce-scatters its gradients in ``post_backward``; the
collective checks (``collective_checks.py``) name a detection in either by the group's
first module (``"blocks.0"``), found on the Python stack that issued the collective. A
torch release that renames these methods leaves FSDP2's collectives labelled as any
other (by the module running), never unchecked.

Why a stack walk, and why cached depths: FSDP2 keeps no public record of the group whose
collective is under way (prefetching issues one group's all-gather inside another's
forward, so the module running is not the answer), and walking ``f_back`` makes a frame
object per level, 15-30 us for the 17-21 levels of a training step on a 2-vCPU VM, per
collective (issue 35).
"""

from __future__ import annotations

import sys
from typing import Any


#: how deep on the stack (from ``fsdp_module``'s caller) an FSDP2 group's frame was found
#: before, shallowest first: FSDP2 issues its collectives from a few fixed call paths, so
#: the next one is looked for there first (one frame made, not one per level)
_FSDP_DEPTHS: list[int] = []


def fsdp_module(max_depth: int = 30) -> Any:
    """The first module of the FSDP2 parameter group whose all-gather or reduce-scatter is
    running, found on the calling Python stack (``FSDPParamGroup.unshard`` /
    ``post_backward`` hold it as ``self``, its modules as ``self.modules``); ``None`` when
    there is none (a DDP bucket, a plain call). Best effort: a torch release that renames
    these leaves collectives labelled by position.

    The depths where a group was found before are tried first (``sys._getframe(depth)``
    makes one frame object; walking ``f_back`` makes one per level, 15-30 us for FSDP2's
    17-21 levels in a training step), then the stack is walked. A group's frame at a
    remembered depth is taken without looking for one nearer: FSDP2 issues no group's
    collective from inside another group's ``unshard`` or ``post_backward``."""
    if "torch.distributed.fsdp" not in sys.modules:  # no FSDP2 in this process: no stack to walk
        return None
    for depth in _FSDP_DEPTHS:
        try:
            owner = _param_group(sys._getframe(depth + 1))
        except ValueError:  # a shallower stack than that
            break
        if owner is not None:
            return _first_module(owner)
    try:
        frame = sys._getframe(1)
    except ValueError:
        return None
    for depth in range(max_depth):
        if frame is None:
            return None
        owner = _param_group(frame)
        if owner is not None:
            if depth not in _FSDP_DEPTHS and len(_FSDP_DEPTHS) < 8:
                _FSDP_DEPTHS.append(depth)
                _FSDP_DEPTHS.sort()
            return _first_module(owner)
        frame = frame.f_back
    return None


def _param_group(frame: Any) -> Any:
    """The ``FSDPParamGroup`` whose ``unshard`` or ``post_backward`` ``frame`` runs, else None."""
    if frame.f_code.co_name not in ("unshard", "post_backward"):
        return None
    owner = frame.f_locals.get("self")
    return owner if owner is not None and type(owner).__name__ == "FSDPParamGroup" else None


def _first_module(owner: Any) -> Any:
    modules = getattr(owner, "modules", None)
    return modules[0] if modules else None
