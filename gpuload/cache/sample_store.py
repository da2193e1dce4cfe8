"""Samples kept by dataset index as they pass, within a byte budget: any map-style dataset's
samples, decoded images, or image files' bytes.

:class:`SampleStore` copies what it is given (tensors to its device), books its bytes in the
ledger, stops at the budget or when free memory reaches the reserve, and knows how many
samples the dataset has, so it can say when it is complete. :class:`BudgetedStore` is what it
shares with the column store (``gpuload.cache.columns``): the budget, the ledger booking, the
room check, the counters, ``settle`` and ``close``; both are filling stores
(:class:`~gpuload.cache.store.FillingStore`).
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable, Hashable, Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from gpuload.cache.allocator import reserved_bytes
from gpuload.cache.budget import LEDGER, BudgetLedger, format_bytes
from gpuload.cache.oom import CacheFallbackWarning, is_oom
from gpuload.cache.store import FillingStore, StreamGuard

__all__ = ["MISSING", "BudgetedStore", "SampleStore", "SampleStoreStats", "Uncacheable", "copy_value"]


_ROOM_CHECK_BYTES = 256 << 20


@dataclass
class SampleStoreStats:
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


class Uncacheable(Exception):
    """A value of a type the caches do not copy (anything but tensors, arrays, numbers,
    strings, bytes, None and tuples, lists and dicts of them)."""


def copy_value(value: Any, device: torch.device) -> tuple[Any, int]:
    """A copy of ``value`` that later changes by the dataset cannot reach (tensors on
    ``device``), and its size in bytes (8 per number); raises :class:`Uncacheable`. A copy
    is of the value's own type (an ``nn.Parameter`` stays one, a tensor keeps ``requires_grad``),
    so a collate function sees what the dataset returned."""
    if isinstance(value, torch.Tensor):
        return _copy_tensor(value, device), value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise Uncacheable("numpy object array")
        return value.copy(), value.nbytes
    if value is None or isinstance(value, (bool, int, float, complex, np.generic)):
        return value, 8
    if isinstance(value, (str, bytes)):
        return value, len(value)
    if isinstance(value, Mapping):
        copied, total = {}, 0
        for key, item in value.items():
            copied[key], size = copy_value(item, device)
            total += size
        return (copied if type(value) is dict else _same_container(value, copied)), total
    if isinstance(value, (tuple, list)):
        items = [copy_value(item, device) for item in value]
        total = sum(size for _, size in items)
        values = [v for v, _ in items]
        if type(value) is tuple or type(value) is list:
            return type(value)(values), total
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*values), total
        return _same_container(value, values), total
    raise Uncacheable(type(value).__name__)


def _same_container(value: Any, items: Any) -> Any:
    """A container of ``value``'s own type and attributes (a defaultdict's factory, a list
    subclass's fields) holding ``items``; :class:`Uncacheable` when it cannot be made."""
    try:
        if isinstance(value, (MutableMapping, list)):
            clone = copy.copy(value)  # the type and its attributes, whatever its constructor takes
            if isinstance(clone, list):
                clone[:] = items
            else:
                clone.clear()
                clone.update(items)
            return clone
        return type(value)(items)
    except Exception as error:  # noqa: BLE001 - a container gpuload cannot rebuild is read again
        raise Uncacheable(f"{type(value).__name__} ({type(error).__name__}: {error})") from None


def _copy_tensor(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy of ``value`` on ``device``, of its type, ``requires_grad`` and attributes."""
    copied = value.detach().to(device, copy=True)
    if isinstance(value, torch.nn.Parameter):
        return type(value)(copied, requires_grad=value.requires_grad)
    if type(copied) is not type(value):  # a subclass detach() does not keep
        copied = copied.as_subclass(type(value))
    if type(value) is not torch.Tensor:  # neither detach() nor to() copies a subclass's attributes
        copied.__dict__.update(value.__dict__)
    return copied.requires_grad_() if value.requires_grad else copied


class BudgetedStore(FillingStore):
    """What every sample-keyed cache shares: a byte budget (booked in ``ledger`` on a CUDA
    ``device``), a ``room`` check against free memory, counters, and giving memory back.

    Subclasses store the samples and implement ``gather``, ``put``, ``shrink`` and ``_drop``.
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
        self._device = self.device = torch.device(device)
        self._ledger = ledger
        self._owner: Hashable = owner if owner is not None else (type(self).__name__, id(self))
        self._on_device = self._device.type != "cpu"
        self._budget = (
            ledger.reserve(budget_bytes, self._owner, device=self._device) if self._on_device else budget_bytes
        )
        self._lock = threading.Lock()
        self._streams = StreamGuard(self._device)  # orders and protects device memory across streams
        self._stats = SampleStoreStats(budget=self._budget)
        self._warned = False
        self._closed = False

    def _has_room(self, nbytes: int) -> bool:
        """Whether ``room()`` (memory the cache may still take, e.g. free device memory above the
        reserve) leaves ``nbytes`` more. Asked again every 256 MiB added and whenever its last
        answer runs out, so a model growing meanwhile is noticed. Call with the lock held."""
        if self._room is None:
            return True
        if nbytes > self._room_left or self._since_check >= _ROOM_CHECK_BYTES:
            self._room_left, self._since_check = self._room(), 0
        return nbytes <= self._room_left

    def _added(self, nbytes: int) -> None:
        """Count ``nbytes`` more against the room check (lock held)."""
        self._room_left -= nbytes
        self._since_check += nbytes

    def _stop_filling(self) -> bool:
        """Mark the cache full (lock held); True the first time, when the caller should warn."""
        self._stats.full = True
        first = not self._warned
        self._warned = True
        return first

    def _warn_stopped(self, why: str) -> None:
        """Say once why the cache stopped filling (outside the lock)."""
        warnings.warn(
            f"gpuload cache: {why} after caching {self._stats.entries} samples "
            f"({format_bytes(self._stats.bytes)}); the rest are read from the dataset",
            CacheFallbackWarning,
            stacklevel=3,
        )

    def _book(self) -> None:
        """Tell the ledger the bytes now held (outside the lock)."""
        if self._on_device:
            self._ledger.set_used(self._owner, self._stats.bytes, device=self._device)

    @property
    def complete(self) -> bool:
        """Every sample of the dataset is held (known only with ``num_samples``)."""
        return self._num_samples is not None and self._stats.entries >= self._num_samples

    @property
    def accepting(self) -> bool:
        """Whether the cache may still add samples: not full, closed or complete."""
        return not (self._stats.full or self._closed or self.complete)

    @property
    def full(self) -> bool:
        return self._stats.full

    @property
    def device_bytes(self) -> int:
        """Bytes held in the memory of ``device`` (host memory for a CPU device)."""
        return self.stats.bytes

    @property
    def stats(self) -> SampleStoreStats:
        with self._lock:
            return SampleStoreStats(**self._stats.as_dict())

    def summary(self, **labels: Any) -> dict[str, Any]:
        """The counters as a dict for ``loader.stats.extra["cache"]``, with the caller's labels."""
        return dict(self.stats.as_dict(), num_samples=self._num_samples, complete=self.complete, **labels)

    def __len__(self) -> int:
        return self._stats.entries


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

    def _drop(self) -> None:
        """Forget every stored sample (lock held)."""

    def close(self) -> None:
        """Drop every stored sample and the ledger booking. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop()
            self._stats.entries = 0
            self._stats.bytes = 0
        if self._on_device:
            self._ledger.release(self._owner)


class SampleStore(BudgetedStore):
    """Samples of a map-style dataset kept as they pass, one object per sample, up to ``budget_bytes``.

    A sample is a tensor, numpy array, number, string, bytes or a nested tuple/list/dict of them;
    tensors and arrays are copied (to ``device`` for tensors) so later changes by the dataset
    cannot reach the cache. Once a sample would exceed the budget the cache is full and stops
    adding. ``get`` returns the stored objects: callers must not modify them in place
    (collation copies). On a CUDA ``device`` the budget is booked in ``ledger``. With
    ``num_samples`` (the dataset's length) the cache knows when it is ``complete``, and then
    settles: it stops adding and hands the unused budget back to other loaders. Right for
    samples of varying sizes (decoded images, file bytes); a dataset's samples of one
    structure are kept by column instead (``gpuload.cache.columns``).
    """

    def __init__(self, budget_bytes: int, device: torch.device | str = "cpu", **options: Any) -> None:
        super().__init__(budget_bytes, device, **options)
        self._entries: dict[int, Any] = {}
        self._sizes: dict[int, int] = {}
        self._last_nbytes = 0

    def put(self, indices: Any, batch: Any) -> int:
        """Store each sample of ``batch`` under its dataset index in ``indices``; how many were
        stored (see :meth:`keep`)."""
        return sum(self.keep(int(index), sample) for index, sample in zip(indices, batch))

    def gather(self, indices: Any) -> list[Any]:
        """The stored samples at ``indices`` (each a hit), in order; ``IndexError`` names the
        first one not stored."""
        with self._lock:
            self._streams.use()
            found = [self._entries.get(int(index), MISSING) for index in indices]
            for index, sample in zip(indices, found):
                if sample is MISSING:
                    raise IndexError(f"dataset index {int(index)} is not in this cache")
            self._stats.hits += len(found)
        return found

    def keep(self, index: int, sample: Any) -> bool:
        """Store ``sample`` for ``index``; False when full, closed, or not a cacheable type."""
        index = int(index)
        with self._lock:
            if self._closed or self._stats.full:
                self._stats.rejected += 1
                return False
            if index in self._entries:
                return True
            self._streams.use()  # the copy is made on this stream
            no_room = not self._has_room(self._last_nbytes)
            if no_room:
                self._stats.rejected += 1
                first = self._stop_filling()
        if no_room:
            if first:
                self._warn_stopped(f"free memory on {self._device} reached the reserve")
            return False
        try:
            copied, nbytes = copy_value(sample, self._device)
            if self._on_device:  # one allocation per tensor: count what the device gives up for it
                nbytes = _as_allocated(copied, nbytes)
        except Uncacheable:
            with self._lock:
                self._stats.uncacheable += 1
            return False
        except RuntimeError as error:
            if not is_oom(error):
                raise
            with self._lock:
                self._stats.rejected += 1
                first = self._stop_filling()
            if first:
                self._warn_stopped(f"out of memory on {self._device}")
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
            self._added(nbytes)
            self._last_nbytes = nbytes
            self._stats.entries += 1
            self._stats.bytes += nbytes
        self._book()
        if self.complete:
            self.settle()
        return True

    def get(self, index: int, default: Any = None) -> Any:
        """The stored sample for ``index`` (a hit), or ``default`` (a miss)."""
        with self._lock:
            found = self._entries.get(int(index), MISSING)
            if found is MISSING:
                self._stats.misses += 1
                return default
            self._stats.hits += 1
            self._streams.use()
            return found

    def peek(self, index: int, default: Any = None) -> Any:
        """The stored sample for ``index`` without counting a hit or miss (for a sample just put)."""
        with self._lock:
            return self._entries.get(int(index), default)

    def __contains__(self, index: object) -> bool:
        return isinstance(index, (int, np.integer)) and int(index) in self._entries

    def shrink(self, max_device_bytes: int) -> int:
        """Drop the most recently added samples until at most ``max_device_bytes`` are held, and
        stop adding; returns the bytes freed. Dropped samples are read from the source again."""
        with self._lock:
            freed, dropped = 0, []
            while self._entries and self._stats.bytes > max_device_bytes:
                index = next(reversed(self._entries))
                nbytes = self._sizes.pop(index)
                dropped.append(self._entries.pop(index))
                self._stats.entries -= 1
                self._stats.bytes -= nbytes
                freed += nbytes
            if freed:
                self._stats.full = True
            # Dropped device tensors stay reserved until the streams that read them are done.
            self._streams.replaced([leaf for sample in dropped for leaf in tree_leaves(sample)
                                    if isinstance(leaf, torch.Tensor)])
        if freed:
            self._book()
        return freed

    def _drop(self) -> None:
        self._entries = {}
        self._sizes = {}


def _as_allocated(copied: Any, nbytes: int) -> int:
    """``nbytes`` of a copy with each device tensor in it counted as torch's CUDA caching
    allocator takes it (:func:`~gpuload.cache.allocator.reserved_bytes`), not by its size."""
    for leaf in tree_leaves(copied):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
            size = leaf.numel() * leaf.element_size()
            nbytes += reserved_bytes(size) - size
    return nbytes


MISSING = object()
"""A default no sample can be: ``get(index, MISSING)`` tells a miss from a cached None."""
