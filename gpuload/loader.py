"""gpuload.DataLoader: torch's DataLoader, keyword for keyword, with batches delivered on a device.

It subclasses ``torch.utils.data.DataLoader``, so argument checking, ``len()``, samplers,
collation and worker processes are torch's own, and wrappers that re-create a loader from its
constructor arguments (Lightning, Accelerate) keep working. What gpuload adds is the device
tail, chosen per dataset:

- in-memory arrays: placed by the cache plan (device, pinned host), one gather per batch;
- image files: each batch read as encoded bytes, decoded at once, transformed on the device;
- anything else: torch fetches and collates, the prefetcher copies batches to the device.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.data as tud

from gpuload.augment import BatchAugmenter, image_column
from gpuload.cache import CacheSettings
from gpuload.cached_samples import CachedSamples, decide_sample_cache, is_default_collate
from gpuload.datasets.images import ImageSource, as_image_source
from gpuload.image_batches import DecodedBatch, ImageBatches
from gpuload.image_cache import ImageCache, choose_image_cache
from gpuload.device import resolve_device
from gpuload.prefetch import Prefetcher, default_depth
from gpuload.sampling import can_draw_whole_epoch, epoch_batches
from gpuload.resident import ResidentColumns, find_resident_columns
from gpuload.stats import LoaderStats
from gpuload.transfer import batch_length, batch_nbytes, move_to_device

__all__ = ["DataLoader"]

# Image batches decoded ahead of the loop: one being made while the loop uses the one before,
# one more to absorb jitter in file sizes. Each holds a finished batch (38 MiB at 128 x 224^2
# float16), so more buys nothing but memory.
_IMAGE_PREFETCH_DEPTH = 2

# Batches in flight for torch-collated batches, whose size is unknown until the first arrives:
# double buffering, one copying while the next is collated.
_GENERIC_PREFETCH_DEPTH = 2


class DataLoader(tud.DataLoader):
    """Drop-in for ``torch.utils.data.DataLoader`` whose batches arrive on ``device``.

    Every argument up to ``in_order`` means exactly what it means for torch (same order, same
    defaults, same errors). gpuload's own options are keyword-only:

    - ``device``: where batches are delivered; default the current CUDA device when there is
      one, else the CPU.
    - ``transforms``, ``cache``, ``cache_size``: the GPU transform list and the device cache
      (see the README); ``cache="off"`` keeps array data on the host and copies each batch.

    Batches are the same, in the same order, as torch's DataLoader gives for the same dataset,
    sampler, generator state and collate_fn; only their tensors live on ``device``.
    """

    def __init__(
        self,
        dataset: tud.Dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: tud.Sampler | Iterable | None = None,
        batch_sampler: tud.Sampler[list] | Iterable[list] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context=None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | int | torch.device | None = None,
        transforms: Sequence[Any] | None = None,
        cache: str | None = None,
        cache_size: int | float | str | None = None,
        cache_reserve: int | float | str | None = None,
        job: str | None = None,
        prefetch_depth: int | None = None,
        on_error: str = "raise",
    ) -> None:
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        if prefetch_depth is not None and (
            isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0
        ):
            raise ValueError(
                f"prefetch_depth={prefetch_depth!r} must be an int >= 1 (batches in flight), 0 to "
                "copy in the loop without a background thread, or None to choose from the batch size"
            )
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r} must be 'raise' or 'skip' (bad image files)")
        self._cache_settings = CacheSettings.resolve(
            cache=cache, cache_size=cache_size, cache_reserve=cache_reserve, job=job
        )
        # Public attributes with the constructor's names, so wrappers can rebuild the loader.
        self.device = resolve_device(device)
        self.transforms = transforms
        self.cache = cache
        self.cache_size = cache_size
        self.cache_reserve = cache_reserve
        self.job = job
        self.prefetch_depth = prefetch_depth
        self.on_error = on_error
        self._prefetcher: Prefetcher | None = None
        self._stats = LoaderStats(device=str(self.device))
        self._columns = self._detect_array_data()
        self._resident: ResidentColumns | None = None
        self._image_source = self._detect_image_source(bool(transforms))
        self._images: ImageBatches | None = None
        self._epoch = -1
        self._augment = self._make_augmenter(transforms)
        self._persistent_seed_drawn = False
        self._samples: CachedSamples | None = None
        self._image_cache_decided = False
        self._epoch_start_bytes: list[int] = []
        self._samples_decided = False
        self._filling_recorder = None

    # ----------------------------------------------------------------- public surface

    @property
    def stats(self) -> LoaderStats:
        """Counters over this loader's life: path, batches, samples, bytes copied, wait time.

        With the cache, ``stats.extra["cache"]`` has bytes, samples and hits per tier and
        ``stats.extra["cache_plan"]`` the placement plan that was chosen.
        """
        tiers = self._resident.stats if self._resident is not None else None
        if tiers is not None:
            self._stats.extra["cache"] = tiers.as_dict()
            self._stats.extra["cache_plan"] = self._resident.store.plan.describe()
        if self._samples is not None:
            self._stats.extra["cache"] = self._samples.stats()
            self._count_fill_bytes()
        if self._images is not None and self._images.cache is not None:
            self._stats.extra["cache"] = self._images.cache.stats()
        if self._epoch_start_bytes:
            ends = [*self._epoch_start_bytes[1:], self._stats.bytes_h2d]
            self._stats.bytes_h2d_per_epoch = [end - start for start, end in zip(self._epoch_start_bytes, ends)]
        return self._stats

    def _count_fill_bytes(self) -> None:
        """Add the bytes the sample cache copied to the device since the last look."""
        filled = self._samples.h2d_bytes
        self._stats.bytes_h2d += filled - self._fill_bytes_seen
        self._fill_bytes_seen = filled

    @property
    def cache_settings(self) -> CacheSettings:
        """The cache settings in force, each with where it came from (keyword, env, file)."""
        return self._cache_settings

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (0-based) for the transforms' randomness.

        Epochs count up by one per ``iter()``; set this when resuming a run so that every
        sample gets the augmentation it would have had. Samplers keep their own ``set_epoch``.
        """
        self._epoch = int(epoch) - 1

    def __iter__(self) -> Iterator[Any]:
        self._epoch_start_bytes.append(self.stats.bytes_h2d)
        self._stats.epochs += 1
        self._epoch += 1
        if self._columns is not None:
            return self._iter_arrays()
        if self._image_source is not None:
            return self._iter_images()
        return self._iter_torch()

    def _epoch_indices(self) -> Iterator[Any]:
        """This epoch's index batches, drawn as torch would (as tensors for torch's samplers)."""
        indices = self._start_epoch_like_torch()
        if self._auto_collation and can_draw_whole_epoch(self.batch_sampler):
            return epoch_batches(self.batch_sampler)
        return indices

    def warm(self, progress: bool = True) -> LoaderStats:
        """Fill the cache now, in one pass, instead of during the first epoch; returns ``stats``.

        Array data is placed (device tier, pinned host tier); another map-style dataset has
        every sample not cached yet read into its sample cache, with this loader's workers when
        it has them, behind a progress bar (``progress=False`` hides it). Samplers and random
        generators are not touched, so batches and their order stay what they would have been.
        Without a cache (``cache="off"``, or auto declining) nothing is read;
        ``stats.extra["sample_cache_decision"]`` says why.
        """
        if self._columns is not None:
            self._place_arrays()
        elif self._image_source is not None:
            self._image_batches().warm(progress, self.batch_size or 1)
        else:
            cached = self._sample_cache()
            if cached is not None:
                options = {
                    "worker_init_fn": self.worker_init_fn,
                    "multiprocessing_context": self.multiprocessing_context,
                    "timeout": self.timeout,
                }
                batch = self.batch_size or 1
                cached.warm(progress, self.num_workers, batch, options)
        return self.stats

    def _place_arrays(self) -> bool:
        """Place the arrays where the cache plan says, once; False if they were placed already."""
        if self._resident is not None:
            return False
        self._resident = self._columns.place(self.device, self._cache_settings, f"loader-{id(self)}")
        weakref.finalize(self, self._resident.release)  # GC gives memory back too
        self._stats.bytes_h2d += self._resident.placed_bytes
        self._stats.path = self._resident.path
        return True

    def _iter_arrays(self) -> Iterator[Any]:
        """Array data: gathered where the cache put it, or streamed through pinned slots."""
        if not self._place_arrays():
            self._resident.shrink_to_reserve(self._cache_settings)
        indices = self._epoch_indices()
        resident = self._resident
        if not resident.copies_batches or self.prefetch_depth == 0:
            return _GatherIterator(self, resident, indices)
        # The whole epoch's indices are drawn here, in the loop's thread, so the samplers'
        # random draws never race with the loop's own use of torch's generator. They are
        # checked batch by batch, so a bad index fails after the batches before it.
        batched = self._auto_collation
        drawn = list(indices)
        fills = (resident.fill(resident.checked_index(index, batched), batched) for index in drawn)
        sample_bytes = self._columns.nbytes // max(self._columns.num_samples, 1)
        epoch = self._prefetch(fills, sample_bytes * (self.batch_size or 1))
        checked = (resident.checked_index(index, batched) for index in drawn)
        return _PrefetchedIterator(self, epoch, checked if self._augment is not None else None)

    def _image_batches(self) -> ImageBatches:
        """The image path's reader/decoder, with its image cache chosen at first use."""
        if self._images is None:
            self._images = ImageBatches(
                self._image_source, self.device, self.batch_size or 1, self._augment, self.on_error
            )
        if self._images.cache is None and not self._image_cache_decided:
            self._image_cache_decided = True
            owner = f"loader-{id(self)}-images"
            decision = choose_image_cache(self._image_source, self._cache_settings, self.device, owner=owner)
            self._stats.extra["image_cache_decision"] = f"{decision.mode}: {decision.reason}"
            if decision.mode != "none":
                cache = ImageCache(decision, self.device, len(self._image_source), owner, self._cache_settings)
                self._images.cache = cache
                weakref.finalize(self, cache.close)
        return self._images

    def _iter_images(self) -> Iterator[Any]:
        """Image files: each batch read, decoded at once and transformed by gpuload."""
        images = self._image_batches()
        if images.cache is not None:
            images.cache.fit_reserve(self._cache_settings)
        self._stats.path = "image-decode" if images.cache is None else f"image-cache ({images.cache.mode})"
        indices = self._epoch_indices()
        images, batched, epoch = self._images, self._auto_collation, self._epoch

        def finish(decoded: DecodedBatch) -> tuple[Any, int, dict[str, Any]]:
            return images.finish(decoded, batched)

        if self.prefetch_depth == 0 or (self.device.type == "cpu" and self.prefetch_depth is None):
            # On a CPU, decoding and the transforms already use every core (DALI's threads,
            # torch's); running them ahead in a thread measured no faster (332 vs 352 img/s
            # on 2 cores), so that takes an explicit prefetch_depth.
            return _ImageIterator(self, (images.decode(index, epoch) for index in indices), finish)
        # As for arrays: the epoch's indices are drawn here, in the loop's thread; the
        # background thread reads, decodes and transforms batches ahead of the loop.
        # On the CPU the transforms stay in the loop's thread: their batch-sized float buffers
        # page-fault afresh each batch when allocated from a background thread's malloc arena
        # (measured 30% slower); on a GPU the thread runs them too, on the side stream.
        transform_ahead = self.device.type == "cuda"
        decoded = (images.decode(index, epoch) for index in list(indices))
        made = (finish(d) for d in decoded) if transform_ahead else decoded
        if self._prefetcher is None:
            depth = self.prefetch_depth or _IMAGE_PREFETCH_DEPTH
            self._prefetcher = Prefetcher(None, self.device, depth, timeout=self.timeout or None, stage=False)
            self._prefetched_bytes_seen = 0
        return _ImageIterator(self, self._prefetcher.epoch(made), None if transform_ahead else finish)

    def _iter_torch(self) -> Iterator[Any]:
        """Any other dataset: torch fetches and collates; the prefetcher moves it to the device.

        With a sample cache, batches are built from cached samples (and the dataset for the
        rest); with workers, torch's iterator fills the cache until it holds every sample.
        """
        self._stats.path = "torch"
        if self._prefetcher is not None:
            # torch's persistent iterator is reset below: no thread may still be pulling from it.
            self._prefetcher.stop_epoch("a new epoch of this DataLoader")
        cached = self._sample_cache()
        if cached is not None:
            cached.fit_reserve(self._cache_settings)
        if cached is not None and (self.num_workers == 0 or cached.complete):
            return self._iter_cached(cached)
        in_loop = self.prefetch_depth == 0 or (self.device.type == "cpu" and self.prefetch_depth is None)
        batches = self._torch_batches(cached)
        if in_loop:
            return _TorchIterator(self, batches)
        return _PrefetchedIterator(self, self._prefetch(batches, None))

    def _torch_batches(self, cached: CachedSamples | None) -> Iterator[Any]:
        """torch's own iterator for this epoch; filling ``cached`` from its workers' samples."""
        if cached is None:
            batches = super().__iter__()
        else:
            collate_fn = self.collate_fn
            self.collate_fn, self._filling_recorder = cached.wrap_for_fill(collate_fn, self._index_sampler)
            try:
                batches = super().__iter__()
            finally:
                self.collate_fn, self._filling_recorder = collate_fn, None
        if self.persistent_workers and self.num_workers > 0:
            self._persistent_seed_drawn = True  # torch drew its workers' seed, once
        if cached is None:
            return batches
        return _LenIterator(self._fill_epoch(cached, batches), len(batches))

    def _fill_epoch(self, cached: CachedSamples, batches: Iterator[Any]) -> Iterator[Any]:
        yield from cached.unwrap(batches)
        cached.warn_if_partial()
        if not cached.complete:
            # With workers only a complete cache serves; keep no memory for a partial one.
            self._drop_sample_cache()

    def _iter_cached(self, cached: CachedSamples) -> Iterator[Any]:
        """Batches built in this process from the sample cache (and the dataset for misses)."""
        self._stats.path = f"sample-cache ({cached.tier})"
        indices = self._epoch_indices()
        if self.prefetch_depth == 0 or (self.device.type == "cpu" and self.prefetch_depth is None):
            return _CachedIterator(self, cached, indices)
        # On CUDA (or with prefetch_depth on a CPU) the prefetcher's thread builds batches ahead (reading what the cache lacks)
        # and stages the host part; device-tier leaves pass through. The epoch's indices are
        # drawn here, in the loop's thread, as for arrays: the sampler's random draws never
        # race the loop's use of torch's generator.
        epoch = _CachedIterator.batches(cached, iter(list(indices)))
        return _PrefetchedIterator(self, self._prefetch(epoch, None))

    @property
    def _index_sampler(self):
        # While torch's iterator is created to fill the sample cache, it draws through a recorder.
        recorder = self.__dict__.get("_filling_recorder")
        return recorder if recorder is not None else tud.DataLoader._index_sampler.fget(self)

    def _sample_cache(self) -> CachedSamples | None:
        """The generic dataset's sample cache, decided at the first epoch (None: no cache)."""
        if self._samples_decided or self._dataset_kind != tud.dataloader._DatasetKind.Map:
            return self._samples
        self._samples_decided = True
        owner = f"loader-{id(self)}-samples"
        decision = decide_sample_cache(
            self.dataset, self._cache_settings, self.device,
            default_collate=is_default_collate(self.collate_fn), num_workers=self.num_workers,
            in_order=self.in_order, owner=owner,
        )
        self._stats.extra["sample_cache_decision"] = f"{decision.tier}: {decision.reason}"
        if decision.warn:
            warnings.warn(
                f"gpuload: not caching this {type(self.dataset).__name__}: {decision.reason}", stacklevel=4
            )
        if decision.tier == "none":
            return None
        self._samples = CachedSamples(
            self.dataset, decision, self.device, self.collate_fn, self._auto_collation, owner, self._cache_settings
        )
        self._fill_bytes_seen = 0
        weakref.finalize(self, self._samples.close)
        return self._samples

    def _drop_sample_cache(self) -> None:
        if self._samples is not None:
            self._count_fill_bytes()
            self._samples.close()
            self._stats.extra["cache"] = dict(self._samples.stats(), released=True)
            self._samples = None

    def _detect_image_source(self, strict: bool) -> ImageSource | None:
        """gpuload's view of an image-file dataset, when batches can be decoded by gpuload.

        A torchvision dataset with its own ``transform`` stays on torch's path (so swapping the
        import changes nothing) unless ``transforms=`` asks gpuload to take over, in which case
        the reason it cannot is raised.
        """
        if self._columns is not None or self._dataset_kind != tud.dataloader._DatasetKind.Map:
            return None
        if self.collate_fn not in (tud.default_collate, tud.default_convert):
            return None
        try:
            return as_image_source(self.dataset)
        except ValueError:
            if strict:
                raise
            return None

    def _make_augmenter(self, transforms: Sequence[Any] | None) -> BatchAugmenter | None:
        if not transforms:
            return None
        if self._columns is None and self._image_source is None:
            raise ValueError(
                "transforms= runs on images gpuload serves itself: uint8 arrays (TensorDataset, "
                "gpuload.ArrayDataset, a tensor or numpy array) or image files "
                "(gpuload.datasets.ImageFolder/ImageList, torchvision's ImageFolder), with the "
                f"default collate_fn; for a {type(self.dataset).__name__}, apply transforms inside the dataset"
            )
        seed = self.generator.initial_seed() if self.generator is not None else torch.initial_seed()
        leaf = image_column(self._columns.columns) if self._columns is not None else 0
        return BatchAugmenter(transforms, seed, self.device, leaf)

    def _augmented(self, batch: Any, flat: torch.Tensor) -> Any:
        if self._augment is None:
            return batch
        batch = self._augment(batch, flat, self._epoch, self._auto_collation)
        self._stats.extra["transform_backend"] = self._augment.backend
        return batch

    def _count_prefetched_bytes(self) -> None:
        """Add what the prefetcher's thread copied since the last look (it runs ahead).

        On a CPU device the staging is a host copy, not a transfer, and is not counted.
        """
        prefetch = self._prefetcher.stats
        copied = prefetch.bytes_copied
        if self.device.type != "cpu":
            self._stats.bytes_h2d += copied - self._prefetched_bytes_seen
        self._prefetched_bytes_seen = copied
        self._stats.extra["prefetch"] = {
            "depth": self._prefetcher.depth,
            "bytes_staged": copied,
            "copy_time_s": prefetch.copy_time_s,
            "slot_allocations": prefetch.slot_allocations,
        }

    def _prefetch(self, source: Iterator[Any], batch_bytes: int | None) -> Iterator[Any]:
        """One epoch of ``source`` through this loader's prefetcher (one side stream per loader)."""
        if self._prefetcher is None:
            depth = self.prefetch_depth
            if depth is None:
                depth = default_depth(batch_bytes) if batch_bytes is not None else _GENERIC_PREFETCH_DEPTH
            self._prefetcher = Prefetcher(None, self.device, depth, timeout=self.timeout or None)
            self._prefetched_bytes_seen = 0
        return self._prefetcher.epoch(source)

    def close(self) -> None:
        """Give back the device copy of the dataset and stop persistent workers; idempotent.

        Iterators still open on this loader stop working; iterating the loader again places
        the dataset again.
        """
        if self._resident is not None:
            self._resident.release()
            self._resident = None
        self._drop_sample_cache()
        self._samples_decided = False
        if self._images is not None and self._images.cache is not None:
            self._images.cache.close()
            self._stats.extra["cache"] = dict(self._images.cache.stats(), released=True)
            self._images.cache = None
        self._image_cache_decided = False
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._count_prefetched_bytes()
            self._prefetcher = None
        iterator = self._iterator
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._iterator = None

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals

    def _detect_array_data(self):
        """The dataset's arrays when batches can be one gather of them, else None.

        A batch built by gathering must equal what torch's fetch + collate builds; that is
        checked once here on sample 0 (structure, dtype, shape and values), so custom
        ``__getitem__`` overrides, custom collate functions or odd dtypes fall back to torch.
        """
        if self._dataset_kind != tud.dataloader._DatasetKind.Map:
            return None
        if self.collate_fn not in (tud.default_collate, tud.default_convert):
            return None
        return find_resident_columns(self.dataset, self.collate_fn, self._auto_collation)

    def _start_epoch_like_torch(self) -> Iterator[Any]:
        """Create the index iterator and consume the generator exactly as torch's iterator does.

        torch draws a base seed for its workers from ``generator`` each time an iterator is made
        (once only with persistent workers), after calling ``iter()`` on the index sampler, and
        multi-process iterators call ``iter()`` on it a second time. Matching this keeps the
        sampler's random stream, and so the batch order, identical to torch's.
        """
        sampler_iter = iter(self._index_sampler)
        persistent = self.persistent_workers and self.num_workers > 0
        if not (persistent and self._persistent_seed_drawn):
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            self._persistent_seed_drawn = True
            if self.num_workers > 0:
                sampler_iter = iter(self._index_sampler)
        else:
            sampler_iter = iter(self._index_sampler)
        return sampler_iter


class _TimedIterator:
    """Common part of gpuload's iterators: wait-time and batch counting around ``_produce``."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._stats = loader._stats
        self._auto_collation = loader._auto_collation

    def __iter__(self) -> _TimedIterator:
        return self

    def __len__(self) -> int:
        return len(self._loader._index_sampler)  # as torch's iterators report it

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            batch, count = self._produce()
        finally:
            self._stats.wait_time_s += time.perf_counter() - started
        self._stats.batches += 1
        self._stats.samples += count
        return batch

    def _produce(self) -> tuple[Any, int]:
        raise NotImplementedError


class _GatherIterator(_TimedIterator):
    """Batches gathered where the arrays live (the device, or the CPU when that is the device)."""

    def __init__(self, loader: DataLoader, resident: ResidentColumns, indices: Iterator[Any]) -> None:
        super().__init__(loader)
        self._resident = resident
        self._sampler_iter = indices
        sampler = loader.sampler
        self._in_range = (
            loader._auto_collation
            and can_draw_whole_epoch(loader.batch_sampler)
            and type(sampler) in (tud.RandomSampler, tud.SequentialSampler)
            and len(sampler.data_source) == resident.source.num_samples
        )

    def _produce(self) -> tuple[Any, int]:
        indices = next(self._sampler_iter)
        batch, flat, moved_bytes = self._resident.gather(indices, self._auto_collation, self._in_range)
        self._stats.bytes_h2d += moved_bytes
        return self._loader._augmented(batch, flat), flat.numel()


class _ImageIterator(_TimedIterator):
    """Image batches decoded from their files, in the loop's thread or the prefetcher's.

    ``epoch`` yields decoded batches (``finish`` then transforms each in the loop's thread) or,
    with ``finish=None``, finished ones. The counters are those as of each batch, not of the
    batches a background thread has decoded since.
    """

    def __init__(
        self,
        loader: DataLoader,
        epoch: Iterator[Any],
        finish: Callable[[DecodedBatch], tuple[Any, int, dict[str, Any]]] | None,
    ) -> None:
        super().__init__(loader)
        self._epoch = epoch
        self._finish = finish

    def _produce(self) -> tuple[Any, int]:
        while True:
            item = next(self._epoch)
            batch, count, counters = item if self._finish is None else self._finish(item)
            self._stats.extra.update(counters)
            if count:
                return batch, count


class _LenIterator(Iterator[Any]):
    """An iterator with the length of the torch iterator it wraps."""

    def __init__(self, inner: Iterator[Any], length: int) -> None:
        self._inner, self._length = inner, length

    def __next__(self) -> Any:
        return next(self._inner)

    def __len__(self) -> int:
        return self._length


class _CachedIterator(_TimedIterator):
    """Batches built from the sample cache in the loop's thread, reading misses from the dataset.

    Used with ``prefetch_depth=0`` and by default on a CPU; otherwise the prefetcher runs
    ``batches``.
    """

    def __init__(self, loader: DataLoader, cached: CachedSamples, indices: Iterator[Any]) -> None:
        super().__init__(loader)
        self._cached = cached
        self._indices = indices
        self._device = loader.device

    @staticmethod
    def batches(cached: CachedSamples, indices: Iterator[Any]) -> Iterator[Any]:
        """The epoch's batches from the cache, for the prefetcher's thread."""
        for index in indices:
            yield cached.batch(index)
        cached.warn_if_partial()

    def _produce(self) -> tuple[Any, int]:
        try:
            index = next(self._indices)
        except StopIteration:
            self._cached.warn_if_partial()
            raise
        batch = self._cached.batch(index)
        if self._device.type != "cpu":
            host_bytes = batch_nbytes(batch, host_only=True)
            if host_bytes:
                batch = move_to_device(batch, self._device, non_blocking=True)
            self._stats.bytes_h2d += host_bytes
        return batch, batch_length(batch) if self._auto_collation else 1


class _TorchIterator(_TimedIterator):
    """torch's own iterator (fetch, collate, workers), each batch copied in the loop's thread.

    Used on the CPU (nothing to copy) and with ``prefetch_depth=0``.
    """

    def __init__(self, loader: DataLoader, inner: Iterator[Any]) -> None:
        super().__init__(loader)
        self._inner = inner
        self._device = loader.device

    def __len__(self) -> int:
        return len(self._inner)

    def _produce(self) -> tuple[Any, int]:
        batch = next(self._inner)
        if self._device.type != "cpu":
            self._stats.bytes_h2d += batch_nbytes(batch)
            batch = move_to_device(batch, self._device, non_blocking=True)
        return batch, batch_length(batch) if self._auto_collation else 1


class _PrefetchedIterator(_TimedIterator):
    """Host batches (torch's, or gathered into pinned slots) delivered by the prefetcher.

    ``checked`` are the index tensors of array batches, in delivery order, for the transforms.
    """

    def __init__(self, loader: DataLoader, epoch: Iterator[Any], checked: Iterator[torch.Tensor] | None = None) -> None:
        super().__init__(loader)
        self._epoch = epoch
        self._checked = checked

    def _produce(self) -> tuple[Any, int]:
        try:
            batch = next(self._epoch)
        finally:
            self._loader._count_prefetched_bytes()
        if self._checked is not None:
            batch = self._loader._augmented(batch, next(self._checked))
        return batch, batch_length(batch) if self._auto_collation else 1
