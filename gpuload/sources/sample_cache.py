"""The sample cache of a map-style dataset while it serves: filled as the first epoch passes,
then batches built from it, calling the dataset only for what it lacks.

``decide_samples`` (in ``gpuload.cache``) chooses where the samples may be kept; a
:class:`CachedSamples` holds the store that keeps them (by column, ``ColumnStore``) and reads
each batch through one chain of keyed tiers (:func:`~gpuload.cache.chain.read_through`): the
store, ``cache_dir``'s disk tier, then the dataset; what a lower tier gives is kept above it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from gpuload.cache import CacheDecision, format_bytes
from gpuload.cache.chain import NOTHING, Hit, KeyedTier, Lookup, read_through
from gpuload.cache.columns import Branch, Column, ColumnStore, Part, prepare, worker_collate
from gpuload.cache.disk_tier import DiskRows, Fingerprint, select_rows
from gpuload.cpu_threads import give_back_cpu_threads, own_cpu_threads, take_cpu_threads
from gpuload.sources import Setup
from gpuload.sources.torch_fetch import KeepSamples, fetch, per_batch, read_prepared
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
        self._gather_stage = gather_stage(self.tier)  # the timeline's stage of a gather from the store
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
        # Below the memory tier, ``cache_dir``'s disk tier: samples read back from it instead
        # of the dataset. Only deterministic samples collated by column (a frozen random epoch
        # is never written), keyed by ``fingerprint`` (``DiskRows.identify``, taken before any read).
        self.disk = DiskRows.open(setup.dataset, setup.settings, fingerprint) \
            if self.by_column and not decision.warn else None
        # The chain a batch is read through: memory, then disk. Its memory tier in two forms,
        # as a batch's keys are known to lie in the dataset or not (no state set per batch: two
        # threads may each read a batch).
        below: tuple[KeyedTier, ...] = () if self.disk is None else (_DiskTier(self.disk),)
        self.copied = _Copied(self._counts_copies)
        self.memory = _StoreTier(self.store, self.copied, in_range=False)
        self.tiers = (self.memory, *below)
        self._tiers_in_range = (_StoreTier(self.store, self.copied, in_range=True), *below)
        self._dataset_by_key = _DatasetTier(setup.dataset, self.batched, None, NOTHING)  # tensor indices

    @property
    def h2d_bytes(self) -> int:
        """Samples put on the device tier, and misses moved there to be collated."""
        return self.copied.bytes

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
                self._keep(keys, SampleRows(part, None))
        if not self.accepting and not (self.disk is not None and self.disk.accepting):
            keep.sending.value = 0

    def _keys_of(self, indices: Any) -> torch.Tensor | None:
        """Cache keys of one index batch; None (and no more caching) once one is not an integer."""
        keys = None if self.unkeyed else _keys(indices, self.batched)
        if keys is None:
            self.unkeyed = True
        return keys

    def _keep(self, keys: torch.Tensor, rows: SampleRows) -> None:
        """Samples read elsewhere (by workers, or by ``warm``) kept by every tier, the disk's first."""
        for tier in reversed(self.tiers):
            tier.keep(keys, rows)

    def batch(self, indices: Any, in_range: bool = False) -> Any:
        """The batch torch's fetch + collate gives for ``indices`` (device-tier leaves on the
        device; anything collated from host samples still on the host). ``in_range``: the
        indices are int64 tensors known to lie in ``[0, len(dataset))``."""
        if in_range and not self.unkeyed:  # the loader's own epochs: int64 tensors already
            keys = indices if indices.dim() == 1 else indices.reshape(-1)
        else:
            keys = self._keys_of(indices)
            if keys is None or not keys.numel():  # torch's fetch and collate (and its error if empty)
                return self._collate(self._fetch(_items(indices, self.batched)))
        if in_range:
            hits, _ = read_through(self._tiers_in_range, keys, self._dataset_by_key)
        else:
            hits, _ = read_through(self.tiers, keys, _DatasetTier(self.dataset, self.batched, indices, keys))
        if len(hits) == 1 and not hits[0][0]:  # every sample from memory: the steady batch
            return self._from_store(hits[0][2])
        # _assemble takes the last hit as every key memory lacked: the disk answers all or none.
        assert len(hits) <= 2, "a sample tier below memory answered part of a batch"
        return self._assemble(keys, hits[-1], indices)

    def _assemble(self, keys: torch.Tensor, below: Hit, indices: Any) -> Any:
        """A batch some of whose samples were read below memory now (``below``: the disk's or
        the dataset's, at their positions), in order: from the store when it took them all,
        else the stored ones and the rest of ``below`` put together."""
        _, positions, rows = below
        slots = self.store.slots(keys)
        left = (slots < 0).nonzero().view(-1)  # positions the store does not hold, even now
        if not left.numel():
            # Every sample read now (``positions``, ascending, then covers every key): the columns
            # just read are the batch, not a third copy gathered back from the store that took them.
            read_all = positions is None or positions.numel() == keys.numel()
            if read_all and self.by_column and not self._counts_copies:
                return rows.part.batch()
            return self._from_store(slots)
        if positions is not None and not torch.equal(left, positions):  # the store took some of them
            rows = rows.select(torch.searchsorted(positions, left))  # both ascending
        if left.numel() == slots.numel():
            return rows.part.batch() if rows.samples is None else self._collate(rows.samples)
        if self.by_column:
            if self._counts_copies:
                self.copied.bytes += rows.nbytes()
            with own_cpu_threads(self.device), stage(self._gather_stage):
                batch = self.store.assemble(slots, rows.part)
            if batch is not None:
                return batch
            if rows.samples is None:  # rows from disk that the stored columns do not fit: as torch reads it
                return self._collate(self._fetch(_items(indices, self.batched)))
        cached = iter(self.store.views(slots[slots >= 0]))
        extra = iter(rows.samples)
        samples = [next(extra) if s < 0 else next(cached) for s in slots.tolist()]
        if self._counts_copies:
            samples = move_staged(samples, self.device, self.setup.staging)
        return self._collate(samples)

    def _fetch(self, items: list[Any]) -> list[Any]:
        return fetch(self.dataset, items, self.batched)

    def _from_store(self, slots: torch.Tensor) -> Any:
        """A batch of stored samples only."""
        if self.by_column:
            threads = take_cpu_threads(self.device)
            try:
                with stage(self._gather_stage):
                    return self.store.gather_rows(slots)
            finally:
                give_back_cpu_threads(threads)
        return self._collate(self.store.views(slots))

    def _collate(self, samples: list[Any]) -> Any:
        return self.collate_fn(samples) if self.batched else self.collate_fn(samples[0])

    def batches(self, indices: Iterator[Any], in_range: bool = False, whole: bool = True) -> Iterator[Any]:
        """An epoch's batches from the cache (and the dataset for what it lacks); ``whole``: not
        the rest of a resumed epoch, which cannot have filled the cache."""
        return per_batch(indices, functools.partial(self.batch, in_range=in_range),
                         self.end_of_epoch if whole else None)

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
                self._keep(torch.tensor(chunk, dtype=torch.int64), SampleRows(part, None))
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


def _items(indices: Any, batched: bool) -> list[Any]:
    """The dataset indices of one index batch as torch's fetch takes them."""
    if isinstance(indices, torch.Tensor):
        return indices.view(-1).tolist()
    return list(indices) if batched else [indices]


@dataclass
class SampleRows:
    """Samples read below the memory tier: prepared (``part``, what the tiers above keep) and
    as the dataset returned them (``samples``; None: read back from the disk tier)."""

    part: Part
    samples: list[Any] | None

    def select(self, positions: torch.Tensor) -> SampleRows:
        """The samples at ``positions`` (int64) of these."""
        if self.samples is None:  # from disk: every leaf a column
            return SampleRows(select_rows(self.part, positions), None)
        samples = [self.samples[p] for p in positions.tolist()]
        return SampleRows(prepare(samples), samples)

    def nbytes(self) -> int:
        """Bytes these samples copy to a device."""
        if self.samples is None:
            return _column_bytes(self.part)
        return sum(batch_nbytes(sample) for sample in self.samples)


class _Copied:
    """Bytes the sample cache copied host-to-device (``counts``: a device tier on a card, where
    what it keeps and the misses it collates there cross PCIe)."""

    def __init__(self, counts: bool) -> None:
        self.counts = counts
        self.bytes = 0


class _StoreTier:
    """The sample store as the chain's memory tier: its slots for the samples it holds
    (gathered when the batch is made), each lookup counted as hits and misses."""

    name = "memory"

    def __init__(self, store: ColumnStore, copied: _Copied, in_range: bool) -> None:
        self.store = store
        self.copied = copied
        self.in_range = in_range  # the keys it is asked are known to lie in the dataset

    def lookup(self, keys: torch.Tensor) -> Lookup:
        store = self.store
        complete = store.complete  # read before the slots: complete then, they are all stored
        slots = store.slots(keys, self.in_range)
        if not (complete and self.in_range):
            rows = slots.numpy()  # numpy's min/max: no thread pool to wake for a few hundred rows
            if int(rows.min()) < 0:
                missing = (slots < 0).nonzero().view(-1)
                store.count(keys.numel() - missing.numel(), missing.numel())
                if int(rows.max()) < 0:  # nothing stored: the filling epoch's usual batch
                    return None, missing
                found = (slots >= 0).nonzero().view(-1)
                return (found, slots.index_select(0, found)), missing
        store.count(keys.numel(), 0)
        return (None, slots), NOTHING

    def keep(self, keys: torch.Tensor, values: SampleRows) -> int:
        if not self.store.accepting:
            return 0
        with own_cpu_threads(self.store.device):  # gpuload's batch-sized copies (exact at any thread count)
            stored = self.store.put(keys, values.part)
        if stored and self.copied.counts:
            self.copied.bytes += _column_bytes(values.part)
        return stored


class _DiskTier:
    """``cache_dir``'s disk tier of the samples: all of the keys asked, or none (``DiskRows.read``)."""

    name = "disk"

    def __init__(self, disk: DiskRows) -> None:
        self.disk = disk

    def lookup(self, keys: torch.Tensor) -> Lookup:
        with stage(gather_stage("disk")):
            part = self.disk.read(keys)
        if part is None:
            return None, torch.arange(keys.numel())
        return (None, SampleRows(part, None)), NOTHING

    def keep(self, keys: torch.Tensor, values: SampleRows) -> int:
        return self.disk.write(keys, values.part)


class _DatasetTier:
    """The dataset at the end of the chain: every sample asked, read by torch's fetch."""

    name = "source"

    def __init__(self, dataset: Any, batched: bool, items: Any, keys: torch.Tensor) -> None:
        self.dataset = dataset
        self.batched = batched
        # The batch's indices as the sampler gave them, and their keys: fetched as they are, as
        # torch fetches them, not as the int64 keys made of them (None: int64 tensors, the keys).
        self.items = items
        self.keys = keys

    def lookup(self, keys: torch.Tensor) -> Lookup:
        if self.items is None:  # int64 tensor indices: fetched as the ints they hold
            samples = fetch(self.dataset, keys.tolist(), self.batched)
            return (None, SampleRows(prepare(samples), samples)), NOTHING
        items = _items(self.items, self.batched)
        if len(items) != keys.numel():  # the tiers above hold the others
            by_key = dict(zip(self.keys.tolist(), items))
            items = [by_key[key] for key in keys.tolist()]
        samples = fetch(self.dataset, items, self.batched)
        return (None, SampleRows(prepare(samples), samples)), NOTHING

    def keep(self, keys: torch.Tensor, values: SampleRows) -> int:
        return 0


def _column_bytes(part: Part) -> int:
    """Bytes of a prepared batch's tensors (what writing it to device columns copies)."""
    if isinstance(part, Column):
        return part.rows.numel() * part.rows.element_size()
    if isinstance(part, Branch):
        return sum(_column_bytes(child) for child in part.children)
    return batch_nbytes(list(part.values))
