"""Image-folder scenario: decode + RandomResizedCrop + flip + normalize to float16, per image.

torch's DataLoader runs the usual per-sample PIL pipeline in its workers (open, crop, resize,
flip, to tensor, normalize); gpuload decodes each batch at once (DALI, or PIL) and runs the same
augmentation as batched transforms on the device. Where torchvision imports, a DALI-free
baseline does the same work the way a torchvision user would on the device: workers read the
files' bytes, ``torchvision.io.decode_jpeg`` decodes each batch on the device (nvJPEG on CUDA)
and ``torchvision.transforms.v2`` crops, flips and normalizes there. The folder is the user's (never written to)
or one made from real photographs (``make_sample_image_folder``) in a temporary folder that is
removed afterwards, unless the user names a folder to keep it in.

gpuload's host-to-device bytes are modelled, on a GPU too (the image path does not count what
DALI's decoder copies): the files' encoded bytes, every epoch without a cache, and with the
decoded image cache only until it holds them, as far as they fit the card (a pretended one on
a CPU). On a CPU torch's are its batches (float16 crops), every epoch.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import gpuload
from gpuload import transforms as T
from gpuload.bench.modelled import DEFAULT_PRETENDED_CARD, modelled_h2d, pretended_card
from gpuload.bench.scenarios import BenchConfig, CountingEpochs, LoaderEpochs, LoaderSpec, not_opened, top_stage
from gpuload.bench.torchvision_baseline import torchvision_spec
from gpuload.cache import CacheSettings, decide_images, estimate_image_bytes
from gpuload.datasets import ImageFolder
from gpuload.device import MemoryInfo, host_memory

__all__ = ["image_loaders", "open_image_folder", "sample_image_folder"]

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class PilTrainSet(Dataset):
    """The classic per-sample pipeline, in PIL: what a torchvision user runs in workers."""

    def __init__(self, folder: ImageFolder, size: int, seed: int) -> None:
        self.samples, self.size, self.seed = folder.samples, size, seed
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def _crop_box(self, rng: random.Random, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        for _ in range(10):  # torchvision's RandomResizedCrop sampling
            target = area * rng.uniform(0.08, 1.0)
            ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
            w, h = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
            if 0 < w <= width and 0 < h <= height:
                x, y = rng.randint(0, width - w), rng.randint(0, height - h)
                return x, y, x + w, y + h
        side = min(width, height)
        x, y = (width - side) // 2, (height - side) // 2
        return x, y, x + side, y + side

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        rng = random.Random(self.seed * 1_000_003 + index)
        with Image.open(path) as image:
            image = image.convert("RGB")
            crop = image.resize((self.size, self.size), Image.BILINEAR, box=self._crop_box(rng, *image.size))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.asarray(crop).copy()).permute(2, 0, 1)
        return ((pixels.float() / 255 - self.mean) / self.std).half(), label


def open_image_folder(path: str | os.PathLike[str]) -> ImageFolder:
    """The user's image folder, read as it is; ``ValueError`` naming it when missing or empty."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{path}: no such folder (the images scenario reads root/<class>/<images>)")
    try:
        folder = ImageFolder(root)
    except (FileNotFoundError, OSError) as error:  # no class folder, or one without images
        raise ValueError(str(error)) from None
    return folder


@contextlib.contextmanager
def sample_image_folder(num_images: int, seed: int, keep: Path | None = None) -> Iterator[ImageFolder]:
    """Generated photographs in a temporary folder removed on exit, or in ``keep`` (kept).

    ``keep`` must be a new or empty folder, so that nothing of the user's is mixed in.
    """
    if keep is not None:
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            raise ValueError(f"{keep} is not an empty folder; pass it as --data to reuse its images")
        yield gpuload.datasets.make_sample_image_folder(keep, num_images=num_images, num_classes=10, seed=seed)
        return
    with tempfile.TemporaryDirectory(prefix="gpuload-bench-images-") as root:
        yield gpuload.datasets.make_sample_image_folder(root, num_images=num_images, num_classes=10, seed=seed)


def image_loaders(
    config: BenchConfig, device: torch.device, folder: ImageFolder, size: int = 224,
    device_memory: int = DEFAULT_PRETENDED_CARD, say: Callable[[str], object] = print,
) -> list[LoaderSpec]:
    """torch (per-sample PIL, each worker count), torchvision on the device where it imports, and
    gpuload (batch decode + device transforms); ``say`` gets a line for a baseline left out."""
    specs = [_torch_spec(workers, folder, config, device, size) for workers in config.torch_workers]
    specs += torchvision_spec(folder, config, device, size, MEAN, STD, say)
    for cache, label in (("off", "decode + transforms"), ("device", "decoded image cache")):
        spec = _gpuload_spec(f"gpuload DataLoader ({label})", folder, config, device, size, cache)
        # Also on a GPU: the image path does not count the bytes DALI's decoder copies.
        spec.notes["h2d_modelled"] = _modelled_image_h2d(folder, cache, device, device_memory)
        specs.append(spec)
    return specs


def _modelled_image_h2d(folder: ImageFolder, cache: str, device: torch.device, device_memory: int) -> dict[str, Any]:
    """What gpuload would copy on a card: the files' bytes, each epoch until the cache holds them.

    On a GPU the card is the real one (its memory now); on a CPU one of ``device_memory`` bytes.
    """
    from gpuload.device import device_memory as memory_of

    encoded = sum(os.path.getsize(path) for path, _ in folder.samples)
    memory = memory_of(device) if device.type == "cuda" else MemoryInfo(free=device_memory, total=device_memory)
    card = str(device) if device.type == "cuda" else pretended_card(device_memory)
    if cache == "off":
        return modelled_h2d(encoded, encoded, "the files' bytes, decoded on the device every epoch", card)
    decision = decide_images(
        folder, CacheSettings.resolve(cache=cache), device if device.type == "cuda" else torch.device("cuda"),
        device_memory_info=memory, host_memory_info=host_memory(),
    )
    decoded, _ = estimate_image_bytes(folder)
    held = min(1.0, decision.budget / decoded) if decoded else 1.0
    return modelled_h2d(encoded, round(encoded * (1 - held)),
                        f"the files' bytes until the decoded images are cached on {card}", card)


def _torch_spec(workers: int, folder: ImageFolder, config: BenchConfig, device: torch.device, size: int) -> LoaderSpec:
    """torch's DataLoader with ``workers`` processes running the PIL pipeline."""
    spec = LoaderSpec(f"torch DataLoader + PIL (num_workers={workers})", not_opened,
                      "baseline" if workers == 0 else "loader")

    def open_torch():
        loader = TorchDataLoader(
            PilTrainSet(folder, size, config.seed), batch_size=config.batch_size, shuffle=True,
            num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(config.seed),
        )
        epochs = CountingEpochs(loader, device, spec.notes)
        return epochs, lambda: epochs.bytes_h2d, epochs.close

    spec.open = open_torch
    return spec


def _gpuload_spec(name: str, folder: ImageFolder, config: BenchConfig, device: torch.device, size: int,
                  cache: str) -> LoaderSpec:
    """gpuload on the folder: decoding every epoch (``cache="off"``) or from the image cache."""
    ops = [T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToDtype(torch.float16), T.Normalize(MEAN, STD)]
    spec = LoaderSpec(name, not_opened)

    def open_gpuload():
        loader = gpuload.DataLoader(
            folder, batch_size=config.batch_size, shuffle=True, device=device, transforms=ops, cache=cache,
            generator=torch.Generator().manual_seed(config.seed),
        )

        def close() -> None:
            extra = loader.stats.extra
            spec.notes.update(top_stage=top_stage(loader), decode_backend=extra.get("decode_backend"),
                              transform_backend=extra.get("transform_backend"))
            if "cache" in extra:
                spec.notes.update(image_cache=extra["cache"]["mode"], cached_images=extra["cache"]["entries"])
            loader.close()

        return LoaderEpochs(loader), lambda: loader.stats.bytes_h2d, close

    spec.open = open_gpuload
    return spec
