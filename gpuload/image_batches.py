"""Batches from image files: read encoded bytes, decode the batch at once, transform on device.

When the transform list starts with a crop, each sample's crop box is drawn from the image
size in the file's header before decoding, and only that window is decoded (DALI decodes just
the window; torchvision/PIL decode and crop); the result equals decoding the whole image.

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

    @property
    def backend(self) -> str:
        return self.decoder.backend

    def batch(self, indices: Any, batched: bool, epoch: int) -> tuple[Any, int]:
        """The batch for ``indices`` and its sample count; (None, 0) if every file was skipped."""
        batch, count, _ = self.finish(self.decode(indices, epoch), batched)
        return batch, count

    def decode(self, indices: Any, epoch: int) -> DecodedBatch:
        """Read and decode the files of ``indices`` (only the transforms' windows, if any)."""
        flat = torch.as_tensor(indices, dtype=torch.long).view(-1)
        positions = [int(i) % len(self.source) for i in flat.tolist()]
        encoded, labels, names, readable = [], [], [], []
        for position in positions:
            try:
                data, label = self.source.read_encoded(position)
            except Exception as error:  # unreadable file: ImageDecodeError names it
                if self.on_error != "skip":
                    raise
                self.skipped.append((position, self.source.path(position), str(error)))
                continue
            encoded.append(data)
            labels.append(label)
            names.append(self.source.path(position))
            readable.append(position)
        sizes, windows = self._windows(encoded, readable, epoch)
        result = self.decoder.decode(encoded, names, readable, rois=windows, on_error=self.on_error)
        self.skipped.extend(result.skipped)
        self.fallback_decoded += result.fallback_decoded
        self.roi = result.roi
        kept = result.kept_positions
        return DecodedBatch(
            images=result.images,
            positions=[readable[k] for k in kept],
            labels=[labels[k] for k in kept],
            epoch=epoch,
            windows=None if windows is None else [windows[k] for k in kept],
            sizes=None if sizes is None else [sizes[k] for k in kept],
            counters={
                "decode_backend": self.backend,
                "skipped": len(self.skipped),
                "fallback_decoded": self.fallback_decoded,
                "roi": self.roi,
            },
        )

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
