"""Fused attention under ``protect()``: the SDPA aten ops, their handlers and their check.

PyTorch's ``scaled_dot_product_attention`` picks one kernel per call; every kernel but the
math one (which decomposes into ``bmm``, verified as GEMMs) is a single aten op the
dispatch mode sees whole. ``ATTENTION_HANDLERS`` maps each of them to a handler written to
its schema (torch 2.13), which turns the call into an ``AttentionCall``; the guard then
screens it with ``sdc_guard.core.attention`` and confirms any suspect exactly with
``sdc_guard.core.attention_confirm`` (docs/ATTENTION.md).

======================================================  ===============  ================
aten op                                                 device           ``op`` / phase
======================================================  ===============  ================
``_scaled_dot_product_flash_attention_for_cpu``         CPU              ``sdpa``
``_scaled_dot_product_flash_attention_for_cpu_backward``  CPU            ``sdpa_backward``
``_scaled_dot_product_flash_attention`` (+ backward)    CUDA             same
``_scaled_dot_product_efficient_attention`` (+ bwd)     CUDA             same
``_scaled_dot_product_cudnn_attention`` (+ backward)    CUDA             same
``_scaled_dot_product_fused_attention_overrideable``    other backends   ``sdpa``
======================================================  ===============  ================

A call the check cannot cover keeps its place in the report as unverified, named
``kernel[reason]``: dropout (its mask lives inside the kernel's random stream), a causal
flag with ``L != S`` on kernels whose alignment is not PyTorch's top-left, nested or
non-4-D inputs, unsupported dtypes, a ``grad_input_mask`` that skips a gradient.

The screen of a CPU call runs in the native kernels when the extension is built
(``sdc_guard.backends.native_attention``: blocked, in cache, several times faster) unless
a backend other than ``"cpu"`` is forced (``protect(backend=...)`` or
``SDC_GUARD_BACKEND``); everything else, and anything those kernels do not cover, runs the
torch screen, which is the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ...core.torch_private import fused_sdp_choice
from ...backends import ENV_BACKEND
from ...backends.native_attention import native_backward_screen, native_forward_screen
from ...core.attention import (AttentionOperands, BackwardCheck, RowCheck, backward_screen, default_scale,
                              forward_screen)
from ...core.attention_confirm import RowConfirmation, confirm_backward, confirm_forward
from ...core.precision import SUPPORTED_DTYPES
from ...core.summary import clear_summary

aten = torch.ops.aten

#: The ``op`` names of attention checks (``Detection.op``, ``GemmFault.op``, site keys).
FORWARD_OP, BACKWARD_OP = "sdpa", "sdpa_backward"
#: Which gradient each column of a backward detection's ``segments`` names.
GRADIENTS = ("grad_query", "grad_key", "grad_value")


@dataclass(frozen=True)
class AttentionCall:
    """One intercepted SDPA call. ``op`` is ``"sdpa"`` or ``"sdpa_backward"``; ``kernel``
    the aten op; ``reason`` why it cannot be verified (``None``: it can). ``out`` is the
    forward's output (in the backward: the saved output, an input of the kernel);
    ``grads`` the backward's (grad_query, grad_key, grad_value)."""

    op: str
    kernel: str
    operands: AttentionOperands | None
    out: Tensor | None
    grad_out: Tensor | None = None
    grads: tuple[Tensor, Tensor, Tensor] | None = None
    reason: str | None = None

    @property
    def site_tensor(self) -> Tensor:
        """The tensor whose autograd node identifies the call's site."""
        assert self.out is not None
        return self.out if self.grads is None else self.grads[0]

    @property
    def dtype(self) -> torch.dtype:
        assert self.out is not None
        return self.out.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """``(B, Hq, L, S, Dv)``: as a GEMM's ``(*batch, M, K, N)``, so that reports count
        its rows as (row, segment)s."""
        assert self.operands is not None
        b, hq, _, l, s, d, dv = self.operands.dims
        return (b, hq, l, s, dv if self.grads is None else d)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _make(op: str, kernel: str, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float,
          causal: bool, scale: float | None, out: Tensor, grad_out: Tensor | None = None,
          grads: tuple | None = None, square_causal_only: bool = False) -> AttentionCall:
    reason = None
    tensors = [q, k, v, out] + ([grad_out, *grads] if grads is not None else [])
    if any(not isinstance(t, Tensor) for t in tensors):
        reason = "missing"
    elif any(t.is_nested or t.dim() != 4 for t in tensors):
        reason = "layout"
    elif q.dtype not in SUPPORTED_DTYPES or any(t.dtype != q.dtype for t in (k, v)):
        reason = str(q.dtype).removeprefix("torch.")
    elif dropout:
        reason = "dropout"
    elif k.shape[1] == 0 or q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        reason = "heads"
    elif causal and square_causal_only and q.shape[2] != k.shape[2]:
        reason = "causal-nonsquare"
    elif mask is not None and (not isinstance(mask, Tensor) or mask.is_nested):
        reason = "mask"
    ops = None
    if reason is None:
        ops = AttentionOperands(q, k, v, mask, bool(causal), default_scale(q.shape[-1], scale))
    return AttentionCall(op, kernel, ops, out if isinstance(out, Tensor) else None, grad_out,
                         tuple(grads) if grads is not None else None, reason)


def _flash_cpu(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    q, k, v = args[:3]
    return _make(FORWARD_OP, "flash_cpu", q, k, v, kwargs.get("attn_mask"), _arg(args, kwargs, 3, "dropout_p", 0.0),
                 _arg(args, kwargs, 4, "is_causal", False), kwargs.get("scale"), out[0])


def _flash_cpu_backward(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    grad, q, k, v, o = args[:5]
    return _make(BACKWARD_OP, "flash_cpu", q, k, v, kwargs.get("attn_mask"), _arg(args, kwargs, 6, "dropout_p", 0.0),
                 _arg(args, kwargs, 7, "is_causal", False), kwargs.get("scale"), o, grad, tuple(out[:3]))


def _flash_cuda(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    q, k, v = args[:3]
    return _make(FORWARD_OP, "flash", q, k, v, None, _arg(args, kwargs, 3, "dropout_p", 0.0),
                 _arg(args, kwargs, 4, "is_causal", False), kwargs.get("scale"), out[0], square_causal_only=True)


def _flash_cuda_backward(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    grad, q, k, v, o = args[:5]
    return _make(BACKWARD_OP, "flash", q, k, v, None, _arg(args, kwargs, 10, "dropout_p", 0.0),
                 _arg(args, kwargs, 11, "is_causal", False), kwargs.get("scale"), o, grad, tuple(out[:3]),
                 square_causal_only=True)


def _efficient(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    q, k, v = args[:3]
    return _make(FORWARD_OP, "efficient", q, k, v, _arg(args, kwargs, 3, "attn_bias"),
                 _arg(args, kwargs, 5, "dropout_p", 0.0), _arg(args, kwargs, 6, "is_causal", False),
                 kwargs.get("scale"), out[0])


def _efficient_backward(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    grad, q, k, v, bias, o = args[:6]
    call = _make(BACKWARD_OP, "efficient", q, k, v, bias if isinstance(bias, Tensor) and bias.numel() else None,
                 _arg(args, kwargs, 9, "dropout_p", 0.0), _arg(args, kwargs, 11, "is_causal", False),
                 kwargs.get("scale"), o, grad, tuple(out[:3]))
    wanted = _arg(args, kwargs, 10, "grad_input_mask", (True,) * 4)
    if call.reason is None and not all(wanted[:3]):
        return AttentionCall(call.op, call.kernel, None, call.out, reason="grad_input_mask")
    return call


def _cudnn(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    q, k, v = args[:3]
    return _make(FORWARD_OP, "cudnn", q, k, v, _arg(args, kwargs, 3, "attn_bias"),
                 _arg(args, kwargs, 5, "dropout_p", 0.0), _arg(args, kwargs, 6, "is_causal", False),
                 kwargs.get("scale"), out[0], square_causal_only=True)


def _cudnn_backward(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    grad, q, k, v, o = args[:5]
    bias = _arg(args, kwargs, 8, "attn_bias")
    return _make(BACKWARD_OP, "cudnn", q, k, v, bias if isinstance(bias, Tensor) and bias.numel() else None,
                 _arg(args, kwargs, 13, "dropout_p", 0.0), _arg(args, kwargs, 14, "is_causal", False),
                 kwargs.get("scale"), o, grad, tuple(out[:3]), square_causal_only=True)


def _overrideable(args: tuple, kwargs: dict, out: Any) -> AttentionCall:
    q, k, v = args[:3]
    return _make(FORWARD_OP, "overrideable", q, k, v, _arg(args, kwargs, 3, "attn_bias"),
                 _arg(args, kwargs, 4, "dropout_p", 0.0), _arg(args, kwargs, 5, "is_causal", False),
                 kwargs.get("scale"), out[0], square_causal_only=True)


#: ``torch._fused_sdp_choice`` (``torch.nn.attention.SDPBackend``) -> the kernel's name here;
#: math (0) is not a fused kernel: its GEMMs run inside the one call the compiled route sees
FUSED_CHOICES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
#: the kernels whose causal alignment is not PyTorch's top-left for ``L != S`` (as above)
_SQUARE_CAUSAL_ONLY = ("flash", "cudnn", "overrideable")


def chosen_kernel(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, causal: bool,
                  scale: float | None, gqa: bool) -> str:
    """The kernel ``F.scaled_dot_product_attention`` runs for these operands, as the
    dispatcher chooses it (``torch._fused_sdp_choice``: metadata only, no host sync);
    ``flash_cpu`` for flash on the host, ``choice<N>`` for a choice this does not know."""
    extra = {"enable_gqa": True} if gqa else {}
    choice = int(fused_sdp_choice(q, k, v, mask, dropout, causal, scale=scale, **extra))
    name = FUSED_CHOICES.get(choice, f"choice{choice}")
    return "flash_cpu" if name == "flash" and q.device.type == "cpu" else name


def function_call(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, causal: bool,
                  scale: float | None, gqa: bool, out: Tensor, grad_out: Tensor | None = None,
                  grads: tuple[Tensor, Tensor, Tensor] | None = None) -> AttentionCall:
    """An SDPA call seen whole, at the level of ``F.scaled_dot_product_attention`` (the
    compiled route, ``sdc_guard.runtime.compiled.function_attention``): the operands as the kernel
    reads them (after autocast's casts), the user's mask (a boolean one means what the
    kernel's converted ``-inf`` mask means), the forward's ``out`` and, for the backward,
    ``grad_out`` and ``grads``. Verified when the dispatcher's kernel is a fused one the
    screen models, with the aten handlers' reasons; the math kernel is counted
    (``math[unfused]``): its GEMMs run inside the call. Grouped-query attention is
    verified on the CPU flash kernel (measured: it groups the heads itself, as the screen
    models); elsewhere it is counted (``[gqa]``) until measured on the device."""
    op = FORWARD_OP if grads is None else BACKWARD_OP
    kernel = "unknown"
    if all(t.dim() == 4 and not t.is_nested for t in (q, k, v)):
        try:
            kernel = chosen_kernel(q, k, v, mask, dropout, causal, scale, gqa)
        except RuntimeError:  # the dispatcher has no choice for these operands
            pass
    call = _make(op, kernel, q, k, v, mask, dropout, causal, scale, out, grad_out, grads,
                 square_causal_only=kernel in _SQUARE_CAUSAL_ONLY)
    screened = kernel in ("flash_cpu", "flash", "efficient", "cudnn") or (kernel == "overrideable" and grads is None)
    reason = call.reason
    if reason is None and not screened:
        reason = "unfused" if kernel == "math" else "backward" if kernel == "overrideable" else "kernel"
    elif reason is None and kernel != "flash_cpu" and q.shape[1] != k.shape[1]:
        reason = "gqa"  # whether these kernels group heads themselves is not measured here
    return call if reason == call.reason else AttentionCall(op, kernel, None, call.out, reason=reason)


AttentionHandler = Callable[[tuple, dict, Any], AttentionCall]

#: aten overload packet -> handler (the ``default`` overload; others stay unverified).
ATTENTION_HANDLERS: dict[Any, AttentionHandler] = {
    getattr(aten, name): handler
    for name, handler in (
        ("_scaled_dot_product_flash_attention_for_cpu", _flash_cpu),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _flash_cpu_backward),
        ("_scaled_dot_product_flash_attention", _flash_cuda),
        ("_scaled_dot_product_flash_attention_backward", _flash_cuda_backward),
        ("_scaled_dot_product_efficient_attention", _efficient),
        ("_scaled_dot_product_efficient_attention_backward", _efficient_backward),
        ("_scaled_dot_product_cudnn_attention", _cudnn),
        ("_scaled_dot_product_cudnn_attention_backward", _cudnn_backward),
        ("_scaled_dot_product_fused_attention_overrideable", _overrideable),
    )
    if hasattr(aten, name)
}


def op_name(packet: Any) -> str:
    """``"sdpa"`` or ``"sdpa_backward"`` for an attention packet (the drill's ``op``)."""
    return BACKWARD_OP if str(packet).endswith("_backward") else FORWARD_OP


def native_allowed(backend: str | None = None) -> bool:
    """Whether the native screen may serve CPU calls: no backend forced (``backend`` or
    ``$SDC_GUARD_BACKEND``), or ``"cpu"``, the native one."""
    name = backend if backend is not None else os.environ.get(ENV_BACKEND) or None
    return name is None or name == "cpu"


def screen_forward(ops: AttentionOperands, out: Tensor, backend: str | None = None) -> RowCheck:
    """The forward screen the guard runs on ``ops`` and its output: the native kernels
    where they cover the call and ``native_allowed(backend)``, else the torch screen."""
    check = native_forward_screen(ops, out) if native_allowed(backend) else None
    return forward_screen(ops, out) if check is None else check


def screen_backward(ops: AttentionOperands, grad_out: Tensor, out: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
                    backend: str | None = None) -> BackwardCheck:
    """The backward screen the guard runs (``screen_forward``'s choice of path)."""
    check = native_backward_screen(ops, grad_out, out, dq, dk, dv) if native_allowed(backend) else None
    return backward_screen(ops, grad_out, out, dq, dk, dv) if check is None else check


def _summary(confs: list[RowConfirmation], checks: list[RowCheck]) -> Tensor:
    """The ledger's ``SUMMARY`` numbers of one attention check (``ledger.SUMMARY``)."""
    corrupted = torch.stack([c.sdc.any() for c in confs]).any()
    overflow = torch.stack([c.overflow.any() for c in confs]).any()
    unverifiable = torch.stack([(~ch.ok & ch.inputs_bad).any() for ch in checks]).any()
    misses = sum((~ch.ok & ~ch.inputs_bad & ~c.sdc & ~c.overflow).sum() for c, ch in zip(confs, checks))
    worst = torch.stack([torch.where(ch.inputs_bad | c.overflow, 0.0, ch.ratio.nan_to_num(nan=float("inf"))).amax()
                         if ch.ratio.numel() else ch.ratio.new_zeros(()) for c, ch in zip(confs, checks)]).amax()
    return torch.stack([corrupted.float(), worst.float(), overflow.float(), unverifiable.float(),
                        torch.as_tensor(misses, device=worst.device).float(), corrupted.float()])


def _clear(checks: list[RowCheck]) -> list[float] | None:
    """On the host: the clear summary when every row passed (nothing to confirm)."""
    if checks[0].ok.device.type != "cpu" or not all(bool(ch.ok.all()) for ch in checks):
        return None
    worst = max((float(ch.ratio.amax()) if ch.ratio.numel() else 0.0) for ch in checks)
    return clear_summary(worst)


def verify(call: AttentionCall, backend: str | None = None) -> tuple[Tensor | None, Tensor | list[float]]:
    """Screen and confirm ``call``: (confirmed-corruption mask ``[B, Hq, R, C]``, the
    ledger's summary). ``C`` columns: 1 for the forward (``O``), 3 for the backward
    (``GRADIENTS``; a key/value row is marked on the first query head of its group),
    ``R = max(L, S)`` rows. ``backend``: the guard's (``screen_forward`` says what it
    selects). Writes no input."""
    ops = call.operands
    assert ops is not None and call.out is not None
    if call.grads is None:
        check = screen_forward(ops, call.out, backend)
        clear = _clear([check])
        if clear is not None:
            return None, clear
        conf = confirm_forward(ops, call.out, check)
        return conf.sdc.unsqueeze(-1), _summary([conf], [check])
    assert call.grad_out is not None
    dq, dk, dv = call.grads
    bcheck = screen_backward(ops, call.grad_out, call.out, dq, dk, dv, backend)
    checks = [bcheck.dq, bcheck.dk, bcheck.dv]
    clear = _clear(checks)
    if clear is not None:
        return None, clear
    confs = list(confirm_backward(ops, call.grad_out, call.out, dq, dk, dv, bcheck))
    b, hq, hkv, l, s, _, _ = ops.dims
    mask = torch.zeros((b, hkv, hq // hkv, max(l, s), 3), dtype=torch.bool, device=dq.device)
    mask[:, :, :, :l, 0] = confs[0].sdc.reshape(b, hkv, hq // hkv, l)
    mask[:, :, 0, :s, 1] = confs[1].sdc
    mask[:, :, 0, :s, 2] = confs[2].sdc
    return mask.reshape(b, hq, max(l, s), 3), _summary(confs, checks)


def fault_target(packet: Any, out: Any, output: int | None) -> Tensor | None:
    """The tensor a drill corrupts in an attention call's result: the forward's ``O``, or
    the backward's gradient ``output`` (0 grad_query, the default; 1 grad_key; 2 grad_value)."""
    index = 0 if op_name(packet) == FORWARD_OP else (output or 0)
    value = out[index] if isinstance(out, (tuple, list)) and len(out) > index else None
    return value if isinstance(value, Tensor) and value.numel() else None
