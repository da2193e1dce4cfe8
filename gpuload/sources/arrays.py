"""In-memory arrays: the data sits in one place, each batch is one gather (``index_select``).

``detect`` recognises datasets whose samples are rows of arrays and whose gather reproduces
torch's fetch + collate (``placed_arrays.find_columns``). At the first epoch the cache plan
places the arrays (device, host memory, or left at the source) and every batch is gathered
where they live; rows in host memory are gathered straight into the prefetcher's pinned slots.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.data import default_collate, default_convert

from gpuload.augment import BatchAugmenter, image_column
from gpuload.cache import Store, TieredArrayStore
from gpuload.cpu_threads import give_back_cpu_threads, take_cpu_threads
from gpuload.prefetch import default_depth
from gpuload.sources import FromRows, Indices, Schedule, Setup, Source, Work
from gpuload.sources.placed_arrays import ArrayColumns, ResidentColumns, find_columns, raw_columns, same_arrays
from gpuload.transfer import batch_length

__all__ = ["ArraySource", "detect"]


def detect(setup: Setup) -> ArraySource | None:
    """An ArraySource when the dataset's batches can be gathered from its arrays, else None
    (also when a ``worker_init_fn`` asks for worker processes and no ``transforms=`` ask for
    gpuload: torch's path runs it)."""
    if not setup.map_style or setup.collate_fn not in (default_collate, default_convert):
        return None
    if setup.worker_code and not setup.transforms:
        return None
    columns = find_columns(setup.dataset, setup.collate_fn, setup.batched)
    return ArraySource(setup, columns) if columns is not None else None


class ArraySource(Source):
    """Batches gathered from in-memory arrays wherever the cache plan put them.

    With ``transforms=``, the first uint8 N,C,H,W array is transformed after each gather.
    Arrays kept on the host (``cache="off"``) stream through the prefetcher's pinned slots,
    on a CPU device too: that is what ``cache="off"`` asks for.
    """

    #: Whether ``_augmented`` completes every gathered batch from its indices (a subclass's
    #: columns gathered per batch), not only when ``transforms=`` are given.
    completes_batches = False

    def __init__(self, setup: Setup, columns: ArrayColumns) -> None:
        super().__init__(setup)
        self.columns = columns
        self.resident: ResidentColumns | None = None
        self.augment = None
        if setup.transforms:
            leaf = image_column(columns.columns)
            self.augment = BatchAugmenter(setup.transforms, setup.seed, setup.device, leaf, setup.staging)

    @property
    def _placed(self) -> ResidentColumns:
        """The arrays where the cache plan put them (``begin_epoch`` places them first)."""
        if self.resident is None:
            raise RuntimeError("the arrays are not placed: begin_epoch() comes before the epoch's batches")
        return self.resident

    def _place(self) -> bool:
        """Place the arrays where the cache plan says, once; False if they were placed already."""
        if self.resident is not None:
            return False
        setup = self.setup
        self.resident = self.columns.place(setup.device, setup.settings, setup.owner, setup.batch_sampler,
                                           setup.staging)
        self.h2d_bytes += self.resident.placed_bytes
        self.path = self.resident.path
        return True

    def begin_epoch(self) -> None:
        self._follow_dataset()
        if not self._place():
            self._placed.shrink_to_reserve(self.setup.settings)

    def warm(self, progress: bool) -> None:
        self._follow_dataset()
        self._place()

    def _follow_dataset(self) -> None:
        """Serve the arrays the dataset holds now: when they are other tensors, or have another
        shape, than those placed (``ds.tensors = ...``), the placement (and its cache) is
        dropped and rebuilt from them. Changes made in place to the same tensors are seen by
        ``cache="off"`` and a CPU device, not by a copy already in a cache."""
        now = raw_columns(self.setup.dataset)
        if now is not None and same_arrays(now, self.columns.columns):
            return
        setup = self.setup
        columns = find_columns(setup.dataset, setup.collate_fn, setup.batched)
        old = self.columns
        if columns is None or columns.spec != old.spec or [c.dtype for c in columns.columns] != [
            c.dtype for c in old.columns
        ]:
            raise ValueError(
                f"the arrays of this {type(setup.dataset).__name__} changed since the DataLoader was "
                "built, into ones gpuload cannot serve as before (another structure, dtype, or no "
                "samples); build a new gpuload.DataLoader for them"
            )
        self.close()  # the old placement and its cache hold the old arrays
        self.columns = columns

    def schedule(self, indices: Indices) -> Schedule:
        """Host rows copied each batch (``cache="off"``, or tiers that leave rows in host memory)
        run ahead (on a CPU device too: ``cache="off"`` asks for the pinned staging); arrays on
        the device are served in place."""
        sample_bytes = self.columns.nbytes // max(self.columns.num_samples, 1)
        return Schedule(lambda ahead: self._work(indices, ahead), ahead=self._placed.copies_batches,
                        ahead_on_cpu=True, depth=default_depth(sample_bytes * (self.setup.batch_size or 1)))

    def _work(self, request: Indices, ahead: bool) -> Work:
        resident, batched = self._placed, self.setup.batched
        indices = request.batches(ahead)
        if not ahead:
            return Work(indices, functools.partial(self._gather_now, resident, request))
        # The check runs once in the prefetcher's thread (the gather needs it) and once here,
        # in order, for the transforms' per-sample randomness: a bad index fails after the
        # batches before it either way.
        drawn = list(indices)
        tiered = isinstance(resident.store, TieredArrayStore)
        make = resident.request if tiered else resident.fill
        fills = (make(resident.checked_index(index), batched) for index in drawn)
        completes = self.augment is not None or self.completes_batches
        positions = (resident.checked_index(index) for index in drawn) if completes else None

        def finish(batch: Any) -> tuple[Any, int]:
            if tiered:
                batch = resident.finished(batch)
            if positions is not None:
                batch = self._augmented(batch, next(positions), request.number)
            return batch, batch_length(batch) if batched else 1

        return Work(fills, finish)

    def _gather_now(self, resident: ResidentColumns, request: Indices, index: Any) -> tuple[Any, int]:
        """The batch of ``index`` gathered from ``resident`` in the caller's thread (the loop's), and its length."""
        threads = take_cpu_threads(self.setup.device)  # batch-sized ops: the free CPUs' threads
        try:
            batch, flat, moved_bytes = resident.gather(index, self.setup.batched, request.in_range,
                                                       copy=request.copy_now)
            self.h2d_bytes += moved_bytes
            if self.augment is not None or self.completes_batches:
                batch = self._augmented(batch, flat, request.number)
            return batch, flat.numel()
        finally:
            give_back_cpu_threads(threads)

    def from_rows(self, number: int, ahead: bool) -> FromRows:
        """Each item's arrays (``(leaves, dataset indices)``) built into the batch (and
        transformed) in the loop's thread."""

        def finish(item: tuple[list[torch.Tensor], torch.Tensor]) -> tuple[Any, int]:
            leaves, flat = item
            return self._augmented(self.columns.build(leaves), flat, number), flat.numel()

        return FromRows(finish)

    def _augmented(self, batch: Any, flat: torch.Tensor, epoch: int) -> Any:
        if self.augment is None:
            return batch
        batch = self.augment(batch, flat, epoch, self.setup.batched)
        self.setup.stats.extra["transform_backend"] = self.augment.backend
        return batch

    def cache_store(self) -> Store | None:
        """The arrays' tiers (device rows go first from the end of the device tier when shrunk;
        the arrays still hold them), or this rank's share; None while nothing is placed."""
        return self.resident.store if self.resident is not None else None

    def stats(self) -> dict[str, Any]:
        store = self.resident.store if self.resident is not None else None
        if store is None:
            return {}
        return {"cache": store.stats.as_dict(), "cache_plan": store.plan.describe()}

    def close(self) -> None:
        if self.resident is not None:
            self.resident.release()
            self.resident = None
