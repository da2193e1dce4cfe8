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

from typing import Any

import torch

from gpuload.augment import BatchAugmenter
from gpuload.datasets.images import ImageSource
from gpuload.decode import BatchDecoder, peek_size
from gpuload.transforms.windows import Window

__all__ = ["ImageBatches"]


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
        kept = [readable[k] for k in result.kept_positions]
        kept_labels = [labels[k] for k in result.kept_positions]
        if not kept:
            return None, 0  # every file of this batch was skipped
        if self.augment is not None:
            if windows is not None:
                sizes = [sizes[k] for k in result.kept_positions]
                windows = [windows[k] for k in result.kept_positions]
            images = self.augment.apply_list(result.images, torch.tensor(kept), epoch, windows, sizes)
        elif batched:
            images = torch.stack(result.images)  # differing sizes fail as in torch's collate
        else:
            images = result.images[0]
        if not batched:
            return [images[0] if self.augment is not None else images, kept_labels[0]], 1
        return [images, torch.tensor(kept_labels, dtype=torch.int64, device=self.device)], len(kept)

    def batch_with_counters(self, indices: Any, batched: bool, epoch: int) -> tuple[Any, int, dict[str, Any]]:
        """``batch()`` plus the decode counters as they stand after it (for ``stats.extra``),
        so a loop consuming batches made ahead in another thread sees counts that match."""
        batch, count = self.batch(indices, batched, epoch)
        counters = {
            "decode_backend": self.backend,
            "skipped": len(self.skipped),
            "fallback_decoded": self.fallback_decoded,
            "roi": self.roi,
        }
        if self.augment is not None:
            counters["transform_backend"] = self.augment.backend
        return batch, count, counters

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
