"""Augmentation scenario: CIFAR-style images in memory, padded random crop + flip + float +
normalize, side by side.

torch's DataLoader gets the usual per-sample Dataset (the same ops written in plain torch, as
torchvision-free code does: pad, crop, flip, scale, normalize, one image at a time, in its
workers or the loop's process); gpuload gets the uint8 arrays and the op list, and runs it on
whole batches (the CuPy kernels on a GPU, the batched torch path on a CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

import gpuload
from gpuload import transforms as T
from gpuload.bench.modelled import DEFAULT_PRETENDED_CARD, plan_notes
from gpuload.bench.scenarios import (
    BenchConfig,
    LoaderEpochs,
    LoaderSpec,
    not_opened,
    served_from,
    synthetic_cifar,
    torch_spec,
)

__all__ = ["MEAN", "STD", "PADDING", "PerSampleAugment", "augment_ops", "augment_loaders"]

MEAN = (0.4914, 0.4822, 0.4465)  # CIFAR-10's channel statistics
STD = (0.2470, 0.2435, 0.2616)
PADDING = 4


def augment_ops(image_size: tuple[int, int]) -> list[T.Op]:
    """gpuload's op list for the scenario."""
    return [
        T.RandomCrop(image_size, padding=PADDING), T.RandomHorizontalFlip(),
        T.ToDtype(torch.float32), T.Normalize(MEAN, STD),
    ]


class PerSampleAugment(Dataset):
    """The same augmentation per sample, in plain torch: what torch's DataLoader runs."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels
        self.mean = torch.tensor(MEAN).view(-1, 1, 1)
        self.std = torch.tensor(STD).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.images)

    @staticmethod
    def draw() -> tuple[int, int, bool]:
        """(top, left, flip) of one sample, from torch's global generator (per worker)."""
        top, left = torch.randint(0, 2 * PADDING + 1, (2,)).tolist()
        return top, left, bool(torch.rand(()) < 0.5)

    def augment(self, image: torch.Tensor, top: int, left: int, flip: bool) -> torch.Tensor:
        """Pad, crop at (top, left) of the padded image, maybe mirror, scale, normalize."""
        h, w = image.shape[-2:]
        crop = F.pad(image, (PADDING,) * 4)[:, top : top + h, left : left + w]
        if flip:
            crop = crop.flip(-1)
        return crop.float().div_(255.0).sub_(self.mean).div_(self.std)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.augment(self.images[index], *self.draw()), self.labels[index]


def _gpuload_spec(
    dataset: TensorDataset, config: BenchConfig, device: torch.device, device_memory: int = DEFAULT_PRETENDED_CARD
) -> LoaderSpec:
    """gpuload over the uint8 arrays with the op list; notes say where batches came from (and,
    on a CPU, the cache plan a pretended card of ``device_memory`` bytes would get: the uint8
    arrays are cached, the transforms run on the device)."""
    spec = LoaderSpec("gpuload DataLoader (batched transforms)", not_opened)
    if device.type != "cuda":
        spec.notes.update(plan_notes(dataset, "auto", None, device_memory))

    def open_():
        loader = gpuload.DataLoader(
            dataset, batch_size=config.batch_size, shuffle=True, device=device,
            generator=torch.Generator().manual_seed(config.seed),
            transforms=augment_ops((dataset.tensors[0].shape[-2], dataset.tensors[0].shape[-1])),
        )

        def close() -> None:
            spec.notes.update(served_from(loader), transform_backend=loader.stats.extra.get("transform_backend"))
            loader.close()

        return LoaderEpochs(loader), lambda: loader.stats.bytes_h2d, close

    spec.open = open_
    return spec


def augment_loaders(
    config: BenchConfig, device: torch.device, dataset: TensorDataset | None = None,
    device_memory: int = DEFAULT_PRETENDED_CARD,
) -> tuple[TensorDataset, list[LoaderSpec]]:
    """(images, labels) in memory, CIFAR-shaped unless given: torch per sample at each worker
    count, then gpuload on whole batches."""
    dataset = dataset if dataset is not None else synthetic_cifar(config)
    images = dataset.tensors[0]
    if images.dtype != torch.uint8 or images.dim() != 4 or len(dataset.tensors) < 2:
        shapes = [f"{tuple(t.shape)} {t.dtype}" for t in dataset.tensors]
        raise ValueError(f"the augment scenario needs uint8 N,C,H,W images and labels, got {shapes}")
    per_sample: Any = PerSampleAugment(images, dataset.tensors[1])
    specs = [torch_spec(per_sample, config, workers, device) for workers in config.torch_workers]
    specs.append(_gpuload_spec(dataset, config, device, device_memory))
    return dataset, specs
