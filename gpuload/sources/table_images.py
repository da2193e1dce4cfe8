"""A table's image columns in its batches: each decoded by the image path, cached decoded.

Each column of encoded images (``ArrowTable(..., images=[...])``, a ``datasets.Image()``
feature) gets its own :class:`ColumnImageSource`: the image source over
:class:`~gpuload.datasets.column_images.ColumnImages`, with its decoder (DALI/nvJPEG where
present, else the CPU's), its image cache (decided and booked apart from the table's arrays,
so epoch 2 decodes nothing when the images fit) and the loader's ``transforms=``. An
:class:`ImageLeaf` puts the column's batch of images into the table's batch. A bad image
raises, naming its column and row: a batch cannot skip one row of a table's columns.

With ``cache_dir=``, the decoded images also go to the disk tier, as an image folder's do, keyed
by :func:`column_fingerprint`: the files the table was read from (or ``datasets``' fingerprint,
or, for a table made in memory, the column's bytes), the column, the samples' rows, and the
files of rows that only name a path; a later job's first epoch reads them back instead of
decoding. The table itself is the disk tier of the encoded bytes.

When ``cache_scope`` splits the table's arrays over the ranks, its image columns follow the
same partition: each rank reads and decodes its block of each column once (through the disk
tier, which the ranks then fill between them, each its share), holds it as a
:class:`ColumnShare`, and the arrays' exchange carries the images beside the array rows
(:func:`~gpuload.distributed.joined_rows.joined`: one exchange per batch); the transforms then
run on the receiving rank, as on the unsplit path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuload.cache import format_bytes
from gpuload.cache.disk import Fingerprint
from gpuload.cache.disk.fingerprint import canonical
from gpuload.cache.disk_tier import DiskImages
from gpuload.cache.identity import file_identity, hash_array
from gpuload.datasets.arrow import import_optional
from gpuload.datasets.column_images import ColumnImages
from gpuload.device import device_memory, host_memory
from gpuload.distributed.group import current_context
from gpuload.distributed.image_shares import DecodedShare, ExchangedImages, ImageRows, SplitImages, read_share
from gpuload.distributed.split_store import SplitStore
from gpuload.sources import Setup
from gpuload.sources.image_decoding import DecodedBatch
from gpuload.sources.images import ImageFileSource
from gpuload.sources.table_columns import Leaf, TableView
from gpuload.transfer import Staging

__all__ = ["ColumnImageSource", "ColumnShare", "ImageLeaf", "column_fingerprint", "image_sources"]


class ColumnShare(SplitImages):
    """This rank's share of an image column of a table split over ranks (``share``, its images'
    travel: ``rows``), split by the plan of ``store``, the table's arrays split over ranks; the
    exchange that carries it is the arrays' (:func:`~gpuload.distributed.joined_rows.joined`)."""

    def __init__(self, store: SplitStore, share: DecodedShare, rows: ImageRows) -> None:
        super().__init__(store)
        self.share, self.rows = share, rows

    def describe(self) -> str:
        plan = self.store.plan
        return f"{plan.kind}: {plan.describe()}; decoded here: {format_bytes(self.share.nbytes)}"

    def summary(self) -> dict[str, Any]:
        plan, share = self.store.plan, self.share
        start, stop = plan.partition.rows_of(plan.rank)
        return {"kind": "images", "mode": "decoded", "scope": plan.decision.scope,
                "entries": share.stats.device_samples, "bytes": share.nbytes, "rows": [start, stop],
                "num_samples": plan.partition.num_samples, "bad_files": len(self.rows.bad),
                "read_s": share.read_s, "complete": not share.closed}

    def close(self) -> dict[str, Any]:
        """Drop the share (the table's exchange, closed with its arrays, drops it too)."""
        self.share.close()
        return dict(self.summary(), released=True)


class ColumnImageSource(ImageFileSource):
    """The image path over one column (``images``), cached on this rank; its disk tier keyed by
    the table's ``origin`` (:class:`~gpuload.sources.table_columns.TableView`)."""

    def __init__(self, setup: Setup, images: ColumnImages, origin: dict[str, Any] | None = None) -> None:
        super().__init__(setup, images)
        self.column, self.origin = images, origin
        self.split: SplitStore | None = None  # the table's arrays split over ranks: the images follow
        self.arrived: ExchangedImages | None = None  # the batch's images the exchange brought

    def _open_disk(self) -> DiskImages | None:
        decoder = self.reader.decoder
        decode = {"backend": decoder.backend, "channels_last": decoder.channels_last}
        key = self.setup.settings.disk_key
        return DiskImages.open(self.images, self.setup.settings, decode,
                               identify=lambda shaped: column_fingerprint(self.column, self.origin, shaped, key))

    def follow(self, split: SplitStore) -> ColumnShare | None:
        """Decide this column's cache under the table's arrays split over ranks (``split``): this
        rank's share of its images, read and decoded now (every rank at the same point), or None
        when a rank's share does not fit or could not be read (each rank then keeps its own image
        cache; all ranks warn when a split was asked for)."""
        self.split = split
        self._decide_cache()
        return self.held if isinstance(self.held, ColumnShare) else None

    def _split(self) -> SplitImages | None:
        split, setup = self.split, self.setup
        context = current_context() if split is not None else None
        if split is None or context is None:
            return None
        device, settings = setup.device, setup.settings
        limit = (settings.device_room(device, device_memory(device), setup.owner) if device.type == "cuda"
                 else settings.host_room(host_memory()))
        found = read_share(split.plan, context, split.control, settings, device, limit=limit,
                           read=self.reader.read_whole, chunk_size=setup.batch_size or 1, on_error="raise",
                           name=self.images.path,
                           failure=self.reader.failure, owner=setup.owner)
        if found is None:
            return None
        held = ColumnShare(split, *found)
        setup.stats.extra["image_cache_decision"] = held.describe()
        return held

    def decoded(self, flat: torch.Tensor, epoch: int) -> DecodedBatch:
        """The images of samples ``flat``: those the table's exchange brought, else decoded here."""
        arrived, self.arrived = self.arrived, None
        if arrived is None:
            return self.reader.decode(flat, epoch)
        if arrived.positions != flat.tolist():
            raise RuntimeError(f"the exchange brought the images of samples {arrived.positions[:4]}... for a batch "
                               f"of samples {flat.tolist()[:4]}...")
        return self._gathered(arrived, epoch)

    def close(self) -> None:
        super().close()
        self.split = None


def column_fingerprint(images: ColumnImages, origin: dict[str, Any] | None, settings: dict[str, Any],
                       key: str | None = None) -> Fingerprint:
    """What produced a column's decoded images: the column, its samples' rows and ``settings``
    (what shapes the pixels), with ``key`` (``cache_key=``) or else the table's ``origin`` (its
    files' identities: size, mtime, ctime, inode; ``datasets``' fingerprint), the column's bytes
    when the table has no origin (made in memory: hashed, about a second per GB), and the
    identity of every file a row names by path only."""
    hasher = hashlib.blake2b(digest_size=16)
    parts: dict[str, Any] = {"class": "ColumnImages", "column": images.column, "length": len(images),
                             "rgb_only": images.rgb_only, "settings": settings}
    if key is not None:
        parts["key"] = key
    else:
        parts["origin"] = None if origin is None else dict(origin, files=_identified(origin.get("files", [])))
        parts["linked"] = _identified(_linked_files(images.array))
        if origin is None:
            for chunk in images.array.chunks:
                _hash_values(hasher, chunk)
    hasher.update(canonical(parts))
    if images.rows is not None:
        hash_array(hasher, images.rows)
    return Fingerprint.of("images", f"column {images.column!r} ({len(images)} images)", hasher)


def _identified(paths: list[str]) -> list[list[Any]]:
    identified = []
    for path in paths:
        try:
            identity: list[Any] = file_identity(path)
        except OSError as error:
            identity = [f"unreadable: {error.strerror}"]
        identified.append([os.path.abspath(path), *identity])
    return identified


def _linked_files(array: Any) -> list[str]:
    """The distinct paths of a ``datasets.Image()`` column's rows that hold no bytes (read from
    those files), in order."""
    pa = import_optional("pyarrow")
    pc = import_optional("pyarrow.compute")
    if not pa.types.is_struct(array.type):
        return []
    names = [field.name for field in array.type]
    paths: dict[str, None] = {}
    for chunk in array.chunks:
        fields = dict(zip(names, chunk.flatten()))
        only_path = pc.and_(pc.is_null(fields["bytes"]), pc.is_valid(fields["path"]))
        paths.update(dict.fromkeys(fields["path"].filter(only_path).to_pylist()))
    return list(paths)


def _hash_values(hasher: Any, chunk: Any) -> None:
    """Feed a chunk of binary (or a struct of binary and string) values to ``hasher``: each row's
    validity, length and bytes, wherever the chunk's slice of its buffers starts."""
    pa = import_optional("pyarrow")
    hash_array(hasher, chunk.is_valid().to_numpy(zero_copy_only=False))
    if pa.types.is_struct(chunk.type):
        for field in chunk.flatten():
            _hash_values(hasher, field)
        return
    _, offsets_buffer, data = chunk.buffers()
    wide = pa.types.is_large_binary(chunk.type) or pa.types.is_large_string(chunk.type)
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64 if wide else np.int32)[chunk.offset:][: len(chunk) + 1]
    hash_array(hasher, offsets - offsets[0])
    if data is not None:
        hasher.update(memoryview(data)[int(offsets[0]):int(offsets[-1])])


def image_sources(setup: Setup, view: TableView) -> dict[str, ColumnImageSource]:
    """A :class:`ColumnImageSource` per image column of ``view`` (its table, each sample's row,
    each column with whether it must be RGB, the table's origin). Raises for what a table's
    image columns cannot honour: ``on_error="skip"`` (a row cannot be left out of the other
    columns' batch) and ``transforms=`` with several image columns (which one would they apply to)."""
    images = view.images
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
        column = ColumnImages(name, view.table.column(name), view.rows, rgb_only)
        # its own cache owner: the image cache's budget then counts the arrays' device bytes
        own = dataclasses.replace(setup, dataset=column, owner=f"{setup.owner}/images:{name}", batch_sampler=None)
        sources[name] = ColumnImageSource(own, column, view.origin)
    return sources


@dataclass
class ImageLeaf(Leaf):
    """An image column of the batch: its images decoded (from the image cache once there) and
    transformed, or stacked as torch's collate stacks them."""

    source: ColumnImageSource

    def batch(self, fixed: list[torch.Tensor], flat: torch.Tensor, device: torch.device, epoch: int | None,
              staging: Staging | None) -> Any:
        if epoch is None:  # the check against torch's samples: the whole images as decoded
            whole = self.source.reader.decode_whole(flat.tolist())
            if whole.bad:
                raise self.source.reader.failure(whole.bad)
            return torch.stack(whole.images)
        decoded = self.source.decoded(flat, epoch)
        extra = self.source.setup.stats.extra
        extra.update(decoded.counters)
        if self.source.augment is not None:
            extra["transform_backend"] = self.source.augment.backend
        return self.source.batch_images(decoded)
