"""Samples kept by dataset index as they pass, within a byte budget: any map-style dataset's
samples, decoded images, or image files' bytes.

:class:`SampleCache` copies what it is given (tensors to its device), books its bytes in the
ledger, stops at the budget or when free memory reaches the reserve, and knows how many
samples the dataset has, so it can say when it is complete.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from gpuload.cache.budget import LEDGER, BudgetLedger, format_bytes
from gpuload.cache.oom import CacheFallbackWarning, is_oom
from gpuload.device import device_memory

__all__ = ["MISSING", "SampleCache", "SampleCacheStats"]


_ROOM_CHECK_BYTES = 256 << 20


@dataclass
class SampleCacheStats:
    """Entries and bytes held, lookups that hit or missed, samples not stored (full/uncacheable)."""

    entries: int = 0
    bytes: int = 0
    budget: int = 0
    hits: int = 0
    misses: int = 0
    rejected: int = 0
    uncacheable: int = 0
    full: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Uncacheable(Exception):
    pass


class SampleCache:
    """Samples of a map-style dataset kept as they pass, up to ``budget_bytes``.

    A sample is a tensor, numpy array, number, string, bytes or a nested tuple/list/dict of them;
    tensors and arrays are copied (to ``device`` for tensors) so later changes by the dataset
    cannot reach the cache. Once a sample would exceed the budget the cache is full and stops
    adding. ``get`` returns the stored objects: callers must not modify them in place
    (collation copies). On a CUDA ``device`` the budget is booked in ``ledger``. With
    ``num_samples`` (the dataset's length) the cache knows when it is ``complete``, and then
    settles: it stops adding and hands the unused budget back to other loaders.
    """

    def __init__(
        self,
        budget_bytes: int,
        device: torch.device | str = "cpu",
        *,
        ledger: BudgetLedger = LEDGER,
        owner: Hashable | None = None,
        room: Callable[[], int] | None = None,
        num_samples: int | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._room = room
        self._num_samples = num_samples
        self._room_left = -1  # bytes ``room`` allowed at its last call, less what was added since
        self._since_check = 0
        self._last_nbytes = 0
        self._device = torch.device(device)
        self._ledger = ledger
        self._owner: Hashable = owner if owner is not None else ("SampleCache", id(self))
        self._on_device = self._device.type != "cpu"
        self._budget = (
            ledger.reserve(budget_bytes, self._owner, device=self._device) if self._on_device else budget_bytes
        )
        self._entries: dict[int, Any] = {}
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stats = SampleCacheStats(budget=self._budget)
        self._warned = False
        self._closed = False

    def _copy(self, value: Any) -> tuple[Any, int]:
        if isinstance(value, torch.Tensor):
            return value.detach().to(self._device, copy=True), value.numel() * value.element_size()
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise _Uncacheable("numpy object array")
            return value.copy(), value.nbytes
        if value is None or isinstance(value, (bool, int, float, complex, np.generic)):
            return value, 8
        if isinstance(value, (str, bytes)):
            return value, len(value)
        if isinstance(value, Mapping):
            copied, total = {}, 0
            for key, item in value.items():
                copied[key], size = self._copy(item)
                total += size
            return (type(value)(copied) if type(value) is not dict else copied), total
        if isinstance(value, (tuple, list)):
            items = [self._copy(item) for item in value]
            total = sum(size for _, size in items)
            values = [v for v, _ in items]
            if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
                return type(value)(*values), total
            return type(value)(values), total
        raise _Uncacheable(type(value).__name__)

    def _has_room(self) -> bool:
        """Whether ``room()`` (memory the cache may still take, e.g. free device memory above the
        reserve) leaves space for a sample like the last one. Asked again every 256 MiB added
        and whenever its last answer runs out, so a model growing meanwhile is noticed."""
        if self._room is None:
            return True
        if self._last_nbytes > self._room_left or self._since_check >= _ROOM_CHECK_BYTES:
            self._room_left, self._since_check = self._room(), 0
        return self._last_nbytes <= self._room_left

    def put(self, index: int, sample: Any) -> bool:
        """Store ``sample`` for ``index``; False when full, closed, or not a cacheable type."""
        index = int(index)
        with self._lock:
            if self._closed or self._stats.full:
                self._stats.rejected += 1
                return False
            if index in self._entries:
                return True
            no_room = not self._has_room()
            if no_room:
                self._stats.full = True
                self._stats.rejected += 1
                first = not self._warned
                self._warned = True
                held, count = self._stats.bytes, self._stats.entries
        if no_room:
            if first:
                warnings.warn(
                    f"gpuload cache: free memory on {self._device} reached the reserve after caching "
                    f"{count} samples ({format_bytes(held)}); the rest are read from the dataset",
                    CacheFallbackWarning,
                    stacklevel=2,
                )
            return False
        try:
            copied, nbytes = self._copy(sample)
        except _Uncacheable:
            with self._lock:
                self._stats.uncacheable += 1
            return False
        except RuntimeError as error:
            if not is_oom(error):
                raise
            with self._lock:
                self._stats.full = True
                self._stats.rejected += 1
                first = not self._warned
                self._warned = True
            if first:
                warnings.warn(
                    f"gpuload cache: out of memory on {self._device} after caching "
                    f"{self._stats.entries} samples ({format_bytes(self._stats.bytes)}); the rest "
                    "are read from the dataset",
                    CacheFallbackWarning,
                    stacklevel=2,
                )
            return False
        with self._lock:
            if self._closed:
                return False
            if self._stats.bytes + nbytes > self._budget:
                self._stats.full = True
                self._stats.rejected += 1
                return False
            self._entries[index] = copied
            self._sizes[index] = nbytes
            self._room_left -= nbytes
            self._since_check += nbytes
            self._last_nbytes = nbytes
            self._stats.entries += 1
            self._stats.bytes += nbytes
            used = self._stats.bytes
        if self._on_device:
            self._ledger.set_used(self._owner, used, device=self._device)
        if self.complete:
            self.settle()
        return True

    @property
    def complete(self) -> bool:
        """Every sample of the dataset is held (known only with ``num_samples``)."""
        return self._num_samples is not None and len(self._entries) >= self._num_samples

    @property
    def accepting(self) -> bool:
        """Whether ``put`` may still add samples: not full, closed or complete."""
        return not (self._stats.full or self._closed or self.complete)

    def summary(self, **labels: Any) -> dict[str, Any]:
        """The counters as a dict for ``loader.stats.extra["cache"]``, with the caller's labels."""
        return dict(self.stats.as_dict(), num_samples=self._num_samples, complete=self.complete, **labels)

    def get(self, index: int, default: Any = None) -> Any:
        """The stored sample for ``index`` (a hit), or ``default`` (a miss)."""
        with self._lock:
            found = self._entries.get(int(index), MISSING)
            if found is MISSING:
                self._stats.misses += 1
                return default
            self._stats.hits += 1
            return found

    def peek(self, index: int, default: Any = None) -> Any:
        """The stored sample for ``index`` without counting a hit or miss (for a sample just put)."""
        with self._lock:
            return self._entries.get(int(index), default)

    def __contains__(self, index: object) -> bool:
        return isinstance(index, (int, np.integer)) and int(index) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def full(self) -> bool:
        return self._stats.full

    @property
    def stats(self) -> SampleCacheStats:
        with self._lock:
            return SampleCacheStats(**self._stats.as_dict())

    def shrink(self, max_bytes: int) -> int:
        """Drop the most recently added samples until at most ``max_bytes`` are held, and stop
        adding; returns the bytes freed. Dropped samples are read from the source again."""
        with self._lock:
            freed = 0
            while self._entries and self._stats.bytes > max_bytes:
                index = next(reversed(self._entries))
                nbytes = self._sizes.pop(index)
                del self._entries[index]
                self._stats.entries -= 1
                self._stats.bytes -= nbytes
                freed += nbytes
            if freed:
                self._stats.full = True
            used = self._stats.bytes
        if freed and self._on_device:
            self._ledger.set_used(self._owner, used, device=self._device)
        return freed

    def fit_reserve(self, keepable: Any, refill: str) -> int:
        """On a CUDA device: shrink to what ``keepable(device, memory, held)`` allows now
        (``CacheSettings.keepable``: free memory must stay above the reserve), warning when it
        does; ``refill`` says where the dropped samples come from instead. Bytes freed."""
        if self._device.type != "cuda":
            return 0
        held = self.stats.bytes
        freed = self.shrink(keepable(self._device, device_memory(self._device), held))
        if freed:
            warnings.warn(
                f"gpuload: free memory on {self._device} fell below the reserve; the cache gave back "
                f"{format_bytes(freed)} and {refill}",
                stacklevel=4,
            )
        return freed

    def settle(self) -> None:
        """Stop adding and shrink the budget booking to the bytes held, freeing the rest for
        other loaders (call once every sample that will be cached is in)."""
        with self._lock:
            if self._closed:
                return
            self._stats.full = True
            self._budget = self._stats.budget = self._stats.bytes
            used = self._stats.bytes
        if self._on_device:
            self._ledger.reserve(used, self._owner, device=self._device)
            self._ledger.set_used(self._owner, used, device=self._device)

    def close(self) -> None:
        """Drop every stored sample and the ledger booking. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries = {}
            self._sizes = {}
            self._stats.entries = 0
            self._stats.bytes = 0
        if self._on_device:
            self._ledger.release(self._owner)


MISSING = object()
"""A default no sample can be: ``get(index, MISSING)`` tells a miss from a cached None."""
