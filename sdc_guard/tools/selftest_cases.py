"""What ``sdc-guard selftest`` checks: the GEMMs and the attention of a training step, at
its dtypes and shapes, on each backend's device, against exact references.

Each case is checked three ways on a backend:

- ``exact``: a known-answer test of the device itself. The operands are small integers
  (GEMMs: entries in {-1, 0, 1}; attention: integer queries and values, keys whose
  scores are all equal), so the product every correct device computes is exact, whatever
  its order of summation, and equal bit for bit to the fp64 reference. Any wrong bit in
  the device's GEMM or attention kernel shows, however small: the check that bad
  hardware fails, where the guard's screen (an error bound) would let a low mantissa bit
  pass.
- ``clean``: real-valued operands (activations N(0, 1), weights N(0, 1/K)) multiplied by
  the device, verified by the backend's check (the screen, then exact confirmation of
  any suspect): no detection allowed, as in training.
- ``caught``: the same product with one element's top exponent bit flipped (as
  ``sdc_guard.drill`` does): the backend must find exactly that element's row and
  segment. For attention, a drilled fault in the fused kernel's output, under
  ``protect()``: the guard must confirm it.

The shapes are those of one transformer layer: ``SHAPES["training"]`` 256 tokens, d_model
512, 8 heads (the default); ``"large"`` 1024 tokens, d_model 2048, 16 heads (for GPUs; its
fp64 references take seconds on a CPU, once per run); ``"small"`` divides the default's
sizes by 8, for the Triton interpreter and quick checks. Operands of a new draw each
round (``--burn``); the known answers are the same every round.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import backends
from ..backends import Backend
from ..runtime.drills.inject import GemmFault, drill, flip_bit
from ..runtime.lifecycle.guard import protect
from ..verify import classify, make_request

#: the top exponent bit of each dtype: the flip a drill makes by default
TOP_BIT = {torch.float32: 30, torch.float16: 14, torch.bfloat16: 14}
#: largest integer each dtype holds exactly (its significand): known answers stay below it
EXACT_INT = {torch.float32: 2 ** 24, torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Case:
    """One operation of a training step: a GEMM ``[batch..] [m, k] @ [k, n]`` (``layout``
    says which operand is a transposed view, as in a linear layer's forward or its
    weight gradient) or fused attention ``[1, heads, length, head_dim]``."""

    name: str
    op: str  #: "gemm" or "attention"
    m: int = 0
    k: int = 0
    n: int = 0
    batch: int = 0  #: 0: a 2-D GEMM
    layout: str = "nn"  #: "nt": B is W.t() (linear forward); "tn": A is a transpose (weight gradient)
    heads: int = 0
    length: int = 0
    head_dim: int = 0


def _shapes(tokens: int, d: int, heads: int) -> tuple[Case, ...]:
    hd = d // heads
    return (
        Case("qkv projection", "gemm", m=tokens, k=d, n=3 * d, layout="nt"),
        Case("mlp weight gradient", "gemm", m=4 * d, k=tokens, n=d, layout="tn"),
        Case("attention scores", "gemm", m=tokens, k=hd, n=tokens, batch=heads),
        Case("fused attention", "attention", heads=heads, length=tokens, head_dim=hd),
    )


SHAPES: dict[str, tuple[Case, ...]] = {
    "small": _shapes(32, 64, 4), "training": _shapes(256, 512, 8), "large": _shapes(1024, 2048, 16),
}


@dataclass
class CheckResult:
    """One (backend, dtype, case) of one round."""

    backend: str
    device: str
    dtype: str
    case: str
    exact: bool | None = None  #: the device matched the exact reference bit for bit
    clean: bool | None = None  #: the backend's check passed the device's correct product
    caught: bool | None = None  #: the backend found the corrupted element
    skipped: str | None = None  #: why the backend does not take this case (not a failure)
    details: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.skipped is not None or (self.exact is not False and self.clean is not False
                                            and self.caught is not False)


@functools.lru_cache(maxsize=8)
def _known_gemm(case: Case, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Integer operands whose exact product fits every dtype's significand (bf16's, the
    smallest), and that product in fp64; the same for every dtype and round of one seed
    (kept: the fp64 reference of a large case costs seconds). Drawn again in the rare
    draw that does not fit."""
    gen = torch.Generator().manual_seed(seed)
    batch = (case.batch,) if case.batch else ()
    for _ in range(16):
        a = torch.randint(-1, 2, (*batch, case.m, case.k), generator=gen).double()
        b = torch.randint(-1, 2, (*batch, case.k, case.n), generator=gen).double()
        ref = a @ b
        if float(ref.abs().max()) <= min(EXACT_INT.values()):
            return a, b, ref
    raise RuntimeError(f"no known-answer operands for {case.name}")  # K far beyond the shapes here


def _laid_out(x: Tensor, transposed: bool) -> Tensor:
    """``x`` itself, or the same values read through a transposed view (``W.t()``)."""
    return x.transpose(-2, -1).contiguous().transpose(-2, -1) if transposed else x


def _on(x: Tensor, device: str, dtype: torch.dtype, transposed: bool = False) -> Tensor:
    return _laid_out(x.to(device=device, dtype=dtype), transposed)


def check_gemm(backend: Backend, device: str, dtype: torch.dtype, case: Case, seed: int,
               round_: int = 0) -> CheckResult:
    """The three checks of a GEMM case on ``backend`` (see the module docstring): the
    known answer of ``seed``, real-valued operands drawn anew for each round."""
    result = CheckResult(backend.name, device, str(dtype).removeprefix("torch."), case.name)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + round_)
    ta, tb = case.layout == "tn", case.layout == "nt"
    a64, b64, ref = _known_gemm(case, seed)
    a, b = _on(a64, device, dtype, ta), _on(b64, device, dtype, tb)
    req = make_request(a, b, torch.matmul(a, b))
    reason = backend.rejects(req)
    if reason is not None:
        result.skipped = reason
        return result
    c = torch.matmul(a, b)  # the device's GEMM, as training runs it
    wrong = c.double().cpu() != ref
    result.exact = not bool(wrong.any())
    if not result.exact:
        where = tuple(int(i) for i in torch.nonzero(wrong)[0])
        result.details.append(f"exact: {int(wrong.sum())} wrong element(s), first at {where}: "
                              f"{float(c.double().cpu()[where])} instead of {float(ref[where])}")
    # real-valued operands: the backend's check must pass the correct product ...
    batch = (case.batch,) if case.batch else ()
    x = torch.randn(*batch, case.m, case.k, generator=gen)
    w = torch.randn(*batch, case.k, case.n, generator=gen) / math.sqrt(case.k)
    a, b = _on(x, device, dtype, ta), _on(w, device, dtype, tb)
    c = torch.matmul(a, b)
    flags = _flags(backend, a, b, c)
    result.clean = not bool(flags.any())
    if not result.clean:
        result.details.append(f"clean: {int(flags.sum())} segment(s) flagged on a correct product")
    # ... and find one corrupted element, in its row and segment
    where = tuple(int(torch.randint(0, s, (), generator=gen)) for s in c.shape)
    bad = c.clone()
    flip_bit(bad, where, TOP_BIT[dtype], "flip")
    flags = _flags(backend, a, b, bad)
    hit = bool(flags[(*where[:-1], where[-1] // 256)]) and int(flags.sum()) == 1
    result.caught = hit
    if not hit:
        result.details.append(f"caught: a flipped bit at {where} gave {int(flags.sum())} flagged segment(s)")
    return result


def _flags(backend: Backend, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """The segments ``backend``'s check confirms as corrupted."""
    req = make_request(a, b, c)
    flags, _, _, _ = classify(req, backend.check(req))
    return flags.cpu()


class _Attention(nn.Module):
    """Fused attention as a model runs it, so that the guard and its drills see it."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v)


def known_attention(case: Case, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Integer queries and values; keys that differ only where the queries are zero, so
    that every score of a row is the same exact number: the softmax is exactly uniform
    over a power-of-two number of keys, and the output, each row's mean of the values, is
    exact in every dtype. Returns q, k, v and the exact output (fp64)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, case.heads, case.length, case.head_dim)
    half = case.head_dim // 2
    q = torch.randint(-1, 2, shape, generator=gen).double()
    q[..., half:] = 0
    k = torch.randint(-1, 2, shape, generator=gen).double()
    k[..., :half] = k[..., :1, :half]  # the same in every key where q is not zero
    v = torch.randint(-2, 3, shape, generator=gen).double()
    return q, k, v, v.mean(dim=-2, keepdim=True).expand(shape)


def check_attention(backend: Backend, device: str, dtype: torch.dtype, case: Case, seed: int,
                    round_: int = 0) -> CheckResult:
    """The three checks of fused attention with ``backend`` forced on the guard."""
    result = CheckResult(backend.name, device, str(dtype).removeprefix("torch."), case.name)
    if not _registered(backend):
        result.skipped = "fused attention is checked by the guard's screens, which this backend instance does not serve"
        return result
    if case.length & (case.length - 1):
        result.skipped = "no exact known answer for a sequence length that is not a power of two"
        return result
    q, k, v, ref = known_attention(case, seed)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + round_)
    out = F.scaled_dot_product_attention(*(t.to(device=device, dtype=dtype) for t in (q, k, v)))
    wrong = out.double().cpu() != ref
    result.exact = not bool(wrong.any())
    if not result.exact:
        result.details.append(f"exact: {int(wrong.sum())} wrong output element(s)")
    shape = (1, case.heads, case.length, case.head_dim)
    operands = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    result.clean, detections, checks = _guarded_attention(backend.name, operands)
    if not result.clean:
        result.details.append(f"clean: {detections} detection(s) in {checks} attention check(s) of correct results")
    caught, detections, _ = _guarded_attention(backend.name, operands, GemmFault(op="sdpa", sticky=True))
    result.caught = not caught and detections > 0
    if not result.caught:
        result.details.append("caught: a drilled fault in the attention output was not confirmed")
    return result


def _registered(backend: Backend) -> bool:
    """Whether ``backend`` is the one ``protect(backend=name)`` would use."""
    try:
        return backends.get(backend.name) is backend
    except ValueError:
        return False


def _guarded_attention(backend: str, operands: list[Tensor], fault: GemmFault | None = None) -> tuple[bool, int, int]:
    """Forward and backward of fused attention under ``protect(backend=...)``, with
    ``fault`` drilled: (no detection and every call checked, detections, calls checked)."""
    module = _Attention()
    q, k, v = (t.detach().clone().requires_grad_() for t in operands)
    faults = (fault,) if fault is not None else ()
    with drill(module, *faults), protect(module, backend=backend, calibrate_every=None) as guard:
        module(q, k, v).float().square().sum().backward()
    report = guard.last_report
    assert report is not None
    return not report.detections and report.attention_checks == 2, len(report.detections), report.attention_checks


def run_case(backend: Backend, device: str, dtype: torch.dtype, case: Case, seed: int,
             round_: int = 0) -> CheckResult:
    """One case on one backend; an exception is a failed check, not a crash of the test."""
    try:
        if case.op == "attention":
            return check_attention(backend, device, dtype, case, seed, round_)
        return check_gemm(backend, device, dtype, case, seed, round_)
    except Exception as exc:
        result = CheckResult(backend.name, device, str(dtype).removeprefix("torch."), case.name, exact=False)
        result.details.append(f"error: {type(exc).__name__}: {exc}")
        return result
