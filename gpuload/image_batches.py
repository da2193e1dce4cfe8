"""Batches from image files: read encoded bytes, decode the batch at once, transform on device.

When the transform list starts with a crop, each sample's crop box is drawn from the image
size in the file's header before decoding, and only that window is decoded (DALI decodes just
the window; torchvision/PIL decode and crop); the result equals decoding the whole image.

With an image cache (``gpuload.image_cache``), a cached decoded image is neither read nor
decoded, and cached encoded bytes are not read again; while the decoded cache fills, its images
are decoded whole (the cache keeps the image, not one epoch's crop of it).

Used by the loader for gpuload's image sources (``gpuload.datasets.ImageFolder``,
``ImageList``, or a torchvision ImageFolder) with torch's default collation: the batch has the
structure default_collate gives ``(image, label)`` samples, ``[images, labels]``, with the
images decoded by DALI (nvJPEG on a GPU, its CPU decoder otherwise) or PIL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpuload.augment import BatchAugmenter
from gpuload.datasets.images import ImageSource
from gpuload.decode import BatchDecoder, peek_size
from gpuload.image_cache import ImageCache
from gpuload.transforms.windows import Window

__all__ = ["ImageBatches", "DecodedBatch"]


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


class ImageBatches:
    """Turns a batch of dataset indices into a device batch of decoded (and transformed) images."""

    def __init__(
        self,
        source: ImageSource,
        device: torch.device,
        max_batch: int,
        augment: BatchAugmenter | None,
        on_error: str,
    ) -> None:
        self.source = source
        self.device = device
        self.augment = augment
        self.on_error = on_error
        self.decoder = BatchDecoder(device, max_batch=max_batch)
        self.skipped: list[tuple[int, str, str]] = []
        self.fallback_decoded = 0
        self.roi = "none"  # how the last batch's decode windows were honoured (DecodeResult.roi)
        self.cache: ImageCache | None = None

    @property
    def backend(self) -> str:
        return self.decoder.backend

    def batch(self, indices: Any, batched: bool, epoch: int) -> tuple[Any, int]:
        """The batch for ``indices`` and its sample count; (None, 0) if every file was skipped."""
        batch, count, _ = self.finish(self.decode(indices, epoch), batched)
        return batch, count

    def _read(self, position: int) -> bytes | None:
        """The file's bytes (from the encoded cache when it has them); None if skipped."""
        cache = self.cache
        if cache is not None and cache.decodes:
            data = cache.get(position)
            if data is not None:
                return data
        try:
            data, _ = self.source.read_encoded(position)
        except Exception as error:  # unreadable file: ImageDecodeError names it
            if self.on_error != "skip":
                raise
            self.skipped.append((position, self.source.path(position), str(error)))
            return None
        if cache is not None and cache.decodes:
            cache.keep(position, data)
        return data

    def decode(self, indices: Any, epoch: int) -> DecodedBatch:
        """Read and decode the files of ``indices`` (only the transforms' windows, if any)."""
        flat = torch.as_tensor(indices, dtype=torch.long).view(-1)
        positions = [int(i) % len(self.source) for i in flat.tolist()]
        cache = self.cache
        keeps_decoded = cache is not None and not cache.decodes
        hits: dict[int, torch.Tensor] = {}  # batch slot -> cached decoded image
        encoded, names, readable, slots = [], [], [], []
        for slot, position in enumerate(positions):
            image = cache.get(position) if keeps_decoded else None
            if image is not None:
                hits[slot] = image
                continue
            data = self._read(position)
            if data is None:
                continue
            encoded.append(data)
            names.append(self.source.path(position))
            readable.append(position)
            slots.append(slot)
        filling = keeps_decoded and cache.accepting
        sizes, windows = (None, None) if filling else self._windows(encoded, readable, epoch)
        decoded: dict[int, tuple[torch.Tensor, Window | None, tuple[int, int] | None]] = {}
        if encoded:
            result = self.decoder.decode(encoded, names, readable, rois=windows, on_error=self.on_error)
            self.skipped.extend(result.skipped)
            self.fallback_decoded += result.fallback_decoded
            self.roi = result.roi
            for k, image in zip(result.kept_positions, result.images):
                if filling:
                    cache.keep(readable[k], image)
                window = None if windows is None else windows[k]
                decoded[slots[k]] = (image, window, None if sizes is None else sizes[k])
        order = sorted([*hits, *decoded])
        images, kept_windows, kept_sizes = [], [], []
        for slot in order:
            image, window, size = (hits[slot], None, None) if slot in hits else decoded[slot]
            if window is None:  # a whole image is the window (0, 0, H, W) of itself
                size = (image.shape[-2], image.shape[-1])
                window = (0, 0, *size)
            images.append(image)
            kept_windows.append(window)
            kept_sizes.append(size)
        any_window = windows is not None
        return DecodedBatch(
            images=images,
            positions=[positions[slot] for slot in order],
            labels=[self.source.label(positions[slot]) for slot in order],
            epoch=epoch,
            windows=kept_windows if any_window else None,
            sizes=kept_sizes if any_window else None,
            counters={
                "decode_backend": self.backend,
                "skipped": len(self.skipped),
                "fallback_decoded": self.fallback_decoded,
                "roi": self.roi,
            },
        )

    def warm(self, progress: bool, batch_size: int) -> int:
        """Fill the image cache in one pass over the files not cached yet; returns how many."""
        from tqdm import tqdm

        cache = self.cache
        if cache is None or not cache.accepting:
            return 0
        todo = [i for i in range(len(self.source)) if i not in cache.store]
        done = 0
        with tqdm(total=len(todo), unit="image", desc="gpuload warm", disable=not progress) as bar:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                if cache.decodes:
                    for position in chunk:
                        self._read(position)
                else:
                    self.decode(chunk, epoch=0)  # decodes whole while the cache accepts
                done += len(chunk)
                bar.update(len(chunk))
                if not cache.accepting:
                    break
        return done

    def finish(self, decoded: DecodedBatch, batched: bool) -> tuple[Any, int, dict[str, Any]]:
        """Transform and collate a decoded batch: (batch, sample count, counters as of it);
        the batch is None and the count 0 when every file was skipped."""
        counters = dict(decoded.counters)
        kept, kept_labels = decoded.positions, decoded.labels
        if not kept:
            return None, 0, counters
        if self.augment is not None:
            images = self.augment.apply_list(
                decoded.images, torch.tensor(kept), decoded.epoch, decoded.windows, decoded.sizes
            )
            counters["transform_backend"] = self.augment.backend
        elif batched:
            images = torch.stack(decoded.images)  # differing sizes fail as in torch's collate
        else:
            images = decoded.images[0]
            if self.cache is not None and not self.cache.decodes:
                images = images.clone()  # the loop may change it in place; the cache keeps its own
        if not batched:
            return [images[0] if self.augment is not None else images, kept_labels[0]], 1, counters
        labels = torch.tensor(kept_labels, dtype=torch.int64, device=self.device)
        return [images, labels], len(kept), counters

    def _windows(
        self, encoded: list[bytes], positions: list[int], epoch: int
    ) -> tuple[list[tuple[int, int] | None] | None, list[Window | None] | None]:
        """Upright sizes from the headers and the windows the transforms read, when the list
        starts with a crop (else None, None). An unreadable header gets no window; the
        decoder reports it as a bad file."""
        if self.augment is None or not self.augment.reads_windows or not encoded:
            return None, None
        sizes: list[tuple[int, int] | None] = []
        for data in encoded:
            try:
                sizes.append(peek_size(data))
            except Exception:
                sizes.append(None)
        known = [k for k, size in enumerate(sizes) if size is not None]
        drawn = self.augment.windows(torch.tensor([positions[k] for k in known]), [sizes[k] for k in known], epoch)
        windows: list[Window | None] = [None] * len(encoded)
        for k, window in zip(known, drawn):
            windows[k] = window
        return sizes, windows
