"""Public verification entry points: ``verify_matmul``, ``abft_verify``, ``matmul_checksum``.

``abft_verify`` is the operator-shaped primitive (the Ascend ``comp_row`` contract,
registered as a ``torch.library`` custom op so FakeTensor / meta tensors get its shape).
``verify_matmul`` is the rich entry point: it classifies every failed segment as
corruption, a legitimate overflow or unverifiable, and may synchronise with the host to
do so (the dispatch mode uses the device-only ``AbftCheck`` instead).

It sits above ``backends/`` (which it dispatches to), not in ``core/`` (which the
backends build on); ``sdc_guard.core.verify`` is its former path.

Operands are validated here, once, with errors that name the argument, what was expected
and what was received; the backends trust what they are given.
"""

from dataclasses import dataclass
from numbers import Real
from typing import Optional

import torch
from torch import Tensor

from . import backends
from .backends import GemmRequest
from .core.abft import AbftCheck
from .core.comp_row import encode_comp_row
from .core.confirm import candidates, confirm
from .core.precision import check_dtype, resolve_screen
from .core.segments import num_segments

KINDS = ("ok", "sdc", "overflow", "unverifiable")
_CPU = torch.device("cpu")


def _check_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _check_scalar(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return value


def check_operands(
    a: object,
    b: object,
    c: object,
    *,
    checksum_weight: object = None,
    bias: object = None,
    alpha: object = 1.0,
    beta: object = 1.0,
) -> None:
    """Raise ``TypeError`` / ``ValueError`` unless ``c = alpha * a @ b + beta * bias`` is well-formed.

    >>> check_operands(torch.ones(2, 3), torch.ones(3, 4), torch.ones(2, 4))
    >>> check_operands(torch.ones(2, 3), torch.ones(4, 4), torch.ones(2, 4))
    Traceback (most recent call last):
    ...
    ValueError: b: expected 3 rows (a has 3 columns), got shape (4, 4)
    """
    a, b, c = _check_tensor("a", a), _check_tensor("b", b), _check_tensor("c", c)
    for name, t in (("a", a), ("b", b), ("c", c)):
        check_dtype(name, t.dtype)
        if t.dim() < 2:
            raise ValueError(f"{name}: expected at least 2 dims [..., rows, cols], got shape {tuple(t.shape)}")
    if b.dtype != a.dtype:
        raise TypeError(f"b: expected dtype {a.dtype} (the dtype of a), got {b.dtype}")
    all_cpu = a.is_cpu and b.is_cpu and c.is_cpu  # a torch.device costs microseconds to make
    for name, t in (("b", b), ("c", c)):
        if not all_cpu and t.device != a.device:
            raise ValueError(f"{name}: expected device {a.device} (the device of a), got {t.device}")
    if b.shape[-2] != a.shape[-1]:
        raise ValueError(
            f"b: expected {a.shape[-1]} rows (a has {a.shape[-1]} columns), got shape {tuple(b.shape)}"
        )
    if a.dim() == 2 and b.dim() == 2:  # the common case: no batch to broadcast
        expected: tuple[int, ...] = (a.shape[0], b.shape[1])
    else:
        try:
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except RuntimeError:
            raise ValueError(
                f"b: batch dims {tuple(b.shape[:-2])} do not broadcast with a's {tuple(a.shape[:-2])}"
            ) from None
        expected = (*batch, a.shape[-2], b.shape[-1])
    if tuple(c.shape) != expected:
        raise ValueError(f"c: expected shape {expected} for a @ b, got {tuple(c.shape)}")
    if checksum_weight is not None:
        w = _check_tensor("checksum_weight", checksum_weight)
        if w.dim() != 1 or w.shape[0] != b.shape[-1]:
            raise ValueError(f"checksum_weight: expected shape ({b.shape[-1]},), got {tuple(w.shape)}")
        if not w.is_floating_point():
            raise TypeError(f"checksum_weight: expected a floating dtype, got {w.dtype}")
        if w.device != a.device:
            raise ValueError(f"checksum_weight: expected device {a.device}, got {w.device}")
    if bias is not None:
        bias_t = _check_tensor("bias", bias)
        if not bias_t.is_floating_point():
            raise TypeError(f"bias: expected a floating dtype, got {bias_t.dtype}")
        if bias_t.device != a.device:
            raise ValueError(f"bias: expected device {a.device}, got {bias_t.device}")
        try:
            if torch.broadcast_shapes(bias_t.shape, c.shape) != c.shape:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(f"bias: expected a shape broadcastable to {tuple(c.shape)}, got {tuple(bias_t.shape)}") from None
    _check_scalar("alpha", alpha)
    _check_scalar("beta", beta)


def make_request(
    a: Tensor, b: Tensor, c: Tensor, *, checksum_weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None, alpha: float = 1.0, beta: float = 1.0,
    e_max: Optional[float] = None, screen: str = "default",
) -> GemmRequest:
    """Validate the operands and resolve ``e_max`` and ``screen`` into a ``GemmRequest``."""
    check_operands(a, b, c, checksum_weight=checksum_weight, bias=bias, alpha=alpha, beta=beta)
    e_max, rounding = resolve_screen(screen, e_max, a.dtype, _CPU if a.is_cpu else a.device)
    return GemmRequest(
        a, b, c, e_max, checksum_weight=checksum_weight,
        bias=bias, alpha=float(alpha), beta=float(beta), rounding=rounding,
    )


# --- abft_verify: the operator-shaped custom op ------------------------------------------

def _comp_row_shape(a: Tensor, b: Tensor, c: Tensor) -> tuple[int, ...]:
    return (*c.shape[:-2], -(-a.shape[-2] // 8) * num_segments(b.shape[-1]))


def _comp_row(req: GemmRequest) -> Tensor:
    """The screen's ``comp_row`` of ``req``: all ones straight from the guard's path when
    the check is known clear on the host (the common case on CPU), else encoded from its
    bits."""
    chosen = backends.select(req)
    if chosen.clear_worst(req) is not None:  # clear: every segment passed
        a, b, c = req.a, req.b, req.c
        return torch.full(_comp_row_shape(a, b, c), 255, dtype=torch.uint8, device=c.device)
    return encode_comp_row(chosen.check(req).ok)


@torch.library.custom_op("sdc_guard::abft_verify", mutates_args=())
def _abft_verify_op(
    a: Tensor, b: Tensor, c: Tensor, checksum_weight: Optional[Tensor], e_max: float
) -> Tensor:
    return _comp_row(GemmRequest(a, b, c, e_max, checksum_weight=checksum_weight))


@_abft_verify_op.register_fake
def _abft_verify_fake(
    a: Tensor, b: Tensor, c: Tensor, checksum_weight: Optional[Tensor], e_max: float
) -> Tensor:
    return a.new_empty(_comp_row_shape(a, b, c), dtype=torch.uint8)


def abft_verify(
    a: Tensor, b: Tensor, c: Tensor, checksum_weight: Optional[Tensor] = None, *,
    e_max: Optional[float] = None,
) -> Tensor:
    """V-ABFT check of ``c == a @ b`` as the Ascend operator's ``comp_row`` bitstream.

    uint8 ``[..., ceil(M/8) * ceil(N/256)]``: byte ``s * ceil(M/8) + m // 8``, bit
    ``m % 8`` (LSB first, segment-major), 1 = OK, 0 = error, padding bits 1. Batched
    operands give one stream per batch element. Works on meta / fake tensors (shape only).

    >>> a, b = torch.randn(10, 64), torch.randn(64, 300)
    >>> abft_verify(a, b, a @ b).tolist()
    [255, 255, 255, 255]
    """
    req = make_request(a, b, c, checksum_weight=checksum_weight, e_max=e_max)
    if _traced(a, b, c):  # FakeTensor, meta, torch.compile: through the registered custom op
        return torch.ops.sdc_guard.abft_verify(a, b, c, checksum_weight, req.e_max)
    return _comp_row(req)  # eager: the custom op's dispatch alone cost ~25 us a call


def _traced(*tensors: Tensor) -> bool:
    """Whether these tensors only carry shapes (meta, fake) or a compiler is tracing."""
    if torch.compiler.is_compiling():
        return True
    return any(t.is_meta or type(t) is not Tensor and not isinstance(t, torch.nn.Parameter) for t in tensors)


# --- verify_matmul: the rich entry point -------------------------------------------------

@dataclass
class Verdict:
    """What ``verify_matmul`` found. Masks are bool ``[..., M, ceil(N/256)]``.

    ``ok`` is True when no corruption was confirmed (a legitimate overflow or an
    unverifiable segment is not corruption); ``kind`` says which case applies, with
    ``"sdc"`` > ``"overflow"`` > ``"unverifiable"`` > ``"ok"`` when several do. ``flags``
    are confirmed by exact recomputation (``sdc_guard.core.confirm``); ``screen_flags`` are what
    the fast screen suspected, a superset where the screen saw the corruption at all. The
    masks are read-only (those of a clear verdict are one broadcast all-False view).
    """

    ok: bool
    kind: str
    flags: Tensor  #: True where corruption was confirmed
    overflow: Tensor  #: True where a non-finite result is a legitimate overflow
    unverifiable: Tensor  #: True where non-finite inputs prevent a verdict
    ratio: float  #: the screen's worst D/T over verified segments (nan when the backend reports no D)
    backend: str  #: the backend that really ran
    e_max: float
    screen_flags: Tensor | None = None  #: True where the screen flagged (failed D <= T with finite inputs)

    @property
    def rows(self) -> list[int]:
        """Row indices (within the last two dims) with at least one flagged segment."""
        return torch.nonzero(self.flags.reshape(-1, *self.flags.shape[-2:]).any(0).any(-1)).flatten().tolist()

    @property
    def screen_misses(self) -> int:
        """Segments the screen flagged that the confirmation cleared (or did not examine)."""
        if self.screen_flags is None:
            return 0
        return int((self.screen_flags & ~self.flags & ~self.overflow).sum())


_FALSE: dict[torch.device, Tensor] = {}


def _all_false(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An all-False bool mask of ``shape``: a broadcast view of one element, so a clear
    verdict allocates nothing, and its masks are read-only (PyTorch refuses writes into
    an expanded tensor)."""
    key = _CPU if like.is_cpu else like.device
    false = _FALSE.get(key)
    if false is None:
        false = _FALSE[key] = torch.zeros((), dtype=torch.bool, device=key)
    return false.expand(shape)


def classify(req: GemmRequest, check: AbftCheck) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Confirm the screen's flags exactly and split them: (corruption, overflow,
    unverifiable, screen flags) masks. Host-synchronising; only does real work when some
    segment failed."""
    inputs_bad = check.inputs_bad.clone()
    flagged = candidates(check.ok, check.inputs_bad)
    if not bool(flagged.any()):
        empty = torch.zeros_like(flagged)
        return empty, empty, inputs_bad, flagged
    conf = confirm(req, check.ok, check.inputs_bad, check.ratio, on_host=True, limit=None)
    return conf.sdc, conf.overflow, inputs_bad, flagged


def verify_matmul(
    a: Tensor, b: Tensor, c: Tensor, *, bias: Optional[Tensor] = None, alpha: float = 1,
    beta: float = 1, e_max: Optional[float] = None, backend: Optional[str] = None,
    checksum_weight: Optional[Tensor] = None, screen: str = "default",
) -> Verdict:
    """Verify ``c == alpha * a @ b + beta * bias`` and say what is wrong, where.

    2-D or batched (broadcast batch dims) bf16 / fp16 / fp32 operands in any layout
    (``W.t()`` is read through its strides); ``bias`` broadcastable to ``c``. The screen
    (``screen="default"`` or ``"tight"``, ``e_max``) flags suspect segments, which are then
    confirmed or cleared by exact recomputation: ``Verdict.flags`` are confirmed.

    >>> a, b = torch.randn(4, 64), torch.randn(64, 300)
    >>> c = a @ b
    >>> verify_matmul(a, b, c).kind
    'ok'
    >>> bad = c.clone(); bad[2, 5] += 1e4
    >>> v = verify_matmul(a, b, bad); v.kind, v.rows
    ('sdc', [2])
    """
    req = make_request(a, b, c, checksum_weight=checksum_weight, bias=bias, alpha=alpha,
                       beta=beta, e_max=e_max, screen=screen)
    chosen = backends.select(req, backend)
    worst = chosen.clear_worst(req)  # the guard's own path
    if worst is not None:  # known clear on the host: nothing to classify
        none = _all_false((*c.shape[:-2], c.shape[-2], num_segments(c.shape[-1])), c)
        return Verdict(True, "ok", none, none, none, worst, chosen.name, req.e_max, none)
    check = chosen.check(req)
    flags, overflow, unverifiable, screen_flags = classify(req, check)
    if bool(flags.any()):
        kind = "sdc"
    elif bool(overflow.any()):
        kind = "overflow"
    elif bool(unverifiable.any()):
        kind = "unverifiable"
    else:
        kind = "ok"
    ratio = float("nan")
    if check.diff is not None and check.threshold is not None:
        verified = ~unverifiable & ~overflow & torch.isfinite(check.diff)
        if bool(verified.any()):
            ratio = float((check.diff / check.threshold)[verified].max())
    return Verdict(kind != "sdc", kind, flags, overflow, unverifiable, ratio, chosen.name, req.e_max, screen_flags)


def matmul_checksum(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Drop-in for ``torch_npu.matmul_checksum``: 0-dim bool tensor, True = anomaly.

    Read-only (the legacy path's in-place "self-heal" is gone) and synchronisation-free:
    the screen's flags are confirmed on the device (``sdc_guard.core.confirm``, a fixed number
    of them, worst first), and a legitimate overflow is not an anomaly.

    >>> a, b = torch.randn(8, 64), torch.randn(64, 32)
    >>> bool(matmul_checksum(a, b, a @ b))
    False
    """
    req = make_request(a, b, c)
    chosen = backends.select(req)
    if chosen.clear_worst(req) is not None:
        return torch.zeros((), dtype=torch.bool, device=c.device)
    check = chosen.check(req)
    return confirm(req, check.ok, check.inputs_bad, check.ratio).sdc.any()
