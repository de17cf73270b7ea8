"""How the device accumulated a GEMM: the model the screen's threshold and the exact
confirmation both assume, read from the knobs PyTorch itself reads.

Why a module of its own: the screen (``precision.screen_terms``, the default ``e_max``)
and the confirmation (``confirm.element_bounds``) must assume the same device, and that
assumption follows documented behaviour per device, not the dtype alone
(docs/ALGORITHM.md, "Accumulation model"):

- CPU (oneDNN / MKL / torch's own kernels) and Ascend's cube unit: bf16 / fp16 products are
  exact in fp32 and accumulated in fp32; fp32 products are rounded to fp32 and accumulated
  in fp32 (under ``torch.set_float32_matmul_precision("high")`` / ``"medium"`` oneDNN may
  round fp32 inputs to bf16-like formats: modelled as rounded inputs).
- CUDA bf16 / fp16 with ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``
  (``allow_fp16_...``; on by default): cuBLAS may add split-K partial sums in the output
  dtype. cuBLAS does not document how many; ``REDUCED_SPLITS`` is an assumption.
- CUDA fp16 with ``allow_fp16_accumulation`` (off by default): the whole dot product is
  accumulated in fp16 (``CUBLAS_COMPUTE_16F``).
- CUDA fp32 with TF32 (``allow_tf32``, matmul precision ``"high"``): inputs rounded to a
  10-bit mantissa before fp32 products.
- Any other device: assumed to accumulate in fp32, as on CPU (not measured).

None of the CUDA or Ascend cases has been measured on hardware here; the model's
selection is tested against these documented knobs, and the reduced-precision split-K
is emulated on CPU (``tests/unit/core/test_accumulation.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_U32 = 2.0**-24
_U16 = 2.0**-11
_BF16 = 2.0**-8

#: Split-K partials cuBLAS may reduce in bf16 / fp16 when reduced-precision reduction is
#: allowed (an assumption: cuBLAS does not document its split factor; docs/ALGORITHM.md).
REDUCED_SPLITS = 32


@dataclass(frozen=True)
class Accumulation:
    """How the device is assumed to have computed C.

    ``input_roundoff``: unit roundoff the operands were rounded to before multiplying
    (0 when products are exact: bf16 / fp16 inputs, fp32 at full precision; TF32 2^-11,
    bf16-internal fp32 2^-8). ``roundoff``: of the accumulator (fp32 2^-24; fp16 2^-11
    with ``allow_fp16_accumulation``). ``reduced_splits``: partial sums rounded to C's
    dtype and added in it (CUDA's reduced-precision reduction for bf16 / fp16), at most
    this many; 0 when off.
    """

    input_roundoff: float = 0.0
    roundoff: float = _U32
    reduced_splits: int = 0

    @property
    def reduced(self) -> bool:
        """Whether anything is rounded coarser than fp32 before C's own final rounding:
        rounded inputs, a reduced accumulator or reduced split-K partials."""
        return self.input_roundoff > 0.0 or self.roundoff > _U32 or self.reduced_splits > 0


#: What every device without reduced precision does: exact or fp32 products, fp32 sums.
FP32 = Accumulation()


def accumulation_model(device: torch.device, a_dtype: torch.dtype) -> Accumulation:
    """The accumulation assumed for a GEMM with inputs of ``a_dtype`` on ``device``.

    >>> accumulation_model(torch.device("cpu"), torch.bfloat16) == FP32
    True
    """
    if a_dtype == torch.float32:
        precision = torch.get_float32_matmul_precision()
        if device.type == "cuda" and bool(torch.backends.cuda.matmul.allow_tf32) and precision == "highest":
            precision = "high"
        if precision == "highest":
            return FP32
        return Accumulation(input_roundoff={"high": _U16}.get(precision, _BF16))
    if device.type != "cuda":
        return FP32
    matmul = torch.backends.cuda.matmul
    if a_dtype == torch.float16 and bool(getattr(matmul, "allow_fp16_accumulation", False)):
        return Accumulation(roundoff=_U16)
    flag = ("allow_bf16_reduced_precision_reduction" if a_dtype == torch.bfloat16
            else "allow_fp16_reduced_precision_reduction")
    if bool(getattr(matmul, flag, False)):
        return Accumulation(reduced_splits=REDUCED_SPLITS)
    return FP32
