"""A table's image columns in its batches: each decoded by the image path, cached decoded.

Each column of encoded images (``ArrowTable(..., images=[...])``, a ``datasets.Image()``
feature) gets its own :class:`ColumnImageSource`: the image source over
:class:`~gpuload.datasets.column_images.ColumnImages`, with its decoder (DALI/nvJPEG where
present, else the CPU's), its image cache (decided and booked apart from the table's arrays,
so epoch 2 decodes nothing when the images fit) and the loader's ``transforms=``. An
:class:`ImageLeaf` puts the column's batch of images into the table's batch. A bad image
raises, naming its column and row: a batch cannot skip one row of a table's columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gpuload.cache.disk_tier import DiskImages
from gpuload.datasets.column_images import ColumnImages
from gpuload.distributed.sharded_images import ShardedImages
from gpuload.sources import Setup
from gpuload.sources.images import ImageFileSource
from gpuload.sources.table_columns import Leaf
from gpuload.transfer import Staging

__all__ = ["ColumnImageSource", "ImageLeaf", "image_sources"]


class ColumnImageSource(ImageFileSource):
    """The image path over one column: cached on this rank, without a disk tier (the column has
    no files to fingerprint; the table is its own disk tier of the encoded bytes)."""

    def _open_disk(self) -> DiskImages | None:
        return None

    def _shard(self) -> ShardedImages | None:
        return None


def image_sources(setup: Setup, view_table: Any, rows: torch.Tensor | None,
                  images: dict[str, bool]) -> dict[str, ColumnImageSource]:
    """A :class:`ColumnImageSource` per image column of ``view_table`` (``rows``: each sample's
    table row; ``images``: column -> RGB only). Raises for what a table's image columns cannot
    honour: ``on_error="skip"`` (a row cannot be left out of the other columns' batch) and
    ``transforms=`` with several image columns (which one would they apply to)."""
    if setup.on_error == "skip":
        raise ValueError(
            f"on_error='skip' cannot skip an image of a table's column ({', '.join(images)}): the batch's other "
            "columns hold that row; filter the bad rows out of the dataset, or leave on_error='raise'"
        )
    if setup.transforms and len(images) > 1:
        raise ValueError(f"transforms= apply to one image column; this table has {len(images)}: "
                         f"{', '.join(images)}; select one with the dataset's columns")
    sources = {}
    for name, rgb_only in images.items():
        column = ColumnImages(name, view_table.column(name), rows, rgb_only)
        # its own cache owner: the image cache's budget then counts the arrays' device bytes
        own = dataclasses.replace(setup, dataset=column, owner=f"{setup.owner}/images:{name}", batch_sampler=None)
        sources[name] = ColumnImageSource(own, column)
    return sources


@dataclass
class ImageLeaf(Leaf):
    """An image column of the batch: its images decoded (from the image cache once there) and
    transformed, or stacked as torch's collate stacks them."""

    source: ColumnImageSource

    def batch(self, fixed: list[torch.Tensor], flat: torch.Tensor, device: torch.device, epoch: int | None,
              staging: Staging | None) -> Any:
        if epoch is None:  # the check against torch's samples: the whole images as decoded
            whole = self.source._decode_whole(flat.tolist())
            if whole.bad:
                raise self.source._failure(whole.bad)
            return torch.stack(whole.images)
        decoded = self.source.decode(flat, epoch)
        extra = self.source.setup.stats.extra
        extra.update(decoded.counters)
        if self.source.augment is not None:
            extra["transform_backend"] = self.source.augment.backend
        return self.source.batch_images(decoded)
