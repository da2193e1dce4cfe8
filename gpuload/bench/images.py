"""Image-folder scenario: decode + RandomResizedCrop + flip + normalize to float16, per image.

torch's DataLoader runs the usual per-sample PIL pipeline in its workers (open, crop, resize,
flip, to tensor, normalize); gpuload decodes each batch at once (DALI, or PIL) and runs the same
augmentation as batched transforms on the device. The folder is made from real photographs
(``make_sample_image_folder``) unless the user gives one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import gpuload
from gpuload import transforms as T
from gpuload.bench.scenarios import BenchConfig, LoaderSpec, CountingEpochs
from gpuload.datasets import ImageFolder

__all__ = ["image_loaders"]

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


def image_loaders(config: BenchConfig, device: torch.device, root: Path, num_images: int, size: int = 224) -> list[LoaderSpec]:
    """torch (per-sample PIL, each worker count) vs gpuload (batch decode + device transforms)."""
    folder = ImageFolder(root) if any(root.iterdir()) else gpuload.datasets.make_sample_image_folder(
        root, num_images=num_images, num_classes=10, seed=config.seed
    )
    specs = []
    for workers in config.torch_workers:
        def open_torch(workers: int = workers):
            loader = TorchDataLoader(
                PilTrainSet(folder, size, config.seed), batch_size=config.batch_size, shuffle=True,
                num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                generator=torch.Generator().manual_seed(config.seed),
            )
            epochs = CountingEpochs(loader, device)
            return epochs, lambda: epochs.bytes_h2d, epochs.close

        kind = "baseline" if workers == 0 else "loader"
        specs.append(LoaderSpec(f"torch DataLoader + PIL (num_workers={workers})", open_torch, kind))

    specs.append(_gpuload_spec("gpuload DataLoader (decode + transforms)", folder, config, device, size, "off"))
    specs.append(_gpuload_spec(
        "gpuload + decoded image cache (cache='device')", folder, config, device, size, "device"
    ))
    return specs


def _gpuload_spec(name: str, folder: ImageFolder, config: BenchConfig, device: torch.device, size: int,
                  cache: str) -> LoaderSpec:
    """gpuload on the folder: decoding every epoch (``cache="off"``) or from the image cache."""
    ops = [T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToDtype(torch.float16), T.Normalize(MEAN, STD)]
    spec = LoaderSpec(name, lambda: None)

    def open_gpuload():
        loader = gpuload.DataLoader(
            folder, batch_size=config.batch_size, shuffle=True, device=device, transforms=ops, cache=cache,
            generator=torch.Generator().manual_seed(config.seed),
        )

        def epoch() -> Iterator[Any]:
            yield from loader
            extra = loader.stats.extra
            spec.notes.update(decode_backend=extra.get("decode_backend"),
                              transform_backend=extra.get("transform_backend"))
            if "cache" in extra:
                spec.notes.update(image_cache=extra["cache"]["mode"], cached_images=extra["cache"]["entries"])

        return epoch, lambda: loader.stats.bytes_h2d, loader.close

    spec.open = open_gpuload
    return spec
