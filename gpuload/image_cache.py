"""Caching an image source: decoded uint8 images on the device, or the encoded bytes on the host.

Two modes, chosen by budget (``choose_image_cache``) or by the user:

- ``"decoded"``: each image is decoded once, at its own resolution, and the uint8 (3, H, W)
  tensor is kept on the device; later epochs neither read nor decode it, only transform it.
  Largest footprint (about 3 bytes a pixel), fastest epochs.
- ``"encoded"``: the file's bytes are kept in host memory and decoded every epoch; no file is
  read twice. About a tenth of the footprint of decoded JPEGs.

Encoded bytes stay in pageable memory: DALI's ``external_source`` copies every input into its own
staging buffers (``no_copy=False``), so a pinned copy of ours would add a pinned allocation per
image without saving a transfer.

Only the deterministic part is cached (file bytes, decoded pixels), never a transform's output,
so an epoch from the cache gives the same batches as one from the files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from gpuload.cache import CacheSettings, SampleCache, format_bytes
from gpuload.datasets.images import ImageSource
from gpuload.decode import peek_size
from gpuload.device import MemoryInfo, device_memory, host_memory

__all__ = ["ImageCache", "ImageCacheDecision", "choose_image_cache", "estimate_image_bytes"]

_PROBE_FILES = 32
_HEADER_BYTES = 64 << 10  # JPEG/PNG headers, EXIF included, sit well within this


@dataclass(frozen=True)
class ImageCacheDecision:
    """``mode`` "decoded", "encoded" or "none", the bytes it may take, and why."""

    mode: str
    budget: int
    reason: str
    decoded_bytes: int = 0  # estimate for the whole source
    encoded_bytes: int = 0


def estimate_image_bytes(source: ImageSource, probe: int = _PROBE_FILES) -> tuple[int, int]:
    """(decoded, encoded) bytes of the whole source, from the headers and sizes of a few files.

    Files are probed evenly across the source, reading only their first 64 KiB (the whole
    file when its header reaches further); unreadable ones are left out of the average.
    """
    count = len(source)
    if count == 0:
        return 0, 0
    step = max(1, count // probe)
    decoded = encoded = seen = 0
    for index in range(0, count, step)[:probe]:
        try:
            height, width, size = _header(source, index)
        except Exception:  # a bad file is reported when the loader reaches it
            continue
        decoded += 3 * height * width
        encoded += size
        seen += 1
    if not seen:
        return 0, 0
    return decoded * count // seen, encoded * count // seen


def _header(source: ImageSource, index: int) -> tuple[int, int, int]:
    """(height, width, file bytes) of one sample, reading as little of its file as it can."""
    path = source.path(index)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            head = file.read(_HEADER_BYTES)
        return (*peek_size(head), size)
    except Exception:  # not a plain file, or a header longer than the prefix
        data, _ = source.read_encoded(index)
        return (*peek_size(data), len(data))


def choose_image_cache(
    source: ImageSource,
    settings: CacheSettings,
    device: torch.device,
    *,
    owner: Any = None,
    device_memory_info: MemoryInfo | None = None,
    host_memory_info: MemoryInfo | None = None,
) -> ImageCacheDecision:
    """Decide how an image source is cached, from its estimated sizes and the budgets.

    ``cache="device"`` keeps decoded images (on the device; in host memory on a CPU device),
    ``cache="host"`` keeps encoded bytes in host memory. ``"auto"`` on CUDA keeps decoded images
    when they all fit the device budget, else encoded bytes when they fit in host memory, else
    as many decoded images as fit. On a CPU device ``"auto"`` caches nothing.
    """
    mode = settings.mode.value
    off = settings.off_reason()
    if off:
        return ImageCacheDecision("none", 0, off)
    if device.type == "cpu" and mode == "auto":
        return ImageCacheDecision(
            "none", 0, "on a CPU device images are decoded every epoch; cache='device' keeps them decoded in "
            "memory, cache='host' keeps the files' bytes",
        )
    decoded, encoded = estimate_image_bytes(source)
    host = host_memory_info or host_memory()
    estimate = f"decoded ~{format_bytes(decoded)}, encoded ~{format_bytes(encoded)}"
    if mode == "host":
        budget = settings.host_room(host)
        return ImageCacheDecision("encoded", budget, f"cache='host': encoded bytes in host memory ({estimate})",
                                  decoded, encoded)
    if device.type == "cpu":
        budget = settings.host_room(host)
        return ImageCacheDecision("decoded", budget, f"cache='device' on a CPU device: decoded images in host "
                                  f"memory ({estimate})", decoded, encoded)
    budget = settings.device_room(device, device_memory_info or device_memory(device), owner)
    if mode == "auto" and decoded > budget:
        room = settings.host_room(host, sized=False)
        if encoded <= room:
            return ImageCacheDecision(
                "encoded", room, f"decoded images would not fit the device budget ({format_bytes(budget)}); "
                f"encoded bytes in host memory ({estimate})", decoded, encoded,
            )
    fits = "all" if decoded <= budget else "part"
    return ImageCacheDecision("decoded", budget, f"decoded images on {device}, {fits} of them within the budget "
                              f"{format_bytes(budget)} ({estimate})", decoded, encoded)


class ImageCache:
    """Decoded images or encoded bytes of an image source, by sample index, within a budget."""

    def __init__(
        self, decision: ImageCacheDecision, device: torch.device, num_samples: int, owner: Any,
        settings: CacheSettings | None = None,
    ) -> None:
        if decision.mode not in ("decoded", "encoded"):
            raise ValueError(f"an ImageCache needs mode 'decoded' or 'encoded', got {decision.mode!r}")
        self.mode = decision.mode
        self.reason = decision.reason
        self.num_samples = num_samples
        where = device if self.mode == "decoded" else torch.device("cpu")
        room = settings.room_check(where) if settings is not None else None
        self.store = SampleCache(decision.budget, where, owner=owner, room=room)

    @property
    def decodes(self) -> bool:
        """True when cached samples still have to be decoded (encoded mode)."""
        return self.mode == "encoded"

    @property
    def complete(self) -> bool:
        return len(self.store) >= self.num_samples

    @property
    def accepting(self) -> bool:
        return not (self.store.full or self.complete)

    def get(self, index: int) -> torch.Tensor | bytes | None:
        """The cached decoded image or encoded bytes of sample ``index``, or None."""
        return self.store.get(index)

    def keep(self, index: int, value: torch.Tensor | bytes) -> bool:
        """Cache a decoded image (decoded mode) or a file's bytes (encoded mode)."""
        if not self.accepting:
            return False
        kept = self.store.put(index, value)
        if kept and self.complete:
            self.store.settle()
        return kept

    def fit_reserve(self, settings: CacheSettings) -> int:
        """At an epoch start: give device memory back if the model has grown into the reserve
        (warns when it does); returns the bytes given back."""
        return self.store.fit_reserve(settings.keepable, "those images are decoded from their files again")

    def stats(self) -> dict[str, Any]:
        entry = self.store.stats.as_dict()
        entry.update(kind="images", mode=self.mode, num_samples=self.num_samples, complete=self.complete,
                     reason=self.reason)
        return entry

    def close(self) -> None:
        self.store.close()

