"""The ``comp_row`` bitstream of the Ascend operator, which every backend also produces.

uint8, segment-major, LSB first, 1 = segment OK; padding bits (rows >= M in the last
row group) are undefined on the operator, so the decoder masks them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .segments import num_segments


def encode_comp_row(ok: Tensor) -> Tensor:
    """Pack per-(row, segment) OK bits ``[..., M, nseg]`` into the operator's bitstream.

    Byte ``s * ceil(M/8) + m // 8``, bit ``m % 8`` (LSB first, segment-major); 1 = OK;
    padding bits (rows >= M) are set to 1. Returns uint8 ``[..., ceil(M/8) * nseg]``.

    >>> encode_comp_row(torch.tensor([[True], [False], [True]])).tolist()
    [253]
    """
    m, nseg = ok.shape[-2], ok.shape[-1]
    groups = -(-m // 8)
    bits = ok.transpose(-1, -2).to(torch.uint8)
    pad = groups * 8 - m
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad), value=1)
    bits = bits.reshape(*ok.shape[:-2], nseg, groups, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=ok.device)
    return (bits * weights).sum(-1, dtype=torch.uint8).reshape(*ok.shape[:-2], nseg * groups)


def decode_comp_row(comp_row: Tensor, m: int, n: int) -> Tensor:
    """Unpack a ``comp_row`` bitstream to bool ``[..., m, ceil(n/256)]``, True = OK.

    Padding bits are masked out, so a stream whose padding bits are garbage (as the
    Ascend operator leaves them) decodes correctly.

    >>> decode_comp_row(torch.tensor([0b11111101], dtype=torch.uint8), 3, 10).tolist()
    [[True], [False], [True]]
    """
    if not isinstance(comp_row, Tensor):
        raise TypeError(f"comp_row: expected a torch.Tensor, got {type(comp_row).__name__}")
    if comp_row.dtype != torch.uint8:
        raise TypeError(f"comp_row: expected dtype uint8, got {comp_row.dtype}")
    for name, value in (("m", m), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    groups, nseg = -(-m // 8), num_segments(n)
    if comp_row.dim() == 0 or comp_row.shape[-1] != groups * nseg:
        raise ValueError(
            f"comp_row: expected last dim ceil(m/8)*ceil(n/256) = {groups * nseg} for "
            f"m={m}, n={n}, got shape {tuple(comp_row.shape)}"
        )
    shifts = torch.arange(8, dtype=torch.uint8, device=comp_row.device)
    stream = comp_row.reshape(*comp_row.shape[:-1], nseg, groups, 1)
    bits = (stream >> shifts) & 1
    bits = bits.reshape(*comp_row.shape[:-1], nseg, groups * 8)[..., :m]
    return bits.transpose(-1, -2).bool()
