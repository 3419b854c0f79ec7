"""Recycled host memory for the large outputs of CPU operators.

Why: a CPU tensor of more than a few MiB is served by a fresh ``mmap``, and the kernel faults in
and zeroes every page on first touch. In a training step the weight gradient (``[E, K, N]``, tens to
hundreds of MiB) and the permuted activations are such tensors, freed and allocated again every
step. Faulting in a weight gradient took longer than computing it (``docs/cpu_kernels.md``); a GPU
caching allocator exists for exactly this, torch's CPU allocator has none.

How: :func:`empty` hands out tensors on storages this cache keeps. A storage is handed out again
only when the cache holds the *last* reference to it (storage use count 1, and no Python
reference to the storage object but the cache's): no tensor, view, ``.grad``, saved activation,
NumPy array or storage object refers to it any more, so reuse can never alias live data. Sizes match exactly (training steps repeat their shapes). Tensors from the cache are
uninitialised, like ``torch.empty``: callers overwrite every element.

Bounded: the cache references at most :func:`limit_bytes` bytes (in use and idle together; default
``MOE_GMM_HOST_CACHE_MB``, else a quarter of physical memory). Past that it drops idle storages,
least recently used first, and when that is not enough it allocates without caching. Idle storages
stay resident between steps (as with a GPU caching allocator): :func:`clear` frees them.
Tensors under 1 MiB are never cached: the heap serves those without page faults.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CACHE_ENV_VAR", "MIN_BYTES", "CacheStats", "clear", "empty", "limit_bytes", "set_limit_bytes", "stats"]

CACHE_ENV_VAR = "MOE_GMM_HOST_CACHE_MB"
MIN_BYTES = 1 << 20

# Private but stable since torch 2.0 (used by torch's own multiprocessing and weakref code);
# without it the cache cannot prove a storage is unreferenced, so it stays off.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _default_limit() -> int:
    value = os.environ.get(CACHE_ENV_VAR)
    if value is not None:
        try:
            mib = float(value)
        except ValueError:
            raise ValueError(f"{CACHE_ENV_VAR} must be a number of MiB, got {value!r}") from None
        if mib < 0:
            raise ValueError(f"{CACHE_ENV_VAR} must be >= 0 MiB, got {value!r}")
        return int(mib * (1 << 20))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 2 << 30


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    last_used: int
    # Python references to ``storage`` when only this slot holds it: ``t.untyped_storage()``
    # returns this very object (torch keeps one Python object per storage), and such a reference
    # does not show in the storage's use count.
    own_refs: int = 0


@dataclass(frozen=True)
class CacheStats:
    """What the cache holds now: storages, their bytes, how many of those are idle, and the limit."""

    storages: int
    bytes_held: int
    idle_bytes: int
    limit_bytes: int
    hits: int
    misses: int


class _HostCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, list[_Slot]] = {}
        self._limit: int | None = None  # read from the environment on first use
        self._clock = 0
        self._hits = 0
        self._misses = 0

    @property
    def limit(self) -> int:
        if self._limit is None:
            self._limit = _default_limit()
        return self._limit

    def set_limit(self, nbytes: int) -> None:
        with self._lock:
            self._limit = nbytes
            self._shrink_to(nbytes)

    def _all_slots(self) -> list[_Slot]:
        return [s for slots in self._slots.values() for s in slots]

    @staticmethod
    def _idle(slot: _Slot) -> bool:
        return _storage_use_count(slot.storage._cdata) == 1 and sys.getrefcount(slot.storage) <= slot.own_refs

    def _held(self) -> int:
        return sum(s.nbytes for s in self._all_slots())

    def _shrink_to(self, budget: int) -> None:
        """Drop idle storages, least recently used first, until at most ``budget`` bytes are held."""
        held = self._held()
        for slot in sorted((s for s in self._all_slots() if self._idle(s)), key=lambda s: s.last_used):
            if held <= budget:
                break
            self._slots[slot.nbytes].remove(slot)
            held -= slot.nbytes
        self._slots = {n: slots for n, slots in self._slots.items() if slots}

    def storage(self, nbytes: int) -> torch.UntypedStorage | None:
        """An idle storage of exactly ``nbytes`` (reused or new), or None when over the limit."""
        with self._lock:
            self._clock += 1
            for slot in self._slots.get(nbytes, ()):
                if self._idle(slot):
                    slot.last_used = self._clock
                    self._hits += 1
                    return slot.storage
            self._misses += 1
            budget = self.limit - nbytes
            if budget < 0:
                return None
            self._shrink_to(budget)
            if self._held() > budget:
                return None
            slot = _Slot(torch.empty(nbytes, dtype=torch.uint8).untyped_storage(), nbytes, self._clock)
            slot.own_refs = sys.getrefcount(slot.storage)
            self._slots.setdefault(nbytes, []).append(slot)
            return slot.storage

    def stats(self) -> CacheStats:
        with self._lock:
            slots = self._all_slots()
            return CacheStats(
                storages=len(slots),
                bytes_held=sum(s.nbytes for s in slots),
                idle_bytes=sum(s.nbytes for s in slots if self._idle(s)),
                limit_bytes=self.limit,
                hits=self._hits,
                misses=self._misses,
            )

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()
            self._hits = self._misses = 0


_cache = _HostCache()


def empty(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised contiguous tensor like ``torch.empty``; on CPU, large ones reuse idle cached memory."""
    device = torch.device(device)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or _storage_use_count is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    storage = _cache.storage(nbytes)
    if storage is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def limit_bytes() -> int:
    """The most bytes the cache references (in use and idle)."""
    return _cache.limit


def set_limit_bytes(nbytes: int) -> None:
    """Change the limit (0 turns caching off); idle storages over the new limit are dropped now."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    _cache.set_limit(nbytes)


def stats() -> CacheStats:
    """Storages and bytes held now, idle bytes among them, the limit, and hit/miss counts."""
    return _cache.stats()


def clear() -> None:
    """Forget every cached storage and reset the hit/miss counts.

    Storages no tensor uses any more are freed: a block the C allocator mapped on its own goes back
    to the system at once; one from its heap (glibc serves blocks below its adaptive mmap threshold,
    up to 32 MiB, from there) stays resident for reuse until the heap is trimmed.
    """
    _cache.clear()
