"""Floating-point facts V-ABFT needs per dtype, and the default ``e_max`` table.

Why a module of its own: the same ``e_max`` must mean the same thing on every backend
(VABFT.md), so the constants that turn ``e_max`` into a threshold live in one place that
the torch backend, the NPU bridge and the Triton kernel all read.
"""

from __future__ import annotations

import math

import torch

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

    VABFT.md's ``2 u_C`` covers rounding C's bias part to C's dtype. The checksum sums of
    C and of the bias are themselves fp32 sums of up to 256 terms (pairwise: at most
    ``log2(256) = 8`` roundings deep), whose error is also proportional to the bias when
    the bias dominates C: ``2 * 8 * u_fp32`` more. Without it, fp32 ``addmm`` with a bias
    1000x the product raised false alarms (D/T up to 1.5 at K = 70).

    >>> bias_rounding(torch.float32) == 2 * (2.0**-24 + 8 * 2.0**-24)
    True
    """
    return 2.0 * (UNIT_ROUNDOFF[c_dtype] + 8 * UNIT_ROUNDOFF[torch.float32])


#: VABFT.md default ``e_max`` by input dtype (fp32 computed at full precision).
DEFAULT_E_MAX: dict[torch.dtype, float] = {
    torch.bfloat16: 1e-3,
    torch.float16: 1e-3,
    torch.float32: 2e-5,
}

#: fp32 whose product was rounded like a 10-bit-mantissa format (TF32 and friends).
REDUCED_FP32_E_MAX = 1e-3

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
        raise ValueError(f"e_max: expected a finite float in (0, {E_MAX_LIMIT:g}] (defaults: bf16/fp16 1e-3, "
                         f"fp32 2e-5), got {e_max!r}")
    return float(e_max)


def default_e_max(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """The ``e_max`` used when a call passes none: override, else the VABFT.md table.

    >>> default_e_max(torch.float32, "cpu") in (2e-5, 1e-3)
    True
    """
    if dtype not in DEFAULT_E_MAX:
        check_dtype("dtype", dtype)
    if dtype in _overrides:
        return _overrides[dtype]
    if dtype == torch.float32 and fp32_matmul_is_reduced(device):
        return REDUCED_FP32_E_MAX
    return DEFAULT_E_MAX[dtype]


def resolve_e_max(e_max: float | None, dtype: torch.dtype, device: torch.device) -> float:
    """``e_max`` if given (validated), else the default for ``dtype`` on ``device``."""
    if e_max is None:
        return default_e_max(dtype, device)
    return check_e_max(e_max)


#: The screens to choose from (``protect(screen=...)``, ``verify_matmul(screen=...)``):
#: ``"default"`` bounds C's rounding by its worst case, ``u_C |A| @ |B|r``, and so suspects
#: almost no clean product (docs/ALGORITHM.md); ``"tight"`` keeps a small share of that
#: term and a smaller ``e_max``, and sees smaller errors, at the price of suspecting more
#: clean products, each of which the exact confirmation then clears at a cost of
#: ``O(K * 256)``. Neither ever acts on a suspect alone.
SCREENS = ("default", "tight")
#: ``e_max`` of the tight screen by input dtype (fp32 computed at full precision).
TIGHT_E_MAX: dict[torch.dtype, float] = {
    torch.bfloat16: 2.5e-4,
    torch.float16: 2.5e-4,
    torch.float32: 5e-6,
}
#: Share of C's worst-case rounding term the tight screen keeps.
TIGHT_ROUNDING = 1.0 / 32


def check_screen(screen: object) -> str:
    """Return ``screen`` or raise naming it.

    >>> check_screen("tight")
    'tight'
    """
    if not isinstance(screen, str) or screen not in SCREENS:
        raise ValueError(f"screen: expected one of {', '.join(map(repr, SCREENS))}, got {screen!r}")
    return screen


def resolve_screen(screen: str, e_max: float | None, dtype: torch.dtype,
                   device: torch.device) -> tuple[float, float]:
    """``(e_max, rounding)`` of ``screen`` for inputs of ``dtype`` on ``device``: an explicit
    ``e_max`` wins; ``rounding`` is the share of C's worst-case rounding term kept.

    >>> resolve_screen("default", None, torch.bfloat16, torch.device("cpu"))
    (0.001, 1.0)
    """
    if check_screen(screen) == "default":
        return resolve_e_max(e_max, dtype, device), 1.0
    if e_max is not None:
        return check_e_max(e_max), TIGHT_ROUNDING
    if dtype == torch.float32 and fp32_matmul_is_reduced(device) and dtype not in _overrides:
        return REDUCED_FP32_E_MAX / 4, TIGHT_ROUNDING
    return (_overrides[dtype] / 4 if dtype in _overrides else TIGHT_E_MAX[dtype]), TIGHT_ROUNDING


def overflow_limit(dtype: torch.dtype) -> float:
    """Magnitude above which a product may legitimately overflow C or the fp32 checksum.

    The checksum adds up to ``SEGMENT`` elements in fp32, so anything above
    ``float32.max / SEGMENT`` may overflow the checksum even when C is finite.
    """
    return min(torch.finfo(dtype).max, torch.finfo(torch.float32).max / SEGMENT)
