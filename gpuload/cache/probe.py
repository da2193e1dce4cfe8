"""Looking at a dataset before caching it: does it read the same every time, and how large is it.

:func:`looks_deterministic` tells whether a dataset returns the same sample at every read,
drawing no random numbers, which caching needs; :func:`estimate_image_bytes` estimates an
image source's decoded and encoded bytes from a few files' headers (the loader's image cache
and ``gpuload plan`` both use it).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuload.cache.allocator import reserved_bytes
from gpuload.datasets.images import ImageFiles
from gpuload.decode.cpu import describe_error
from gpuload.decode.headers import PixelLimitError, check_pixels, peek_header

__all__ = [
    "PROBE_COMPARISONS", "PROBE_SAMPLES", "ImageProbe", "estimate_image_bytes", "looks_deterministic", "probe_images",
    "probed_indices",
]

_PROBE_FILES = 32
_HEADER_BYTES = 64 << 10  # JPEG/PNG headers, EXIF included, sit well within this
_CONFIRMATIONS = 2  # reads again of a sample whose read moved a global generator (looks_deterministic)


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


PROBE_SAMPLES = 4
PROBE_COMPARISONS = 20
"""Reads of a sample compared with its first read, over the probed samples. A transform that
changes a sample with probability ``p`` at each read passes all of them with probability
``(1 - p) ** 20``: for a flip with ``p = 1/2``, ``2 ** -20`` = 9.5e-7, below one in a million
(4 samples read 6 times each: 24 reads). A transform drawing from torch's, NumPy's or Python's
global random generator is caught whatever its ``p``, by the generator's state (see
:func:`looks_deterministic`)."""


def probed_indices(length: int) -> list[int]:
    """The samples :func:`looks_deterministic` reads of a dataset of ``length``: up to
    :data:`PROBE_SAMPLES`, spread from the first to the last."""
    return sorted({k * (length - 1) // (PROBE_SAMPLES - 1) for k in range(PROBE_SAMPLES)}) if length else []


def looks_deterministic(dataset: Any, probe_indices: Sequence[int] | None = None) -> tuple[bool, str]:
    """Read a few samples several times; (True, reason) when every read of a sample equals its
    first and no read drew from a global random generator, else (False, reason).

    Caching a dataset that augments at random would freeze its first epoch's augmentation, so
    ``cache="auto"`` caches only datasets that pass, and the disk tier stores only their samples.
    ``probe_indices`` (default: :data:`PROBE_SAMPLES` spread over the dataset) are read until
    :data:`PROBE_COMPARISONS` reads have been compared, stopping at the first difference.

    Draws from torch's, NumPy's or Python's global generator are seen as a move of its state
    across a read. Another thread of the process may move it too (a loader starting an epoch
    draws its seed there), so a move counts only when two more reads of that sample, each from
    the state the first started at, move the generator to the same state again: a dataset that
    draws from it always does, whatever its ``p``, and is called random at that read. A thread
    that drew during one of the three reads leaves the move unconfirmed and the next read tries
    again, so a drawing dataset is missed only if every one of its (up to 24) reads overlaps
    another thread's draws. A deterministic dataset is called random only if another thread
    drew from the generator during all three reads, equally often each time (the second and
    third reads start after letting other threads run, which puts a thread drawing in step with
    this one's reads out of step): a one-off draw (a seed taken) never does; a thread drawing
    from all three generators in a tight loop did in 2 of 2,800 probes on 2 cores at load 8.
    The generators' states are restored afterwards, so probing does not shift the training's
    randomness.
    """
    if probe_indices is None:
        probe_indices = probed_indices(len(dataset))
    if not probe_indices:
        return True, "the dataset is empty: nothing to compare"
    reads = 1 + -(-PROBE_COMPARISONS // len(probe_indices))
    before = _global_rng_states()
    try:
        for index in probe_indices:
            first, first_drew = _read(dataset, index)
            for _ in range(reads - 1):
                sample, drew = _read(dataset, index)
                found = _difference(first, sample, f"dataset[{index}]")
                if found:
                    return False, f"two reads of dataset[{index}] differ ({found}): it looks randomly augmented"
                drawn = first_drew or drew
                if drawn:
                    return False, (f"reading dataset[{index}] draws from {drawn}'s global random generator: it looks "
                                   "randomly augmented")
    finally:
        _restore(before)
    shown = ", ".join(str(i) for i in probe_indices)
    return True, f"{reads} reads each of dataset[{shown}] were equal and drew no random numbers"


def _read(dataset: Any, index: int) -> tuple[Any, str]:
    """``dataset[index]`` and the global generators the read is confirmed to draw from ("" when
    none): those it moved that :data:`_CONFIRMATIONS` more reads, each from the same states, move
    to the same state again."""
    start = _global_rng_states()
    sample = dataset[index]
    after = _global_rng_states()
    drawn = [name for name in start if not _same_state(start[name], after[name])]
    for _ in range(_CONFIRMATIONS if drawn else 0):
        time.sleep(0)  # lets a thread that draws in step with this one's reads draw a different count
        _restore(start)
        dataset[index]
        again = _global_rng_states()
        drawn = [name for name in drawn if _same_state(after[name], again[name])]
    return sample, " and ".join(drawn)


def _global_rng_states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "NumPy": np.random.get_state(), "Python's random": random.getstate()}


def _same_state(a: Any, b: Any) -> bool:
    """Whether two states of one global generator (as :func:`_global_rng_states` gives) are equal."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) == 5 and isinstance(a[1], np.ndarray):  # NumPy's legacy state
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
    return bool(a == b)


def _restore(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["NumPy"])
    random.setstate(states["Python's random"])


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


def probe_images(source: ImageFiles, probe: int = _PROBE_FILES) -> ImageProbe:
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


def estimate_image_bytes(source: ImageFiles, probe: int = _PROBE_FILES, on_device: bool = False) -> tuple[int, int]:
    """(decoded, encoded) bytes of the whole source, from the headers and sizes of a few files;
    ``on_device``: decoded images as a device's caching allocator takes them, one tensor each."""
    sizes = probe_images(source, probe).sizes
    if not sizes:
        return 0, 0
    count = len(source)
    decoded = [reserved_bytes(d) if on_device else d for d, _ in sizes]
    return sum(decoded) * count // len(sizes), sum(e for _, e in sizes) * count // len(sizes)


def _header(source: ImageFiles, index: int) -> tuple[int, int, int]:
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
