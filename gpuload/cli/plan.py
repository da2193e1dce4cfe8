"""``gpuload plan``: print where a dataset's bytes would live, before running anything.

The dataset is an image folder (bytes per sample estimated from the decoded size of a few
images, 3*H*W uint8, plus an int64 label), an ``.npy``/``.npz`` file (read from its header, not
loaded) or a synthetic shape (``--synthetic cifar``, the default). ``--device-memory`` and
``--host-memory`` pretend a machine, so the plan for an 80 GiB card can be read on a laptop.
"""

from __future__ import annotations

import argparse
import math
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuload.cache.budget import (
    CacheSettingError,
    format_bytes,
    parse_size,
    resolve_budget,
    resolve_reserve,
)
from gpuload.cache.plan import make_plan
from gpuload.cache.settings import MODES, CacheSettings
from gpuload.device import MemoryInfo, cuda_available, device_memory, host_memory, resolve_device

__all__ = ["add_plan_arguments", "run_plan", "size_argument", "DatasetShape", "estimate_dataset"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
LABEL_BYTES = 8  # one int64 class label per sample
SYNTHETIC = {
    # name: (samples, bytes per sample, description)
    "cifar": (50_000, 3 * 32 * 32 + LABEL_BYTES, "CIFAR-10 train: 50000 x 3x32x32 uint8 + int64 label"),
    "imagenet": (
        1_281_167,
        3 * 224 * 224 + LABEL_BYTES,
        "ImageNet-1k train at 224x224: 1281167 x 3x224x224 uint8 + int64 label",
    ),
}


@dataclass(frozen=True)
class DatasetShape:
    """How many samples, how many bytes each, and how that was found out."""

    num_samples: int
    bytes_per_sample: int
    description: str


def _image_folder(path: Path, probes: int) -> DatasetShape:
    """Count the images and estimate their decoded size from the headers of ``probes`` of them.

    A probed file whose header cannot be read, or claims more pixels than the pixel limit
    (``gpuload.decode.default_max_pixels()``, a decompression bomb), is one the loader would
    skip or refuse: it is left out of the estimate and named on a line of its own.
    """
    from gpuload.decode import default_max_pixels, peek_header
    from gpuload.decode.cpu import describe_error

    files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(
            f"{path} holds no images ({', '.join(IMAGE_SUFFIXES)}); give an image folder, an "
            ".npy/.npz file, or --synthetic"
        )
    step = max(1, len(files) // max(1, probes))
    sampled = files[::step][:probes]
    limit = default_max_pixels()
    decoded, encoded, refused = [], [], []
    for file in sampled:
        try:
            with open(file, "rb") as handle:
                header = peek_header(handle.read(_HEADER_BYTES))
        except Exception as error:  # unreadable, not an image, or over PIL's own limit
            refused.append(f"{file}: not a readable image header ({describe_error(error)})")
            continue
        if limit is not None and header.pixels > limit:
            refused.append(
                f"{file}: {header.width}x{header.height} = {header.pixels:,} pixels, over the pixel limit "
                f"of {limit:,} (a decompression bomb?)"
            )
            continue
        decoded.append(3 * header.width * header.height)
        encoded.append(file.stat().st_size)
    bad = ""
    if refused:
        bad = (f"\n  bad files: {len(refused)} of the {len(sampled)} probed would be skipped or refused: "
               + "; ".join(refused[:3]) + ("; ..." if len(refused) > 3 else ""))
    if not decoded:
        raise ValueError(f"none of the {len(sampled)} probed images in {path} can be loaded:{bad}")
    per_sample = math.ceil(sum(decoded) / len(decoded)) + LABEL_BYTES
    return DatasetShape(
        len(files),
        per_sample,
        f"image folder {path}: {len(files)} images; {len(decoded)} probed, decoded RGB uint8 "
        f"{format_bytes(min(decoded))} to {format_bytes(max(decoded))} "
        f"(mean {format_bytes(per_sample - LABEL_BYTES)}) + int64 label; "
        f"encoded mean {format_bytes(sum(encoded) / len(encoded))} on disk{bad}",
    )


_HEADER_BYTES = 256 * 1024  # JPEG headers with EXIF thumbnails and ICC profiles fit


def _npy_header(handle) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(handle)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = reader(handle)
    return tuple(shape), np.dtype(dtype)


def _array_file(path: Path) -> DatasetShape:
    if path.suffix == ".npy":
        array = np.load(path, mmap_mode="r")
        columns = {path.name: (tuple(array.shape), array.dtype)}
    else:
        with zipfile.ZipFile(path) as archive:
            columns = {}
            for name in archive.namelist():
                if name.endswith(".npy"):
                    with archive.open(name) as member:
                        columns[name.removesuffix(".npy")] = _npy_header(member)
    if not columns:
        raise ValueError(f"{path} holds no arrays")
    for name, (shape, _) in columns.items():
        if len(shape) == 0:
            raise ValueError(f"array {name!r} in {path} is 0-dimensional; each array needs one row per sample")
    lengths = {name: shape[0] for name, (shape, _) in columns.items()}
    if len(set(lengths.values())) != 1:
        listed = ", ".join(f"{n}: {k}" for n, k in lengths.items())
        raise ValueError(f"the arrays in {path} must have the same number of rows; got {listed}")
    per_sample = sum(int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize for shape, dtype in columns.values())
    listed = ", ".join(f"{n} {shape} {dtype}" for n, (shape, dtype) in columns.items())
    return DatasetShape(next(iter(lengths.values())), per_sample, f"arrays in {path}: {listed}")


def estimate_dataset(path: str | None, synthetic: str | None, probes: int = 16) -> DatasetShape:
    """Sample count and bytes per sample of the dataset the user names."""
    if path is None:
        samples, per_sample, description = SYNTHETIC[synthetic or "cifar"]
        return DatasetShape(samples, per_sample, f"synthetic {description}")
    where = Path(path)
    if where.is_dir():
        return _image_folder(where, probes)
    if where.is_file() and where.suffix in (".npy", ".npz"):
        return _array_file(where)
    raise ValueError(f"{path} is neither an image folder nor an existing .npy/.npz file")


def size_argument(text: str) -> int:
    try:
        spec = parse_size(text, setting="memory", source="command line")
    except CacheSettingError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if spec.kind != "bytes":
        raise argparse.ArgumentTypeError(f"{text!r}: give an absolute size such as 80GiB")
    return int(spec.amount)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gpuload plan`` options, added to ``parser``."""
    parser.add_argument("dataset", nargs="?", default=None,
                        help="an image folder or an .npy/.npz file (default: --synthetic cifar)")
    parser.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None,
                        help="a well-known dataset shape instead of a path (default cifar)")
    parser.add_argument("--cache", choices=MODES, default=None, help="cache mode (default: settings, else auto)")
    parser.add_argument("--cache-size", default=None, help="device budget: '40GiB', 0.8, 'auto', 'off'")
    parser.add_argument("--cache-reserve", default=None, help="device memory kept for the model (default max(2 GiB, 10%%))")
    parser.add_argument("--job", default=None, help="a [jobs.NAME] table of gpuload.toml")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    parser.add_argument("--device-memory", type=size_argument, default=None, metavar="SIZE",
                        help="pretend a card of this size, e.g. 80GiB")
    parser.add_argument("--device-free", type=size_argument, default=None, metavar="SIZE",
                        help="with --device-memory: pretend this much is free (default: all of it)")
    parser.add_argument("--host-memory", type=size_argument, default=None, metavar="SIZE",
                        help="pretend this much host RAM, all available")
    parser.add_argument("--probe-images", type=int, default=16, metavar="N",
                        help="images opened to estimate an image folder's sample size")


def run_plan(args: argparse.Namespace) -> int:
    """Print the settings, the dataset's size and the cache plan; 0 on success, 2 on a bad input."""
    try:
        settings = CacheSettings.resolve(
            cache=args.cache, cache_size=args.cache_size, cache_reserve=args.cache_reserve, job=args.job
        )
        shape = estimate_dataset(args.dataset, args.synthetic, args.probe_images)
        if args.device_memory is not None:
            free = args.device_memory if args.device_free is None else args.device_free
            if free > args.device_memory:
                raise ValueError("--device-free cannot exceed --device-memory")
            device_name, target = f"a pretended {format_bytes(args.device_memory)} card", "cuda"
            memory = MemoryInfo(free=free, total=args.device_memory)
        else:
            device = resolve_device(args.device)
            if device.type == "cuda":
                device_name, target, memory = str(device), "cuda", device_memory(device)
            else:
                device_name, target, memory = "cpu", "cpu", MemoryInfo(free=0, total=0)
        host = (MemoryInfo(args.host_memory, args.host_memory) if args.host_memory is not None
                else host_memory())
        if target == "cuda":
            reserve = resolve_reserve(settings.reserve_spec, memory, source=settings.reserve.source,
                                      device_name=device_name)
            budget = resolve_budget(settings.size_spec, memory, reserve, source=settings.size.source,
                                    device_name=device_name)
        else:
            reserve = budget = 0
        plan = make_plan(
            shape.bytes_per_sample, shape.num_samples, memory.free, host.free, budget, reserve,
            settings.mode.value, device_total=memory.total or None, host_total=host.total, target=target,
        )
    except ValueError as error:  # CacheSettingError, DeviceError and bad datasets are ValueErrors
        print(f"gpuload plan: error: {error}", file=sys.stderr)
        return 2
    print("settings:")
    print("  " + settings.describe().replace("\n", "\n  "))
    print(f"dataset: {shape.description}")
    print(f"  {shape.num_samples} samples x {format_bytes(shape.bytes_per_sample)} "
          f"({shape.bytes_per_sample} bytes per sample)")
    print(f"device: {device_name}")
    if target == "cpu" and not cuda_available() and args.device_memory is None:
        print("  no CUDA device here: pass --device-memory 80GiB to plan for a card")
    print(plan.describe())
    if args.dataset is not None and Path(args.dataset).is_dir():
        print(_image_cache_line(Path(args.dataset), settings, target, memory, host))
    return 0


def _image_cache_line(path: Path, settings: CacheSettings, target: str, memory: MemoryInfo, host: MemoryInfo) -> str:
    """What the loader's image cache would keep for this folder: decoded images or file bytes."""
    import torch

    from gpuload.datasets.images import ImageList
    from gpuload.image_cache import choose_image_cache

    files = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    decision = choose_image_cache(
        ImageList([(file, 0) for file in files]), settings, torch.device(target), owner="gpuload plan",
        device_memory_info=memory, host_memory_info=host,
    )
    return f"image cache (for gpuload.DataLoader on this folder): {decision.mode}: {decision.reason}"
