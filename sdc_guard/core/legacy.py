"""The checksum V-ABFT replaces: ``torch_npu.matmul_checksum``'s pure-PyTorch path.

Kept for side-by-side benchmarks and as the batch-invariance harness's negative control:
its threshold comes from C itself (a corrupted C moves its own threshold) and its one
branch for the whole matrix depends on every row, so a row's verdict can change when
other rows change. The original re-ran the matmul into ``c`` in place ("self-heal");
this copy never mutates a caller's tensor and reports the flags only (docs/ALGORITHM.md,
"Output contract: comp_row").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch  # noqa: F401  (the examples below use it)
from torch import Tensor

_PEAK_RATIO = 5.0
_ROUNDING = 2.0**-8
_SAFETY = 5.0
_FLOOR = 5e-20


@dataclass(frozen=True)
class LegacyCheck:
    """Per-row outcome of the legacy checksum (all ``[M]``)."""

    flags: Tensor  #: bool, True = row flagged
    diff: Tensor  #: ``|c_sum - c1|`` (fp32)
    err: Tensor  #: the row's error estimate (threshold is ``5 * err + 5e-20``)
    peaky: bool  #: which branch the whole matrix took (``min c_max/c_mean > 5``)


def legacy_check(a: Tensor, b: Tensor, c: Tensor) -> LegacyCheck:
    """Run the legacy algorithm on 2-D ``a [M, K]``, ``b [K, N]``, ``c [M, N]``.

    >>> a, b = torch.randn(8, 32), torch.randn(32, 16)
    >>> bool(legacy_check(a, b, a @ b).flags.any())
    False
    """
    for name, t in (("a", a), ("b", b), ("c", c)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ValueError(
            f"c: expected shape {(a.shape[0], b.shape[1])} for a {tuple(a.shape)} @ "
            f"b {tuple(b.shape)}, got {tuple(c.shape)}"
        )
    n = c.shape[1]
    c32 = c.float()
    c_sum = c32.sum(-1)
    c1 = a.float() @ b.float().sum(-1)
    c_abs = c32.abs()
    c_max = c_abs.amax(-1)
    c_mean = c_abs.mean(-1)
    peaky = bool((c_max / c_mean).min() > _PEAK_RATIO) if c.shape[0] else False
    if peaky:
        err = c_max * _ROUNDING * (n**0.5)
    else:
        err = c_mean * _ROUNDING * n
    diff = (c_sum - c1).abs()
    flags = (diff - _SAFETY * err) > _FLOOR
    return LegacyCheck(flags, diff, err, peaky)


def matmul_checksum(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """The legacy ``torch_npu.matmul_checksum``: 0-dim bool, True = anomaly; read-only.

    >>> a, b = torch.randn(8, 32), torch.randn(32, 16)
    >>> bool(matmul_checksum(a, b, a @ b))
    False
    """
    return legacy_check(a, b, c).flags.any()
