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
from typing import Any

import numpy as np
import torch

from gpuload.datasets.images import ImageSource
from gpuload.decode.headers import peek_size

__all__ = ["looks_deterministic", "estimate_image_bytes", "image_sizes"]

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


def image_sizes(source: ImageSource, probe: int = _PROBE_FILES) -> list[tuple[int, int]]:
    """(decoded bytes, encoded bytes) of up to ``probe`` files spread evenly over the source.

    Only each file's first 64 KiB is read (the whole file when its header reaches further);
    decoded bytes are 3 x height x width (RGB uint8). Files whose header cannot be read are
    left out: the loader reports them when it reaches them.
    """
    count = len(source)
    if count == 0 or probe < 1:
        return []
    step = max(1, count // probe)
    sizes = []
    for index in range(0, count, step)[:probe]:
        try:
            height, width, size = _header(source, index)
        except Exception:  # a bad file is reported when the loader reaches it
            continue
        sizes.append((3 * height * width, size))
    return sizes


def estimate_image_bytes(source: ImageSource, probe: int = _PROBE_FILES) -> tuple[int, int]:
    """(decoded, encoded) bytes of the whole source, from the headers and sizes of a few files."""
    sizes = image_sizes(source, probe)
    if not sizes:
        return 0, 0
    count = len(source)
    return (sum(d for d, _ in sizes) * count // len(sizes), sum(e for _, e in sizes) * count // len(sizes))


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
