"""Ops for tests/unit/bi/test_bi.py that the command line loads by file path (``--op tests/support/bi_ops.py:NAME``).

They live in a file, not in the test module, because ``torch.distributed.run`` workers
are fresh processes that must import them.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from sdc_guard.bi.collective import DistributedOp, reduce_scatter_rows, shard_matmul


def noisy_op(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` plus unseeded noise: a different result on every call."""
    return x @ w + 1e-3 * torch.randn(x.shape[0], w.shape[1])


def split_k_by_batch(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` by another algorithm when the batch has more than one row (accumulated in
    fp64, then rounded), as a kernel that picks its tiling, split-K or accumulator by
    shape does: each row's result then changes with M, never with the other rows' values.
    A batch-variant GEMM by construction, on any host (whether the host's own
    ``torch.mm`` is batch-variant depends on its BLAS, its instruction set and its
    threads: MKL's AVX-512 kernels are at the tests' shapes, its AVX2 ones not always;
    an even split of K can coincide with a BLAS's own two-thread split)."""
    if x.shape[0] == 1:
        return x @ w
    return (x.double() @ w.double()).to(x.dtype)


def raising_op(x: Tensor, w: Tensor) -> Tensor:
    """Always raises."""
    raise RuntimeError("injected failure")


def _raise_on_rank1_for_m8(x: Tensor, w: Tensor, rank: int, world_size: int) -> Tensor:
    if rank == 1 and x.shape[0] == 8:
        raise RuntimeError("injected failure on rank 1")
    return shard_matmul(x, w, rank, world_size)


def _hang_on_rank1(x: Tensor, w: Tensor, rank: int, world_size: int) -> Tensor:
    if rank == 1:
        time.sleep(120)
    return shard_matmul(x, w, rank, world_size)


#: Raises on rank 1 only, and only for M = 8: the other ranks must not hang.
RAISE_ON_RANK1 = DistributedOp("raise_on_rank1", _raise_on_rank1_for_m8, reduce_scatter_rows)
#: Rank 1 never reaches the collective: only the job timeout can end it.
HANG_ON_RANK1 = DistributedOp("hang_on_rank1", _hang_on_rank1, reduce_scatter_rows)
