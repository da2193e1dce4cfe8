"""Any map-style or iterable dataset: torch fetches and collates; a sample cache in front.

For a dataset gpuload cannot gather from (any ``__getitem__``), the deterministic part of the
data is the dataset's own samples. ``decide_samples`` (in ``gpuload.cache``) chooses where they
may be kept (the device, host memory, or nowhere) and why; ``CachedSamples`` fills a
``ColumnStore`` while the first epoch runs and then builds batches from it, calling the dataset
only for what it lacks. Without a cache (an IterableDataset, ``cache="off"``, auto declining),
torch's own iterator makes every batch, workers included, and the loader moves it. In a
torch.distributed job whose ``cache_scope`` splits the dataset, ``split_samples`` (in
``gpuload.distributed``) reads this rank's share of the samples instead, once, and each batch
comes from every rank's share over the exchange. Either is the one store the source holds
(``held``), and says itself what the source reports of it.

Filling needs to know which sample each fetched batch holds. With ``num_workers=0`` gpuload
fetches itself; with workers, a private torch DataLoader over the same dataset, sampler and
generator runs the epoch and records each batch's indices (``torch_fetch``). It draws from the
generator exactly what the loader's own torch iterator would. ``sample_cache`` holds the cache
while it serves.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import default_collate
from torch.utils.data.dataloader import DataLoader as TorchDataLoader

from gpuload.cache import Store, decide_samples
from gpuload.cache.disk import Fingerprint
from gpuload.cache.disk_tier import DiskRows
from gpuload.distributed.sample_shares import SplitSamples, split_samples
from gpuload.resume import stateful
from gpuload.sources import FromRows, Indices, Schedule, Setup, Source, Work
from gpuload.sources.sample_cache import CachedSamples
from gpuload.sources.torch_fetch import (
    HandedOver,
    KeepSamples,
    RecordingSampler,
    TorchBatches,
    TorchLoading,
    WorkerBatches,
    fetch,
    is_default_collate,
    per_batch,
    read_prepared,
)
from gpuload.transfer import batch_length, batch_nbytes
from gpuload.worker_start import start_workers

__all__ = ["SampleSource", "TorchLoading"]


class SampleSource(Source):
    """Batches of any dataset: from the sample cache when it serves, else from torch's iterator."""

    rows_ahead = False  # rows gathered from a share (each batch a collective) come in the loop's thread

    def __init__(self, setup: Setup, torch_loading: TorchLoading) -> None:
        super().__init__(setup)
        self.torch = torch_loading
        # What the cache decision chose: the sample cache, this rank's share of samples split over
        # the ranks, or nothing.
        self.held: CachedSamples | SplitSamples | None = None
        self._decided = False
        self._released: dict[str, Any] | None = None
        self._fill_loader: TorchDataLoader | None = None
        self._keep: KeepSamples | None = None
        self._recorder: RecordingSampler | None = None
        self._moved_bytes = 0  # what shares and caches dropped since copied (the live cache counts its own)

    @property
    def h2d_bytes(self) -> int:  # type: ignore[override]
        return self._moved_bytes + (self.held.h2d_bytes if self.held is not None else 0)

    def _decide_cache(self) -> CachedSamples | SplitSamples | None:
        """The store held, decided at the first epoch (again after ``close``); None: no cache."""
        setup = self.setup
        if self._decided or not setup.map_style:
            return self.held
        self._decided = True
        share = self._split()
        self.held = share if share is not None else self._sample_cache()
        return self.held

    def _sample_cache(self) -> CachedSamples | None:
        """This rank's own sample cache, when ``decide_samples`` keeps one."""
        setup = self.setup
        by_column = setup.batched and setup.collate_fn is default_collate  # what the disk tier keeps
        identity: dict[str, Fingerprint | None] = {}

        def probe(dataset: Any) -> tuple[bool, str]:  # run only when a cache is considered
            identity["fingerprint"] = DiskRows.identify(dataset, setup.settings) if by_column else None
            return DiskRows.probe(dataset, setup.settings, identity["fingerprint"])

        decision = decide_samples(
            setup.dataset, setup.settings, setup.device,
            default_collate=is_default_collate(setup.collate_fn), num_workers=self.torch.num_workers,
            in_order=self.torch.options.get("in_order", True), owner=setup.owner, probe=probe,
        )
        setup.stats.extra["sample_cache_decision"] = f"{decision.tier}: {decision.reason}"
        if decision.warn:
            doing = "caching" if decision.caches else "not caching"
            warnings.warn(f"gpuload: {doing} this {type(setup.dataset).__name__}: {decision.reason}", stacklevel=5)
        if not decision.caches:
            return None
        cached = CachedSamples(setup, decision, self.torch.num_workers, identity.get("fingerprint"))
        weakref.finalize(self, cached.store.close)
        return cached

    def _split(self) -> SplitSamples | None:
        """This rank's share of the samples when ``cache_scope`` splits them over the ranks of
        torch.distributed (read now, with the loader's workers when it has them), else None."""
        setup = self.setup
        options = self._reader_options()
        share = split_samples(
            setup.dataset, setup.settings, setup.device, setup.batch_sampler, setup.owner,
            default_collate=setup.batched and setup.collate_fn is default_collate,
            read=lambda chunks: read_prepared(setup.dataset, chunks, self.torch.num_workers, options),
            chunk_size=setup.batch_size or 1, staging=setup.staging,
        )
        if share is not None:
            self.path = share.path
            setup.stats.extra["sample_cache_decision"] = share.describe()
        return share

    def _reader_options(self) -> dict[str, Any]:
        """The loader's options a private torch DataLoader reading its samples keeps."""
        return {k: self.torch.options[k] for k in ("worker_init_fn", "multiprocessing_context", "timeout")
                if k in self.torch.options}

    def begin_epoch(self) -> None:
        held = self._decide_cache()
        if held is not None:
            held.begin_epoch(self.setup.settings.keepable)
        self.path = held.path if held is not None else "torch"

    def schedule(self, indices: Indices) -> Schedule:
        """Runs ahead on a GPU (or with ``prefetch_depth``), except a stateful iterable dataset,
        whose own state must be the position of the batches handed to the loop (``state_dict``),
        (nor are rows gathered for it from a share: ``rows_ahead``)."""
        may_run_ahead = self.setup.map_style or not stateful(self.setup.dataset)
        return Schedule(lambda ahead: self._work(indices, ahead), ahead=may_run_ahead)

    def _work(self, request: Indices, ahead: bool) -> Work:
        cached = self.held
        assert not isinstance(cached, SplitSamples)  # a share's batches are made from_rows()
        finish: Callable[[Any], Any] = self._passed if ahead else functools.partial(self._moved, copy=request.copy_now)
        if not self.setup.map_style:
            batches = self.torch.iterate()  # an iterable dataset: torch's own iterator, workers included
            return Work(batches, finish, length=cast(Sized, batches).__len__, from_torch=True, torch_iterator=batches)
        if self.torch.num_workers == 0 or (cached is not None and cached.complete):
            # Read in this process as torch's fetcher reads (dataset[i] or __getitems__, then
            # collate_fn), from the sample cache when there is one.
            self._stop_fill_workers()
            indices = request.batches(ahead)
            if cached is not None:
                return Work(cached.batches(indices, request.in_range, whole=not request.resumed), finish)
            return Work(self._fetched(indices), finish)
        handed: deque[int | None] | None = None
        places = self.torch.epoch_places()
        if not self.torch.options.get("in_order", True) and places.note is not None:
            handed = deque()  # each batch's place, queued as it leaves torch's iterator (HandedOver)
            finish = self._noting_places(finish, handed, places.note)
        if request.resumed:
            epoch = self._worker_epoch(cached, list(request.batches(ahead)), handed=handed, places=places.places)
        else:
            epoch = self._worker_epoch(cached, seed_drawn=self.torch.seed_drawn(), handed=handed)
        return Work(epoch, finish, length=epoch.length, from_torch=not request.resumed,
                    torch_iterator=epoch.torch_iterator)

    @staticmethod
    def _noting_places(finish: Callable[[Any], Any], places: deque[int | None], note: Callable[[int | None], None]
                       ) -> Callable[[Any], Any]:
        """``finish``, first telling ``note`` (in the loop's thread) the place of the batch handed
        to the loop: ``places`` were queued in the same order as the batches left torch's iterator."""
        def noted(batch: Any) -> Any:
            note(places.popleft())
            return finish(batch)
        return noted

    def from_rows(self, number: int, ahead: bool) -> FromRows:
        """Batches of columns gathered from the share held, rebuilt as ``default_collate`` gives them."""
        share = self.held
        if not isinstance(share, SplitSamples):
            raise TypeError(f"{type(self).__name__} holds no share of samples to make batches of rows from")

        def finish(item: tuple[list[torch.Tensor], torch.Tensor]) -> tuple[Any, int]:
            rows, flat = item
            return share.batch(rows), flat.numel()

        return FromRows(finish)

    def _fetched(self, indices: Iterator[Any]) -> Iterator[Any]:
        return per_batch(indices, self._read_batch)

    def _read_batch(self, index: Any) -> Any:
        """One batch read as torch's fetcher reads it (``dataset[i]`` with Python ints)."""
        batched, collate = self.setup.batched, self.setup.collate_fn
        if isinstance(index, torch.Tensor):
            index = index.tolist()
        samples = fetch(self.setup.dataset, list(index) if batched else [index], batched)
        return collate(samples) if batched else collate(samples[0])

    def _worker_epoch(
        self, cached: CachedSamples | None, remaining: list[Any] | None = None, seed_drawn: bool = False,
        handed: deque[int | None] | None = None, places: list[int] | None = None,
    ) -> TorchBatches:
        """An epoch read by torch's worker processes, through a private torch DataLoader over the
        same dataset, sampler and generator (it draws what the loader's own iterator would),
        its index batches recorded and its samples kept for the cache while it accepts them.

        The loader is made once and runs every epoch (its persistent workers, if any, stay the
        ones whose seed torch drew). ``remaining``: the rest of a resumed epoch, read by a
        one-off loader over those batches with a generator of its own (the epoch's draws were
        made already). ``seed_drawn``: the persistent workers' base seed was drawn before in the
        run this one resumes; torch's draw when it first starts them is then made from a
        throwaway generator, so the loader's generator goes on as in an uninterrupted run.
        ``handed``: gets each batch's place among the epoch's index batches as it leaves torch's
        iterator (``places``: those of ``remaining``), for workers that hand batches over out of order.
        """
        collate, batched = self.setup.collate_fn, self.setup.batched
        if remaining is not None:
            # torch's fetcher hands each index to __getitem__ as it is: Python ints, as torch's own batches
            remaining = [index.tolist() if isinstance(index, torch.Tensor) else index for index in remaining]
            keep, recorder = KeepSamples(collate, batched), RecordingSampler(remaining)
            options = dict(self.torch.options, generator=torch.Generator(), persistent_workers=False)
            reader = self._torch_loader(keep, recorder, options)
        else:
            if self._fill_loader is None or self._keep is None or self._recorder is None:  # made together
                self._keep, self._recorder = KeepSamples(collate, batched), RecordingSampler(self.torch.index_sampler)
                self._fill_loader = self._torch_loader(self._keep, self._recorder, self.torch.options)
            keep, recorder, reader = self._keep, self._recorder, self._fill_loader
        keep.sending.value = int(cached is not None and cached.accepting)
        if seed_drawn and reader.persistent_workers and reader._iterator is None:
            # torch draws the workers' base seed from ``generator`` when it first starts them,
            # before the sampler's own draws; here that draw was made in the run being resumed.
            generator, reader.generator = reader.generator, torch.Generator()
            try:
                pairs = start_workers(iter, reader)
            finally:
                reader.generator = generator
        else:
            pairs = start_workers(iter, reader)
        at_end = functools.partial(self._end_of_worker_epoch, cached) if cached is not None and remaining is None \
            else None
        handing = pairs if handed is None else HandedOver(pairs, places, handed.append)

        def take(indices: Any, part: Any) -> None:
            if cached is not None:
                cached.take(indices, part, keep)

        batches = WorkerBatches(handing, recorder, take, at_end)
        return TorchBatches(batches, pairs.__len__, pairs)

    def _torch_loader(self, keep: KeepSamples, recorder: RecordingSampler, options: dict[str, Any]) -> TorchDataLoader:
        placement = {"batch_sampler": recorder} if self.setup.batched else {"batch_size": None, "sampler": recorder}
        return TorchDataLoader(self.setup.dataset, num_workers=self.torch.num_workers, collate_fn=keep,
                               **placement, **options)

    def _end_of_worker_epoch(self, cached: CachedSamples) -> None:
        """After a whole worker epoch (not the rest of a resumed one, which cannot have filled
        the cache): with workers only a complete cache serves, so a partial one is kept only
        while the epochs still add to it (a sampler that visits a part of the dataset each
        epoch), and dropped, saying why, once it cannot complete. ``cached``: the cache the
        epoch began with, still held (``close`` waits for a worker epoch's ``next()`` to return)."""
        if cached.end_of_epoch() or cached.complete:
            return
        if not cached.store.stats.full and not cached.unkeyed and not cached.store.stats.uncacheable:
            warnings.warn(
                f"gpuload: the {cached.tier} sample cache of this {type(self.setup.dataset).__name__} is dropped: "
                f"the sampler's epochs read {cached.store.stats.entries} of its {cached.num_samples} samples and "
                "no more, and with worker processes only a complete cache serves (num_workers=0 serves from "
                "the samples cached)", stacklevel=3,
            )
        self._drop_cache()

    def _moved(self, batch: Any, copy: Callable[[Any], Any] | None) -> tuple[Any, int]:
        """In the loop's thread, nothing ran ahead: the batch's host tensors go to the device
        through the loader's staging (``copy``: ``Prefetcher.copy_now``, which counts them)."""
        if self.setup.device.type != "cpu" and batch_nbytes(batch, host_only=True):
            if copy is None:
                raise RuntimeError(f"host batches reach {self.setup.device} only through the loader's staging")
            batch = copy(batch)
        return self._passed(batch)

    def _passed(self, batch: Any) -> tuple[Any, int]:
        return batch, batch_length(batch) if self.setup.batched else 1

    def warm(self, progress: bool) -> None:
        held = self._decide_cache()
        if held is not None:
            held.warm(progress, self.torch.num_workers, self._reader_options())

    def stats(self) -> dict[str, Any]:
        if self.held is not None:
            return self.held.entries()
        return {"cache": self._released} if self._released is not None else {}

    def cache_store(self) -> Store | None:
        """This rank's share of the samples, or the sample cache (the samples cached last go
        first when it shrinks: the store keeps its first slots)."""
        return self.held.store if self.held is not None else None

    def _drop_cache(self) -> None:
        held = self.held
        if held is not None:
            released = held.close()
            self._moved_bytes += held.h2d_bytes
            if released is not None:
                self._released = released
            self.held = None

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


