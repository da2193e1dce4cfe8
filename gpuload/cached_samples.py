"""Generic map-style datasets kept in a sample cache: decide once, fill as batches go by, serve.

For a dataset gpuload cannot gather from (any ``__getitem__``), the deterministic part of the
data is the dataset's own samples. ``decide_sample_cache`` chooses where they may be kept (the
device, host memory, or nowhere) and why; ``CachedSamples`` fills a ``SampleCache`` while the
first epoch runs and then builds batches from it, calling the dataset only for what it lacks.

Filling needs to know which sample each fetched batch holds. With ``num_workers=0`` gpuload
fetches itself. With workers, torch's iterator runs unchanged except that the loader's index
sampler is wrapped by ``RecordingSampler`` (it notes each index batch it hands out, in order) and
the workers' collate function by ``KeepSamples`` (it returns the samples beside the batch, until
the cache says it is full). Batches come back in the order their indices were drawn
(``in_order=True``), so the k-th batch belongs to the k-th recorded index batch.
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from gpuload.cache import CacheSettings, SampleCache, format_bytes, looks_deterministic
from gpuload.device import MemoryInfo, device_memory, host_memory
from gpuload.transfer import batch_nbytes, map_leaves, move_to_device

__all__ = ["CacheDecision", "CachedSamples", "KeepSamples", "RecordingSampler", "decide_sample_cache"]


@dataclass(frozen=True)
class CacheDecision:
    """Where a generic dataset's samples are kept: ``tier`` "device", "host" or "none"."""

    tier: str
    budget: int
    reason: str
    warn: bool = False  # the reason is worth a one-time warning (auto mode declined)


def decide_sample_cache(
    dataset: Any,
    settings: CacheSettings,
    device: torch.device,
    *,
    default_collate: bool,
    num_workers: int,
    in_order: bool,
    owner: Any = None,
    device_memory_info: MemoryInfo | None = None,
    host_memory_info: MemoryInfo | None = None,
    probe: Callable[[Any], tuple[bool, str]] = looks_deterministic,
) -> CacheDecision:
    """Decide the tier and budget of a sample cache for ``dataset``, with the reason.

    ``cache="auto"`` caches on a CUDA device only, and only a dataset whose samples read the
    same twice (``probe``); on a CPU device the dataset itself already serves the loop, so auto
    leaves it alone. ``cache="device"`` / ``"host"`` cache without probing (the user vouches
    for the data). The device tier needs torch's default collation (batches are collated from
    device tensors); with a custom ``collate_fn`` samples are kept in host memory.
    """
    mode = settings.mode.value
    off = settings.off_reason()
    if off:
        return CacheDecision("none", 0, off)
    try:
        count = len(dataset)
    except TypeError:
        return CacheDecision("none", 0, f"{type(dataset).__name__} has no len(): samples cannot be counted")
    if count == 0:
        return CacheDecision("none", 0, "the dataset is empty")
    if num_workers > 0 and not in_order:
        return CacheDecision(
            "none", 0, "in_order=False with workers: batches cannot be matched to their samples", warn=mode != "auto"
        )
    host = host_memory_info or host_memory()
    if device.type == "cpu":
        if mode == "auto":
            return CacheDecision(
                "none", 0, "on a CPU device the dataset serves the loop itself; cache='host' keeps its samples in memory"
            )
        return CacheDecision("host", settings.host_room(host), f"cache={mode!r} on a CPU device: host memory")
    if mode == "auto":
        deterministic, why = probe(dataset)
        if not deterministic:
            return CacheDecision("none", 0, why, warn=True)
    if mode == "host" or not default_collate:
        why = f"cache={mode!r}" if mode == "host" else "a custom collate_fn runs on host samples"
        return CacheDecision("host", settings.host_room(host), f"{why}: host memory")
    budget = settings.device_room(device, device_memory_info or device_memory(device), owner)
    if budget == 0 and mode == "auto":
        return CacheDecision("host", settings.host_room(host), f"no device budget left on {device}: host memory")
    return CacheDecision("device", budget, f"device memory on {device} (budget {format_bytes(budget)})")


class KeepSamples:
    """A collate function that also returns the samples it collated, while ``sending`` is set.

    Picklable, so it travels to worker processes; ``sending`` is shared memory the loader
    clears once the cache cannot take more, so workers stop shipping samples twice.
    """

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn
        self.sending = multiprocessing.get_context().Value("b", 1, lock=False)

    def __call__(self, samples: Any) -> tuple[Any, Any]:
        return (samples if self.sending.value else None), self.collate_fn(samples)


class RecordingSampler:
    """Wraps an index sampler and records, in order, each index (batch) its iterator yields.

    Iterating it draws exactly what the wrapped sampler draws; each new ``iter()`` starts a new
    record, as torch's iterators call ``iter()`` once per epoch.
    """

    def __init__(self, sampler: Iterable[Any]) -> None:
        self.sampler = sampler
        self.drawn: deque[Any] = deque()

    def __iter__(self) -> Iterator[Any]:
        self.drawn = drawn = deque()
        for index in self.sampler:
            drawn.append(index)
            yield index

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


def _keys(indices: Any, batched: bool) -> list[int] | None:
    """Cache keys of one index batch, or None if an index is not an integer."""
    if isinstance(indices, torch.Tensor):
        return [int(i) for i in indices.view(-1).tolist()]
    items = indices if batched else [indices]
    keys = []
    for index in items:
        if isinstance(index, torch.Tensor) and index.numel() == 1:
            index = index.item()
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            return None
        keys.append(int(index))
    return keys


class CachedSamples:
    """A dataset's samples cached by index, and batches built from them as torch would build them.

    ``tier="device"``: samples are copied to ``device`` and collated there (nothing crosses
    PCIe once cached); ``"host"``: kept in host memory and collated there.
    """

    def __init__(
        self,
        dataset: Any,
        decision: CacheDecision,
        device: torch.device,
        collate_fn: Callable[[Any], Any],
        batched: bool,
        owner: Any,
        settings: CacheSettings,
    ) -> None:
        self.dataset = dataset
        self.tier = decision.tier
        self.reason = decision.reason
        self.device = device
        self.collate_fn = collate_fn
        self.batched = batched
        self.num_samples = len(dataset)
        where = device if decision.tier == "device" else torch.device("cpu")
        self.cache = SampleCache(decision.budget, where, owner=owner, room=settings.room_check(where))
        self.keep: KeepSamples | None = None
        self.recorder: RecordingSampler | None = None
        self.unkeyed = False  # an index that is not an int was seen: nothing more is cached
        self.fill_epochs = 0
        # Bytes this cache copied host-to-device: samples put on the device tier, and samples
        # it could not take, moved there to be collated with the cached ones.
        self.h2d_bytes = 0

    @property
    def complete(self) -> bool:
        """Every sample is cached: epochs need no dataset reads."""
        return len(self.cache) >= self.num_samples

    @property
    def accepting(self) -> bool:
        return not (self.cache.full or self.unkeyed or self.complete)

    def fit_reserve(self, settings: CacheSettings) -> int:
        """At an epoch start: drop samples from a CUDA device tier if the model has grown into
        the reserve; returns the bytes given back (warns when it does)."""
        return self.cache.fit_reserve(settings.keepable, "those samples are read from the dataset again")

    def stats(self) -> dict[str, Any]:
        entry = self.cache.stats.as_dict()
        entry.update(kind="samples", tier=self.tier, num_samples=self.num_samples, complete=self.complete,
                     reason=self.reason)
        return entry

    def close(self) -> None:
        self.cache.close()
        if self.keep is not None:
            self.keep.sending.value = 0

    # -- filling while torch's iterator runs (num_workers > 0) --------------------------------

    def wrap_for_fill(self, collate_fn: Callable[[Any], Any], index_sampler: Iterable[Any]) -> tuple[KeepSamples, RecordingSampler]:
        """The collate function and index sampler torch's iterator should use to fill the cache."""
        if self.keep is None:
            self.keep = KeepSamples(collate_fn)
            self.recorder = RecordingSampler(index_sampler)
        self.keep.sending.value = int(self.accepting)
        return self.keep, self.recorder

    def unwrap(self, batches: Iterator[Any]) -> Iterator[Any]:
        """torch's (samples, batch) pairs to batches, caching the samples on the way."""
        recorder = self.recorder
        for samples, batch in batches:
            indices = recorder.drawn.popleft() if recorder.drawn else None
            if samples is not None and indices is not None:
                self._store(self._keys_of(indices), samples if self.batched else [samples])
            if self.keep is not None and not self.accepting:
                self.keep.sending.value = 0
            yield batch

    # -- serving (and filling with num_workers=0) --------------------------------------------

    def _keys_of(self, indices: Any) -> list[int] | None:
        """Cache keys of one index batch; None (and no more caching) once one is not an integer."""
        keys = None if self.unkeyed else _keys(indices, self.batched)
        if keys is None:
            self.unkeyed = True
        return keys

    def _store(self, keys: list[int] | None, samples: Sequence[Any]) -> list[Any]:
        """Put fetched samples in the cache; returns them, each replaced by its cached copy."""
        if keys is None:
            return list(samples)
        kept = []
        for key, sample in zip(keys, samples):
            if self.accepting and self.cache.put(key, sample):
                if self.tier == "device" and self.device.type != "cpu":
                    self.h2d_bytes += batch_nbytes(sample)
                sample = self.cache.peek(key, sample)
            kept.append(sample)
        return kept

    def _fetch(self, indices: list[Any]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None) if self.batched else None
        if getitems is not None:  # as torch's fetcher: a batch's samples in one call
            return list(getitems(indices))
        return [self.dataset[index] for index in indices]

    def batch(self, indices: Any) -> Any:
        """The batch torch's fetch + collate gives for ``indices`` (device-tier leaves on the
        device; anything collated from host samples still on the host)."""
        keys = self._keys_of(indices)
        items = indices.view(-1).tolist() if isinstance(indices, torch.Tensor) else (
            list(indices) if self.batched else [indices]
        )
        samples: list[Any] = [None] * len(items)
        missing: list[int] = []
        for position, key in enumerate(keys if keys is not None else [None] * len(items)):
            found = self.cache.get(key, _MISSING) if key is not None else _MISSING
            if found is _MISSING:
                missing.append(position)
            else:
                samples[position] = found
        if missing:
            fetched = self._fetch([items[p] for p in missing])
            stored = self._store([keys[p] for p in missing], fetched) if keys is not None else fetched
            for position, sample in zip(missing, stored):
                samples[position] = sample
        if self.device.type != "cpu" and missing and self.tier == "device":
            # Samples the cache could not take are still on the host: move them before collating.
            for position in missing:
                if not _on_device(samples[position], self.device):
                    self.h2d_bytes += batch_nbytes(samples[position])
                    samples[position] = move_to_device(samples[position], self.device, non_blocking=False)
        if not (self.batched and is_default_collate(self.collate_fn)):
            # default_collate builds new tensors; anything else might hand the cached objects
            # themselves to the loop, where an in-place change would alter later epochs.
            samples = [_fresh(sample) for sample in samples]
        batch = self.collate_fn(samples) if self.batched else self.collate_fn(samples[0])
        return batch

    def warm(self, progress: bool, num_workers: int, batch_size: int, worker_options: dict[str, Any]) -> int:
        """Read every sample not cached yet into the cache, in index order; returns how many."""
        from tqdm import tqdm

        todo = [i for i in range(self.num_samples) if i not in self.cache]
        if not todo or not self.accepting:
            return 0
        chunks = [todo[k : k + batch_size] for k in range(0, len(todo), batch_size)]
        if num_workers > 0:
            # torch's workers read in parallel; a private generator keeps the user's RNG untouched.
            reader = tud.DataLoader(
                self.dataset, batch_sampler=chunks, num_workers=num_workers, collate_fn=_sample_list,
                generator=torch.Generator(), **worker_options,
            )
            fetched: Iterable[list[Any]] = iter(reader)
        else:
            fetched = (self._fetch(chunk) for chunk in chunks)
        read = 0
        try:
            with tqdm(total=len(todo), unit="sample", desc="gpuload warm", disable=not progress) as bar:
                for chunk, samples in zip(chunks, fetched):
                    self._store(chunk, samples)
                    read += len(chunk)
                    bar.update(len(chunk))
                    if not self.accepting:
                        break
        finally:
            if hasattr(fetched, "_shutdown_workers"):  # torch's workers stop even on an error
                fetched._shutdown_workers()
        if self.complete:
            self.cache.settle()
        return read

    def warn_if_partial(self) -> None:
        """After a whole epoch: settle the budget, and say once why samples stay uncached."""
        self.fill_epochs += 1
        if self.complete:
            self.cache.settle()  # the unused rest of the budget goes back to other loaders
        if self.fill_epochs != 1 or self.complete:
            return
        stats = self.cache.stats
        if self.unkeyed:
            why = "its sampler yields indices that are not integers"
        elif stats.uncacheable:
            why = f"{stats.uncacheable} samples are of types gpuload cannot copy (tensors, arrays, numbers, strings and containers of them)"
        else:
            why = f"the budget ({format_bytes(stats.budget)}) holds {stats.entries} of {self.num_samples} samples"
        warnings.warn(
            f"gpuload: the {self.tier} sample cache of this {type(self.dataset).__name__} is partial: {why}; "
            "the rest are read from the dataset every epoch",
            stacklevel=3,
        )


def _sample_list(samples: list[Any]) -> list[Any]:
    return samples


def _fresh(sample: Any) -> Any:
    """A copy of a cached sample's tensors and arrays (numbers and strings are immutable)."""

    def copy(leaf: Any) -> Any:
        return leaf.copy() if isinstance(leaf, np.ndarray) else leaf.clone()

    return map_leaves(sample, copy, is_leaf=lambda leaf: isinstance(leaf, np.ndarray))


def _on_device(sample: Any, device: torch.device) -> bool:
    from torch.utils._pytree import tree_leaves

    return all(not isinstance(leaf, torch.Tensor) or leaf.device == device for leaf in tree_leaves(sample))


_MISSING = object()


def is_default_collate(collate_fn: Callable[[Any], Any]) -> bool:
    return collate_fn in (tud.default_collate, tud.default_convert)
