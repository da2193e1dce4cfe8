"""The reading and decoding half of the image source: files read (from the encoded cache when it
has them), headers read once per dataset, the transforms' windows drawn from them, a batch
decoded at once (only the windows, when the list starts with a crop), bad files skipped or
named, and the counters that say what ran. A batch's decoded images are read through one chain
of keyed tiers (:func:`~gpuload.cache.chain.read_through`): the decoded-image cache, the disk
tier, then the files (:class:`ImageRows` their answers); what a lower tier gives whole is kept
above it.

:class:`~gpuload.sources.images.ImageFileSource` holds one :class:`ImageReader`, built with the
files (their paths and labels), the decoder, the transforms (which windows they read) and the
device route, and told the cache tiers to read through (:meth:`ImageReader.use`) whenever the
source decides them; the reader keeps the decode counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

import torch

from gpuload.cache.chain import NOTHING, KeyedTier, Lookup, read_through
from gpuload.decode import Header, HeaderTable, ImageDecodeError
from gpuload.distributed.image_shares import BadFile, WholeImages
from gpuload.sampling import in_range
from gpuload.timeline import gather_stage, stage
from gpuload.transfer import to_device
from gpuload.transforms.windows import Window

if TYPE_CHECKING:
    from gpuload.augment import BatchAugmenter
    from gpuload.cache import SampleStore
    from gpuload.cache.disk_tier import DiskImages
    from gpuload.datasets.images import ImageFiles
    from gpuload.decode import BatchDecoder
    from gpuload.transfer import Staging

__all__ = ["DecodedBatch", "ImageReader", "ImageRows"]

# Distinct skipped files kept with their reasons in ``stats.extra["skipped_files"]``; the
# counts go on past it (a folder of bad files must not grow memory each epoch).
_KEEP_SKIPPED = 100

@dataclass
class DecodedBatch:
    """A batch after decoding, before the transforms: the kept samples' images (whole, or
    their ``windows`` of images of ``sizes``), dataset positions and labels, and the decode
    counters as they stood after it (for ``stats.extra``)."""

    images: list[torch.Tensor]
    positions: list[int]
    labels: list[int]
    epoch: int
    windows: list[Window] | None
    sizes: list[tuple[int, int]] | None
    counters: dict[str, Any]


class ImageReader:
    """Reading and decoding image files a batch at once (see the module docstring): the files of
    ``images``, decoded by ``decoder``, only the windows ``augment`` reads when it starts with a
    crop; a bad file raised or skipped as ``on_error`` says; images read from the disk tier go
    to ``device`` through ``staging``."""

    def __init__(self, images: ImageFiles, decoder: BatchDecoder, augment: BatchAugmenter | None, *,
                 device: torch.device, staging: Staging | None, on_error: str) -> None:
        self.images = images
        self.decoder = decoder
        self.augment = augment
        self.device, self.staging, self.on_error = device, staging, on_error
        self.headers = HeaderTable(len(images))  # each file's header read once, not per batch
        # The tiers read through (see ``use``): none until the source decides its cache.
        self.cache: SampleStore | None = None
        self.keeps = ""
        self.disk: DiskImages | None = None
        self.skipped = 0  # files skipped over the loader's life (one file once per epoch)
        self.skipped_files: dict[int, tuple[str, str]] = {}  # position -> (file, reason), bounded
        self._skipped_in_epoch = (-1, 0)  # (epoch number, files skipped in it)
        self.fallback_decoded = 0
        self.cpu_decoded = 0  # non-JPEG files the GPU's nvjpeg backend left to the CPU
        self.roi = "none"  # how the last batch's decode windows were honoured (DecodeResult.roi)

    def use(self, cache: SampleStore | None, keeps: str, disk: DiskImages | None) -> None:
        """Read through (and fill) ``cache``, which keeps ``"decoded"`` images or ``"encoded"``
        bytes, then ``disk``'s decoded images, before the files (None: no such tier)."""
        self.cache, self.keeps, self.disk = cache, keeps, disk

    def counters(self, epoch: int) -> dict[str, Any]:
        """The decode counters as they stand, for ``stats.extra`` (skipped files in ``epoch``)."""
        return {"decode_backend": self.decoder.backend, **self._skipped_counters(epoch),
                "fallback_decoded": self.fallback_decoded, "cpu_decoded": self.cpu_decoded, "roi": self.roi}

    def note_skipped(self, entries: list[tuple[int, str, str]], epoch: int) -> None:
        """Count skipped files, in total and in ``epoch``; keep the first distinct ones named."""
        number, count = self._skipped_in_epoch
        self._skipped_in_epoch = (epoch, (count if number == epoch else 0) + len(entries))
        self.skipped += len(entries)
        for position, path, reason in entries:
            if position in self.skipped_files or len(self.skipped_files) < _KEEP_SKIPPED:
                self.skipped_files[position] = (path, reason)

    def _skipped_counters(self, epoch: int) -> dict[str, int]:
        number, count = self._skipped_in_epoch
        return {"skipped": self.skipped, "skipped_epoch": count if number == epoch else 0}

    def read_whole(self, positions: list[int]) -> WholeImages:
        """The images of ``positions`` whole, bad files listed (not raised): a share's block,
        read before its first epoch from the disk tier where it has them (on this source's
        device), the others read and decoded (and written to the disk tier)."""
        stored_at: list[int] = []
        stored: list[torch.Tensor] = []
        if self.disk is not None and positions:
            tier = _DiskImagesTier(self.disk, self.device, self.staging)
            found, _ = tier.lookup(torch.tensor(positions, dtype=torch.int64))
            if found is not None:
                at, rows = found
                stored_at, stored = list(range(len(positions))) if at is None else at.tolist(), rows.images
        on_disk = set(stored_at)
        decoded = self.decode_whole([p for slot, p in enumerate(positions) if slot not in on_disk])
        if self.disk is not None and self.disk.accepting:
            self.disk.write(decoded.positions, decoded.images)
        return WholeImages([positions[slot] for slot in stored_at] + decoded.positions, stored + decoded.images,
                           decoded.bad)

    def decode_whole(self, positions: list[int]) -> WholeImages:
        """The files of ``positions`` read and decoded whole, bad ones listed."""
        if not positions:
            return WholeImages([], [], [])
        encoded, readable, bad = [], [], []
        for position in positions:
            try:
                data, _ = self.images.read_encoded(position)
            except ImageDecodeError as error:
                bad.append((position, "read", error.reason))
                continue
            encoded.append(data)
            readable.append(position)
        result = self.decoder.decode(encoded, self.images.paths(readable), readable,
                                     on_error="skip", headers=self._headers(encoded, readable))
        self.fallback_decoded += result.fallback_decoded
        self.cpu_decoded += result.cpu_decoded
        bad += [(position, result.backend, reason) for position, _, reason in result.skipped]
        return WholeImages([readable[k] for k in result.kept_positions], result.images, bad)

    def skip_reason(self, position: int, backend: str, reason: str) -> str:
        """What the unsplit path lists for a skipped file: a read error's whole message."""
        if backend != "read":
            return reason
        return str(ImageDecodeError(position, self.images.path(position), "read", reason))

    def failure(self, bad: list[BadFile]) -> ImageDecodeError:
        """The error the unsplit path raises for a batch holding ``bad`` (in batch order): the
        first unreadable file, else the first that did not decode, with the others counted."""
        unreadable = [entry for entry in bad if entry[1] == "read"]
        if unreadable:
            position, _, reason = unreadable[0]
            return ImageDecodeError(position, self.images.path(position), "read", reason)
        position, backend, reason = bad[0]
        return ImageDecodeError(position, self.images.path(position), backend, reason, len(bad) - 1)

    def read(self, positions: list[int], epoch: int) -> list[bytes | None]:
        """The files' bytes (from the encoded cache when it has them); None for a file skipped.
        One ``read`` stage for the batch's files (none when the cache had them all)."""
        cache = self.cache if self.keeps == "encoded" else None
        files: list[bytes | None] = [None] * len(positions) if cache is None else [cache.get(p) for p in positions]
        unread = [k for k, data in enumerate(files) if data is None]
        if not unread:
            return files
        with stage("read"):
            for k in unread:
                position = positions[k]
                try:
                    files[k], _ = self.images.read_encoded(position)
                except Exception as error:  # unreadable file: ImageDecodeError names it
                    if self.on_error != "skip":
                        raise
                    self.note_skipped([(position, self.images.path(position), str(error))], epoch)
                    continue
                if cache is not None:
                    cache.keep(position, files[k])
        return files

    def decode(self, indices: Any, epoch: int) -> DecodedBatch:
        """Read and decode the files of ``indices`` (only the transforms' windows, if any): read
        through the decoded-image cache, the disk tier, then the files (:func:`read_through`)."""
        keys = in_range(indices, len(self.images))
        positions = keys.tolist()
        memory = self.cache if self.keeps == "decoded" else None
        tiers: list[KeyedTier] = [] if memory is None else [_MemoryImages(memory)]
        if self.disk is not None:
            tiers.append(_DiskImagesTier(self.disk, self.device, self.staging))
        # While a tier takes images, they are decoded whole (a tier keeps the image, not one
        # epoch's window of it).
        filling = (memory is not None and memory.accepting) or (self.disk is not None and self.disk.accepting)
        files = _Files(self, epoch, filling)
        hits, _ = read_through(tiers, keys, files)
        slots: list[tuple[torch.Tensor, Window | None, tuple[int, int] | None] | None] = [None] * len(positions)
        for _, at, rows in hits:
            for slot, image, window, size in zip(range(len(positions)) if at is None else at.tolist(), rows.images,
                                                 rows.windows or repeat(None), rows.sizes or repeat(None)):
                slots[slot] = (image, window, size)
        order = [slot for slot, held in enumerate(slots) if held is not None]
        images, kept_windows = [], []
        kept_sizes: list[tuple[int, int]] = []
        for slot in order:
            image, window, size = slots[slot]  # type: ignore[misc]
            if window is None:  # a whole image is the window (0, 0, H, W) of itself
                size = (image.shape[-2], image.shape[-1])
                window = (0, 0, *size)
            assert size is not None  # _windows draws a window only where the header gave the size
            images.append(image)
            kept_windows.append(window)
            kept_sizes.append(size)
        any_window = files.windowed
        return DecodedBatch(
            images=images,
            positions=[positions[slot] for slot in order],
            labels=self.images.labels([positions[slot] for slot in order]),
            epoch=epoch,
            windows=kept_windows if any_window else None,
            sizes=kept_sizes if any_window else None,
            counters=self.counters(epoch),
        )

    def _headers(self, encoded: list[bytes], positions: list[int]) -> list[Header | None]:
        """Each file's header, read once per dataset (``HeaderTable``); None where unreadable
        (the decoder reads it again and reports the file)."""
        headers = self.headers.kept(positions)
        for k, header in enumerate(headers):
            if header is None:
                try:
                    headers[k] = self.headers.read(positions[k], encoded[k])
                except Exception:  # PIL raises many types for garbage
                    pass
        return headers

    def _windows(
        self, headers: list[Header | None], positions: list[int], epoch: int
    ) -> tuple[list[tuple[int, int] | None] | None, list[Window | None] | None]:
        """Upright sizes from the headers and the windows the transforms read, when the list
        starts with a crop (else None, None). An unreadable header gets no window; the
        decoder reports it as a bad file."""
        if self.augment is None or not self.augment.reads_windows or not headers:
            return None, None
        sizes = [None if header is None else header.upright for header in headers]
        known = [k for k, size in enumerate(sizes) if size is not None]
        known_sizes = [size for size in sizes if size is not None]
        drawn = self.augment.windows(torch.tensor([positions[k] for k in known]), known_sizes, epoch)
        windows: list[Window | None] = [None] * len(headers)
        for k, window in zip(known, drawn):
            windows[k] = window
        return sizes, windows


# ---------------------------------------------------------------- the decoded images' chain


@dataclass
class ImageRows:
    """Images a tier of the decoded-image chain gave: whole (``windows`` None), or the
    transforms' ``windows`` of images of ``sizes`` (decoded from the files, never kept)."""

    images: list[torch.Tensor]
    windows: list[Window | None] | None = None
    sizes: list[tuple[int, int] | None] | None = None


class _MemoryImages:
    """The decoded-image cache (a ``SampleStore`` by dataset index) as the chain's memory tier."""

    name = "memory"

    def __init__(self, cache: SampleStore) -> None:
        self.cache = cache

    def lookup(self, keys: torch.Tensor) -> Lookup:
        found, images, missing = [], [], []
        for at, position in enumerate(keys.tolist()):
            image = self.cache.get(position)
            if image is None:
                missing.append(at)
            else:
                found.append(at)
                images.append(image)
        lacking = torch.tensor(missing, dtype=torch.int64)
        if not found:
            return None, lacking
        return (None if not missing else torch.tensor(found, dtype=torch.int64), ImageRows(images)), lacking

    def keep(self, keys: torch.Tensor, values: ImageRows) -> int:
        if values.windows is not None or not self.cache.accepting:
            return 0
        return sum(self.cache.keep(position, image) for position, image in zip(keys.tolist(), values.images))


class _DiskImagesTier:
    """``cache_dir``'s disk tier of whole decoded images: those it has published, on the
    loader's device (through its staging, each image's layout kept)."""

    name = "disk"

    def __init__(self, disk: DiskImages, device: torch.device, staging: Staging | None) -> None:
        self.disk = disk
        self.device, self.staging = device, staging

    def lookup(self, keys: torch.Tensor) -> Lookup:
        positions = keys.tolist()
        present = self.disk.present(positions)
        found = [at for at, held in enumerate(present) if held]
        with stage(gather_stage("disk")):
            images = self.disk.read([positions[at] for at in found]) if found else None
        if images is None:  # none published, or a block dropped (damaged) meanwhile
            return None, torch.arange(len(positions))
        if self.device.type != "cpu":
            images = to_device(images, self.device, self.staging, keep_layout=True)
        if len(found) == len(positions):
            return (None, ImageRows(images)), NOTHING
        missing = [at for at, held in enumerate(present) if not held]
        return (torch.tensor(found, dtype=torch.int64), ImageRows(images)), torch.tensor(missing, dtype=torch.int64)

    def keep(self, keys: torch.Tensor, values: ImageRows) -> int:
        if values.windows is not None or not self.disk.accepting:
            return 0
        return self.disk.write(keys.tolist(), values.images)


class _Files:
    """The end of the chain: the image files read (from the encoded cache when it has them)
    and decoded, whole while ``filling``, else only the transforms' windows. A file skipped
    (``on_error="skip"``) is missing; ``windowed`` says whether windows were decoded."""

    name = "source"

    def __init__(self, reader: ImageReader, epoch: int, filling: bool) -> None:
        self.reader = reader
        self.epoch = epoch
        self.filling = filling
        self.windowed = False

    def lookup(self, keys: torch.Tensor) -> Lookup:
        reader, epoch = self.reader, self.epoch
        positions = keys.tolist()
        files = reader.read(positions, epoch)
        ats = [at for at, data in enumerate(files) if data is not None]  # the files not skipped
        encoded = [data for data in files if data is not None]
        readable = [positions[at] for at in ats]
        names = reader.images.paths(readable)
        with stage("decode"):
            headers = reader._headers(encoded, readable)
        sizes, windows = (None, None) if self.filling else reader._windows(headers, readable, epoch)
        self.windowed = windows is not None
        kept: list[int] = []
        rows = ImageRows([], None if windows is None else [], None if sizes is None else [])
        if encoded:
            with stage("decode"):
                result = reader.decoder.decode(
                    encoded, names, readable, rois=windows, on_error=reader.on_error, headers=headers
                )
            reader.note_skipped(result.skipped, epoch)
            reader.fallback_decoded += result.fallback_decoded
            reader.cpu_decoded += result.cpu_decoded
            reader.roi = result.roi
            for k, image in zip(result.kept_positions, result.images):
                kept.append(ats[k])
                rows.images.append(image)
                if rows.windows is not None and windows is not None:
                    rows.windows.append(windows[k])
                if rows.sizes is not None and sizes is not None:
                    rows.sizes.append(sizes[k])
        missing = torch.tensor(sorted(set(range(keys.numel())) - set(kept)), dtype=torch.int64)
        if not kept:
            return None, missing
        return (torch.tensor(kept, dtype=torch.int64), rows), missing

    def keep(self, keys: torch.Tensor, values: ImageRows) -> int:
        return 0  # the files are the source: nothing is written back
