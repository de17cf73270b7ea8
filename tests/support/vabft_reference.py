"""Independent float64 NumPy implementation of the V-ABFT screen (``docs/ALGORITHM.md``; 2-D only).

Why it exists: ``sdc_guard.core.abft`` computes V-ABFT in fp32 PyTorch, and the NPU stand-in
needs the operator's math without PyTorch kernels. Writing the formulas a second time, in
float64, straight from the specification and without importing ``sdc_guard``, gives the
tests a yardstick whose own rounding is ~1e-16 relative, far below anything fp32 does.

Two readings of the specification had to be made; both are stated where they are used:

- ``alpha`` scales the variance-adaptive part of ``T`` by ``|alpha|`` (the threshold
  bounds the rounding of ``alpha * (A @ B)``); the underflow floor ``T_abs`` is not scaled.
  The V-ABFT paper says how ``alpha`` enters ``D`` but not ``T`` (docs/ALGORITHM.md, "The question").
- the bias rounding term weighs each column by ``|r[n]|``: ``2 u_C sum |beta r[n] bias|``.
  The paper writes ``sum |beta * bias|``; the two coincide for the default all-ones ``r``,
  and only the weighted form bounds the rounding of ``sum r * out`` when ``|r| > 1``.

``roundoff_floor=True`` is sdc_guard's screen (docs/ALGORITHM.md), with its documented
departures from the operator: one accumulator rounding of the worst-case magnitude,
``u_acc |alpha| (|A| @ |B| r)`` per segment (``acc_roundoff``: 2^-24 for fp32
accumulation; plus ``3 u_fp32`` with an epilogue, ``alpha != 1`` or a bias); C's own
rounding read from C, ``u_C / (1 - u_C) sum |r C|`` for ``screen="default"``,
``min(6 u_C sqrt(sum (r C)^2 / 3) + u_C |sum r C|, that rigorous term)`` for
``screen="tight"`` (the rigorous one alone where C's fp32 squares leave fp32's range); a
finite ``T`` is part of a pass (it reads C); the underflow floor
``n_s (tiny_C + (2K + 2) 2^-126)`` (a device may flush subnormals: ``tiny_C`` is 2^-126
for fp32 / bf16 C); the bias term covers the fp32 checksum sums and the epilogue,
``19 u_fp32 sum |beta r bias|`` (C's own rounding covers the bias's share of C). The
default ``False`` is the operator's formula (``e_eff`` as passed, floor ``n_s`` times
the smallest subnormal), which the NPU stand-in runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Columns per checksum segment (docs/ALGORITHM.md, "Checksum").
SEGMENT = 256
#: Robustness constant ``c`` of the shipping NPU operator's threshold.
C_ROBUST = 4.0
#: Smallest subnormal of C's dtype: the operator's underflow floor ``T_abs = n_s * tiny``.
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149}
#: sdc_guard's per-element floor near zero: a flushing device loses up to the smallest normal
#: of fp32 / bf16 C (fp16 keeps its subnormals), plus 2^-126 per product and addition.
TINY_FTZ = {"float16": 2.0**-24, "bfloat16": 2.0**-126, "float32": 2.0**-126}
FTZ_STEP = 2.0**-126
#: Unit roundoff of C's dtype, for the bias rounding term.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}


@dataclass(frozen=True)
class ReferenceCheck:
    """Per-(row, segment) float64 results, each ``[M, nseg]``."""

    diff: np.ndarray  #: ``D``
    threshold: np.ndarray  #: ``T``
    ok: np.ndarray  #: bool: ``D <= T`` and ``D`` finite


def as_f64(x: Any) -> np.ndarray:
    """A float64 NumPy copy of ``x`` (a torch tensor of any float dtype, or array-like).

    Duck-typed so that this module never imports torch: bf16 has no NumPy dtype, so a
    tensor is widened to float64 by its own ``.double()`` first (exact for every dtype).
    """
    if hasattr(x, "detach"):
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def dtype_name(dtype: Any) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` or ``"bfloat16"``; keys of ``TINY``."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in TINY:
        raise ValueError(f"c_dtype: expected float16, bfloat16 or float32, got {dtype!r}")
    return name


def segments(n: int) -> list[slice]:
    """Column ranges of the ``ceil(n / 256)`` segments (the last one may be short)."""
    return [slice(start, min(start + SEGMENT, n)) for start in range(0, n, SEGMENT)]


def extrema_variance(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and Bhatia-Davis variance ``|(max - mu)(mu - min)|`` along ``axis``.

    An empty axis (K = 0) has no statistics; both are 0 so that the threshold is the
    underflow floor alone, which is what an exact ``0 = sum of nothing`` deserves.
    """
    if x.shape[axis] == 0:
        shape = np.delete(np.array(x.shape), axis)
        return np.zeros(shape), np.zeros(shape)
    mu = x.mean(axis=axis)
    var = np.abs((x.max(axis=axis) - mu) * (mu - x.min(axis=axis)))
    return mu, var


def effective_e_max(e_max: float, k: int, roundoff_floor: float = 0.0) -> float:
    """The NPU operator's scaling of ``e_max`` with ``K``, optionally floored."""
    return max(e_max * 6.0 * math.sqrt(k / 1024.0), roundoff_floor)


def _bracket(mu_a: np.ndarray, var_a: np.ndarray, bw: np.ndarray, n_s: float) -> np.ndarray:
    """The bracket of ``T`` (what ``e_eff`` multiplies) for one segment, ``[M]``.

    ``bw`` is the segment of the weighted B, ``[K, n_s]``; its row statistics over ``n``
    give ``muB``, ``varB`` and the aggregates ``P1``, ``P2``, ``V``.
    """
    mu_b, var_b = extrema_variance(bw, axis=1)  # for every k, over n in s
    p1, p2, v = np.abs(mu_b).sum(), (mu_b**2).sum(), var_b.sum()
    c2 = C_ROBUST**2
    return (
        n_s * np.abs(mu_a) * p1
        + np.sqrt(c2 * n_s * mu_a**2 * v + c2 * n_s**2 * var_a * p2)
        + np.sqrt(n_s) * np.sqrt(var_a) * np.sqrt(v)
    )


def reference_check(
    a: Any,
    b: Any,
    c: Any,
    checksum_weight: Any = None,
    *,
    e_max: float,
    c_dtype: Any,
    bias: Any = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    roundoff_floor: bool = False,
    screen: str = "default",
    acc_roundoff: float = 2.0**-24,
) -> ReferenceCheck:
    """V-ABFT ``D``, ``T`` and OK bits of ``c == alpha * a @ b + beta * bias`` in float64.

    ``a`` is ``[M, K]``, ``b`` ``[K, N]``, ``c`` ``[M, N]`` (values as stored: pass the
    tensor itself, its dtype is only named by ``c_dtype``), ``checksum_weight`` ``[N]``,
    ``bias`` broadcastable to ``[M, N]``.
    """
    with np.errstate(all="ignore"):  # non-finite inputs are data here, not accidents
        return _check(as_f64(a), as_f64(b), as_f64(c), checksum_weight, e_max=e_max,
                      c_dtype=c_dtype, bias=bias, alpha=alpha, beta=beta,
                      roundoff_floor=roundoff_floor, screen=screen, acc_roundoff=acc_roundoff)


def _check(
    a64: np.ndarray, b64: np.ndarray, c64: np.ndarray, checksum_weight: Any, *,
    e_max: float, c_dtype: Any, bias: Any, alpha: float, beta: float, roundoff_floor: bool,
    screen: str = "default", acc_roundoff: float = 2.0**-24,
) -> ReferenceCheck:
    """``reference_check`` on float64 arrays."""
    m, k = a64.shape
    n = b64.shape[1]
    assert b64.shape[0] == k and c64.shape == (m, n), "shapes do not form a @ b = c"
    r = np.ones(n) if checksum_weight is None else as_f64(checksum_weight)
    name = dtype_name(c_dtype)
    mu_a, var_a = extrema_variance(a64, axis=1)  # [M]
    bias64 = None if bias is None else np.broadcast_to(as_f64(bias), (m, n))
    e_eff = effective_e_max(e_max, k)
    diffs, thresholds = [], []
    for cols in segments(n):
        n_s = float(cols.stop - cols.start)
        bw = b64[:, cols] * r[cols]  # r[n] * B[k, n]
        checksum = (c64[:, cols] * r[cols]).sum(axis=1)
        expected = alpha * (a64 @ bw.sum(axis=1))  # alpha * A @ Br
        t = abs(alpha) * e_eff * _bracket(mu_a, var_a, bw, n_s)
        if roundoff_floor:  # sdc_guard: C's rounding read from C, one accumulator rounding, a flush-aware floor
            u_c = UNIT_ROUNDOFF[name]
            epilogue = alpha != 1.0 or (bias64 is not None and beta != 0.0)
            acc = acc_roundoff + (3 * UNIT_ROUNDOFF["float32"] if epilogue else 0.0)
            t = t + acc * abs(alpha) * (np.abs(a64) @ np.abs(bw).sum(axis=1))
            rc = c64[:, cols] * r[cols]
            if screen == "default":
                t = t + u_c / (1.0 - u_c) * np.abs(rc).sum(axis=1)
            elif screen == "tight":  # the probabilistic term, capped by the rigorous one
                rigorous = u_c / (1.0 - u_c) * np.abs(rc).sum(axis=1)
                prob = 6.0 * u_c * np.sqrt((rc**2).sum(axis=1) / 3.0) + u_c * np.abs(rc.sum(axis=1))
                squares = (rc.astype(np.float32) ** 2).astype(np.float64).sum(axis=1)  # fp32 squares' range
                normal = (squares >= 2.0**-126) & (squares < 2.0**128)
                t = t + np.where(normal, np.minimum(prob, rigorous), rigorous)
            else:
                raise ValueError(f"screen: expected 'default' or 'tight', got {screen!r}")
            t = t + n_s * (TINY_FTZ[name] + (2 * k + 2) * FTZ_STEP)
        else:
            t = t + n_s * TINY[name]
        if bias64 is not None:
            weighted_bias = bias64[:, cols] * r[cols]
            expected = expected + beta * weighted_bias.sum(axis=1)
            if roundoff_floor:  # checksum sums of the bias (2 x 8) and the fp32 epilogue (3)
                bias_factor = 19 * UNIT_ROUNDOFF["float32"]
            else:
                bias_factor = 2.0 * UNIT_ROUNDOFF[name]
            t = t + bias_factor * np.abs(beta * weighted_bias).sum(axis=1)
        diffs.append(np.abs(checksum - expected))
        thresholds.append(t)
    diff = np.stack(diffs, axis=1) if diffs else np.zeros((m, 0))
    threshold = np.stack(thresholds, axis=1) if thresholds else np.zeros((m, 0))
    ok = np.isfinite(diff) & (diff <= threshold)
    if roundoff_floor:  # sdc_guard's T reads C: an infinite T is not a pass (the operator's is from A and B)
        ok &= np.isfinite(threshold)
    return ReferenceCheck(diff, threshold, ok)
