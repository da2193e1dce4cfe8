"""Looking at a dataset before caching it: does it read the same twice, and how large is it.

:func:`looks_deterministic` tells whether a dataset returns the same sample twice, which
caching needs; :func:`estimate_image_bytes` estimates an image source's decoded and encoded
bytes from a few files' headers (the loader's image cache and ``gpuload plan`` both use it).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuload.cache.allocator import reserved_bytes
from gpuload.datasets.images import ImageSource
from gpuload.decode.cpu import describe_error
from gpuload.decode.headers import PixelLimitError, check_pixels, peek_header

__all__ = ["ImageProbe", "estimate_image_bytes", "looks_deterministic", "probe_images"]

_PROBE_FILES = 32
_HEADER_BYTES = 64 << 10  # JPEG/PNG headers, EXIF included, sit well within this


def _difference(a: Any, b: Any, where: str) -> str | None:
    """Where and how two reads of one sample differ, or None when they are equal."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: tensor {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        if a.is_floating_point() or a.is_complex():
            same = bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        else:
            same = torch.equal(a, b)
        return None if same else f"{where}: tensor values differ"
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: array {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        same = np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        return None if same else f"{where}: array values differ"
    if isinstance(a, Mapping):
        if list(a.keys()) != list(b.keys()):
            return f"{where}: keys {list(a.keys())} vs {list(b.keys())}"
        for key in a:
            found = _difference(a[key], b[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    if hasattr(a, "tobytes") and hasattr(a, "size") and hasattr(a, "mode"):  # PIL images
        same = a.mode == b.mode and a.size == b.size and a.tobytes() == b.tobytes()
        return None if same else f"{where}: image pixels differ"
    try:
        same = bool(a == b)
    except Exception:  # objects whose == is not a truth value
        return f"{where}: {type(a).__name__} values cannot be compared"
    return None if same else f"{where}: {a!r} vs {b!r}"


def looks_deterministic(dataset: Any, probe_indices: Sequence[int] | None = None) -> tuple[bool, str]:
    """Read a few samples twice; (True, reason) when every pair is equal, else (False, reason).

    Caching a dataset that augments at random would freeze its first epoch's augmentation, so
    ``cache="auto"`` caches only datasets that pass. Random number generator states (torch,
    numpy, python) are restored afterwards, so probing does not shift the training's randomness.
    """
    if probe_indices is None:
        n = len(dataset)
        probe_indices = sorted({0, n // 2, n - 1}) if n else []
    if not probe_indices:
        return True, "the dataset is empty: nothing to compare"
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            for index in probe_indices:
                first, second = dataset[index], dataset[index]
                found = _difference(first, second, f"dataset[{index}]")
                if found:
                    return False, f"two reads of dataset[{index}] differ ({found}): it looks randomly augmented"
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
    shown = ", ".join(str(i) for i in probe_indices)
    return True, f"two reads of dataset[{shown}] were equal"


@dataclass(frozen=True)
class ImageProbe:
    """What a few files spread over an image source say: ``sizes``, the (decoded bytes, encoded
    bytes) of each readable one, and ``bad``, ``"path: why"`` for each the loader would skip or
    refuse (unreadable header, or more pixels than the decoder's limit)."""

    sizes: list[tuple[int, int]]
    bad: list[str]

    @property
    def probed(self) -> int:
        return len(self.sizes) + len(self.bad)


def probe_images(source: ImageSource, probe: int = _PROBE_FILES) -> ImageProbe:
    """Read the headers of up to ``probe`` files spread evenly over the source.

    Only each file's first 64 KiB is read (the whole file when its header reaches further);
    decoded bytes are 3 x height x width (RGB uint8), counted only for files within the pixel
    limit (``gpuload.decode.default_max_pixels()``).
    """
    count = len(source)
    sizes: list[tuple[int, int]] = []
    bad: list[str] = []
    if count == 0 or probe < 1:
        return ImageProbe(sizes, bad)
    step = max(1, count // probe)
    for index in range(0, count, step)[:probe]:
        try:
            height, width, size = _header(source, index)
        except PixelLimitError as error:
            bad.append(f"{source.path(index)}: {error}")
            continue
        except Exception as error:  # the loader reports it, by file and index, when it reaches it
            bad.append(f"{source.path(index)}: not a readable image header ({describe_error(error)})")
            continue
        sizes.append((3 * height * width, size))
    return ImageProbe(sizes, bad)


def estimate_image_bytes(source: ImageSource, probe: int = _PROBE_FILES, on_device: bool = False) -> tuple[int, int]:
    """(decoded, encoded) bytes of the whole source, from the headers and sizes of a few files;
    ``on_device``: decoded images as a device's caching allocator takes them, one tensor each."""
    sizes = probe_images(source, probe).sizes
    if not sizes:
        return 0, 0
    count = len(source)
    decoded = [reserved_bytes(d) if on_device else d for d, _ in sizes]
    return sum(decoded) * count // len(sizes), sum(e for _, e in sizes) * count // len(sizes)


def _header(source: ImageSource, index: int) -> tuple[int, int, int]:
    """(height, width, file bytes) of one sample, reading as little of its file as it can."""
    path = source.path(index)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            head = file.read(_HEADER_BYTES)
        return (*_upright(head), size)
    except PixelLimitError:
        raise
    except Exception:  # not a plain file, or a header longer than the prefix
        data, _ = source.read_encoded(index)
        return (*_upright(data), len(data))


def _upright(data: bytes) -> tuple[int, int]:
    """(height, width) from the header, within the decoder's pixel limit (else PixelLimitError)."""
    return (check_pixels(data) or peek_header(data)).upright
