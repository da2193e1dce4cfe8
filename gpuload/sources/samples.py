"""Any map-style or iterable dataset: torch fetches and collates; a sample cache in front.

For a dataset gpuload cannot gather from (any ``__getitem__``), the deterministic part of the
data is the dataset's own samples. ``decide_samples`` (in ``gpuload.cache``) chooses where they
may be kept (the device, host memory, or nowhere) and why; ``CachedSamples`` fills a
``SampleCache`` while the first epoch runs and then builds batches from it, calling the dataset
only for what it lacks. Without a cache (an IterableDataset, ``cache="off"``, auto declining),
torch's own iterator makes every batch, workers included, and the loader moves it.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import default_collate, default_convert
from torch.utils.data.dataloader import DataLoader as TorchDataLoader

from gpuload.cache import CacheDecision, SampleCache, decide_samples, format_bytes
from gpuload.cache.sample_store import MISSING
from gpuload.resume import stateful
from gpuload.sources import Epoch, EpochRequest, Setup, Source
from gpuload.transfer import batch_length, batch_nbytes, map_leaves, move_to_device

__all__ = ["CachedSamples", "KeepSamples", "RecordingSampler", "SampleSource", "TorchLoading"]


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
    PCIe once cached); ``"host"``: kept in host memory and collated there. Every byte this
    cache copies host-to-device is added to ``stats.bytes_h2d``.
    """

    def __init__(self, setup: Setup, decision: CacheDecision) -> None:
        self.dataset = setup.dataset
        self.setup = setup
        self.tier = decision.tier
        self.reason = decision.reason
        self.device = setup.device
        self.collate_fn = setup.collate_fn
        self.batched = setup.batched
        self.num_samples = len(setup.dataset)
        where = setup.device if decision.tier == "device" else torch.device("cpu")
        self.cache = SampleCache(
            decision.budget, where, owner=setup.owner, room=setup.settings.room_check(where),
            num_samples=self.num_samples,
        )
        self.unkeyed = False  # an index that is not an int was seen: nothing more is cached
        self.fill_epochs = 0
        self._counts_copies = decision.tier == "device" and setup.device.type != "cpu"
        self.h2d_bytes = 0  # samples put on the device tier, and misses moved there to be collated

    @property
    def complete(self) -> bool:
        """Every sample is cached: epochs need no dataset reads."""
        return self.cache.complete

    @property
    def accepting(self) -> bool:
        return self.cache.accepting and not self.unkeyed

    def stats(self) -> dict[str, Any]:
        return self.cache.summary(kind="samples", tier=self.tier, reason=self.reason)

    def close(self) -> None:
        self.cache.close()

    def unwrap(self, batches: Iterable[tuple[Any, Any, Any]], keep: KeepSamples) -> Iterator[Any]:
        """A worker epoch's (indices, samples, batch) to batches, caching the samples on the way."""
        for indices, samples, batch in batches:
            if samples is not None and indices is not None:
                self._store(self._keys_of(indices), samples if self.batched else [samples])
            if not self.accepting:
                keep.sending.value = 0
            yield batch

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
                if self._counts_copies:
                    self.h2d_bytes += batch_nbytes(sample)
                sample = self.cache.peek(key, sample)
            kept.append(sample)
        return kept

    def _fetch(self, indices: list[Any]) -> list[Any]:
        return fetch(self.dataset, indices, self.batched)

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
            found = self.cache.get(key, MISSING) if key is not None else MISSING
            if found is MISSING:
                missing.append(position)
            else:
                samples[position] = found
        if missing:
            fetched = self._fetch([items[p] for p in missing])
            stored = self._store([keys[p] for p in missing], fetched) if keys is not None else fetched
            for position, sample in zip(missing, stored):
                samples[position] = sample
        if self._counts_copies and missing:
            # Samples the cache could not take are still on the host: move them before collating.
            for position in missing:
                if not _on_device(samples[position], self.device):
                    self.h2d_bytes += batch_nbytes(samples[position])
                    samples[position] = move_to_device(samples[position], self.device, non_blocking=False)
        if not (self.batched and is_default_collate(self.collate_fn)):
            # default_collate builds new tensors; anything else might hand the cached objects
            # themselves to the loop, where an in-place change would alter later epochs.
            samples = [_fresh(sample) for sample in samples]
        return self.collate_fn(samples) if self.batched else self.collate_fn(samples[0])

    def batches(self, indices: Iterator[Any], whole: bool = True) -> Iterator[Any]:
        """An epoch's batches from the cache (and the dataset for what it lacks); ``whole``: not
        the rest of a resumed epoch, which cannot have filled the cache."""
        for index in indices:
            yield self.batch(index)
        if whole:
            self.end_of_epoch()

    def warm(self, progress: bool, num_workers: int, worker_options: dict[str, Any]) -> int:
        """Read every sample not cached yet into the cache, in index order; returns how many."""
        from tqdm import tqdm

        todo = [i for i in range(self.num_samples) if i not in self.cache]
        if not todo or not self.accepting:
            return 0
        batch_size = self.setup.batch_size or 1
        chunks = [todo[k : k + batch_size] for k in range(0, len(todo), batch_size)]
        if num_workers > 0:
            # torch's workers read in parallel; a private generator keeps the user's RNG untouched.
            reader = TorchDataLoader(
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
        return read

    def end_of_epoch(self) -> None:
        """After a whole epoch: say once why samples stay uncached."""
        self.fill_epochs += 1
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
        self._decided = False
        self._released: dict[str, Any] | None = None
        self._fill_loader: TorchDataLoader | None = None
        self._keep: KeepSamples | None = None
        self._recorder: RecordingSampler | None = None
        self._moved_bytes = 0  # batches copied in the loop's thread, and caches dropped since

    @property
    def h2d_bytes(self) -> int:  # type: ignore[override]
        return self._moved_bytes + (self.cached.h2d_bytes if self.cached is not None else 0)

    @property
    def streams(self) -> bool:  # type: ignore[override]
        # A stateful iterable dataset's own state must be the position of the batches handed
        # to the loop (``state_dict``), so nothing reads it ahead.
        return self.setup.map_style or not stateful(self.setup.dataset)

    def _decide_cache(self) -> CachedSamples | None:
        """The sample cache, decided at the first epoch (again after ``close``); None: no cache."""
        setup = self.setup
        if self._decided or not setup.map_style:
            return self.cached
        self._decided = True
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
            weakref.finalize(self, self.cached.cache.close)
        return self.cached

    def begin_epoch(self) -> None:
        cached = self._decide_cache()
        if cached is not None:
            cached.cache.fit_reserve(self.setup.settings.keepable, "those samples are read from the dataset again")
        serves = cached is not None and (self.torch.num_workers == 0 or cached.complete)
        self.path = f"sample-cache ({cached.tier})" if serves else "torch"

    def epoch(self, request: EpochRequest) -> Epoch:
        cached = self.cached
        finish = self._passed if request.ahead else self._moved
        if not self.setup.map_style:
            batches = self.torch.iterate()  # an iterable dataset: torch's own iterator, workers included
            return Epoch(batches, finish, length=batches.__len__, from_torch=True, torch_iterator=batches)
        if self.torch.num_workers == 0 or (cached is not None and cached.complete):
            # Read in this process as torch's fetcher reads (dataset[i] or __getitems__, then
            # collate_fn), from the sample cache when there is one.
            self._stop_fill_workers()
            indices = request.indices()
            if cached is not None:
                return Epoch(cached.batches(indices, whole=not request.resumed), finish)
            return Epoch(self._fetched(indices), finish)
        if request.resumed:
            epoch = self._worker_epoch(cached, list(request.indices()))
        else:
            epoch = self._worker_epoch(cached, seed_drawn=request.worker_seed_drawn)
        return Epoch(epoch, finish, length=epoch.length, from_torch=not request.resumed,
                     torch_iterator=epoch.torch_iterator)

    def _fetched(self, indices: Iterator[Any]) -> Iterator[Any]:
        batched, collate = self.setup.batched, self.setup.collate_fn
        for index in indices:
            samples = fetch(self.setup.dataset, list(index) if batched else [index], batched)
            yield collate(samples) if batched else collate(samples[0])

    def _worker_epoch(
        self, cached: CachedSamples | None, remaining: list[Any] | None = None, seed_drawn: bool = False
    ) -> _TorchEpoch:
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
        collate = self.setup.collate_fn
        if remaining is not None:
            keep, recorder = KeepSamples(collate), RecordingSampler(remaining)
            options = dict(self.torch.options, generator=torch.Generator(), persistent_workers=False)
            reader = self._torch_loader(keep, recorder, options)
        else:
            if self._fill_loader is None:
                self._keep, self._recorder = KeepSamples(collate), RecordingSampler(self.torch.index_sampler)
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
        batches = self._filled(cached, _matched(pairs, recorder), keep, whole=remaining is None)
        return _TorchEpoch(batches, pairs.__len__, pairs)

    def _torch_loader(self, keep: KeepSamples, recorder: RecordingSampler, options: dict[str, Any]) -> TorchDataLoader:
        placement = {"batch_sampler": recorder} if self.setup.batched else {"batch_size": None, "sampler": recorder}
        return TorchDataLoader(self.setup.dataset, num_workers=self.torch.num_workers, collate_fn=keep,
                               **placement, **options)

    def _filled(self, cached: CachedSamples | None, batches: Iterator[Any], keep: KeepSamples,
                whole: bool = True) -> Iterator[Any]:
        if cached is None:
            for _, _, batch in batches:
                yield batch
            return
        yield from cached.unwrap(batches, keep)
        if not whole:
            return  # the rest of a resumed epoch: the next whole epoch fills what is missing
        cached.end_of_epoch()
        if not cached.complete:
            # With workers only a complete cache serves; keep no memory for a partial one.
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
            options = {k: self.torch.options[k] for k in ("worker_init_fn", "multiprocessing_context", "timeout")
                       if k in self.torch.options}
            cached.warm(progress, self.torch.num_workers, options)

    def stats(self) -> dict[str, Any]:
        if self.cached is not None:
            return {"cache": self.cached.stats()}
        return {"cache": self._released} if self._released is not None else {}

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
        self._decided = False
        self._stop_fill_workers()
        self._fill_loader = None
        if self._keep is not None:
            self._keep.sending.value = 0


class _TorchEpoch(Iterator[Any]):
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
            add_note(error, f"gpuload: raised by {type(dataset).__name__}.__getitems__ for dataset indices {indices}")
            raise
    samples = []
    for index in indices:
        try:
            samples.append(dataset[index])
        except Exception as error:
            add_note(error, f"gpuload: raised while reading dataset[{index}] ({type(dataset).__name__})")
            raise
    return samples


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error`` (shown under its message in a traceback); Python 3.10 has no
    notes, and there the exception is left as it is rather than replaced."""
    if hasattr(error, "add_note"):
        error.add_note(note)


def _matched(pairs: Iterator[Any], recorder: RecordingSampler) -> Iterator[tuple[Any, Any, Any]]:
    """A worker epoch's (samples, batch) pairs as (indices, samples, batch): batches come back in
    the order their indices were drawn (``in_order=True``), so the k-th is the k-th recorded.
    An exception (re-raised by torch from a worker) gets a note naming the batch's indices."""
    while True:
        try:
            samples, batch = next(pairs)
        except StopIteration:
            return
        except Exception as error:
            if recorder.drawn:
                indices = recorder.drawn[0]
                shown = indices.tolist() if isinstance(indices, torch.Tensor) else indices
                add_note(error, f"gpuload: raised while reading the batch of dataset indices {shown}")
            raise
        yield (recorder.drawn.popleft() if recorder.drawn else None), samples, batch


def _sample_list(samples: list[Any]) -> list[Any]:
    return samples


def _fresh(sample: Any) -> Any:
    """A copy of a cached sample's tensors and arrays (numbers and strings are immutable)."""

    def copy(leaf: Any) -> Any:
        return leaf.copy() if isinstance(leaf, np.ndarray) else leaf.clone()

    return map_leaves(sample, copy, is_leaf=lambda leaf: isinstance(leaf, np.ndarray))


def _on_device(sample: Any, device: torch.device) -> bool:
    return all(not isinstance(leaf, torch.Tensor) or leaf.device == device for leaf in tree_leaves(sample))


def is_default_collate(collate_fn: Callable[[Any], Any]) -> bool:
    return collate_fn in (default_collate, default_convert)
