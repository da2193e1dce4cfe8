"""gpuload.DataLoader: torch's DataLoader, keyword for keyword, with batches delivered on a device.

It subclasses ``torch.utils.data.DataLoader``, so argument checking, ``len()``, samplers,
collation and worker processes are torch's own, and wrappers that re-create a loader from its
constructor arguments (Lightning, Accelerate) keep working. What gpuload adds is the device
tail: in-memory array datasets are placed on the device once and every batch is one gather
there; any other dataset is read by torch and its batches are moved to the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.data as tud

from gpuload.device import resolve_device
from gpuload.sampling import can_draw_whole_epoch, epoch_batches
from gpuload.resident import ResidentColumns, find_resident_columns
from gpuload.stats import LoaderStats
from gpuload.transfer import batch_length, batch_nbytes, move_to_device

__all__ = ["DataLoader"]


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
        cache: str | None = "auto",
        cache_size: int | float | str | None = None,
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
        if transforms:
            raise NotImplementedError(
                "transforms= is not available in this version of gpuload; apply transforms in "
                "the Dataset or in the training loop for now"
            )
        if cache not in ("auto", "device", "host", "off", None):
            raise ValueError(
                f"cache={cache!r} is not a cache mode; use 'auto', 'device', 'host' or 'off'"
            )
        # Public attributes with the constructor's names, so wrappers can rebuild the loader.
        self.device = resolve_device(device)
        self.transforms = transforms
        self.cache = cache
        self.cache_size = cache_size
        self._stats = LoaderStats(device=str(self.device))
        self._columns = self._detect_array_data()
        self._resident: ResidentColumns | None = None
        self._persistent_seed_drawn = False

    # ----------------------------------------------------------------- public surface

    @property
    def stats(self) -> LoaderStats:
        """Counters over this loader's life: path, batches, samples, bytes copied, wait time."""
        return self._stats

    def __iter__(self) -> Iterator[Any]:
        self._stats.epochs += 1
        if self._columns is not None:
            if self._resident is None:
                self._resident = self._columns.place(self.device, keep_on_host=self.cache == "off")
                self._stats.bytes_h2d += self._resident.placed_bytes
                self._stats.path = self._resident.path
            return _GatherIterator(self, self._resident)
        self._stats.path = "torch"
        return _DeviceTailIterator(self, super().__iter__())

    def close(self) -> None:
        """Give back the device copy of the dataset and stop persistent workers; idempotent.

        Iterators still open on this loader stop working; iterating the loader again places
        the dataset again.
        """
        if self._resident is not None:
            self._resident.release()
            self._resident = None
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
    """Batches from device-resident arrays: one ``index_select`` per array per batch."""

    def __init__(self, loader: DataLoader, resident: ResidentColumns) -> None:
        super().__init__(loader)
        self._resident = resident
        self._sampler_iter = loader._start_epoch_like_torch()
        if self._auto_collation and can_draw_whole_epoch(loader.batch_sampler):
            self._sampler_iter = epoch_batches(loader.batch_sampler)

    def __len__(self) -> int:
        return len(self._loader._index_sampler)

    def _produce(self) -> tuple[Any, int]:
        indices = next(self._sampler_iter)
        batch, count, index_bytes = self._resident.gather(indices, batched=self._auto_collation)
        self._stats.bytes_h2d += index_bytes
        return batch, count


class _DeviceTailIterator(_TimedIterator):
    """torch's own iterator (fetch, collate, workers), with each batch moved to the device."""

    def __init__(self, loader: DataLoader, inner: Iterator[Any]) -> None:
        super().__init__(loader)
        self._inner = inner
        self._device = loader.device
        self._copies = loader.device.type != "cpu"

    def __len__(self) -> int:
        return len(self._inner)

    def _produce(self) -> tuple[Any, int]:
        batch = next(self._inner)
        count = batch_length(batch) if self._auto_collation else 1
        if self._copies:
            self._stats.bytes_h2d += batch_nbytes(batch)
            batch = move_to_device(batch, self._device, non_blocking=True)
        return batch, count
