"""Arrow tables (``ArrowTable``, ``Parquet``) and Hugging Face ``datasets.Dataset``: columns, not rows.

``detect`` recognises them (a ``datasets.Dataset`` only when ``datasets`` is already imported:
gpuload never imports it) and ``table_columns`` splits the table: fixed-width columns go to
the array tiers whole (this source is an :class:`ArraySource` over them, so placement, tiers,
ranks and resume are the arrays'), and each gathered batch is completed with the columns
gathered per batch. A ``datasets.Dataset``'s index mapping (``select``, ``shuffle``,
``filter``) is followed when rows are read (each sample's table row, in the file's chunks).

A table's image columns are decoded by the image path (``table_images``), a batch's images ahead
of the loop in the prefetcher's thread as an image folder's are. Split over ranks
(``cache_scope``, decided on a row's array and decoded image bytes together), the arrays' share
and exchange are the arrays' as well, and each image column follows their partition
(:meth:`ColumnImageSource.follow`): the exchange of a batch carries its array rows and its
decoded images together.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from torch.utils.data import default_collate

from gpuload.datasets.arrow import ArrowTable, hugging_face_dataset
from gpuload.distributed.joined_rows import joined
from gpuload.distributed.split_store import SplitStore
from gpuload.sources import FromRows, Indices, Schedule, Setup, Work
from gpuload.sources.arrays import ArraySource
from gpuload.sources.table_columns import TableColumns, TableView, table_columns
from gpuload.sources.table_images import (
    AheadImages,
    ColumnImageSource,
    ImageLeaf,
    decoded_bytes_per_row,
    image_sources,
)

__all__ = ["ArrowSource", "detect", "table_view"]

# datasets' formats whose samples gpuload reproduces (None: Python values).
_FORMATS = {None: "python", "numpy": "numpy", "torch": "torch"}


def _hugging_face_view(dataset: Any) -> TableView | None:
    if not hugging_face_dataset(dataset):
        return None
    if type(dataset).__getitem__ is not sys.modules["datasets"].Dataset.__getitem__:
        return None
    format = dataset.format
    if format["type"] not in _FORMATS or format["format_kwargs"] or format["output_all_columns"]:
        return None
    indices = dataset._indices
    rows = None if indices is None else torch.from_numpy(
        indices.column(0).to_numpy().astype("int64"))
    origin = {"datasets": dataset._fingerprint, "files": [file["filename"] for file in dataset.cache_files]}
    return TableView(dataset.data.table, rows, _FORMATS[format["type"]], _image_features(dataset), origin)


def _image_features(dataset: Any) -> dict[str, bool]:
    """A ``datasets.Dataset``'s decoded ``Image()`` columns that gpuload's decoders can give as
    ``datasets`` does (the image's own mode, or the feature's ``mode``: format ``"torch"`` a uint8
    (C, H, W) tensor, ``"numpy"`` an (H, W, C) array, None a PIL image), each with whether its
    images must be RGB (no ``mode``: gpuload's decoders give RGB)."""
    image, served = sys.modules["datasets"].Image, dataset.format["columns"]
    return {name: feature.mode is None for name, feature in dataset.features.items()
            if isinstance(feature, image) and feature.decode and feature.mode in (None, "RGB")
            and (served is None or name in served)}


def table_view(dataset: Any) -> TableView | None:
    """The Arrow table behind ``dataset`` and how its samples read it, or None for other datasets."""
    if isinstance(dataset, ArrowTable) and type(dataset).__getitem__ is ArrowTable.__getitem__:
        return TableView(dataset.table, None, "arrow", dict.fromkeys(dataset.images, False),
                         {"files": dataset.files} if dataset.files else None)
    return _hugging_face_view(dataset)


def _identity(dataset: Any) -> Any:
    """What changes when a dataset's samples may change (``set_format`` changes one in place)."""
    if isinstance(dataset, ArrowTable):
        return id(dataset.table)
    return dataset._fingerprint, repr(dataset.format), id(dataset.data), id(dataset._indices)


def detect(setup: Setup) -> ArrowSource | None:
    """An ArrowSource for a table whose batches gpuload can make column by column with torch's
    default collate, else None (torch's path: also without auto-collation, with a
    ``worker_init_fn``, or with ``transforms=`` and no image column)."""
    if not setup.map_style or setup.collate_fn is not default_collate or not setup.batched:
        return None
    if setup.worker_code:
        return None
    view = table_view(setup.dataset)
    if view is None or len(setup.dataset) == 0 or (setup.transforms and not view.images):
        return None
    if view.format == "python" and view.images and not setup.transforms:
        return None  # PIL images: torch's collate has no batch of them, and raises its TypeError
    images = image_sources(setup, view) if view.images else {}
    hwc = view.format == "numpy"  # datasets gives (H, W, C) arrays
    columns = table_columns(setup.dataset, view, lambda name: ImageLeaf(images[name], hwc))
    if columns is None:
        for source in images.values():
            source.close()
        return None
    return ArrowSource(setup, columns, images)


class ArrowSource(ArraySource):
    """Batches of a table: its fixed-width columns gathered where the cache plan put them, the
    variable-length and text columns gathered per batch beside them, its image columns decoded
    by the image path (``images``: one source per column, with its own image cache)."""

    completes_batches = True

    def __init__(self, setup: Setup, table: TableColumns, images: dict[str, ColumnImageSource] | None = None) -> None:
        images = images or {}
        # the image columns split with the arrays: the ranks decide the split on both's bytes
        arrays = dataclasses.replace(table.arrays, split_beside=(lambda: decoded_bytes_per_row(images)) if images
                                     else None)
        super().__init__(dataclasses.replace(setup, transforms=None), arrays)  # transforms: the images'
        self.table = table
        self.images = images
        self.identity = _identity(setup.dataset)
        self.carried: list[str] = []  # the image columns the arrays' exchange carries, in its order

    def _place(self) -> bool:
        """Place the arrays; when they are split over ranks, split the image columns with them."""
        if not super()._place():
            return False
        store = self._placed.store
        if isinstance(store, SplitStore) and self.images:
            shares = {name: share for name, source in self.images.items()
                      if (share := source.follow(store)) is not None}
            if shares:
                self._placed.store = joined(store, [(s.share, s.rows, s.share.nbytes) for s in shares.values()])
                self.carried = list(shares)
        return True

    def schedule(self, indices: Indices) -> Schedule:
        """The arrays' schedule; with image columns, their images are read and decoded ahead of
        the loop, in the prefetcher's thread, as an image folder's are (on a GPU transformed
        there too, on its side stream; on a CPU device only when ``prefetch_depth`` asks), and
        the arrays gathered where they lie, in the loop's thread."""
        if not self.images:
            return super().schedule(indices)
        return Schedule(lambda ahead: self._work_with_images(indices, ahead), staged=False)

    def _work_with_images(self, request: Indices, ahead: bool) -> Work:
        if not ahead:
            return self._work(request, False)
        number = request.number

        def made(index: Any) -> tuple[Any, list[torch.Tensor | None], list[AheadImages]]:  # the prefetcher's thread
            flat = self._placed.checked_index(index)
            images = [source.made_ahead(flat, number) for source in self.images.values()]
            # the batches made on the device stand in the item itself: the prefetcher orders and
            # protects the item's tensors on the loop's stream
            return index, [ready.images for ready in images], images

        def finish(item: tuple[Any, list[torch.Tensor | None], list[AheadImages]]) -> tuple[Any, int]:
            index, _, images = item
            for source, ready in zip(self.images.values(), images):
                source.ready = ready
            try:
                return self._gather_now(self._placed, request, index)
            finally:
                for source in self.images.values():
                    source.ready = None

        return Work((made(index) for index in request.batches(True)), finish)

    def from_rows(self, number: int, ahead: bool) -> FromRows:
        """Batches from an exchange's items: the arrays' rows, and each carried image column's images."""
        if not self.carried:
            return super().from_rows(number, ahead)

        def finish(items: list[Any]) -> tuple[Any, int]:
            (leaves, flat), *arrived = items
            for name, images in zip(self.carried, arrived):
                self.images[name].arrived = images
            try:
                return self._augmented(self.columns.build(leaves), flat, number), flat.numel()
            finally:
                for name in self.carried:
                    self.images[name].arrived = None

        return FromRows(finish)

    def begin_epoch(self) -> None:
        super().begin_epoch()
        for source in self.images.values():
            source.begin_epoch()

    def warm(self, progress: bool) -> None:
        super().warm(progress)
        for source in self.images.values():
            source.warm(progress)

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        if self.images:
            stats["image_columns"] = {name: source.stats() for name, source in self.images.items()}
        return stats

    def close(self) -> None:
        super().close()
        self.carried = []
        for source in self.images.values():
            source.close()

    def _follow_dataset(self) -> None:
        if _identity(self.setup.dataset) != self.identity:
            raise ValueError(
                f"this {type(self.setup.dataset).__name__} changed since the DataLoader was built (its table, "
                "index mapping or format); build a new gpuload.DataLoader for it"
            )

    def _augmented(self, batch: Any, flat: torch.Tensor, epoch: int) -> Any:
        return self.table.batch(batch, flat, self.setup.device, epoch, self.setup.staging)
