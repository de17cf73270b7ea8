"""What a re-execution restores, so that a step re-run after a transient fault leaves
the run bit-identical to a clean one.

A step's closure (zero_grad, forward, backward) changes more than the gradients: the
forward draws random numbers (dropout) and updates buffers (BatchNorm's running
statistics and ``num_batches_tracked``), and user code may keep its own counters. Before
the closure runs, ``StepState.capture`` records:

- the default random generators: the CPU one and every CUDA device's (process-global,
  see "The random generators" below);
- the gradients of the optimizer's parameters;
- every floating-point and integer buffer of the protected model (a clone: buffers are
  small beside the parameters; bool buffers, masks, are never written by a forward and
  are not copied), and which tensor each buffer name holds (a buffer the forward
  reassigns, ``self.count = self.count + 1``, is put back without a copy);
- the user's own state, ``Policy(save_state=..., restore_state=...)``, like Megatron's
  ``state_save_func`` / ``state_restore_func``.

``restore`` puts all of it back before each re-execution (and when a detected step is
skipped, so that a dropped step leaves no trace in the buffers either).

The random generators. PyTorch's default generators are process-global: a re-execution
sets them back to the step's starting state for as long as the re-executed closure
runs, then moves them on to where the step's first run left them (``finish``). So the
step's draws are replayed exactly, a single-threaded run ends bit-identical to a clean
one, and the stream the rest of the process sees after the step is the clean run's.
The limit: another thread that draws from a default generator *while a re-execution
runs* draws numbers already drawn during the step's first run. Give such threads their
own ``torch.Generator`` (DataLoader worker processes are unaffected).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn


def check_state_functions(save_state: Any, restore_state: Any) -> None:
    """Raise unless ``save_state`` and ``restore_state`` are both ``None`` or a pair of
    callables: ``save_state()`` returning an object, ``restore_state(obj)`` taking it."""
    if save_state is None and restore_state is None:
        return
    if (save_state is None) != (restore_state is None):
        given, missing = ("save_state", "restore_state") if restore_state is None else ("restore_state", "save_state")
        raise ValueError(f"{missing}: expected a callable too, since {given} is given (the state a re-execution "
                         f"restores needs both: save_state() -> state, restore_state(state)); got None")
    for name, fn, args in (("save_state", save_state, ()), ("restore_state", restore_state, (None,))):
        if not callable(fn):
            raise TypeError(f"{name}: expected a callable, got {type(fn).__name__} {fn!r}")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: trust it
            continue
        try:
            signature.bind(*args)
        except TypeError:
            what = "no arguments" if not args else "one argument (the object save_state returned)"
            raise TypeError(f"{name}: expected a callable taking {what}, got {fn!r} with signature "
                            f"{signature}") from None


@dataclass
class Rng:
    """The default generators' states: the CPU one and each CUDA device's."""

    cpu: Tensor
    cuda: list[Tensor]

    @classmethod
    def capture(cls) -> "Rng":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class BufferEntry:
    """One buffer of the model: the module and name holding it, the tensor it held, and
    a copy of its value (``None`` for a buffer a forward never writes, a bool mask)."""

    module: nn.Module
    name: str
    tensor: Tensor
    saved: Tensor | None


def _buffers(model: nn.Module) -> list[BufferEntry]:
    entries, copies = [], {}
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is None:
                continue
            saved = None
            if buf.dtype != torch.bool and not buf.is_complex() and buf.device.type != "meta":
                key = id(buf)  # a buffer shared by several modules is copied once
                if key not in copies:
                    copies[key] = buf.detach().clone()
                saved = copies[key]
            entries.append(BufferEntry(module, name, buf, saved))
    return entries


def grads_of(params: list[Tensor]) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def set_grads(params: list[Tensor], grads: list[Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


@dataclass
class StepState:
    """Everything a step's closure may change that its re-execution must start from."""

    rng: Rng
    grads: list[Tensor | None] | None  #: None: a replaying closure restores its own
    buffers: list[BufferEntry] = field(default_factory=list)
    user: Any = None
    restore_user: Callable[[Any], None] | None = None
    after_first: Rng | None = None  #: the generators where the step's first run left them

    @classmethod
    def capture(cls, model: nn.Module, params: list[Tensor], *, replay: bool = False,
                save_state: Callable[[], Any] | None = None,
                restore_state: Callable[[Any], None] | None = None) -> "StepState":
        """The state before the closure runs. ``replay``: the step already ran (the
        replaying closure restores its own gradients, buffers and generators)."""
        if replay:
            return cls(Rng.capture(), None)
        user = save_state() if save_state is not None else None
        return cls(Rng.capture(), grads_of(params), _buffers(model), user, restore_state)

    def first_run_done(self) -> None:
        """Note where the first run left the generators (``finish`` returns there)."""
        self.after_first = Rng.capture()

    def restore(self, params: list[Tensor]) -> None:
        """Put the step's starting state back (before a re-execution, or a skip)."""
        self.rng.restore()
        if self.grads is not None:
            set_grads(params, self.grads)
        self.restore_model_state()

    def restore_model_state(self) -> None:
        """Put the buffers and the user's state back as they were before the closure."""
        with torch.no_grad():
            for entry in self.buffers:
                current = entry.module._buffers.get(entry.name)
                if current is not entry.tensor:  # reassigned by the forward: put the old one back
                    entry.module._buffers[entry.name] = entry.tensor
                if entry.saved is not None:
                    entry.tensor.copy_(entry.saved)
        if self.restore_user is not None:
            self.restore_user(self.user)

    def finish(self) -> None:
        """After the re-executions: move the generators on to where the first run left
        them, so that other threads do not draw the re-execution's numbers again."""
        if self.after_first is not None:
            self.after_first.restore()
