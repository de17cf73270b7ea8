"""GEMMs in the eager frames of the compiled route: the user's own call, tapped, checked
forward and backward (docs/COMPILE.md, "Eager frames").

The function mode (``sdc_guard.runtime.compiled.function_mode``) hands this module ``F.linear``,
``torch.matmul`` / ``@``, ``mm``, ``bmm``, ``addmm`` and ``baddbmm`` called outside a
compiled graph. As for fused attention (``sdc_guard.runtime.compiled.function_attention``), the
route does not compute the GEMM or its gradients itself: it makes the user's call,
unchanged, and taps autograd around it, so the step computes what it computes unguarded,
bit for bit (autograd's own backward formulas).

- ``GemmTapIn`` (before the call): the identity on the call's two matrix operands, plus a
  *carrier*, a zero tensor of the output's shape that the call never reads. Its identity
  outputs feed only the call, so its backward receives exactly the call's two operand
  gradients and, as the carrier's gradient, the output's gradient ``g``: it checks each
  operand gradient as the GEMM it is (``dA = g @ B^T``, ``dB = A^T @ g``), then returns
  both unchanged.
- ``GemmTapOut`` (after the call): the identity on the output, with the carrier as an
  extra input; its backward passes ``g`` on to the call's backward and to the carrier.
- ``sdc_guard::check_gemm``, an op that reads its tensors and writes none of them
  (``graph_checks.check_op``), runs on the output right after the call and on the
  gradients in ``GemmTapIn``'s backward. Its body is the eager guard's verification
  (``Guard.on_gemm``). It receives the tensors as the call has them and a ``form`` saying
  which product they make; the body builds the product's operands from them (a
  transposed view, a batch folded into rows). The ops are named as the eager route and the
  graphs name them (``addmm`` / ``mm`` for a Linear, ``mm`` / ``bmm`` for ``matmul``).

Under autocast the route makes autocast's casts itself before the taps (the same ``to``
calls), so that the taps and the checks see the dtypes the kernel computes in; autocast
then leaves the call alone. Products whose gradients the taps cannot express as one GEMM
each (a vector right operand, batch dimensions that broadcast) go through
``CheckedGemm``, which computes both gradient GEMMs itself and checks them (its gradients
can differ from autograd's in the last bits where the two order a product differently).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.torch_private import DisableTorchFunction, top_saved_tensors_default_hooks
from .graph_checks import check_op, count_check, current_sink, resolve_site, run_drills, unverified
from ..dispatch.ops import Gemm

#: what ``check_gemm``'s ``form`` says its tensors ``x``, ``y`` multiply to: ``x @ y``,
#: ``x @ y^T``, ``x^T @ y`` (batched), and ``x^T @ y`` with every leading dim of both
#: folded into the inner one (the gradient of a 2-D ``B`` against a batched ``A``)
FORMS = ("ab", "abt", "atb", "atb_sum")


@check_op("check_gemm(Tensor x, Tensor y, Tensor out, Tensor? bias, float alpha, float beta, str form, "
          "Tensor? anchor, str op, str site, str phase) -> ()")
def check_gemm(x: Tensor, y: Tensor, out: Tensor, bias: Optional[Tensor], alpha: float, beta: float,
               form: str, anchor: Optional[Tensor], op: str, site: str, phase: str) -> None:
    """Verify ``out == beta * bias + alpha * product`` with this thread's guard, the
    product being ``form``'s of ``x`` and ``y`` (``FORMS``). Reads its tensors, writes
    none of them (a drill may corrupt ``out`` first, as a faulty unit would). ``site``
    empty: not known at trace time (eager frames); ``anchor``: the GEMM's parameter
    operand, whose module is the site at run time (``graph_checks.resolve_site``)."""
    with DisableTorchFunction():  # verification's own ops are not the model's
        site = resolve_site(site, anchor)
        run_drills(op, out, site, phase)
        sink = current_sink()
        if sink is not None:
            sink.on_gemm(product(op, x, y, out, bias, alpha, beta, form), site or None, phase)
        count_check()




def _matrix(t: Tensor) -> Tensor:
    """A vector as the one-row matrix a GEMM sees (``[K]`` -> ``[1, K]``)."""
    return t if t.dim() >= 2 else t.unsqueeze(0)


def _fold(t: Tensor) -> Tensor | None:
    """``t`` with its leading dims folded into rows, as a view; ``None`` when its strides
    do not allow one (a copy would cost what the check saves)."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def product(op: str, x: Tensor, y: Tensor, out: Tensor, bias: Tensor | None, alpha: float, beta: float,
            form: str) -> Gemm:
    """The ``Gemm`` that ``check_gemm``'s arguments describe, its operands laid out as the
    eager route would see them: a batch against a 2-D right operand folded into the rows
    of one matrix product where the strides allow (one native call over contiguous rows
    instead of a walk over the batch)."""
    if form == "atb_sum":  # sum_i x_i^T @ y_i: the rows of every batch entry are the inner dim
        a, b = x.reshape(-1, x.shape[-1]).t(), y.reshape(-1, y.shape[-1])
    else:
        a = x.mT if form == "atb" else _matrix(x)
        b = y.mT if form == "abt" else y
    c = _matrix(out) if out.dim() < 2 else out
    if b.dim() == 2 and a.dim() > 2:
        a2, c2 = _fold(a), _fold(c)
        if a2 is not None and c2 is not None:
            a, c = a2, c2
    return Gemm(op, a, b, c, bias, alpha, beta)


def check(x: Tensor, y: Tensor, out: Tensor, form: str, op: str, site: str, phase: str,
          bias: Tensor | None = None, alpha: float = 1.0, beta: float = 1.0, anchor: Tensor | None = None) -> None:
    """Put a check of ``out`` into the graph being traced (or run it, in an eager frame)."""
    torch.ops.sdc_guard.check_gemm(x, y, out, bias, alpha, beta, form, anchor, op, site, phase)


#: What ``unverified_ops`` counts, once per backward GEMM (or attention backward), for the
#: backward of a GEMM an eager frame of the compiled route ran inside a non-reentrant
#: activation checkpoint (``tapped``).
CHECKPOINTED_BACKWARD = "backward of a checkpointed eager GEMM"


def in_checkpoint_forward() -> bool:
    """Whether this call runs in the forward of a non-reentrant activation checkpoint
    (``torch.utils.checkpoint``, ``use_reentrant=False``: its saved-tensor hooks are the
    innermost ones).

    Why: the checkpoint recomputes that forward during the backward, and the function mode
    is not on then (a torch function mode is off while its handler runs, and the backward
    starts in the handler of ``Tensor.backward``): a tap there would save tensors the
    recomputation does not, which the checkpoint refuses (``CheckpointError``). Such a GEMM
    is checked in the forward without a tap, and its backward is counted. Reads a private
    autograd API (``core/torch_private.py``)."""
    hooks = top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook.")


# --- the taps --------------------------------------------------------------------------

#: per kind of call: (forward form, dA's form and operands, dB's form and operands); the
#: operands name what ``GemmTapIn``'s backward has: "g" (the output's gradient), "x", "y"
#: (the call's two operands, as saved)
KINDS: dict[str, tuple[str, tuple[str, str, str], tuple[str, str, str]]] = {
    # F.linear(x, w): out = x @ w^T; dx = g @ w; dw = sum_i g_i^T @ x_i
    "linear": ("abt", ("ab", "g", "y"), ("atb_sum", "g", "x")),
    # a @ b with a 2-D b (a a matrix, a vector or a batch): db = sum_i a_i^T @ g_i
    "fold": ("ab", ("abt", "g", "y"), ("atb_sum", "x", "g")),
    # a @ b, both matrices or batches of the same shape (mm, bmm, addmm, baddbmm, matmul)
    "batch": ("ab", ("abt", "g", "y"), ("atb", "x", "g")),
}


class GemmTapIn(torch.autograd.Function):
    """Identity on the call's operands ``x``, ``y`` and a carrier of the output's
    ``shape``; the backward checks the call's gradients of ``x`` and ``y`` (see the module
    doc). ``kind``: a key of ``KINDS``; ``op``: the backward checks' name. ``anchor``: the
    parameter that names the site when it is neither ``x`` nor ``y`` (autocast's cast of it
    is), else ``None`` with ``role`` saying which of them it is (1, 2; 0: none): dynamo
    cannot trace an ``autograd.Function`` handed one tensor twice."""

    @staticmethod
    def forward(x: Tensor, y: Tensor, anchor: Tensor | None, role: int, kind: str, alpha: float, op: str,
                site: str, shape: tuple) -> tuple:
        # views, not the inputs themselves, and a carrier of its own: dynamo's tracing of
        # autograd.Function needs each output to be a tensor of its own
        return x.view_as(x), y.view_as(y), x.new_zeros(()).expand(shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x, y, anchor, role, kind, alpha, op, site, _ = inputs
        ctx.save_for_backward(x, y, anchor)
        ctx.role, ctx.kind, ctx.alpha, ctx.op, ctx.site = role, kind, alpha, op, site
        ctx.set_materialize_grads(False)  # an operand the call takes untapped has no gradient here

    @staticmethod
    def backward(ctx: Any, dx: Tensor | None, dy: Tensor | None, g: Tensor | None) -> tuple:
        x, y, anchor = ctx.saved_tensors
        anchor = (anchor, x, y)[ctx.role]
        if g is not None:
            have = {"g": g, "x": x, "y": y}
            _, (form_x, *of_x), (form_y, *of_y) = KINDS[ctx.kind]
            # an operand that needs no gradient went to the call untapped: whatever arrives
            # for it here (zeros, where a backend materialises them) is no GEMM's output
            if dx is not None and ctx.needs_input_grad[0]:
                check(have[of_x[0]], have[of_x[1]], dx, form_x, ctx.op, ctx.site, "backward", alpha=ctx.alpha,
                      anchor=anchor)
            if dy is not None and ctx.needs_input_grad[1]:
                check(have[of_y[0]], have[of_y[1]], dy, form_y, ctx.op, ctx.site, "backward", alpha=ctx.alpha,
                      anchor=anchor)
        return dx, dy, None, None, None, None, None, None, None


class GemmTapOut(torch.autograd.Function):
    """Identity on the call's output; its backward hands ``g`` to ``GemmTapIn`` through
    the carrier."""

    @staticmethod
    def forward(out: Tensor, carrier: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        return g, g


def tapped(call: Any, x: Tensor, y: Tensor, kind: str, op: str, site: str, alpha: float = 1.0,
           bias: Tensor | None = None, beta: float = 1.0, anchor: Tensor | None = None) -> Tensor:
    """``call(x, y)`` (the user's call with its two matrix operands, as given), its output
    checked, and, when either operand needs a gradient, its gradients checked in the
    backward. ``op``: the forward's name in reports; the backward checks are ``mm`` for
    matrices, ``bmm`` for batches. ``anchor``: the parameter among the operands (before
    autocast's cast), which names the site at run time."""
    form = KINDS[kind][0]
    grads = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    if not grads or in_checkpoint_forward():
        out = call(x, y)
        check(x, y, out, form, op, site, "forward", bias, alpha, beta, anchor)
        for needed in (x.requires_grad, y.requires_grad) if grads else ():
            if needed:  # one backward GEMM per operand that needs a gradient
                unverified(CHECKPOINTED_BACKWARD)
        return out
    backward_op = "bmm" if kind == "batch" and x.dim() > 2 else "mm"
    role = 0 if anchor is None else 1 if anchor is x else 2 if anchor is y else 0
    tx, ty, carrier = GemmTapIn.apply(x, y, anchor if role == 0 else None, role, kind, alpha, backward_op, site,
                                      _out_shape(kind, x, y))
    # an operand that needs no gradient goes to the call as it is: tapped, it would need one
    out = call(tx if x.requires_grad else x, ty if y.requires_grad else y)
    check(x, y, out, form, op, site, "forward", bias, alpha, beta, anchor)
    return GemmTapOut.apply(out, carrier)


def _out_shape(kind: str, x: Tensor, y: Tensor) -> tuple:
    n = y.shape[0] if kind == "linear" else y.shape[-1]
    return (*x.shape[:-1], n)


# --- products the taps cannot express: gradients computed here -------------------------

def _grad_op(x: Tensor, y: Tensor) -> str:
    if x.dim() == 2 and y.dim() == 2:
        return "mm"
    return "bmm" if x.dim() > 2 and y.dim() > 2 else "matmul"


class CheckedGemm(torch.autograd.Function):
    """``a @ b`` (a ``torch.matmul`` whose batch dims broadcast, or a vector operand made a
    one-row or one-column matrix by the route), checked in the forward, with both gradient
    GEMMs computed here and checked in the backward (each summed over the batch dims its
    operand was broadcast along, as autograd does)."""

    @staticmethod
    def forward(a: Tensor, b: Tensor, site: str) -> Tensor:
        out = torch.matmul(a, b)
        check(a, b, out, "ab", "matmul", site, "forward")
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        a, b, site = inputs
        ctx.save_for_backward(a, b)
        ctx.site = site

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = torch.matmul(g, b.mT)
            check(g, b, ga, "abt", _grad_op(g, b), ctx.site, "backward")
            ga = ga.sum_to_size(a.shape)
        if ctx.needs_input_grad[1]:
            gb = torch.matmul(a.mT, g)
            check(a, g, gb, "atb", _grad_op(a, g), ctx.site, "backward")
            gb = gb.sum_to_size(b.shape)
        return ga, gb, None


# --- autocast --------------------------------------------------------------------------

#: devices whose autocast casts every GEMM function's floating operands (a lower-precision
#: op on CPU and CUDA: linear, matmul, mm, bmm, addmm, baddbmm)
AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """Autocast's dtype for a GEMM function on ``t``'s device, or ``None`` when autocast
    is off there (or the device is one whose autocast lists this route does not know)."""
    device = t.device.type
    if device not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def autocast_cast(t: Any, dtype: torch.dtype | None) -> Any:
    """``t`` as autocast hands it to the kernel: a floating tensor but float64 cast to
    ``dtype`` (the same ``to`` autocast makes); anything else as it is."""
    if dtype is None or not isinstance(t, Tensor) or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
        return t
    return t.to(dtype)


def parameter_of(*tensors: Any) -> Tensor | None:
    """The first of ``tensors`` that is a parameter (a GEMM's anchor), or ``None``."""
    return next((t for t in tensors if isinstance(t, torch.nn.Parameter)), None)


def linear_call(bias: Tensor | None) -> Any:
    """``F.linear`` with ``bias`` bound: the user's call, given its two matrix operands."""
    return lambda x, w: F.linear(x, w, bias)
