"""Inputs for the batch-invariance harness, and the check that they could tell anything.

Why a module of its own: an invariance test is only as good as its data. Small integers
sum exactly in any order, so on them every op looks batch-invariant, CPU fp32 ``torch.mm``
included. The default data here spread their exponents widely, so that a changed
accumulation order changes the last bits of a result; ``order_sensitive`` says when a
cell's inputs could not have shown such a change (the harness then warns: its BI_PASS
proves nothing).

A ``DataSpec`` makes float32 rows for three roles: ``"target"`` (the row both variants
share, byte for byte), ``"a"`` and ``"b"`` (the other rows of variant A and of variant B),
and the shared weight. The harness casts them to the dtype under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

#: Row roles a ``DataSpec.rows`` is asked for.
ROLES: tuple[str, ...] = ("target", "a", "b")

RowMaker = Callable[[int, int, str, torch.Generator], Tensor]
WeightMaker = Callable[[int, int, torch.Generator], Tensor]


@dataclass(frozen=True)
class DataSpec:
    """How to make a cell's inputs: ``rows(m, k, role, gen) -> [m, k]``, ``weight(k, n, gen) -> [k, n]``.

    Both return float32 on the CPU, drawn only from ``gen`` (so the same seed gives the
    same bytes in every process of a distributed run).
    """

    name: str
    rows: RowMaker
    weight: WeightMaker


def _spread(dtype: torch.dtype) -> int:
    """Largest power-of-two exponent offset that keeps K=1024 dot products finite in ``dtype``."""
    return 2 if dtype == torch.float16 else 8


def _wide(shape: tuple[int, ...], gen: torch.Generator, spread: int) -> Tensor:
    scale = torch.randint(-spread, spread + 1, shape, generator=gen).float()
    return torch.randn(shape, generator=gen) * torch.exp2(scale)


def wide_data(dtype: torch.dtype = torch.float32) -> DataSpec:
    """Gaussian values times ``2**e`` with ``e`` uniform over a wide range (the default).

    >>> wide_data().rows(2, 8, "a", torch.Generator().manual_seed(0)).shape
    torch.Size([2, 8])
    """
    spread = _spread(dtype)
    return DataSpec(
        "wide",
        lambda m, k, role, gen: _wide((m, k), gen, spread),
        lambda k, n, gen: _wide((k, n), gen, spread),
    )


def gaussian_data(dtype: torch.dtype = torch.float32) -> DataSpec:
    """Standard normal rows and weight: realistic, but a narrower exponent range than ``wide``.

    >>> gaussian_data().weight(4, 2, torch.Generator().manual_seed(0)).dtype
    torch.float32
    """
    return DataSpec(
        "gaussian",
        lambda m, k, role, gen: torch.randn(m, k, generator=gen),
        lambda k, n, gen: torch.randn(k, n, generator=gen),
    )


def small_int_data(dtype: torch.dtype = torch.float32) -> DataSpec:
    """Integers in [-3, 3]: every sum is exact, so every op looks invariant (the vacuous case).

    >>> bool((small_int_data().rows(2, 8, "a", torch.Generator().manual_seed(0)).abs() <= 3).all())
    True
    """
    return DataSpec(
        "small-int",
        lambda m, k, role, gen: torch.randint(-3, 4, (m, k), generator=gen).float(),
        lambda k, n, gen: torch.randint(-3, 4, (k, n), generator=gen).float(),
    )


#: Size of the spike a peaky row puts on column 0 of ``x @ w``, relative to K.
_PEAK = 8.0


def _peaky_weight(k: int, n: int, gen: torch.Generator) -> Tensor:
    w = torch.randn(k, n, generator=gen)
    w[0] = 0.0
    w[0, 0] = float(k)
    return w


def _peaky_rows(m: int, k: int, role: str, gen: torch.Generator) -> Tensor:
    x = torch.randn(m, k, generator=gen)
    x[:, 0] = _PEAK if role in ("target", "a") else 0.0
    return x


def peaky_data(dtype: torch.dtype = torch.float32) -> DataSpec:
    """Rows whose product row is peaky (``max/mean`` well above 5) for roles target and a only.

    Built to move the legacy checksum's matrix-wide branch (``min over rows of
    c_max/c_mean > 5``): variant A (all rows peaky) takes the peaky branch, variant B
    (gaussian other rows) the other one, while the target row is the same in both. Needs
    N > 5 output columns, or no row can be peaky.

    >>> d, g = peaky_data(), torch.Generator().manual_seed(0)
    >>> y = d.rows(1, 64, "target", g) @ d.weight(64, 16, g)
    >>> bool(y.abs().max() / y.abs().mean() > 5)
    True
    """
    return DataSpec("peaky", _peaky_rows, _peaky_weight)


#: Built-in data specs by name (each a factory taking the dtype under test).
DATA_SPECS: dict[str, Callable[[torch.dtype], DataSpec]] = {
    "wide": wide_data,
    "gaussian": gaussian_data,
    "small-int": small_int_data,
    "peaky": peaky_data,
}


def resolve_data(data: str | DataSpec, dtype: torch.dtype) -> DataSpec:
    """``data`` itself if a ``DataSpec``, else the built-in of that name for ``dtype``.

    >>> resolve_data("wide", torch.float32).name
    'wide'
    """
    if isinstance(data, DataSpec):
        return data
    if isinstance(data, str) and data in DATA_SPECS:
        return DATA_SPECS[data](dtype)
    raise ValueError(f"data: expected a DataSpec or one of {sorted(DATA_SPECS)}, got {data!r}")


def order_sensitive(row: Tensor, w: Tensor) -> bool:
    """True when summing ``row[k] * w[k, n]`` in different orders changes some fp32 result.

    Four orders are compared per column: sequential forward, sequential reverse, numpy's
    pairwise sum and the exactly rounded sum. When all agree on every column, no
    accumulation order can change the result, and an invariance verdict on these inputs
    is vacuous.

    >>> order_sensitive(torch.tensor([1.0, 2.0]), torch.tensor([[3.0], [4.0]]))
    False
    >>> order_sensitive(torch.tensor([1e8, 1.0, -1e8]), torch.ones(3, 1))
    True
    """
    products = (row.detach().cpu().double()[:, None] * w.detach().cpu().double()).float().numpy()
    forward = np.cumsum(products, axis=0, dtype=np.float32)[-1]
    reverse = np.cumsum(products[::-1], axis=0, dtype=np.float32)[-1]
    pairwise = np.ascontiguousarray(products.T).sum(axis=1, dtype=np.float32)
    exact = products.astype(np.float64).sum(axis=0).astype(np.float32)
    same = all(np.array_equal(forward, other, equal_nan=True) for other in (reverse, pairwise, exact))
    return not same
