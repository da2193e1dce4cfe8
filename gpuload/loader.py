"""gpuload.DataLoader: torch's DataLoader, keyword for keyword, with batches delivered on a device.

It subclasses ``torch.utils.data.DataLoader``, so argument checking, ``len()``, samplers,
collation and worker processes are torch's own, and wrappers that re-create a loader from its
constructor arguments (Lightning, Accelerate) keep working. The loader only orchestrates: it
chooses the Source that serves the dataset (``gpuload.sources``), draws each epoch's batch
indices exactly as torch would, decides whether the source's work runs in the loop's thread or
ahead of it in the prefetcher's, and merges the counters.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.utils.data as tud
from torch.utils.data.dataloader import _DatasetKind

from gpuload.cache import CacheSettings
from gpuload.device import resolve_device
from gpuload.iterators import EpochIterator
from gpuload.prefetch import Prefetcher, one_epoch_at_a_time
from gpuload.resume import EpochProgress, RandomStates, load_state, save_state
from gpuload.sampling import (
    can_draw_whole_epoch,
    cut_order,
    draws_in_range,
    epoch_batches,
    epoch_order,
    start_epoch_like_torch,
)
from gpuload.sources import Epoch, EpochRequest, Setup, Source, arrays, images, tokens
from gpuload.sources.samples import SampleSource, TorchLoading
from gpuload.stats import LoaderStats

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)

# Rebuilt on the next ``iter()``: never pickled (device memory, pinned slots, threads, streams,
# and the epoch in progress: a copy starts its own).
_RUNTIME_STATE = ("_source", "_prefetcher", "_iterator", "_progress", "_current", "_open_epochs", "_torch_iterators")

_NEW_EPOCH = "a new epoch of this DataLoader"  # what stops an older epoch that shares its reader

# The largest batch size ``set_batch_size`` takes (index tensors and kernels count in int32).
MAX_BATCH_SIZE = 2**31 - 1


class DataLoader(tud.DataLoader[T_co]):
    """Drop-in for ``torch.utils.data.DataLoader`` whose batches arrive on ``device``.

    Every argument up to ``in_order`` means exactly what it means for torch (same order, same
    defaults, same errors). gpuload's own options are keyword-only:

    - ``device``: where batches are delivered; default the current CUDA device when there is
      one, else the CPU.
    - ``transforms``, ``cache``, ``cache_size``, ``cache_reserve``, ``job``: the transform list
      and the cache (see the README); ``cache="off"`` keeps array data on the host and copies
      each batch. ``cache_scope``: in a torch.distributed job, over which ranks one copy of the
      dataset is split (``"rank"``, ``"node"``, ``"world"``, ``"auto"``; README, multi-GPU).
    - ``prefetch_depth``: batches made ahead of the loop (0: none, in the loop's thread).
    - ``on_error``: ``"skip"`` leaves out image files that cannot be decoded.

    Batches are the same, in the same order, as torch's DataLoader gives for the same dataset,
    sampler, generator state and collate_fn; only their tensors live on ``device``.
    """

    def __init__(
        self,
        dataset: tud.Dataset[T_co],
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
        cache_scope: str | None = None,
        job: str | None = None,
        prefetch_depth: int | None = None,
        on_error: str = "raise",
    ) -> None:
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
            drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
        if prefetch_depth is not None and (
            isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int)
            or not 0 <= prefetch_depth <= Prefetcher.MAX_DEPTH
        ):
            raise ValueError(
                f"prefetch_depth={prefetch_depth!r} must be an int from 1 to {Prefetcher.MAX_DEPTH} "
                "(batches in flight, each held in host memory), 0 to copy in the loop without a "
                "background thread, or None to choose from the batch size"
            )
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r} must be 'raise' or 'skip' (bad image files)")
        self._cache_settings = CacheSettings.resolve(
            cache=cache, cache_size=cache_size, cache_reserve=cache_reserve, job=job, cache_scope=cache_scope
        )
        # Public attributes with the constructor's names, so wrappers can rebuild the loader.
        self.device = resolve_device(device)
        self.transforms = transforms
        self.cache = cache
        self.cache_size = cache_size
        self.cache_reserve = cache_reserve
        self.cache_scope = cache_scope
        self.job = job
        self.prefetch_depth = prefetch_depth
        self.on_error = on_error
        self._transform_seed = generator.initial_seed() if generator is not None else torch.initial_seed()
        self._stats = LoaderStats(device=str(self.device))
        self._epoch = -1
        self._persistent_seed_drawn = False
        self._epoch_start_bytes: list[int] = []
        self._counted = {"source": 0, "prefetch": 0}  # what was already added to stats.bytes_h2d
        self._prefetcher: Prefetcher | None = None
        self._progress: EpochProgress | None = None  # the latest epoch's, for state_dict()
        self._resume: EpochProgress | None = None  # a loaded position the next iter() takes up
        self._built_batch_size = self.batch_size
        self._current: weakref.ref[EpochIterator] | None = None  # the latest epoch's iterator
        self._open_epochs: weakref.WeakSet[EpochIterator] = weakref.WeakSet()  # what close() stops
        self._torch_iterators: weakref.WeakSet[Any] = weakref.WeakSet()  # whose workers close() stops
        self._ahead = self._in_range = False  # how the latest epoch runs (for set_batch_size)
        self._source = self._choose_source()

    # ----------------------------------------------------------------- public surface

    @property
    def stats(self) -> LoaderStats:
        """Counters over this loader's life: path, batches, samples, bytes copied, wait time.

        With a cache, ``stats.extra["cache"]`` has its bytes, samples and hits (per tier for
        arrays, with ``stats.extra["cache_plan"]`` the placement plan that was chosen).
        """
        self._merge_counters()
        if self._epoch_start_bytes:
            ends = [*self._epoch_start_bytes[1:], self._stats.bytes_h2d]
            self._stats.bytes_h2d_per_epoch = [end - start for start, end in zip(self._epoch_start_bytes, ends)]
        return self._stats

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

    def __iter__(self) -> Iterator[T_co]:
        self._epoch_start_bytes.append(self.stats.bytes_h2d)
        self._stats.epochs += 1
        self._epoch += 1
        if self._prefetcher is not None:
            # The source's iterators (torch's persistent one, the cache) are reused below: no
            # thread may still be pulling from the last epoch.
            self._prefetcher.stop_epoch(_NEW_EPOCH)
        source = self._source
        source.begin_epoch()
        self._stats.path = source.path
        ahead = self._runs_ahead(source)
        in_range = (
            self._dataset_kind == _DatasetKind.Map and self._auto_collation
            and draws_in_range(self.batch_sampler, len(self.dataset))
        )
        resume, self._resume = self._resume, None
        length: Callable[[], int] | None = None
        if resume is None:
            progress = EpochProgress(self._epoch, RandomStates.capture(self), batch_size=self.batch_size)
            draw = self._draw_indices
        else:
            progress, (draw, length) = resume, self._resumed_draw(resume)
        self._progress = progress
        self._ahead, self._in_range = ahead, in_range
        seed_drawn = self._persistent_seed_drawn
        request = EpochRequest(self._epoch, ahead, draw, in_range, resumed=resume is not None,
                               worker_seed_drawn=seed_drawn, position=progress.position())
        epoch = self._started(source.epoch(request))
        if epoch.torch_iterator is not None:
            # torch's persistent workers serve every epoch through one iterator, which a new epoch
            # resets: an older epoch still reading from it would end short without a word.
            for older in list(self._open_epochs):
                if older.reads_from(epoch.torch_iterator):
                    older.stop(one_epoch_at_a_time(_NEW_EPOCH))
        if epoch.from_torch and self.persistent_workers and self.num_workers > 0:
            self._persistent_seed_drawn = True  # torch drew its workers' seed, once
        items = epoch.items
        if ahead:
            items = self._prefetch(items, epoch.depth, source.stages)
        length = length or epoch.length or self._index_sampler.__len__
        iterator = EpochIterator(epoch, items, self._stats, length, progress, self._epoch_ended)
        self._current = weakref.ref(iterator)
        self._open_epochs.add(iterator)
        return iterator

    def set_batch_size(self, batch_size: int) -> None:
        """Make batches of ``batch_size`` samples from the next one the loop asks for.

        The epoch in progress keeps its sample order: its remaining samples are cut into
        batches of the new size (none skipped, none repeated; with ``drop_last`` a last batch
        shorter than the new size is left out, as torch leaves it out). Batches made ahead with
        the old size are dropped and made again. Later epochs use the new size;
        ``len(loader)`` is an epoch's batch count at it, and ``len()`` of the epoch's
        iterator counts the epoch's batches given the change. ``state_dict()`` keeps the
        change, and a resumed epoch goes on with the same batches.

        Raises ValueError for a size that is not a positive int, without automatic batching
        (``batch_size=None``), with a ``batch_sampler=`` (it makes the batches), and for an
        IterableDataset (it makes its own batches).
        """
        size = self._checked_batch_size(batch_size)
        if size == self.batch_size:
            return
        self._apply_batch_size(size)
        progress = self._resume or self._progress
        if progress is None or progress.finished:
            return
        progress.cut(size)
        iterator = self._current() if self._current is not None else None
        if iterator is not None and iterator.progress is progress:
            iterator.replace(*self._rest_of_epoch(progress))

    @property
    def device_cache_bytes(self) -> int:
        """Bytes of the cache held in the device's memory (0 with none there)."""
        return self._source.device_cache_bytes()

    @property
    def cache_split_over_ranks(self) -> bool:
        """Whether this loader's data is split over ranks (``cache_scope`` node/world in force,
        decided when the first epoch begins): every rank must then make the same batches, so the
        batch size changes only on every rank together (README, multi-GPU)."""
        return self._source.split_over_ranks()

    def shrink_cache(self, max_device_bytes: int) -> int:
        """Keep at most ``max_device_bytes`` of the cache in device memory and return the bytes
        freed. What goes first is what is cheapest to get back (array rows the host tier also
        holds, the samples cached last); it is read from its next tier or the dataset again.
        A share of a cache split over ranks does not shrink (the other ranks read from it): 0,
        with a warning saying so."""
        if isinstance(max_device_bytes, bool) or not isinstance(max_device_bytes, int) or max_device_bytes < 0:
            raise ValueError(f"max_device_bytes={max_device_bytes!r} must be a non-negative int")
        return self._source.shrink_cache(max_device_bytes)

    def state_dict(self) -> dict[str, Any]:
        """This loader's position: after the batches already handed to the loop (not those made
        ahead), as a small dict of Python values and CPU tensors (``torch.save`` it).

        ``load_state_dict`` on a loader built with the same arguments continues from there, and
        the epochs after it follow as in an uninterrupted run. See the README's resume section.
        """
        return save_state(self, self._resume or self._progress, self._epoch, self._transform_seed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next ``iter()`` takes the epoch up where it was
        saved, without reading, decoding or transforming the batches before that point.

        Raises :class:`gpuload.resume.ResumeError` naming what differs when the state was saved
        by a loader with other arguments or another dataset.
        """
        loaded = load_state(self, state, iterable=self._dataset_kind != _DatasetKind.Map)
        if loaded.transform_seed != self._transform_seed:
            self._transform_seed = loaded.transform_seed
            self._source.close()
            self._source = self._choose_source()  # its transforms draw from the saved seed
        self._progress, self._resume = None, loaded.resume
        self._epoch = loaded.epoch if loaded.resume is None else loaded.epoch - 1
        if loaded.batch_size is not None and loaded.batch_size != self.batch_size:
            self._apply_batch_size(loaded.batch_size)  # a set_batch_size before the save

    def warm(self, progress: bool = True) -> LoaderStats:
        """Fill the cache now, in one pass, instead of during the first epoch; returns ``stats``.

        Array data is placed (device tier, pinned host tier); image files and other map-style
        datasets have every sample not cached yet read into their cache (with this loader's
        workers when it has them), behind a progress bar (``progress=False`` hides it).
        Samplers and random generators are not touched, so batches and their order stay what
        they would have been. Without a cache (``cache="off"``, or auto declining) nothing is
        read; ``stats.extra`` says why.
        """
        self._source.warm(progress)
        if self._source.path:
            self._stats.path = self._source.path
        return self.stats

    def close(self) -> None:
        """Give back the cache's memory, stop the prefetcher and persistent workers; idempotent.

        Iterators still open on this loader raise ``EpochStoppedError`` at their next batch;
        iterating the loader again places the dataset again.
        """
        self._source.close()
        inside_a_source = False
        if self._prefetcher is not None:
            self._prefetcher.close()
            inside_a_source = self._prefetcher.running()
            self._merge_counters()
            self._prefetcher = None
        for epoch in list(self._open_epochs):
            epoch.stop("the loader was closed (DataLoader.close()); iterate it again for a new epoch")
        # The workers of every torch iterator still alive (an open epoch, or one a kept exception's
        # traceback holds) end now, not whenever that iterator is freed; but not under a thread that
        # would not stop (it warned): inside torch's next() it would wait for them forever.
        for iterator in [] if inside_a_source else [*self._torch_iterators, self._iterator]:
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        self._open_epochs, self._torch_iterators = weakref.WeakSet(), weakref.WeakSet()
        self._iterator = None

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = {key: value for key, value in self.__dict__.items() if key not in _RUNTIME_STATE}
        state["_counted"] = {"source": 0, "prefetch": 0}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._iterator = None
        self._prefetcher = None
        self._progress = None
        self._current = None
        self._open_epochs, self._torch_iterators = weakref.WeakSet(), weakref.WeakSet()
        self._source = self._choose_source()

    # ----------------------------------------------------------------- internals

    def _choose_source(self) -> Source:
        """The Source that serves this dataset: arrays, image files, else torch's own path."""
        map_style = self._dataset_kind == _DatasetKind.Map
        setup = Setup(
            dataset=self.dataset, map_style=map_style, device=self.device, settings=self._cache_settings,
            batched=self._auto_collation, batch_size=self.batch_size, collate_fn=self.collate_fn,
            stats=self._stats, owner=f"loader-{id(self)}", transforms=self.transforms,
            seed=self._transform_seed, on_error=self.on_error,
            worker_code=self.num_workers > 0 and self.worker_init_fn is not None,
            batch_sampler=self.batch_sampler,
        )
        source = tokens.detect(setup) or arrays.detect(setup) or images.detect(setup, strict=bool(self.transforms))
        if source is not None:
            return source
        if self.transforms:
            raise ValueError(
                "transforms= runs on images gpuload serves itself: uint8 arrays (TensorDataset, "
                "gpuload.ArrayDataset, a tensor or numpy array) or image files "
                "(gpuload.datasets.ImageFolder/ImageList, torchvision's ImageFolder), with the "
                f"default collate_fn; for a {type(self.dataset).__name__}, apply transforms inside the dataset"
            )
        options = {
            "worker_init_fn": self.worker_init_fn, "multiprocessing_context": self.multiprocessing_context,
            "timeout": self.timeout, "generator": self.generator, "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers, "pin_memory": self.pin_memory,
            "pin_memory_device": self.pin_memory_device, "in_order": self.in_order,
        }
        # A weak reference: the source must not keep the loader alive (torch's loader is freed, and
        # its workers stopped, as soon as the last reference to it goes).
        torch_epoch = weakref.WeakMethod(self._torch_epoch)
        return SampleSource(setup, TorchLoading(lambda: torch_epoch()(), self._index_sampler, self.num_workers, options))

    def _torch_epoch(self) -> Iterator[Any]:
        """torch's own iterator for one epoch (fetch, collate, worker processes)."""
        return super().__iter__()

    def _runs_ahead(self, source: Source) -> bool:
        """Whether the source's work runs in the prefetcher's thread, ahead of the loop.

        ``prefetch_depth=0`` keeps it in the loop's thread, and so does a source with nothing
        to run ahead (arrays on the device). On a GPU the copies, reads and decoding overlap
        the loop's compute; on a CPU device the source says (``Source.ahead_on_cpu``) unless
        ``prefetch_depth`` is set.
        """
        if self.prefetch_depth == 0 or not source.streams:
            return False
        if self.device.type == "cpu" and self.prefetch_depth is None:
            return source.ahead_on_cpu
        return True

    def _prefetch(self, items: Iterator[Any], depth: int, stages: bool) -> Iterator[Any]:
        """One epoch of ``items`` through this loader's prefetcher (one side stream per loader)."""
        if self._prefetcher is not None and self._prefetcher.stage != stages:
            # the source's placement changed (its cache planned again: a share split over ranks
            # makes its batches itself, a per-rank cache has them staged)
            self._merge_counters()
            self._prefetcher.close()
            self._prefetcher = None
            self._counted["prefetch"] = 0
        if self._prefetcher is None:
            depth = self.prefetch_depth if self.prefetch_depth is not None else depth
            self._prefetcher = Prefetcher(None, self.device, depth, timeout=self.timeout or None, stage=stages)
        return self._prefetcher.epoch(items)

    def _merge_counters(self) -> None:
        """Add what the source and the prefetcher copied since the last look to ``bytes_h2d``.

        On a CPU device the prefetcher's staging is a host copy, not a transfer, and is not counted.
        """
        source_bytes = self._source.h2d_bytes
        self._stats.bytes_h2d += source_bytes - self._counted["source"]
        self._counted["source"] = source_bytes
        self._stats.extra.update(self._source.stats())
        if self._prefetcher is None:
            return
        prefetch = self._prefetcher.stats
        if self.device.type != "cpu":
            self._stats.bytes_h2d += prefetch.bytes_copied - self._counted["prefetch"]
        self._counted["prefetch"] = prefetch.bytes_copied
        self._stats.extra["prefetch"] = {
            "depth": self._prefetcher.depth,
            "bytes_staged": prefetch.bytes_copied,
            "copy_time_s": prefetch.copy_time_s,
            "slot_allocations": prefetch.slot_allocations,
        }

    def _epoch_ended(self, progress: EpochProgress) -> None:
        progress.end_states = RandomStates.capture(self)

    def _resumed_draw(
        self, resume: EpochProgress
    ) -> tuple[Callable[[], Iterator[Any]], Callable[[], int] | None]:
        """The index batches left in a resumed epoch, and the epoch's length: drawn again from
        the states the epoch began with, the ones already done dropped (nothing of them is
        read); after a batch-size change, the rest of the epoch's sample order cut at the size."""
        if self._dataset_kind != _DatasetKind.Map:
            return self._draw_indices, None  # an iterable dataset continues from its own state
        if resume.cuts:
            remaining = self._remaining_batches(resume)
        else:
            resume.states.restore_explicit(self)
            remaining = resume.states.draw_with_global(self._draw_indices)[resume.batches :]
        return (lambda: iter(remaining)), (lambda: resume.batches + len(remaining))

    def _remaining_batches(self, progress: EpochProgress) -> list[Any]:
        """The epoch's sample order drawn again from the states it began with (the generators
        then stand where a whole epoch leaves them), after the samples done, cut at the last
        batch size set."""
        progress.states.restore_explicit(self)
        order = progress.states.with_global(self._draw_order)
        return cut_order(order[progress.samples_done() :], progress.cuts[-1][2], self.drop_last)

    def _started(self, epoch: Epoch) -> Epoch:
        """``epoch``, its torch iterator (if any) noted for ``close()``."""
        if epoch.torch_iterator is not None:
            self._torch_iterators.add(epoch.torch_iterator)
        return epoch

    def _rest_of_epoch(self, progress: EpochProgress) -> tuple[Any, Iterator[Any], Callable[[], int]]:
        """The source's work for the rest of the epoch in progress, after a batch-size change:
        made as for a resumed epoch, from the remaining batches (what ran ahead is dropped)."""
        remaining = self._remaining_batches(progress)
        in_range = self._in_range and all(isinstance(batch, torch.Tensor) for batch in remaining)
        request = EpochRequest(progress.number, self._ahead, lambda: iter(remaining), in_range, resumed=True,
                               worker_seed_drawn=self._persistent_seed_drawn, position=progress.position())
        if self._prefetcher is not None:
            self._prefetcher.stop_epoch("the rest of this epoch at a new batch size (set_batch_size)")
        epoch = self._started(self._source.epoch(request))
        items = self._prefetch(epoch.items, epoch.depth, self._source.stages) if self._ahead else epoch.items
        done = progress.batches
        return epoch, items, lambda: done + len(remaining)

    def _draw_order(self) -> torch.Tensor | list[Any]:
        """This epoch's flat sample order, drawn as torch's iterator and BatchSampler draw it."""
        _, self._persistent_seed_drawn = start_epoch_like_torch(self, self._persistent_seed_drawn)
        return epoch_order(self.batch_sampler.sampler)

    def _checked_batch_size(self, batch_size: int) -> int:
        """``batch_size`` if this loader can change to it, else the ValueError saying why."""
        if self._dataset_kind != _DatasetKind.Map:
            raise ValueError(
                f"set_batch_size: an IterableDataset ({type(self.dataset).__name__}) makes its own "
                "batches from its stream; gpuload cannot re-cut them (build a new DataLoader)"
            )
        if self._built_batch_size is None:
            if self.batch_sampler is not None:
                raise ValueError(
                    "set_batch_size: batch_sampler option is mutually exclusive with batch_size, "
                    "shuffle, sampler, and drop_last; this loader's batch_sampler= makes its batches, "
                    "so change the size there (or build the loader with batch_size= and sampler=)"
                )
            raise ValueError(
                "set_batch_size: this loader was built with batch_size=None (no automatic batching: "
                "each item is one sample); build it with a batch_size to change it later"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise ValueError(
                f"batch_size should be a positive integer value up to {MAX_BATCH_SIZE}, but got "
                f"batch_size={batch_size!r}"
            )
        return batch_size

    def _apply_batch_size(self, size: int) -> None:
        """The batch size in force: torch's attribute and the BatchSampler the loader made
        (shared by the sources, and by torch's iterators for later epochs)."""
        object.__setattr__(self, "batch_size", size)
        self.batch_sampler.batch_size = size

    def __setattr__(self, attr: str, value: Any) -> None:
        if attr == "batch_size" and self.__dict__.get("_DataLoader__initialized", False):
            raise ValueError(
                f"batch_size attribute should not be set after {type(self).__name__} is initialized; "
                "call loader.set_batch_size(n), which keeps the epoch's sample order"
            )
        super().__setattr__(attr, value)

    def _draw_indices(self) -> Iterator[Any]:
        """This epoch's index batches, drawn as torch would (as tensors for torch's samplers)."""
        indices, self._persistent_seed_drawn = start_epoch_like_torch(self, self._persistent_seed_drawn)
        if self._auto_collation and can_draw_whole_epoch(self.batch_sampler):
            return epoch_batches(self.batch_sampler)
        return indices
