"""The site trackers' module hooks, under the same keys from one step to the next.

A site tracker (``intercept.SiteTracker``) installs a forward pre-hook and an
always-called forward hook on every module of its model at each watched step and removes
them at the step's end, so that nothing outlives the ``protect()`` block. Dynamo guards
on the keys of a module's non-empty hook dicts: when it captures a module call (the
branches of an eager ``torch.cond``, compiled by torch itself, see ``runtime/dispatch/hops.py``) with
the hooks on, a hook registered again under a fresh key (``RemovableHandle`` draws a new
id every time) fails those guards, and the capture is compiled again, at every step,
without bound (torch lifts the cache limit for these compiles).

So each module keeps a few *slots*, a pair of keys per tracker that hooks it at the same
time (a drill and a guard, nested guards, guards in two threads): a tracker takes the
first free slot and registers its hooks under that slot's keys (the first time, the keys
the registration drew). Successive steps and successive per-step ``protect()`` blocks
therefore install the same keys in the same order, and a captured module call is
compiled once. The hooks themselves are registered and removed through the public
``register_forward_*hook`` API and their handles; only their keys are moved.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

_lock = threading.Lock()
#: module -> the (pre-hook key, hook key) of each slot, and the slots in use
_slots: "weakref.WeakKeyDictionary[nn.Module, list[tuple[int, int]]]" = weakref.WeakKeyDictionary()
_busy: "weakref.WeakKeyDictionary[nn.Module, set[int]]" = weakref.WeakKeyDictionary()


def _rekey(handle: RemovableHandle, key: int) -> None:
    """Move the hook of ``handle`` (and its entries in the handle's extra dicts, such as
    ``_forward_hooks_always_called``) to ``key``, at the end of each dict as a new
    registration would be. A handle of another shape keeps its key."""
    old = getattr(handle, "id", None)
    if old == key or old is None:
        return
    refs = (getattr(handle, "hooks_dict_ref", None), *getattr(handle, "extra_dict_ref", ()))
    if refs[0] is None:
        return
    for ref in refs:
        hooks = ref() if ref is not None else None
        if hooks is not None and old in hooks:
            hooks[key] = hooks.pop(old)
    handle.id = key


class SlotHooks:
    """The pre-hook and always-called hook of one tracker on one module, in a slot."""

    def __init__(self, module: nn.Module, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self.module = module
        with _lock:
            slots = _slots.setdefault(module, [])
            busy = _busy.setdefault(module, set())
            self.slot = next((i for i in range(len(slots)) if i not in busy), len(slots))
            busy.add(self.slot)
            self._pre = module.register_forward_pre_hook(pre)
            self._post = module.register_forward_hook(post, always_call=True)
            if self.slot < len(slots):
                pre_key, post_key = slots[self.slot]
                _rekey(self._pre, pre_key)
                _rekey(self._post, post_key)
            else:
                slots.append((self._pre.id, self._post.id))

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()
        with _lock:
            busy = _busy.get(self.module)
            if busy is not None:
                busy.discard(self.slot)
