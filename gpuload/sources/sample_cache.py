"""The sample cache of a map-style dataset while it serves: filled as the first epoch passes,
then batches built from it, calling the dataset only for what it lacks.

``decide_samples`` (in ``gpuload.cache``) chooses where the samples may be kept; a
:class:`CachedSamples` holds the store that keeps them (by column, ``ColumnStore``) and answers
each batch from it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from gpuload.cache import CacheDecision, format_bytes
from gpuload.cache.columns import Branch, Column, ColumnStore, Part, prepare, worker_collate
from gpuload.cache.disk_tier import DiskRows, Fingerprint, select_rows
from gpuload.cpu_threads import own_cpu_threads
from gpuload.sources import Setup
from gpuload.sources.torch_fetch import KeepSamples, PerBatch, fetch, read_prepared
from gpuload.timeline import gather_stage, stage
from gpuload.transfer import batch_nbytes, move_staged

__all__ = ["CachedSamples"]


def _keys(indices: Any, batched: bool) -> torch.Tensor | None:
    """Cache keys of one index batch as an int64 tensor, or None if an index is not an integer."""
    if isinstance(indices, torch.Tensor) and indices.dtype == torch.int64:
        return indices if indices.dim() == 1 else indices.reshape(-1)
    items = indices if batched else [indices]
    if isinstance(items, torch.Tensor):
        items = items.view(-1).tolist()
    if isinstance(items, list) and set(map(type, items)) <= {int}:  # torch's BatchSampler: a list of ints
        return torch.tensor(items, dtype=torch.int64)
    keys = []
    for index in items:
        if isinstance(index, torch.Tensor) and index.numel() == 1:
            index = index.item()
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            return None
        keys.append(int(index))
    return torch.tensor(keys, dtype=torch.int64)


class CachedSamples:
    """A dataset's samples cached by index in a ``ColumnStore``, and batches built from it as
    torch would build them.

    ``tier="device"``: the columns live on ``device`` and batches are gathered there (nothing
    crosses PCIe once cached); ``"host"``: in host memory (pinned when the loader's device is
    CUDA). With torch's default_collate a cached batch is one gather per column; with any
    other collate_fn (or ``batch_size=None``) the collate_fn gets fresh per-sample copies.
    Every byte this cache copies host-to-device is added to ``h2d_bytes``. ``num_workers``: the
    loader's; with workers torch collates in worker processes, and so does a cached batch's
    per-sample leaves (``worker_collate``: a dtype that varies between samples stays the
    first sample's, as there).
    """

    def __init__(self, setup: Setup, decision: CacheDecision, num_workers: int = 0,
                 fingerprint: Fingerprint | None = None) -> None:
        self.dataset = setup.dataset
        self.setup = setup
        self.tier = decision.tier
        self.reason = decision.reason
        self.device = setup.device
        self.collate_fn = setup.collate_fn
        self.batched = setup.batched
        self.by_column = setup.batched and setup.collate_fn is default_collate
        self.num_samples = len(setup.dataset)
        self.num_workers = num_workers
        where = setup.device if decision.tier == "device" else torch.device("cpu")
        self.store = ColumnStore(decision.budget, self.num_samples, where, owner=setup.owner,
                                 room=setup.settings.room_check(where),
                                 collate=worker_collate if num_workers else default_collate,
                                 views_only=not self.by_column, staging=setup.staging)
        self.unkeyed = False  # an index that is not an int was seen: nothing more is cached
        self.fill_epochs = 0
        self._entries_seen = 0  # entries at the end of the last epoch: does an epoch still add?
        self._warned_partial = False
        self._counts_copies = decision.tier == "device" and setup.device.type != "cpu"
        self.h2d_bytes = 0  # samples put on the device tier, and misses moved there to be collated
        # Below the memory tiers, ``cache_dir``'s disk tier: samples read back from it instead
        # of the dataset. Only deterministic samples collated by column (a frozen random epoch
        # is never written), keyed by ``fingerprint`` (``DiskRows.identify``, taken before any read).
        self.disk = DiskRows.open(setup.dataset, setup.settings, fingerprint) \
            if self.by_column and not decision.warn else None

    @property
    def complete(self) -> bool:
        """Every sample is cached (in memory or on disk): epochs need no dataset reads."""
        return self.store.complete or (self.disk is not None and self.disk.complete)

    @property
    def accepting(self) -> bool:
        return self.store.accepting and not self.unkeyed

    @property
    def layout(self) -> str:
        """How the samples are stored (by column or per sample), for the decision line."""
        return self.store.describe()

    @property
    def path(self) -> str:
        """``loader.stats.path`` while it is held: with workers only a complete cache serves."""
        serves = self.num_workers == 0 or self.complete
        return f"sample-cache ({self.tier})" if serves else "torch"

    def begin_epoch(self, keepable: Any) -> None:
        """Give device memory back if the model has grown into the reserve (the samples cached
        last go first: the store keeps its first slots)."""
        self.store.shrink_to_reserve(keepable, "those samples are read from the dataset again")

    def stats(self) -> dict[str, Any]:
        """For ``loader.stats.extra["cache"]``."""
        summary = self.store.summary(kind="samples", tier=self.tier, reason=self.reason)
        if self.disk is not None:
            summary["disk"] = self.disk.stats()
        return summary

    def entries(self) -> dict[str, Any]:
        """The sample source's entries in ``loader.stats.extra``."""
        return {"cache": self.stats(), "sample_cache_decision": f"{self.tier}: {self.reason}; {self.layout}"}

    def close(self) -> dict[str, Any]:
        """Drop the cache; its counters as released."""
        self.store.close()
        if self.disk is not None:
            self.disk.close()
        return dict(self.stats(), released=True)

    def take(self, indices: Any, part: Part | None, keep: KeepSamples) -> None:
        """Cache a worker batch's prepared samples (``part``) for its ``indices``; tell the workers
        to stop sending once the cache takes no more."""
        if part is not None and indices is not None:
            keys = self._keys_of(indices)
            if keys is not None:
                self._store(keys, part)
                if self.disk is not None:
                    self.disk.write(keys, part)
        if not self.accepting and not (self.disk is not None and self.disk.accepting):
            keep.sending.value = 0

    def _keys_of(self, indices: Any) -> torch.Tensor | None:
        """Cache keys of one index batch; None (and no more caching) once one is not an integer."""
        keys = None if self.unkeyed else _keys(indices, self.batched)
        if keys is None:
            self.unkeyed = True
        return keys

    def _store(self, keys: torch.Tensor, part: Part) -> int:
        """Put a prepared batch in the store; how many of its samples were stored now."""
        with own_cpu_threads(self.device):  # gpuload's batch-sized copies (exact at any thread count)
            stored = self.store.put(keys, part) if self.accepting else 0
        if stored and self._counts_copies:
            self.h2d_bytes += _column_bytes(part)
        return stored

    def _fetch(self, indices: list[Any]) -> list[Any]:
        return fetch(self.dataset, indices, self.batched)

    def batch(self, indices: Any, in_range: bool = False) -> Any:
        """The batch torch's fetch + collate gives for ``indices`` (device-tier leaves on the
        device; anything collated from host samples still on the host). ``in_range``: the
        indices are int64 tensors known to lie in ``[0, len(dataset))``."""
        keys = self._keys_of(indices)
        if keys is None or not keys.numel():  # torch's fetch and collate (and its error if empty)
            items = list(indices) if self.batched else [indices]
            return self._collate(self._fetch(items))
        store = self.store
        complete = self.store.complete  # read before the slots: complete then, they are all stored
        slots = store.slots(keys, in_range)
        if complete and in_range:
            store.count(keys.numel(), 0)
            return self._from_store(slots)
        rows = slots.numpy()  # numpy's min/max: no thread pool to wake for a few hundred rows
        low, high = int(rows.min()), int(rows.max())
        if low >= 0:
            store.count(keys.numel(), 0)
            return self._from_store(slots)
        items = indices.view(-1).tolist() if isinstance(indices, torch.Tensor) else (
            list(indices) if self.batched else [indices])
        if high < 0:  # nothing cached: the filling epoch's usual batch
            missing, positions = keys, list(range(len(items)))
        else:
            where = (slots < 0).nonzero().view(-1)
            missing, positions = keys.index_select(0, where), where.tolist()
        store.count(keys.numel() - len(positions), len(positions))
        with stage(gather_stage("disk")):
            part = self.disk.read(missing) if self.disk is not None else None
        fetched = None
        if part is None:
            fetched = self._fetch(items if high < 0 else [items[p] for p in positions])
            part = prepare(fetched)
            if self.disk is not None:
                self.disk.write(missing, part)
        if self.accepting and self._store(missing, part) == len(positions):
            if high < 0 and self.by_column and not self._counts_copies:
                return part.batch()  # every sample was read now: the columns just written
            return self._from_store(store.slots(keys))
        if fetched is None:
            return self._partial_from_disk(store.slots(keys), positions, part, items)
        return self._partial(store.slots(keys), positions, fetched)

    def _from_store(self, slots: torch.Tensor) -> Any:
        """A batch of stored samples only."""
        if self.by_column:
            with own_cpu_threads(self.device), stage(gather_stage(self.tier)):
                return self.store.gather_rows(slots)
        return self._collate(self.store.views(slots))

    def _partial(self, slots: torch.Tensor, positions: list[int], fetched: list[Any]) -> Any:
        """A batch of stored samples and samples read now (``fetched``, at ``positions``), in order."""
        read = (slots < 0).nonzero().view(-1).tolist()
        if read != positions:  # only some were stored just now: keep the rest
            kept = dict(zip(positions, fetched))
            fetched = [kept[p] for p in read]
        if not read:  # a sample drawn twice: all were stored after all
            return self._from_store(slots)
        if len(read) == slots.numel():
            return self._collate(fetched)
        if self.by_column:
            if self._counts_copies:
                self.h2d_bytes += sum(batch_nbytes(sample) for sample in fetched)
            with own_cpu_threads(self.device):
                batch = self.store.assemble(slots, prepare(fetched))
            if batch is not None:
                return batch
        cached = iter(self.store.views(slots[slots >= 0]))
        extra = iter(fetched)
        samples = [next(extra) if s < 0 else next(cached) for s in slots.tolist()]
        if self._counts_copies:
            samples = move_staged(samples, self.device, self.setup.staging)
        return self._collate(samples)

    def _partial_from_disk(self, slots: torch.Tensor, positions: list[int], part: Part, items: list[Any]) -> Any:
        """A batch of stored samples and samples read from the disk tier (``part``, at
        ``positions``), in order (collated by column: the disk tier needs it)."""
        read = (slots < 0).nonzero().view(-1).tolist()
        if not read:
            return self._from_store(slots)
        if read != positions:  # only some were stored just now: keep the rest
            at = {p: k for k, p in enumerate(positions)}
            part = select_rows(part, torch.tensor([at[p] for p in read], dtype=torch.int64))
        if len(read) == slots.numel():
            return part.batch()
        if self._counts_copies:
            self.h2d_bytes += _column_bytes(part)
        with own_cpu_threads(self.device), stage(gather_stage(self.tier)):
            batch = self.store.assemble(slots, part)
        if batch is None:  # the stored columns changed structure: as torch reads it
            batch = self._collate(self._fetch(items))
        return batch

    def _collate(self, samples: list[Any]) -> Any:
        return self.collate_fn(samples) if self.batched else self.collate_fn(samples[0])

    def batches(self, indices: Iterator[Any], in_range: bool = False, whole: bool = True) -> Iterator[Any]:
        """An epoch's batches from the cache (and the dataset for what it lacks); ``whole``: not
        the rest of a resumed epoch, which cannot have filled the cache."""
        return PerBatch(indices, lambda index: self.batch(index, in_range), self.end_of_epoch if whole else None)

    def warm(self, progress: bool, num_workers: int, worker_options: dict[str, Any]) -> int:
        """Read every sample not cached yet into the cache, in index order; returns how many."""
        from tqdm import tqdm

        everything = torch.arange(self.num_samples, dtype=torch.int64)
        todo = (self.store.slots(everything, in_range=True) < 0).nonzero().view(-1).tolist()
        if not todo or not self.accepting:
            return 0
        batch_size = self.setup.batch_size or 1
        chunks = [todo[k : k + batch_size] for k in range(0, len(todo), batch_size)]
        read = 0
        with (
            read_prepared(self.dataset, chunks, num_workers, worker_options, self.batched) as fetched,
            tqdm(total=len(todo), unit="sample", desc="gpuload warm", disable=not progress) as bar,
        ):
            for chunk, part in zip(chunks, fetched):
                keys = torch.tensor(chunk, dtype=torch.int64)
                self._store(keys, part)
                if self.disk is not None:
                    self.disk.write(keys, part)
                read += len(chunk)
                bar.update(len(chunk))
                if not self.accepting:
                    break
        return read

    def end_of_epoch(self) -> bool:
        """After a whole epoch: whether the cache is worth keeping (complete, or still filling
        as the epochs visit new samples); says once why it stays partial when it is.

        A sampler that visits part of the dataset in an epoch (a ``DistributedSampler``'s share,
        ``WeightedRandomSampler``, sampling with replacement) leaves the rest for later epochs:
        that is not the budget's doing, and the cache goes on filling. One whose epochs add no
        new sample caches all it will ever read."""
        self.fill_epochs += 1
        stats = self.store.stats
        grew, self._entries_seen = stats.entries > self._entries_seen, stats.entries
        if self.complete:
            return True
        if self.unkeyed:
            why = "its sampler yields indices that are not integers"
        elif stats.uncacheable:
            why = (f"{stats.uncacheable} samples are of types gpuload cannot copy "
                   "(tensors, arrays, numbers, strings and containers of them)")
        elif stats.full:
            why = f"the budget ({format_bytes(stats.budget)}) holds {stats.entries} of {self.num_samples} samples"
        else:  # the sampler has not visited the rest (yet): nothing to say
            return grew
        if not self._warned_partial:
            self._warned_partial = True
            warnings.warn(
                f"gpuload: the {self.tier} sample cache of this {type(self.dataset).__name__} is partial: {why}; "
                "the rest are read from the dataset every epoch",
                stacklevel=3,
            )
        return False


def _column_bytes(part: Part) -> int:
    """Bytes of a prepared batch's tensors (what writing it to device columns copies)."""
    if isinstance(part, Column):
        return part.rows.numel() * part.rows.element_size()
    if isinstance(part, Branch):
        return sum(_column_bytes(child) for child in part.children)
    return batch_nbytes(list(part.values))
