"""Cache of V-ABFT weight-side encodings, one per parameter view (orientation), for its latest known-good state.

The weight side (``Br``, ``Babs``, ``P1``, ``P2``, ``V``; docs/ALGORITHM.md) is O(KN) per
call without a cache: the whole weight read again for every GEMM, which is what made the
Ascend operator cost 186-309 % on decode shapes. A parameter does not change between the
forward (where it arrives as ``W.t()``) and the backward (``W``) of a step, nor across
micro-batches, nor ever during inference.

Only tensors whose storage belongs to a registered parameter are cached: an activation's
storage can be freed and reused at the same address with the same version counter, which
would serve a stale encoding. Entries hold a reference to the weight view, so a cached
storage cannot be freed and reused while its entry lives.

When an encoding must be remade: an entry is made stale (``invalidate``) whenever the
guard observes a legitimate write to its parameter, and ``refresh`` re-encodes stale
entries at once, while the new value is known good. The guard observes every route a
program writes a weight by: an optimizer step, plain, foreach or fused (a global
optimizer-step post-hook while the guard is active: foreach and fused kernels do not bump
version counters), an in-place aten op on the parameter's storage under the dispatch mode
(``p.data.add_()``, ``torch.no_grad()`` writes, ``load_state_dict``'s ``copy_``), a bump of
the version counter (the key of every lookup), and the start of a watched step after
unwatched ones (whatever happened in between). What it cannot observe, a bit flipped in
memory, leaves the encoding of the good weight in place: the GEMM then reads the flipped
weight, the screen flags it against the good encoding, and the confirmation
(``sdc_guard.core.confirm``) tells a stale encoding from a wrong product: a corruption of the
weight at rest.

Sharded parameters (docs/DISTRIBUTED.md): a tensor-parallel parameter is a ``DTensor``
whose local shard is an ordinary, persistent tensor; its GEMMs run on that shard (the
dispatch mode sees the local op), so the shard's storage is what is registered and cached.
A parameter managed by FSDP2 (``fully_shard``) is all-gathered into a buffer before each
use and the buffer freed after it: the GEMM's operand lives in memory that exists for
one use and whose address and version counter say nothing about its content next time.
Those parameters are never registered (``persistent_parameters``), so their GEMMs encode
the weight side afresh on every call: correct, and the cost is one O(KN) pass per GEMM,
which the O(MKN) GEMM dwarfs. (Caching them would buy nothing anyway: with FSDP2's
default resharding the forward and the backward use separate gathers, in different
orientations.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
import sys
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from ...core.abft import WeightSide, weight_side

CacheKey = tuple
#: The version recorded for an entry made stale by ``invalidate`` (never a real version).
_STALE = -1
#: A weight-side encoder: ``abft.weight_side`` or a backend's ``encode``.
Encoder = Callable[[Tensor], WeightSide]


def _dtensor_type() -> type | None:
    """The ``DTensor`` class if it was ever imported (no DTensor can exist otherwise)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _fsdp_module_type() -> type | None:
    """The FSDP2 module class if ``fully_shard`` was ever imported."""
    module = sys.modules.get("torch.distributed.fsdp")
    return getattr(module, "FSDPModule", None)


def local_tensor(t: Tensor) -> Tensor:
    """``t`` itself, or a ``DTensor``'s local shard (what its GEMMs compute on)."""
    if type(t) is Tensor:  # every activation: no subclass to look for
        return t
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return t._local_tensor
    return t


def storage_address(t: Tensor) -> int | None:
    """The address of the storage ``t``'s data lives in (a ``DTensor``'s: its local
    shard's), or ``None`` when it has none to speak of: a wrapper subclass without
    storage, a meta tensor, a storage freed by resizing it to nothing (FSDP2's unsharded
    buffers between uses).

    >>> storage_address(torch.ones(2)) is not None, storage_address(torch.ones(2, device="meta"))
    (True, None)
    """
    t = local_tensor(t)
    try:
        storage = t.untyped_storage()
        address = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # "invalid python storage", no storage at all
        return None
    return address if address and storage.nbytes() > 0 else None


def storage_addresses(tensors: Iterable[Tensor]) -> list[int]:
    """The storage addresses of ``tensors`` that have one (``storage_address``)."""
    return [a for a in map(storage_address, tensors) if a is not None]


def persistent_parameters(model: nn.Module) -> Iterator[Tensor]:
    """The parameters of ``model`` whose storage outlives a step, which are the ones a
    weight encoding may be cached for: every parameter except those FSDP2 manages
    (anything under a ``fully_shard`` module: between uses its parameters are sharded
    ``DTensor`` s that no GEMM reads, during use an all-gathered buffer that is freed
    after it). A tensor-parallel ``DTensor`` parameter is persistent (its local shard)."""
    fsdp = _fsdp_module_type()
    managed: set[int] = set()
    if fsdp is not None:
        for module in model.modules():
            if isinstance(module, fsdp):
                managed.update(id(p) for p in module.parameters())
    for p in model.parameters():
        if id(p) not in managed:
            yield p


def cache_key(b: Tensor) -> CacheKey:
    """Identity of a weight view: storage, offset, shape, strides, dtype, device. The
    version counter is not part of it: an entry holds the version it encoded, and a lookup
    of a newer version replaces it (an older version can never hit again)."""
    return (b.untyped_storage().data_ptr(), b.storage_offset(), tuple(b.shape), b.stride(), b.dtype, b.device)


@dataclass
class CacheStats:
    """Counters for tests, metrics and tuning."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    uncacheable: int = 0  #: lookups of tensors that are not parameters


class WeightCache:
    """Bounded LRU of ``WeightSide`` encodings for the parameters it is told about.

    >>> w = torch.nn.Parameter(torch.randn(300, 64))
    >>> cache = WeightCache(max_bytes=1 << 20); cache.set_parameters([w])
    >>> _ = cache.get(w.t()); _ = cache.get(w.t()); cache.stats.hits
    1
    """

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes: expected a non-negative int, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        #: view -> (version encoded, the view, its encoding, the encoder that made it, its bytes)
        self._entries: OrderedDict[CacheKey, tuple[int, Tensor, WeightSide, Encoder, int]] = OrderedDict()
        self._bytes = 0
        self._storages: set[int] = set()

    @property
    def nbytes(self) -> int:
        """Memory held by the cached encodings."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def set_parameters(self, params: Iterable[Tensor]) -> None:
        """Declare which storages are parameters (cacheable); drops entries of others.
        A ``DTensor`` registers its local shard; a tensor without a live storage (a
        parameter FSDP2 has freed) registers nothing. Pass ``persistent_parameters(model)``
        for a model that may be sharded by FSDP2."""
        self._storages = set(storage_addresses(params))
        for key in [k for k in self._entries if k[0] not in self._storages]:
            self._drop(key)

    def holds(self, storage: int) -> bool:
        """Whether ``storage`` (an address) is a registered parameter's."""
        return storage in self._storages

    def is_cacheable(self, b: Tensor) -> bool:
        """Whether ``b`` views a registered parameter's storage."""
        address = storage_address(b)
        return address is not None and address in self._storages

    def get(self, b: Tensor, checksum_weight: Tensor | None = None, *,
            encode: Encoder = weight_side) -> WeightSide | None:
        """The encoding of ``b`` (computed by ``encode`` on a miss), or ``None`` if ``b`` is
        not cacheable.

        ``encode`` is the verifying backend's ``Backend.encode`` (every backend reads every
        encoding; a backend's own is the fastest to compute); ``refresh`` re-encodes an
        entry with the encoder that made it. Custom checksum weights are not cached (the
        key would have to include them).
        """
        # the lookup runs for every verified GEMM: the storage is read once, for the
        # registration test and the key (``storage_address``, ``cache_key``)
        if checksum_weight is None:
            b = local_tensor(b)
            try:
                address = b.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage: see storage_address
                address = None
        if checksum_weight is not None or address not in self._storages:
            self.stats.uncacheable += 1
            return None
        key = (address, b.storage_offset(), b.shape, b.stride(), b.dtype, b.device)
        entry = self._entries.get(key)
        if entry is not None:
            if entry[0] == b._version:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return entry[2]
            self._drop(key)  # an older version: it can never hit again
        self.stats.misses += 1
        version = b._version
        # b itself is kept (a detached alias may not share its version counter); the
        # encoding reads a no-grad alias, since b's base may since have been updated in place
        # (on which nothing the encoding computes is recorded: no grad mode needed)
        encoded = encode(b.detach())
        nbytes = encoded.nbytes
        self._entries[key] = (version, b, encoded, encode, nbytes)
        self._bytes += nbytes
        self._evict()
        return encoded

    def invalidate(self, storages: Iterable[int] | None = None) -> int:
        """Make the entries of parameters whose storage address is in ``storages`` (every
        entry with ``None``) stale: the next lookup re-encodes them, and so does
        ``refresh``. Returns how many entries were made stale. Cheap: no tensor is read."""
        wanted = None if storages is None else set(storages)
        count = 0
        for key, (version, view, encoded, encode, nbytes) in list(self._entries.items()):
            if version != _STALE and (wanted is None or key[0] in wanted):
                self._entries[key] = (_STALE, view, encoded, encode, nbytes)
                count += 1
        return count

    def _drop(self, key: CacheKey) -> None:
        self._bytes -= self._entries.pop(key)[4]

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1

    def refresh(self) -> int:
        """Re-encode every cached view that is stale or whose parameter changed version
        (after an optimizer step), so the encoding is made while the weight is known
        fresh: a corruption at rest before the next use is then caught. Costs nothing
        extra (the next use would have missed and encoded anyway). Returns the number of
        views re-encoded.
        """
        refreshed = 0
        for version, view, _, encode, _ in list(self._entries.values()):
            if view._version != version and self.is_cacheable(view):
                self.get(view, encode=encode)
                refreshed += 1
        return refreshed

    def clear(self) -> None:
        """Forget every encoding (after a rollback restores weights, say)."""
        self._entries.clear()
        self._bytes = 0
