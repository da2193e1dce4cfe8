"""Any map-style or iterable dataset: torch fetches and collates; a sample cache in front.

For a dataset gpuload cannot gather from (any ``__getitem__``), the deterministic part of the
data is the dataset's own samples. ``decide_samples`` (in ``gpuload.cache``) chooses where they
may be kept (the device, host memory, or nowhere) and why; ``CachedSamples`` fills a
``SampleCache`` while the first epoch runs and then builds batches from it, calling the dataset
only for what it lacks. Without a cache (an IterableDataset, ``cache="off"``, auto declining),
torch's own iterator makes every batch, workers included, and the loader moves it. In a
torch.distributed job whose ``cache_scope`` splits the dataset, ``shard_samples`` (in
``gpuload.distributed``) reads this rank's share of the samples instead, once, and each batch
comes from every rank's share over the exchange.

Filling needs to know which sample each fetched batch holds. With ``num_workers=0`` gpuload
fetches itself. With workers, a private torch DataLoader over the same dataset, sampler and
generator runs the epoch, its batch sampler wrapped by ``RecordingSampler`` (it notes each index
batch it hands out, in order) and its collate function by ``KeepSamples`` (it returns the
samples beside the batch, until the cache says it is full). It draws from the generator exactly
what the loader's own torch iterator would. Batches come back in the order their indices were
drawn (``in_order=True``), so the k-th batch belongs to the k-th recorded index batch.
"""

from __future__ import annotations

import multiprocessing
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate, default_convert
from torch.utils.data.dataloader import DataLoader as TorchDataLoader

from gpuload.cache import CacheDecision, decide_samples, format_bytes
from gpuload.cache.columns import Branch, Column, ColumnStore, Part, prepare
from gpuload.device import cuda_available
from gpuload.distributed.sharded_samples import ShardedSamples, shard_samples
from gpuload.resume import stateful
from gpuload.sources import Indices, Schedule, Setup, Source, Work
from gpuload.transfer import batch_length, batch_nbytes, move_to_device

__all__ = ["CachedSamples", "KeepSamples", "RecordingSampler", "SampleSource", "TorchLoading"]


class KeepSamples:
    """A collate function that also returns the batch's samples prepared for the column store
    (``gpuload.cache.columns.prepare``), while ``sending`` is set.

    Picklable, so it travels to worker processes; ``sending`` is shared memory the loader
    clears once the cache cannot take more, so workers stop preparing samples. A prepared
    batch sends one tensor per column instead of every sample's tensors; with torch's
    default_collate the batch is built from the same columns, so they cross once.
    """

    def __init__(self, collate_fn: Callable[[Any], Any], batched: bool) -> None:
        self.collate_fn = collate_fn
        self.batched = batched
        self.by_column = batched and collate_fn is default_collate
        self.sending = multiprocessing.get_context().Value("b", 1, lock=False)

    def __call__(self, samples: Any) -> tuple[Any, Any]:
        if not self.sending.value:
            return None, self.collate_fn(samples)
        part = prepare(samples if self.batched else [samples])
        return part, part.batch() if self.by_column else self.collate_fn(samples)


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
    Every byte this cache copies host-to-device is added to ``h2d_bytes``.
    """

    def __init__(self, setup: Setup, decision: CacheDecision) -> None:
        self.dataset = setup.dataset
        self.setup = setup
        self.tier = decision.tier
        self.reason = decision.reason
        self.device = setup.device
        self.collate_fn = setup.collate_fn
        self.batched = setup.batched
        self.by_column = setup.batched and setup.collate_fn is default_collate
        self.num_samples = len(setup.dataset)
        where = setup.device if decision.tier == "device" else torch.device("cpu")
        self.store = ColumnStore(
            decision.budget, self.num_samples, where, owner=setup.owner, room=setup.settings.room_check(where),
            pin=setup.device.type == "cuda" and cuda_available(),
        )
        self.unkeyed = False  # an index that is not an int was seen: nothing more is cached
        self.fill_epochs = 0
        self._counts_copies = decision.tier == "device" and setup.device.type != "cpu"
        self.h2d_bytes = 0  # samples put on the device tier, and misses moved there to be collated

    @property
    def complete(self) -> bool:
        """Every sample is cached: epochs need no dataset reads."""
        return self.store.complete

    @property
    def accepting(self) -> bool:
        return self.store.accepting and not self.unkeyed

    @property
    def layout(self) -> str:
        """How the samples are stored (by column or per sample), for the decision line."""
        return self.store.describe()

    def stats(self) -> dict[str, Any]:
        return self.store.summary(kind="samples", tier=self.tier, reason=self.reason)

    def close(self) -> None:
        self.store.close()

    def take(self, indices: Any, part: Part | None, keep: KeepSamples) -> None:
        """Cache a worker batch's prepared samples (``part``) for its ``indices``; tell the workers
        to stop sending once the cache takes no more."""
        if part is not None and indices is not None:
            keys = self._keys_of(indices)
            if keys is not None:
                self._store(keys, part)
        if not self.accepting:
            keep.sending.value = 0

    def _keys_of(self, indices: Any) -> torch.Tensor | None:
        """Cache keys of one index batch; None (and no more caching) once one is not an integer."""
        keys = None if self.unkeyed else _keys(indices, self.batched)
        if keys is None:
            self.unkeyed = True
        return keys

    def _store(self, keys: torch.Tensor, part: Part, unseen: bool = False) -> int:
        """Put a prepared batch in the store; how many of its samples were stored now."""
        stored = self.store.put(keys, part, unseen=unseen) if self.accepting else 0
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
        slots = store.slots(keys, in_range)
        if self.complete and in_range:
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
        fetched = self._fetch(items if high < 0 else [items[p] for p in positions])
        part = prepare(fetched)
        if self.accepting and self._store(missing, part, unseen=True) == len(positions):
            if high < 0 and self.by_column and not self._counts_copies:
                return part.batch()  # every sample was read now: the columns just written
            return self._from_store(store.slots(keys))
        return self._partial(store.slots(keys), positions, fetched)

    def _from_store(self, slots: torch.Tensor) -> Any:
        """A batch of stored samples only."""
        if self.by_column:
            return self.store.gather(slots)
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
            batch = self.store.assemble(slots, prepare(fetched))
            if batch is not None:
                return batch
        cached = iter(self.store.views(slots[slots >= 0]))
        extra = iter(fetched)
        samples = [next(extra) if s < 0 else next(cached) for s in slots.tolist()]
        if self._counts_copies:
            samples = [move_to_device(sample, self.device) for sample in samples]
        return self._collate(samples)

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
                self._store(torch.tensor(chunk, dtype=torch.int64), part)
                read += len(chunk)
                bar.update(len(chunk))
                if not self.accepting:
                    break
        return read

    def end_of_epoch(self) -> None:
        """After a whole epoch: say once why samples stay uncached."""
        self.fill_epochs += 1
        if self.fill_epochs != 1 or self.complete:
            return
        stats = self.store.stats
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


@contextmanager
def read_prepared(
    dataset: Any, chunks: list[list[int]], num_workers: int, worker_options: dict[str, Any], batched: bool = True
) -> Iterator[Iterable[Part]]:
    """Each chunk of dataset indices read and prepared for the column store, in order: in this
    process (``batched``: through ``__getitems__`` when the dataset has it, as torch's fetcher),
    or by ``num_workers`` torch workers (with a private generator, so the user's random state is
    untouched), stopped on leaving even after an error."""
    if num_workers == 0:
        yield (prepare(fetch(dataset, chunk, batched)) for chunk in chunks)
        return
    reader = iter(TorchDataLoader(
        dataset, batch_sampler=chunks, num_workers=num_workers, collate_fn=prepare,
        generator=torch.Generator(), **worker_options,
    ))
    try:
        yield reader
    finally:
        reader._shutdown_workers()


def _column_bytes(part: Part) -> int:
    """Bytes of a prepared batch's tensors (what writing it to device columns copies)."""
    if isinstance(part, Column):
        return part.rows.numel() * part.rows.element_size()
    if isinstance(part, Branch):
        return sum(_column_bytes(child) for child in part.children)
    return batch_nbytes(list(part.values))


@dataclass(frozen=True)
class TorchLoading:
    """torch's own loading of the loader's dataset: the loader's torch iterator for one epoch
    (``iterate``), and what it takes to build a private torch DataLoader that runs the same
    epoch through the same workers to fill the cache (``options``: worker_init_fn,
    multiprocessing_context, timeout, prefetch_factor, persistent_workers, pin_memory,
    pin_memory_device, in_order, generator)."""

    iterate: Callable[[], Iterator[Any]]
    index_sampler: Any
    num_workers: int
    options: dict[str, Any] = field(default_factory=dict)


class SampleSource(Source):
    """Batches of any dataset: from the sample cache when it serves, else from torch's iterator."""

    def __init__(self, setup: Setup, torch_loading: TorchLoading) -> None:
        super().__init__(setup)
        self.torch = torch_loading
        self.cached: CachedSamples | None = None
        self.sharded: ShardedSamples | None = None  # this rank's share, when cache_scope splits the samples
        self._decided = False
        self._released: dict[str, Any] | None = None
        self._fill_loader: TorchDataLoader | None = None
        self._keep: KeepSamples | None = None
        self._recorder: RecordingSampler | None = None
        self._moved_bytes = 0  # batches copied in the loop's thread, and caches dropped since

    @property
    def h2d_bytes(self) -> int:  # type: ignore[override]
        return self._moved_bytes + (self.cached.h2d_bytes if self.cached is not None else 0)

    def _decide_cache(self) -> CachedSamples | None:
        """The sample cache, decided at the first epoch (again after ``close``); None: no cache."""
        setup = self.setup
        if self._decided or not setup.map_style:
            return self.cached
        self._decided = True
        self.sharded = self._shard()
        if self.sharded is not None:
            return None
        decision = decide_samples(
            setup.dataset, setup.settings, setup.device,
            default_collate=is_default_collate(setup.collate_fn), num_workers=self.torch.num_workers,
            in_order=self.torch.options.get("in_order", True), owner=setup.owner,
        )
        setup.stats.extra["sample_cache_decision"] = f"{decision.tier}: {decision.reason}"
        if decision.warn:
            doing = "caching" if decision.caches else "not caching"
            warnings.warn(f"gpuload: {doing} this {type(setup.dataset).__name__}: {decision.reason}", stacklevel=5)
        if decision.caches:
            self.cached = CachedSamples(setup, decision)
            weakref.finalize(self, self.cached.store.close)
        return self.cached

    def _shard(self) -> ShardedSamples | None:
        """This rank's share of the samples when ``cache_scope`` splits them over the ranks of
        torch.distributed (read now, with the loader's workers when it has them), else None."""
        setup = self.setup
        options = self._reader_options()
        sharded = shard_samples(
            setup.dataset, setup.settings, setup.device, setup.batch_sampler, setup.owner,
            default_collate=setup.batched and setup.collate_fn is default_collate,
            read=lambda chunks: read_prepared(setup.dataset, chunks, self.torch.num_workers, options),
            chunk_size=setup.batch_size or 1,
        )
        if sharded is not None:
            self.path = sharded.path
            setup.stats.extra["sample_cache_decision"] = sharded.describe()
            self._moved_bytes += sharded.store.stats.device_bytes
        return sharded

    def _reader_options(self) -> dict[str, Any]:
        """The loader's options a private torch DataLoader reading its samples keeps."""
        return {k: self.torch.options[k] for k in ("worker_init_fn", "multiprocessing_context", "timeout")
                if k in self.torch.options}

    def begin_epoch(self) -> None:
        cached = self._decide_cache()
        if self.sharded is not None:
            self.path = self.sharded.path
            return
        if cached is not None:
            cached.store.fit_reserve(self.setup.settings.keepable, "those samples are read from the dataset again")
        serves = cached is not None and (self.torch.num_workers == 0 or cached.complete)
        self.path = f"sample-cache ({cached.tier})" if serves else "torch"

    def epoch(self, indices: Indices) -> Schedule:
        """Runs ahead on a GPU (or with ``prefetch_depth``), except a stateful iterable dataset,
        whose own state must be the position of the batches handed to the loop (``state_dict``),
        and the exchange of a share split over ranks (each batch is a collective)."""
        sharded = self.sharded
        if sharded is not None:
            return Schedule(lambda ahead: self._sharded_epoch(sharded, indices), ahead=False)
        may_run_ahead = self.setup.map_style or not stateful(self.setup.dataset)
        return Schedule(lambda ahead: self._work(indices, ahead), ahead=may_run_ahead)

    def _work(self, request: Indices, ahead: bool) -> Work:
        cached = self.cached
        finish = self._passed if ahead else self._moved
        if not self.setup.map_style:
            batches = self.torch.iterate()  # an iterable dataset: torch's own iterator, workers included
            return Work(batches, finish, length=batches.__len__, from_torch=True, torch_iterator=batches)
        if self.torch.num_workers == 0 or (cached is not None and cached.complete):
            # Read in this process as torch's fetcher reads (dataset[i] or __getitems__, then
            # collate_fn), from the sample cache when there is one.
            self._stop_fill_workers()
            indices = request.batches(ahead)
            if cached is not None:
                return Work(cached.batches(indices, request.in_range, whole=not request.resumed), finish)
            return Work(self._fetched(indices), finish)
        if request.resumed:
            epoch = self._worker_epoch(cached, list(request.batches(ahead)))
        else:
            epoch = self._worker_epoch(cached, seed_drawn=request.worker_seed_drawn)
        return Work(epoch, finish, length=epoch.length, from_torch=not request.resumed,
                    torch_iterator=epoch.torch_iterator)

    def _sharded_epoch(self, sharded: ShardedSamples, request: Indices) -> Work:
        """Batches assembled from every rank's share, in the loop's thread (each is a collective)."""
        drawn = [torch.as_tensor(index, dtype=torch.long).reshape(-1) for index in request.batches(False)]
        store = sharded.store

        def finish(item: tuple[list[torch.Tensor], torch.Tensor]) -> tuple[Any, int]:
            rows, flat = item
            self.setup.stats.extra["exchange"] = store.describe_exchange()
            return sharded.batch(rows), flat.numel()

        return Work(store.epoch(self.setup.batch_sampler, drawn, position=request.position, number=request.number),
                    finish)

    def _fetched(self, indices: Iterator[Any]) -> Iterator[Any]:
        return PerBatch(indices, self._read_batch)

    def _read_batch(self, index: Any) -> Any:
        """One batch read as torch's fetcher reads it (``dataset[i]`` with Python ints)."""
        batched, collate = self.setup.batched, self.setup.collate_fn
        if isinstance(index, torch.Tensor):
            index = index.tolist()
        samples = fetch(self.setup.dataset, list(index) if batched else [index], batched)
        return collate(samples) if batched else collate(samples[0])

    def _worker_epoch(
        self, cached: CachedSamples | None, remaining: list[Any] | None = None, seed_drawn: bool = False
    ) -> _TorchBatches:
        """An epoch read by torch's worker processes, through a private torch DataLoader over the
        same dataset, sampler and generator (it draws what the loader's own iterator would),
        its index batches recorded and its samples kept for the cache while it accepts them.

        The loader is made once and runs every epoch (its persistent workers, if any, stay the
        ones whose seed torch drew). ``remaining``: the rest of a resumed epoch, read by a
        one-off loader over those batches with a generator of its own (the epoch's draws were
        made already). ``seed_drawn``: the persistent workers' base seed was drawn before in the
        run this one resumes; torch's draw when it first starts them is then made from a
        throwaway generator, so the loader's generator goes on as in an uninterrupted run.
        """
        collate, batched = self.setup.collate_fn, self.setup.batched
        if remaining is not None:
            # torch's fetcher hands each index to __getitem__ as it is: Python ints, as torch's own batches
            remaining = [index.tolist() if isinstance(index, torch.Tensor) else index for index in remaining]
            keep, recorder = KeepSamples(collate, batched), RecordingSampler(remaining)
            options = dict(self.torch.options, generator=torch.Generator(), persistent_workers=False)
            reader = self._torch_loader(keep, recorder, options)
        else:
            if self._fill_loader is None:
                self._keep, self._recorder = KeepSamples(collate, batched), RecordingSampler(self.torch.index_sampler)
                self._fill_loader = self._torch_loader(self._keep, self._recorder, self.torch.options)
            keep, recorder, reader = self._keep, self._recorder, self._fill_loader
        keep.sending.value = int(cached is not None and cached.accepting)
        if seed_drawn and reader.persistent_workers and reader._iterator is None:
            # torch draws the workers' base seed from ``generator`` when it first starts them,
            # before the sampler's own draws; here that draw was made in the run being resumed.
            generator, reader.generator = reader.generator, torch.Generator()
            try:
                pairs = iter(reader)
            finally:
                reader.generator = generator
        else:
            pairs = iter(reader)
        at_end = self._end_of_worker_epoch if cached is not None and remaining is None else None
        batches = _WorkerBatches(pairs, recorder, lambda indices, part: cached is not None and cached.take(
            indices, part, keep), at_end)
        return _TorchBatches(batches, pairs.__len__, pairs)

    def _torch_loader(self, keep: KeepSamples, recorder: RecordingSampler, options: dict[str, Any]) -> TorchDataLoader:
        placement = {"batch_sampler": recorder} if self.setup.batched else {"batch_size": None, "sampler": recorder}
        return TorchDataLoader(self.setup.dataset, num_workers=self.torch.num_workers, collate_fn=keep,
                               **placement, **options)

    def _end_of_worker_epoch(self) -> None:
        """After a whole worker epoch (not the rest of a resumed one, which cannot have filled
        the cache): say why it is partial, if so, and keep no memory for it: with workers only a
        complete cache serves."""
        cached = self.cached
        if cached is None:
            return
        cached.end_of_epoch()
        if not cached.complete:
            self._drop_cache()

    def _moved(self, batch: Any) -> tuple[Any, int]:
        """In the loop's thread, nothing ran ahead: copy the batch's host tensors to the device."""
        device = self.setup.device
        if device.type != "cpu":
            host_bytes = batch_nbytes(batch, host_only=True)
            if host_bytes:
                batch = move_to_device(batch, device, non_blocking=True)
            self._moved_bytes += host_bytes
        return self._passed(batch)

    def _passed(self, batch: Any) -> tuple[Any, int]:
        return batch, batch_length(batch) if self.setup.batched else 1

    def warm(self, progress: bool) -> None:
        cached = self._decide_cache()
        if cached is not None:
            cached.warm(progress, self.torch.num_workers, self._reader_options())

    def stats(self) -> dict[str, Any]:
        if self.sharded is not None:
            store = self.sharded.store
            return {"cache": store.stats.as_dict(), "cache_plan": store.plan.describe(),
                    "sample_cache_decision": self.sharded.describe()}
        cached = self.cached
        if cached is not None:
            decision = f"{cached.tier}: {cached.reason}; {cached.layout}"
            return {"cache": cached.stats(), "sample_cache_decision": decision}
        return {"cache": self._released} if self._released is not None else {}

    def device_cache_bytes(self) -> int:
        cached = self.cached
        return cached.store.stats.bytes if cached is not None and cached.store.device == self.setup.device else 0

    def split_over_ranks(self) -> bool:
        return self.sharded is not None

    def shrink_cache(self, max_device_bytes: int) -> int:
        """The samples cached last go first (the store keeps its first slots); a share split
        over ranks does not shrink."""
        if self.sharded is not None:
            return self.sharded.store.shrink_device_tier(max_device_bytes)
        if not self.device_cache_bytes():
            return 0
        return self.cached.store.shrink(max_device_bytes)

    def _drop_cache(self) -> None:
        if self.cached is not None:
            self.cached.close()
            self._moved_bytes += self.cached.h2d_bytes
            self._released = dict(self.cached.stats(), released=True)
            self.cached = None

    def _stop_fill_workers(self) -> None:
        iterator = self._fill_loader._iterator if self._fill_loader is not None else None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def close(self) -> None:
        self._drop_cache()
        if self.sharded is not None:
            self.sharded.close()
            self.sharded = None
        self._decided = False
        self._stop_fill_workers()
        self._fill_loader = None
        if self._keep is not None:
            self._keep.sending.value = 0


class _TorchBatches(Iterator[Any]):
    """An epoch of batches with the length of the torch iterator that makes them."""

    def __init__(self, inner: Iterator[Any], length: Callable[[], int], torch_iterator: Any) -> None:
        self._inner, self.length, self.torch_iterator = inner, length, torch_iterator

    def __next__(self) -> Any:
        return next(self._inner)


def fetch(dataset: Any, indices: list[Any], batched: bool) -> list[Any]:
    """The samples of ``indices``, read as torch's map-style fetcher reads them; an exception
    keeps its type and message and gets a note naming the dataset index."""
    getitems = getattr(dataset, "__getitems__", None) if batched else None
    if getitems is not None:  # a batch's samples in one call
        try:
            return list(getitems(indices))
        except Exception as error:
            add_note(error, f"gpuload: raised by {type(dataset).__name__}.__getitems__ for the batch of dataset indices {indices}")
            raise
    samples = []
    for index in indices:
        try:
            samples.append(dataset[index])
        except Exception as error:
            add_note(error, f"gpuload: raised while reading dataset index {index} ({type(dataset).__name__})")
            raise
    return samples


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error`` (shown under its message in a traceback); Python 3.10 has no
    notes, and there the exception is left as it is rather than replaced."""
    if hasattr(error, "add_note"):
        error.add_note(note)


class PerBatch(Iterator[Any]):
    """``make(item)`` for each of ``items``, going on after a batch that raised, as torch's
    iterators do (the failed batch is consumed; the next ``next()`` makes the one after), and
    ``at_end()`` once when the items run out."""

    def __init__(self, items: Iterator[Any], make: Callable[[Any], Any], at_end: Callable[[], None] | None = None) -> None:
        self._items, self._make, self._at_end = items, make, at_end

    def __next__(self) -> Any:
        try:
            item = next(self._items)
        except StopIteration:
            at_end, self._at_end = self._at_end, None
            if at_end is not None:
                at_end()
            raise
        return self._make(item)


class _WorkerBatches(Iterator[Any]):
    """A worker epoch's batches from torch's (samples, batch) pairs. Batches come back in the
    order their indices were drawn (``in_order=True``), so the k-th is the k-th ``recorder``
    noted: ``take(indices, samples)`` gets each (for the cache), also past a batch that raised
    (torch's iterator goes on; that batch's indices are dropped, and the exception, re-raised by
    torch from the worker, gets a note naming them). ``at_end()`` runs once at the end."""

    def __init__(self, pairs: Iterator[Any], recorder: RecordingSampler, take: Callable[[Any, Any], Any],
                 at_end: Callable[[], None] | None) -> None:
        self._pairs, self._recorder, self._take, self._at_end = pairs, recorder, take, at_end

    def __next__(self) -> Any:
        try:
            samples, batch = next(self._pairs)
        except StopIteration:
            at_end, self._at_end = self._at_end, None
            if at_end is not None:
                at_end()
            raise
        except Exception as error:
            drawn = self._recorder.drawn
            if drawn:
                indices = drawn.popleft()
                shown = indices.tolist() if isinstance(indices, torch.Tensor) else indices
                add_note(error, f"gpuload: raised in a worker reading the batch of dataset indices {shown}")
            raise
        drawn = self._recorder.drawn
        self._take(drawn.popleft() if drawn else None, samples)
        return batch


def is_default_collate(collate_fn: Callable[[Any], Any]) -> bool:
    return collate_fn in (default_collate, default_convert)
