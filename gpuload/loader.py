"""gpuload.DataLoader: torch's DataLoader, keyword for keyword, with batches delivered on a device.

It subclasses ``torch.utils.data.DataLoader``, so argument checking, ``len()``, samplers,
collation and worker processes are torch's own, and wrappers that re-create a loader from its
constructor arguments (Lightning, Accelerate) keep working. The loader only orchestrates: it
chooses the Source (``gpuload.sources.choose``), has each epoch's indices drawn as torch draws
them (``gpuload.sampling``) or taken up where a state left them (``gpuload.resume``), starts the
source's schedule in the thread ``runs_ahead`` picks, and adds up the counters (``gpuload.stats``).
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any, TypeVar, cast

import torch
import torch.utils.data as tud
from torch.utils.data.dataloader import _DatasetKind

from gpuload.cache import CacheSettings
from gpuload.device import resolve_device
from gpuload.elastic import distributed_layout, for_this_world_size
from gpuload.epoch import Epoch, when_all_idle
from gpuload.iterators import EpochIterator, OpenEpochs, shut_down_workers
from gpuload.prefetch import Prefetcher
from gpuload.resume import (
    Position,
    RandomStates,
    begin_epoch,
    load_state,
    save_state,
    stream_ended,
    stream_of,
    take_up_iterable,
)
from gpuload.sampling import DrawState, checked_batch_size, draws_in_range
from gpuload.sources import Indices, RestOfEpoch, Schedule, Source, Work, runs_ahead
from gpuload.sources.choose import choose_source
from gpuload.sources.exchanged import serving
from gpuload.sources.torch_fetch import EpochPlaces
from gpuload.state_format import check_format
from gpuload.stats import LoaderStats, Tally
from gpuload.timeline import Timeline, resolve_steps
from gpuload.transfer import Staging
from gpuload.worker_start import start_workers

__all__ = ["OPTIONS", "DataLoader"]

T_co = TypeVar("T_co", covariant=True)

# Rebuilt on the next ``iter()``: never pickled (device memory, pinned slots, threads, streams,
# and the epoch in progress: a copy starts its own).
_RUNTIME_STATE = ("_source", "_prefetcher", "_iterator", "_position", "_current", "_open")

_NEW_EPOCH = "a new epoch of this DataLoader"  # what stops an older epoch that shares its reader
_CLOSED = "the loader was closed (DataLoader.close()); iterate it again for a new epoch"


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
      ``cache_dir``, ``disk_cache_size``: the disk tier below host memory (README): array rows,
      a sample cache's fixed-shape samples and gpuload's image source's whole decoded images
      spilled to a local folder, read back memory-mapped. ``cache_key``: a string you change
      whenever the data does, keying the disk tier's entry instead of gpuload's look at the
      dataset (needed for a dataset gpuload cannot identify: one that does not pickle).
    - ``prefetch_depth``: batches made ahead of the loop (0: none, in the loop's thread).
    - ``on_error``: ``"skip"`` leaves out image files that cannot be decoded.
    - ``timeline_steps``: how many recent steps ``loader.timeline`` keeps (where the loop waits);
      0 turns it off; None: ``GPULOAD_TIMELINE``, else off.

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
        cache_dir: str | os.PathLike[str] | None = None,
        disk_cache_size: int | float | str | None = None,
        cache_key: str | None = None,
        job: str | None = None,
        prefetch_depth: int | None = None,
        on_error: str = "raise",
        timeline_steps: int | None = None,
    ) -> None:
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
            drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
        depth = prefetch_depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)
                                  or not 0 <= depth <= Prefetcher.MAX_DEPTH):
            raise ValueError(
                f"prefetch_depth={prefetch_depth!r} must be an int from 1 to {Prefetcher.MAX_DEPTH} "
                "(batches in flight, each held in host memory), 0 to copy in the loop without a "
                "background thread, or None to choose from the batch size"
            )
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r} must be 'raise' or 'skip' (bad image files)")
        self._cache_settings = CacheSettings.resolve(
            cache=cache, cache_size=cache_size, cache_reserve=cache_reserve, job=job, cache_scope=cache_scope,
            cache_dir=cache_dir, disk_cache_size=disk_cache_size, cache_key=cache_key,
        )
        # Public attributes with the constructor's names, so wrappers can rebuild the loader.
        self.device = resolve_device(device)
        self.transforms, self.cache, self.cache_size, self.cache_reserve = transforms, cache, cache_size, cache_reserve
        self.cache_scope, self.job, self.prefetch_depth, self.on_error = cache_scope, job, prefetch_depth, on_error
        self.cache_dir, self.disk_cache_size, self.cache_key = cache_dir, disk_cache_size, cache_key
        self.timeline_steps = timeline_steps
        self._timeline = Timeline(resolve_steps(timeline_steps), self.device)
        self._transform_seed = generator.initial_seed() if generator is not None else torch.initial_seed()
        self._stats = LoaderStats(device=str(self.device))
        self._tally = Tally(self._stats)  # what the source and prefetcher counted, added once
        self._epoch = -1
        self._draw = DrawState.of(self, self._dataset_kind == _DatasetKind.Map)  # read by sampling and resume
        self._prefetcher: Prefetcher | None = None
        self._position: Position | None = None  # the latest epoch's, for state_dict()
        self._resume: Position | None = None  # a loaded position the next iter() takes up
        self._iterable_resume: Position | None = None  # the same, for torch's iterator of an iterable dataset
        self._current: weakref.ref[EpochIterator] | None = None  # the latest epoch's iterator
        self._open = OpenEpochs()  # what a new epoch and close() stop
        self._in_range = False  # the latest epoch's indices need no check (for set_batch_size)
        self._source = self._choose_source()

    @property
    def stats(self) -> LoaderStats:
        """Counters over this loader's life: path, batches, samples, bytes copied, wait time; with a
        cache, ``stats.extra["cache"]`` (bytes, samples, hits per tier) and ``["cache_plan"]``."""
        return self._tally.merge(self._source, self._prefetcher, self.device.type)

    @property
    def timeline(self) -> Timeline:
        """Where the loop waits: per step, the wait for the batch and what each stage took for it;
        ``summary()`` says in one line what would help (the waiting page of the docs)."""
        self._timeline.about = weakref.ref(self)  # the verdict's suggestions read this loader's settings
        return self._timeline

    @property
    def cache_settings(self) -> CacheSettings:
        """The cache settings in force, each with where it came from (keyword, env, file)."""
        return self._cache_settings

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` epoch ``epoch`` (0-based) for the transforms' randomness."""
        self._epoch = int(epoch) - 1

    @property
    def next_epoch(self) -> int:
        """The epoch (0-based) the next ``iter()`` runs. After ``load_state_dict``: the saved epoch
        when it was cut short (the next ``iter()`` finishes it), else the one after it (0 for a
        state saved before the first ``iter()``), so a resumed loop is
        ``for epoch in range(loader.next_epoch, epochs)`` wherever the state was saved."""
        return self._epoch + 1

    def __iter__(self) -> Iterator[T_co]:  # type: ignore[override]  # gpuload's epoch iterator, not torch's class
        self._tally.begin_epoch(self._source, self._prefetcher, self.device.type)
        self._epoch += 1
        self._timeline.new_epoch()
        if self._prefetcher is not None:  # no thread may still pull from the source's iterators
            self._prefetcher.stop_epoch(_NEW_EPOCH)
        self._source.begin_epoch()  # decides the source's store: split over ranks, or its own
        source = self._source = serving(self._source)
        self._stats.path = source.path
        map_style = self._draw.map_style
        self._in_range = map_style and draws_in_range(self.batch_sampler, len(cast(Sized, self.dataset)))
        resume, self._resume = self._resume, None
        position, draw, length = begin_epoch(self._draw, self._epoch, resume)
        self._position = position
        self._iterable_resume = resume if not map_style else None  # taken by _torch_epoch
        rest = RestOfEpoch(position.after_cut()) if resume is not None else None
        indices = Indices(self._epoch, draw, self._in_range, rest, copy_now=self._copy_now)
        epoch = Epoch()
        try:
            work, items, epoch = self._start(source.schedule(indices), "")
        finally:
            self._iterable_resume = None
        if work.from_torch and self.persistent_workers and self.num_workers > 0:
            self._draw.seed_drawn = True  # torch drew its workers' seed, once
        length = length or work.length or self._index_sampler.__len__
        iterator = EpochIterator(work, items, self._stats, length, position, self._epoch_ended, epoch,
                                 self._timeline)
        self._current = weakref.ref(iterator)
        self._open.add(iterator, work, _NEW_EPOCH)
        return iterator

    def set_batch_size(self, batch_size: int) -> None:
        """Make batches of ``batch_size`` samples from the next one the loop asks for: the epoch in
        progress keeps its sample order, the rest cut at the new size (none skipped or repeated);
        later epochs, ``len()`` and ``state_dict()`` follow (README). ValueError for a size that is
        not a positive int, or batches not cut by size (``batch_size=None``, ``batch_sampler=``, an
        IterableDataset)."""
        size = checked_batch_size(self._draw, batch_size)
        if size == self.batch_size:
            return
        position = self._resume or self._position
        if position is not None and not position.finished and position.delivered is not None:
            raise ValueError(
                "set_batch_size: this epoch's batches came from workers with in_order=False, out of the "
                "epoch's order, so its rest cannot be cut at another size; change it between epochs"
            )
        self._apply_batch_size(size)
        if position is None or position.finished:
            return
        position.cut(size)
        iterator = self._current() if self._current is not None else None
        if iterator is not None and iterator.position is position:
            iterator.replace(*self._rest_of_epoch(position))

    @property
    def device_cache_bytes(self) -> int:
        """Bytes of the cache held in the device's memory (0 with none there)."""
        return self._source.device_cache_bytes()

    @property
    def cache_split_over_ranks(self) -> bool:
        """Whether this loader's data is split over ranks (``cache_scope`` node/world, decided at the
        first epoch): every rank then makes the same batches, and changes batch size together."""
        return self._source.split_over_ranks()

    def shrink_cache(self, max_device_bytes: int) -> int:
        """Keep at most ``max_device_bytes`` of the cache in device memory; the bytes freed. What is
        cheapest to get back goes first (read again from its next tier or the dataset); a share
        of a cache split over ranks does not shrink (0, with a warning)."""
        if isinstance(max_device_bytes, bool) or not isinstance(max_device_bytes, int) or max_device_bytes < 0:
            raise ValueError(f"max_device_bytes={max_device_bytes!r} must be a non-negative int")
        return self._source.shrink_cache(max_device_bytes)

    def state_dict(self) -> dict[str, Any]:
        """This loader's position after the batches handed to the loop (not those made ahead): a small
        dict that ``load_state_dict`` continues from, at this or another world size (README, resume)."""
        current = self._current() if self._current is not None else None
        in_progress = current is not None and current.position is self._position
        stream, ended = (stream_of(current), stream_ended(current)) if in_progress else (None, False)
        state = save_state(self._draw, self._resume or self._position, self._epoch, self._transform_seed, stream, ended)
        state["distributed"] = distributed_layout(self._draw)  # taken up at another world size (gpuload.elastic)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next ``iter()`` takes the epoch up where it was
        saved, reading nothing before that point. :class:`gpuload.resume.ResumeError` names
        what differs (arguments, dataset, generators, a DistributedSampler's seed, a world size
        the saved position cannot be split over) or what a malformed state lacks."""
        state = for_this_world_size(self._draw, check_format(state))
        loaded = load_state(self._draw, state)
        if loaded.transform_seed != self._transform_seed:
            self._transform_seed = loaded.transform_seed
            self._source.close()
            self._source = self._choose_source()  # its transforms draw from the saved seed
        self._position, self._resume = None, loaded.resume
        self._epoch = loaded.epoch if loaded.resume is None else loaded.epoch - 1
        if loaded.batch_size is not None and loaded.batch_size != self.batch_size:
            self._apply_batch_size(loaded.batch_size)  # a set_batch_size before the save

    def warm(self, progress: bool = True) -> LoaderStats:
        """Fill the cache now, in one pass (this loader's workers, a progress bar), not during the first
        epoch; returns ``stats``. Samplers and generators are untouched; without a cache nothing is read."""
        self._source.warm(progress)
        if self._source.path:
            self._stats.path = self._source.path
        return self.stats

    def close(self) -> None:
        """Give back the cache's memory, stop the prefetcher and persistent workers; idempotent. Open
        iterators, in any thread (also one inside ``next()``), raise ``EpochStoppedError`` at their
        next batch; iterating the loader again places the dataset again."""
        prefetcher, self._prefetcher = self._prefetcher, None
        # torch's workers are shut down only once no thread is inside its iterator (under one it
        # would hang or end short); any other source closes first, letting go of a thread that
        # waits inside it (an exchange waiting for other ranks).
        in_torch = self._open.mark_stopped(_CLOSED)
        if not in_torch:
            self._source.close()
        if prefetcher is not None:
            prefetcher.close()
        self._tally.merge(self._source, prefetcher, self.device.type)
        busy, torch_iterators = self._open.stop(_CLOSED, prefetcher.join_timeout if prefetcher else 5.0)
        torch_iterators.append(self._iterator)
        self._iterator = None
        source = self._source if in_torch else None
        if busy and in_torch:  # closed by the last thread to leave it: the next epoch gets a new source
            self._source = self._choose_source()
            self._tally.forget(source=True)
        when_all_idle(busy, functools.partial(_close_source_and_workers, source, torch_iterators))

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key not in _RUNTIME_STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._iterator = self._prefetcher = self._position = self._current = None
        self._open = OpenEpochs()
        self._tally.forget(source=True, prefetcher=True)
        self._source = self._choose_source()

    def _choose_source(self) -> Source:
        """The Source that serves this dataset (``gpuload.sources.choose``)."""
        torch_epoch = weakref.WeakMethod(self._torch_epoch)  # the source must not keep the loader alive

        def epoch() -> Iterator[Any]:
            method = torch_epoch()
            if method is None:
                raise RuntimeError("the gpuload.DataLoader of this epoch was garbage-collected")
            return method()

        epoch_places = weakref.WeakMethod(self._epoch_places)

        def places() -> EpochPlaces:
            method = epoch_places()
            return method() if method is not None else EpochPlaces()

        return choose_source(self, self._draw, self._cache_settings, self._stats, self._transform_seed, epoch, places,
                             self._staging())

    def _epoch_places(self) -> EpochPlaces:
        """Where the batches of the epoch being started sit among its index batches, from its
        position (torch's workers handing them over out of order note each): none to note once
        its rest was cut at another batch size."""
        position = self._position
        if position is None or position.cuts:
            return EpochPlaces()
        return EpochPlaces(position.places, position.hand_over)

    def _staging(self) -> Staging | None:
        """This loader's copy route to the device for its source and epochs: its prefetcher's
        pinned slots and side stream (``Prefetcher.staging``; the prefetcher in place when a copy
        is made, one per loader); None on a CPU device, where nothing is copied."""
        if self.device.type != "cuda":
            return None
        copies = weakref.WeakMethod(self._copies)  # the source must not keep the loader alive

        def copy(item: Any) -> Any:
            method = copies()
            if method is None:
                raise RuntimeError("the gpuload.DataLoader of this batch was garbage-collected")
            return method().copy_now(item, counted=False)

        return Staging(copy)

    def _torch_epoch(self) -> Iterator[Any]:
        """torch's own iterator for one epoch (fetch, collate, worker processes); for an iterable
        dataset's resumed epoch, taken up where it was saved (``gpuload.resume.take_up_iterable``)."""
        resume, self._iterable_resume = self._iterable_resume, None
        torch_iter = super().__iter__
        if self.num_workers > 0:
            torch_iter = functools.partial(start_workers, torch_iter)
        if resume is not None:
            return take_up_iterable(self._draw, resume, torch_iter)
        return torch_iter()

    def _start(self, schedule: Schedule, stopping: str) -> tuple[Work, Iterator[Any], Epoch]:
        """Start ``schedule``'s work in the thread :func:`runs_ahead` picks (ahead: through this
        loader's prefetcher, one side stream per loader), and its :class:`Epoch`: the stop token
        and, on CUDA, the loader's staging (its source's); ``stopping``: what stops the
        prefetcher's epoch in progress first (empty: none runs)."""
        ahead = runs_ahead(schedule, self.device, self.prefetch_depth)
        if stopping and self._prefetcher is not None:
            self._prefetcher.stop_epoch(stopping)
        prefetcher = self._place_prefetcher(schedule) if ahead else None
        epoch = Epoch(self._source.setup.staging)
        work = self._open.note(schedule.start(ahead), epoch)
        if prefetcher is None:
            return work, work.items, epoch
        return work, prefetcher.epoch(work.items, epoch), epoch

    def _place_prefetcher(self, schedule: Schedule) -> Prefetcher:
        """This loader's prefetcher, made for ``schedule``'s work (staged, or made on the device)."""
        if self._prefetcher is not None and self._prefetcher.stage != schedule.staged:
            # the source's placement changed (its cache planned again: a share split over ranks
            # makes its batches itself, a per-rank cache has them staged)
            self._tally.merge(self._source, self._prefetcher, self.device.type)
            self._prefetcher.close()
            self._prefetcher = None
            self._tally.forget(prefetcher=True)
        if self._prefetcher is None:
            depth = self.prefetch_depth if self.prefetch_depth is not None else schedule.depth
            self._prefetcher = Prefetcher(None, self.device, depth, timeout=self.timeout or None,
                                          stage=schedule.staged)
        self._prefetcher.timeline = self._timeline.sampling
        return self._prefetcher

    def _copies(self) -> Prefetcher:
        """The prefetcher whose slots and side stream this loader's copies go through (made if none)."""
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(None, self.device, self.prefetch_depth or 2, timeout=self.timeout or None)
        return self._prefetcher

    def _copy_now(self, item: Any, counted: bool = True) -> Any:
        """``item`` copied to the device through this loader's prefetcher, in the caller's thread."""
        return self._copies().copy_now(item, counted)

    def _epoch_ended(self, position: Position) -> None:
        position.end_states = RandomStates.capture(self._draw)

    def _rest_of_epoch(self, position: Position) -> tuple[Work, Iterator[Any], Callable[[], int], Epoch]:
        """The source's work for the rest of the epoch in progress, after a batch-size change:
        made as for a resumed epoch, from the remaining batches (what ran ahead is dropped)."""
        _, draw, length = begin_epoch(self._draw, position.number, position)  # the rest of its order, cut
        assert length is not None  # only a BatchSampler's epoch is cut: begin_epoch counts its rest
        indices = Indices(position.number, draw, self._in_range, RestOfEpoch(cut=position.after_cut()),
                          copy_now=self._copy_now)
        stopping = "the rest of this epoch at a new batch size (set_batch_size)"
        work, items, epoch = self._start(self._source.schedule(indices), stopping)
        return work, items, length, epoch

    def _apply_batch_size(self, size: int) -> None:
        """The batch size in force: torch's attribute and the BatchSampler the sources share."""
        object.__setattr__(self, "batch_size", size)
        self._draw.batch_size = size
        cast(tud.BatchSampler, self.batch_sampler).batch_size = size  # set_batch_size checked it is one

    def __setattr__(self, attr: str, value: Any) -> None:
        if attr == "batch_size" and self.__dict__.get("_DataLoader__initialized", False):
            raise ValueError(
                f"batch_size attribute should not be set after {type(self).__name__} is initialized; "
                "call loader.set_batch_size(n), which keeps the epoch's sample order"
            )
        super().__setattr__(attr, value)
        if attr in DrawState.FOLLOWED and "_draw" in self.__dict__:
            setattr(self._draw, attr, value)


def _close_source_and_workers(source: Source | None, torch_iterators: list[Any]) -> None:
    """Close ``source`` (None: none to close) and end the worker processes of ``torch_iterators``:
    what ``close()`` leaves to the last thread to leave a busy epoch."""
    if source is not None:
        source.close()
    shut_down_workers(torch_iterators)


#: gpuload's own options, in the constructor's order: its keyword arguments that torch's DataLoader
#: lacks. Each is kept as a public attribute of that name; a wrapper that rebuilds a loader must
#: carry every one (the integrations do; tests/clients/test_options.py checks each over this tuple).
OPTIONS: tuple[str, ...] = tuple(
    name for name in inspect.signature(DataLoader.__init__).parameters
    if name != "self" and name not in inspect.signature(tud.DataLoader.__init__).parameters
)
