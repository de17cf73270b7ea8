"""Walking batched operands without copies: batch strides, and merging batch dims.

Shared by the kernels that take raw pointers and strides (the Triton kernel on CUDA and
the native CPU kernels): both walk at most ``MAX_BATCH_DIMS`` strided batch dims, so a
batch shape is first reduced by merging the dims one stride can serve in every operand.
Pure Python on shapes and strides, so that a backend's ``rejects`` can plan a call
without touching a tensor.
"""

from __future__ import annotations

from typing import Sequence

#: Most batch dims a kernel walks (after merging dims that one stride can serve).
MAX_BATCH_DIMS = 2


def collapse_batch(
    batch: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[list[int], list[list[int]]] | None:
    """Merge the batch dims of several tensors into at most ``MAX_BATCH_DIMS`` strided dims.

    ``batch`` is the common batch shape and ``strides[i]`` the batch strides of tensor
    ``i`` (0 where it is broadcast). Adjacent dims merge when one stride serves both in
    every tensor; size-1 dims are dropped. Returns ``(sizes, strides)`` padded to exactly
    ``MAX_BATCH_DIMS`` dims (leading size-1 dims), or ``None`` when more would remain:
    then no single kernel call can walk the batch without a copy.

    >>> collapse_batch([2, 3], [[3, 1], [0, 0]])
    ([1, 6], [[0, 1], [0, 0]])
    >>> collapse_batch([2, 3, 4], [[12, 4, 1], [0, 4, 0]]) is None
    True
    """
    merged: list[tuple[int, list[int]]] = []
    for dim, size in enumerate(batch):
        if size == 1:
            continue
        current = [s[dim] for s in strides]
        if merged and all(prev == cur * size for prev, cur in zip(merged[-1][1], current)):
            merged[-1] = (merged[-1][0] * size, current)
        else:
            merged.append((size, current))
    if len(merged) > MAX_BATCH_DIMS:
        return None
    while len(merged) < MAX_BATCH_DIMS:
        merged.insert(0, (1, [0] * len(strides)))
    sizes = [size for size, _ in merged]
    per_tensor = [[st[i] for _, st in merged] for i in range(len(strides))]
    return sizes, per_tensor


def batch_strides(
    shape: Sequence[int], strides: Sequence[int], batch: Sequence[int], trailing: int = 2
) -> list[int]:
    """Batch strides of a tensor broadcast to ``batch`` (0 where it is broadcast).

    ``shape`` / ``strides`` describe the tensor, whose last ``trailing`` dims are not
    batch dims; its batch dims are aligned to the right of ``batch`` as in broadcasting.

    >>> batch_strides((3, 4, 5), (20, 5, 1), [2, 3])
    [0, 20]
    """
    own = len(shape) - trailing
    lead = len(batch) - own
    return [strides[i - lead] if i >= lead and shape[i - lead] != 1 else 0
            for i in range(len(batch))]


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Strides of a contiguous tensor of ``shape`` (size-0 dims count as 1).

    >>> contiguous_strides((2, 3, 4))
    [12, 4, 1]
    """
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]
