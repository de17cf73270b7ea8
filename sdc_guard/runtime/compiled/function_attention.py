"""Fused attention in the eager frames of the compiled route (docs/COMPILE.md).

In compiled graphs SDPA is the aten kernel AOT autograd chose
(``_scaled_dot_product_flash_attention_for_cpu``, ``..._efficient_attention``, ...) and its
backward, checked by the graph pass like any GEMM (``runtime/compiled/graph_pass.py``, with the
eager route's attention handlers). In an eager frame of the compiled route,
``F.scaled_dot_product_attention`` is one torch function to the function mode
(``sdc_guard.runtime.compiled.function_mode``), and this module checks it: it makes the user's own
call, unchanged, and taps autograd around it, so the step computes what it computes
unguarded, bit for bit, forward and backward, whatever kernel runs.

- ``TapIn`` (before the call): the identity on ``q``, ``k``, ``v``, plus two *carriers*,
  zero tensors of the output's shape that the call does not read. Its backward receives
  the call's ``dQ``, ``dK``, ``dV`` (its identity outputs feed only the call) and, as the
  carriers' gradients, ``dO`` and ``O``: it checks the backward, then passes the three
  gradients on unchanged.
- ``TapOut`` (after the call): the identity on ``O``, with the carriers as inputs. Its
  backward hands ``dO`` on to the call's backward unchanged and returns ``dO`` and the
  saved ``O`` as the carriers' gradients, which autograd routes to ``TapIn``.
- ``sdc_guard::check_attention``, an op like ``check_gemm`` (writes nothing,
  ``graph_checks.check_op``), runs on ``O`` after the call and on the gradients in
  ``TapIn``'s backward. Its body is the eager route's attention check
  (``Guard.on_attention``): the call as ``runtime.dispatch.attention.function_call`` describes it
  (the kernel the dispatcher chooses for these operands, ``torch._fused_sdp_choice``, and
  the eager handlers' reasons for counting instead of verifying), the same screen
  (``core.attention``), the same fp64 confirmation (``core.attention_confirm``), the same
  ledger, drills and reports.

Under autocast the route casts ``q``, ``k``, ``v`` and a floating mask to autocast's dtype
itself, as autocast would (the same ``to`` calls), so that the taps and the check see the
kernel's operands; autocast then leaves the call alone. Calls the screen cannot cover
(dropout > 0: the mask is in the kernel's random stream; non-4-D or nested inputs;
integer dtypes; tensor subclasses; devices other than CPU and CUDA) run as called and are
counted in ``unverified_ops`` as ``scaled_dot_product_attention[reason]``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ...core.torch_private import DisableTorchFunction
from ..dispatch.attention import BACKWARD_OP, FORWARD_OP, function_call
from .function_gemm import CHECKPOINTED_BACKWARD, autocast_cast, autocast_dtype, in_checkpoint_forward
from .graph_checks import check_op, count_check, current_sink, run_drills, unverified

NAME = "scaled_dot_product_attention"
#: ``F.scaled_dot_product_attention``'s parameters, in order, and their defaults
PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
#: devices whose kernels the screen models (the CUDA ones written to their schemas, not run)
DEVICES = ("cpu", "cuda")


@check_op("check_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor? grad_out, Tensor? dq, "
          "Tensor? dk, Tensor? dv, float dropout, bool causal, float? scale, bool gqa, str site) -> ()")
def check_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Tensor,
                    grad_out: Optional[Tensor], dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor],
                    dropout: float, causal: bool, scale: Optional[float], gqa: bool, site: str) -> None:
    """Verify one SDPA call with this thread's guard: the forward's ``out``, or (with
    ``grad_out``) the backward's ``dq``, ``dk``, ``dv``. Reads its
    tensors, writes none of them (a drill may corrupt ``out`` or a gradient first, as a
    faulty unit would). ``site`` empty: not known at trace time (eager frames)."""
    with DisableTorchFunction():  # verification's own ops are not the model's
        backward = grad_out is not None and dq is not None and dk is not None and dv is not None
        op, phase = (BACKWARD_OP, "backward") if backward else (FORWARD_OP, "forward")
        grads = (dq, dk, dv) if backward else None
        run_drills(op, grads if backward else out, site, phase)
        sink = current_sink()
        if sink is not None:
            call = function_call(q, k, v, mask, dropout, causal, scale, gqa, out, grad_out, grads)  # type: ignore[arg-type]
            sink.on_attention(call, site or None, phase)
        count_check()




class TapIn(torch.autograd.Function):
    """Identity on ``q``, ``k``, ``v`` and two carriers of the output's ``shape``; the
    backward checks the call's gradients (see the module doc).

    Dynamo cannot trace an ``autograd.Function`` handed one tensor twice, so a tensor
    passed as two of ``q``, ``k``, ``v`` comes in once: ``roles`` says which input each of
    them is (``(0, 0, 0)``: one tensor for all three; ``None`` for the inputs left out),
    and its gradient is the sum of theirs in the order autograd sums them for the bare
    call (``(dQ + dK) + dV``), so the result stays bit-identical."""

    @staticmethod
    def forward(a: Tensor, b: Tensor | None, c: Tensor | None, roles: tuple[int, int, int], mask: Tensor | None,
                dropout: float, causal: bool, scale: float | None, gqa: bool, site: str, shape: tuple) -> tuple:
        inputs = (a, b, c)
        q, k, v = (inputs[r] for r in roles)
        # views, not the inputs themselves, and two distinct carriers: dynamo's tracing of
        # autograd.Function needs each output to be a tensor of its own
        return (q.view_as(q), k.view_as(k), v.view_as(v), q.new_zeros(()).expand(shape),
                q.new_zeros(()).expand(shape))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        a, b, c, roles, mask, dropout, causal, scale, gqa, site, _ = inputs
        ctx.save_for_backward(a, b, c, mask)
        ctx.roles, ctx.dropout, ctx.causal, ctx.scale, ctx.gqa, ctx.site = roles, dropout, causal, scale, gqa, site

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor, dv: Tensor, grad_out: Tensor, out: Tensor) -> tuple:
        a, b, c, mask = ctx.saved_tensors
        roles = ctx.roles
        q, k, v = ((a, b, c)[r] for r in roles)
        torch.ops.sdc_guard.check_attention(q, k, v, mask, out, grad_out, dq, dk, dv, ctx.dropout, ctx.causal,
                                            ctx.scale, ctx.gqa, ctx.site)
        grads: list[Tensor | None] = [None, None, None]
        for role, grad in zip(roles, (dq, dk, dv)):
            previous = grads[role]
            grads[role] = grad if previous is None else previous + grad
        return (*grads, None, None, None, None, None, None, None, None)


class TapOut(torch.autograd.Function):
    """Identity on the call's output; its backward hands ``dO`` and ``O`` to ``TapIn``
    through the carriers."""

    @staticmethod
    def forward(out: Tensor, carry_grad: Tensor, carry_out: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        (out,) = ctx.saved_tensors
        return grad_out, grad_out, out


def _plain(t: Any) -> bool:
    return type(t) is Tensor or type(t) is torch.nn.Parameter


def sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by parameter name, defaults filled in; ``None`` when they do
    not fit ``F.scaled_dot_product_attention``'s signature (the call then raises itself)."""
    if len(args) > len(PARAMETERS) or any(name not in PARAMETERS for name in kwargs):
        return None
    values: dict[str, Any] = dict(DEFAULTS)
    for name, value in zip(PARAMETERS, args):
        values[name] = value
    values.update(kwargs)
    return values if all(name in values for name in PARAMETERS[:3]) else None


def unverifiable(values: dict[str, Any]) -> str | None:
    """Why the route cannot take this call (known at trace time), or ``None``: its
    ``[reason]`` in ``unverified_ops``."""
    q, k, v, mask = values["query"], values["key"], values["value"], values["attn_mask"]
    if not (_plain(q) and _plain(k) and _plain(v) and (mask is None or _plain(mask))):
        return "tensor"
    if any(t.is_nested or t.dim() != 4 for t in (q, k, v)):
        return "layout"
    if q.device.type not in DEVICES:
        return "device"
    if any(t.dtype not in _FLOAT and t.dtype != torch.float64 for t in (q, k, v)):
        return "dtype"
    dropout, scale = values["dropout_p"], values["scale"]
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or dropout:
        return "dropout"
    if not (scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool))):
        return "scale"
    if not isinstance(values["is_causal"], bool) or not isinstance(values["enable_gqa"], bool):
        return "flags"
    return None


def autocast_operands(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple:
    """``q``, ``k``, ``v`` and ``mask`` as the kernel receives them: under autocast on their
    device, each floating one but float64 cast to autocast's dtype, as autocast casts the
    arguments of ``scaled_dot_product_attention`` (a lower-precision op on CPU and CUDA)."""
    dtype = autocast_dtype(q)
    return autocast_cast(q, dtype), autocast_cast(k, dtype), autocast_cast(v, dtype), autocast_cast(mask, dtype)


def route_sdpa(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.scaled_dot_product_attention`` on the compiled route (see the module doc)."""
    values = sdpa_arguments(args, kwargs)
    if values is None:
        return func(*args, **kwargs)
    reason = unverifiable(values)
    if reason is not None:
        unverified(f"{NAME}[{reason}]")
        return func(*args, **kwargs)
    q, k, v, mask = autocast_operands(values["query"], values["key"], values["value"], values["attn_mask"])
    dropout, causal, gqa = float(values["dropout_p"]), values["is_causal"], values["enable_gqa"]
    scale = None if values["scale"] is None else float(values["scale"])
    site = ""  # an eager frame: the guard's site tracker has no hooks on this route ("global")
    options: dict[str, Any] = {"attn_mask": mask, "dropout_p": values["dropout_p"], "is_causal": causal,
                               "scale": values["scale"]}
    if gqa:
        options["enable_gqa"] = True
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not grads or in_checkpoint_forward():  # no tap where a checkpoint recomputes (function_gemm)
        out = func(q, k, v, **options)
        torch.ops.sdc_guard.check_attention(q, k, v, mask, out, None, None, None, None, dropout, causal, scale, gqa,
                                            site)
        if grads:
            unverified(CHECKPOINTED_BACKWARD)
        return out
    shape = (*q.shape[:-1], v.shape[-1])
    roles = (0, 0 if k is q else 1, 0 if v is q else 1 if v is k else 2)
    tq, tk, tv, carry_grad, carry_out = TapIn.apply(q, k if roles[1] == 1 else None, v if roles[2] == 2 else None,
                                                    roles, mask, dropout, causal, scale, gqa, site, shape)
    out = func(tq, tk, tv, **options)
    torch.ops.sdc_guard.check_attention(q, k, v, mask, out, None, None, None, None, dropout, causal, scale, gqa,
                                        site)
    return TapOut.apply(out, carry_grad, carry_out)
