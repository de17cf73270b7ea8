"""Floating-point facts V-ABFT needs per dtype, and the default ``e_max`` table.

Why a module of its own: the same ``e_max`` must mean the same thing on every backend
(docs/ALGORITHM.md, "Threshold of the screen"), so the constants that turn ``e_max`` into a
threshold live in one place that
the torch backend, the NPU bridge and the Triton kernel all read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .accumulation import accumulation_model

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

#: Largest error near zero of one element of C stored in its dtype, on a device that may
#: flush subnormal results to zero (CPUs with FTZ / DAZ, GPUs): the smallest normal number
#: for fp32 and bf16 (which share fp32's exponent range), and the subnormal step for fp16,
#: whose subnormals every device keeps. docs/ALGORITHM.md, "Underflow floor".
TINY: dict[torch.dtype, float] = {
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-126,
    torch.float32: 2.0**-126,
}

#: Smallest normal fp32 number: what a flushing fp32 accumulator may lose per product and
#: per addition when the values fall below it.
FTZ_STEP = 2.0**-126

#: Unit roundoff of C's dtype: the largest relative error of rounding one element into it.
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float32: 2.0**-24,
}

def element_floor(k: int, c_dtype: torch.dtype) -> float:
    """The underflow part of one element's legitimate error: storing C near zero
    (``TINY``) plus a flushed fp32 accumulator's loss over ``k`` products and ``k + 1``
    additions (``(2k + 2) FTZ_STEP``). The screen's floor is ``n_s`` times this; the
    confirmation adds it to every element's bound.

    >>> element_floor(0, torch.float16) == 2.0**-24 + 2 * 2.0**-126
    True
    """
    return TINY[c_dtype] + (2 * k + 2) * FTZ_STEP


def bias_rounding(c_dtype: torch.dtype) -> float:
    """Factor of ``sum |beta * r * bias|`` added to T for a GEMM with bias.

    C's own final rounding, bias part included, is the self-bounded term of the
    threshold (it reads C). What is left is fp32 arithmetic proportional to the bias:
    the checksum sums of C and of the bias, each an fp32 sum of up to 256 terms
    (pairwise: at most ``log2(256) = 8`` roundings deep, ``2 * 8 u_fp32``), and the
    device's fp32 epilogue adding ``beta * bias`` (``3 u_fp32``, as the confirmation
    assumes). Without the checksum part, fp32 ``addmm`` with a bias 1000x the product
    raised false alarms (D/T up to 1.5 at K = 70). ``c_dtype`` is accepted for the
    callers of the earlier signature (``2 (u_C + 8 u_fp32)``) and not used.

    >>> bias_rounding(torch.float32) == 19 * 2.0**-24
    True
    """
    return (2 * 8 + 3) * UNIT_ROUNDOFF[torch.float32]


#: ``e_max`` of the bracket (the accumulation's share of T) where the device accumulates in
#: fp32 with exact or fp32 products: bf16 / fp16 on CPU, on CUDA without reduced-precision
#: reduction and on Ascend; fp32 at full precision (the operator's fp32 recommendation).
ACCUMULATION_E_MAX = 2e-5
#: ``e_max`` where something is rounded coarser than fp32 before C's final rounding: split-K
#: partials in bf16 / fp16 (CUDA's default), an fp16 accumulator, fp32 inputs rounded to
#: TF32 (the operator's bf16 recommendation, the earlier default).
REDUCED_E_MAX = 1e-3
#: Default ``e_max`` by input dtype on a device that accumulates in fp32 (CPU).
DEFAULT_E_MAX: dict[torch.dtype, float] = {
    torch.bfloat16: ACCUMULATION_E_MAX,
    torch.float16: ACCUMULATION_E_MAX,
    torch.float32: ACCUMULATION_E_MAX,
}

#: fp32 whose product was rounded like a 10-bit-mantissa format (TF32 and friends).
REDUCED_FP32_E_MAX = REDUCED_E_MAX

#: Segment width S: columns per checksum segment.
SEGMENT = 256

#: Robustness constant ``c`` of the shipping NPU operator's threshold.
C_ROBUST = 4.0

_overrides: dict[torch.dtype, float] = {}


def check_dtype(name: str, dtype: torch.dtype) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``dtype`` is one V-ABFT supports.

    >>> check_dtype("a", torch.float32)
    """
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: expected dtype bfloat16, float16 or float32, got {dtype}"
        )


def fp32_matmul_is_reduced(device: torch.device | str = "cpu") -> bool:
    """True when fp32 matmuls on ``device`` may be rounded like TF32 / bf16.

    Reads the global knobs PyTorch itself reads: ``torch.backends.cuda.matmul.allow_tf32``
    for CUDA and ``torch.get_float32_matmul_precision()`` everywhere.

    >>> fp32_matmul_is_reduced("cpu") in (True, False)
    True
    """
    if torch.get_float32_matmul_precision() != "highest":
        return True
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return kind == "cuda" and bool(torch.backends.cuda.matmul.allow_tf32)


def set_default_e_max(dtype: torch.dtype, e_max: float | None) -> None:
    """Override the process-wide default ``e_max`` for ``dtype`` (``None`` removes it).

    The override is what a calibration on the user's hardware recommends (``sdc-guard
    bench calibrate``); a per-call ``e_max=`` still wins over it.

    >>> set_default_e_max(torch.bfloat16, 2e-3); default_e_max(torch.bfloat16)
    0.002
    >>> set_default_e_max(torch.bfloat16, None)
    """
    check_dtype("dtype", dtype)
    if e_max is None:
        _overrides.pop(dtype, None)
        return
    check_e_max(e_max)
    _overrides[dtype] = float(e_max)


#: Largest ``e_max`` accepted. ``e_max`` is a relative rounding-error coefficient (bf16's
#: unit roundoff is 3.9e-3); at 1 the threshold already exceeds the sums it checks
#: (``bench calibrate`` measures at 1), so a larger one can only hide corruption, and
#: one near fp32's maximum overflows the threshold itself.
E_MAX_LIMIT = 1.0


def check_e_max(e_max: float) -> float:
    """Return ``e_max`` as a float, or raise ``ValueError``/``TypeError`` naming it.

    ``e_max`` must be in (0, ``E_MAX_LIMIT``]: 0 makes every rounding error an alarm.

    >>> check_e_max(1e-3)
    0.001
    """
    if isinstance(e_max, bool) or not isinstance(e_max, (int, float)):
        raise TypeError(f"e_max: expected a float in (0, {E_MAX_LIMIT:g}], got {type(e_max).__name__} {e_max!r}")
    if not math.isfinite(e_max) or not 0 < e_max <= E_MAX_LIMIT:
        raise ValueError(f"e_max: expected a finite float in (0, {E_MAX_LIMIT:g}] (defaults: 2e-5 with fp32 "
                         f"accumulation, 1e-3 with reduced precision), got {e_max!r}")
    return float(e_max)


def default_e_max(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """The ``e_max`` used when a call passes none: an override (``set_default_e_max``),
    else the accumulation model's (``accumulation.accumulation_model``): ``ACCUMULATION_E_MAX``
    where the device accumulates in fp32, ``REDUCED_E_MAX`` where it rounds partial sums,
    the accumulator or fp32 inputs coarser (CUDA's default for bf16 / fp16, TF32).

    >>> default_e_max(torch.bfloat16, "cpu")
    2e-05
    """
    if dtype not in DEFAULT_E_MAX:
        check_dtype("dtype", dtype)
    if dtype in _overrides:
        return _overrides[dtype]
    dev = device if isinstance(device, torch.device) else torch.device(device)
    return REDUCED_E_MAX if accumulation_model(dev, dtype).reduced else DEFAULT_E_MAX[dtype]


def resolve_e_max(e_max: float | None, dtype: torch.dtype, device: torch.device) -> float:
    """``e_max`` if given (validated), else the default for ``dtype`` on ``device``."""
    if e_max is None:
        return default_e_max(dtype, device)
    return check_e_max(e_max)


#: The screens to choose from (``protect(screen=...)``, ``verify_matmul(screen=...)``).
#: Both read C for its own rounding, in a way a corrupted element can raise by at most
#: ``u_C`` of its error (docs/ALGORITHM.md, "Reading C"): ``"default"`` bounds it
#: rigorously, ``u_C / (1 - u_C) sum |r C|``, and so suspects almost no clean product;
#: ``"tight"`` models it as independent roundings (six standard deviations, plus a
#: coherent share ``u_C |sum r C|`` for segments whose elements round alike), sees
#: errors about three times smaller in bf16, and suspects more clean products, each of
#: which the exact confirmation then clears at a cost of ``O(K * 256)``. Neither ever
#: acts on a suspect alone.
SCREENS = ("default", "tight")
#: Standard deviations of the tight screen's probabilistic rounding term.
TIGHT_SIGMAS = 6.0


@dataclass(frozen=True)
class ScreenTerms:
    """The threshold's terms beyond the bracket, as coefficients (docs/ALGORITHM.md, "Threshold").

    ``acc``: of ``|alpha| (|A| @ Babs)``, one rounding of the accumulator at its precision
    (``u_acc``: fp32, or C's dtype for reduced split-K partials / an fp16 accumulator):
    the backstop for operands whose accumulation the bracket underestimates.
    ``bounded``: share of the self-bounded ``u_C / (1 - u_C) sum |r C|``; ``sigmas``: of the
    probabilistic ``u_C sqrt(sum (r C)^2 / 3)``; ``coherent``: share of ``u_C |sum r C|``.
    With ``sigmas``, C's rounding term is ``min(c_sq sqrt(Q) + c_coh |sum r C|, c_abs sum |r C|)``,
    ``Q = sum (r C)^2`` in fp32, and the rigorous ``c_abs sum |r C|`` alone where ``Q`` is not
    a normal fp32 number (C's squares left fp32's range): the minimum of a rigorous bound
    and a statistical one never exceeds the rigorous one.
    """

    acc: float = UNIT_ROUNDOFF[torch.float32]
    bounded: float = 1.0
    sigmas: float = 0.0
    coherent: float = 0.0

    def coefficients(self, c_dtype: torch.dtype, alpha: float = 1.0,
                     epilogue: bool = False) -> tuple[float, float, float, float]:
        """``(a_round, c_abs, c_sq, c_coh)``: the factors of ``|A| @ Babs``, ``sum |r C|``,
        ``sqrt(sum (r C)^2)`` and ``|sum r C|`` in T for C of ``c_dtype``; ``epilogue``
        (``alpha != 1`` or a bias) adds the fp32 epilogue's ``3 u_fp32`` to the first.

        >>> ScreenTerms().coefficients(torch.bfloat16)[1] == 2.0**-8 / (1 - 2.0**-8)
        True
        """
        u = UNIT_ROUNDOFF[c_dtype]
        acc = self.acc + (3 * UNIT_ROUNDOFF[torch.float32] if epilogue else 0.0)
        return (abs(alpha) * acc, self.bounded * u / (1.0 - u), self.sigmas * u / math.sqrt(3.0),
                self.coherent * u)


def screen_terms(screen: str, dtype: torch.dtype, device: torch.device) -> ScreenTerms:
    """The ``ScreenTerms`` of ``screen`` for inputs of ``dtype`` on ``device``: ``acc``
    from the accumulation model (``u_C`` for reduced split-K partials, the accumulator's
    roundoff otherwise).

    >>> screen_terms("tight", torch.bfloat16, torch.device("cpu")).sigmas
    6.0
    """
    model = accumulation_model(device, dtype)
    acc = max(model.roundoff, UNIT_ROUNDOFF[dtype] if model.reduced_splits else 0.0)
    if check_screen(screen) == "default":
        return ScreenTerms(acc)
    return ScreenTerms(acc, bounded=1.0, sigmas=TIGHT_SIGMAS, coherent=1.0)


def check_screen(screen: object) -> str:
    """Return ``screen`` or raise naming it.

    >>> check_screen("tight")
    'tight'
    """
    if not isinstance(screen, str) or screen not in SCREENS:
        raise ValueError(f"screen: expected one of {', '.join(map(repr, SCREENS))}, got {screen!r}")
    return screen


def resolve_screen(screen: str, e_max: float | None, dtype: torch.dtype,
                   device: torch.device) -> tuple[float, ScreenTerms]:
    """``(e_max, terms)`` of ``screen`` for inputs of ``dtype`` on ``device``: an explicit
    ``e_max`` wins; both screens share the bracket's ``e_max`` and differ in C's rounding.

    >>> resolve_screen("default", None, torch.bfloat16, torch.device("cpu"))[0]
    2e-05
    """
    terms = screen_terms(screen, dtype, device)
    return resolve_e_max(e_max, dtype, device), terms


def overflow_limit(dtype: torch.dtype) -> float:
    """Magnitude above which a product may legitimately overflow C or the fp32 checksum.

    The checksum adds up to ``SEGMENT`` elements in fp32, so anything above
    ``float32.max / SEGMENT`` may overflow the checksum even when C is finite.
    """
    return min(torch.finfo(dtype).max, torch.finfo(torch.float32).max / SEGMENT)
