"""In-memory scenario: CIFAR-shaped uint8 images + labels, gpuload vs torch's DataLoader.

Every loader sees the same tensors, batch size and shuffling; torch's loaders get the fair
settings a tuned job would use (persistent workers and pinned memory with non-blocking copies
when a GPU is present). The ideal is a bare ``index_select`` gather from data already on the
device with a precomputed permutation: no sampler, no Python per sample.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

import gpuload
from gpuload.bench.measure import EpochTimes, time_epochs

__all__ = ["InMemoryConfig", "LoaderResult", "run_inmemory", "synthetic_cifar"]


@dataclass(frozen=True)
class InMemoryConfig:
    """What the in-memory scenario measures."""

    num_samples: int = 50_000
    image_shape: tuple[int, int, int] = (3, 32, 32)
    batch_size: int = 512
    epochs: int = 3
    torch_workers: tuple[int, ...] = (0, 2)
    seed: int = 0


@dataclass
class LoaderResult:
    """One loader's timings and counters in one run."""

    name: str
    times: EpochTimes
    bytes_h2d_per_epoch: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "first_epoch_s": self.times.first_s,
            "steady_epoch_s": self.times.steady_s,
            "median_epoch_s": self.times.median_s,
            "spread_s": self.times.spread_s,
            "samples_per_s": self.times.samples_per_s,
            "bytes_h2d_per_epoch": self.bytes_h2d_per_epoch,
        }


def synthetic_cifar(num_samples: int, image_shape: tuple[int, ...], seed: int) -> TensorDataset:
    """Random uint8 images and int64 labels with CIFAR's shapes and dtypes."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (num_samples, *image_shape), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (num_samples,), dtype=torch.int64, generator=generator)
    return TensorDataset(images, labels)


def _torch_epochs(
    dataset: TensorDataset, config: InMemoryConfig, workers: int, device: torch.device
) -> Callable[[], Iterable[Any]]:
    on_gpu = device.type == "cuda"
    loader = TorchDataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=on_gpu,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(config.seed),
    )

    def epoch() -> Iterable[Any]:
        for images, labels in loader:
            if on_gpu:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
            yield images, labels

    return epoch


def _ideal_epochs(
    dataset: TensorDataset, config: InMemoryConfig, device: torch.device
) -> Callable[[], Iterable[Any]]:
    images, labels = (t.to(device) for t in dataset.tensors)
    generator = torch.Generator().manual_seed(config.seed)

    def epoch() -> Iterable[Any]:
        order = torch.randperm(images.shape[0], generator=generator).to(device)
        for batch_index in order.split(config.batch_size):
            yield images.index_select(0, batch_index), labels.index_select(0, batch_index)

    return epoch


def run_inmemory(
    config: InMemoryConfig,
    device: torch.device,
    progress: Callable[[str], None] = lambda _: None,
) -> list[LoaderResult]:
    """Time every loader on the same synthetic dataset; the ideal gather comes last."""
    dataset = synthetic_cifar(config.num_samples, config.image_shape, config.seed)
    results: list[LoaderResult] = []
    for workers in config.torch_workers:
        name = f"torch DataLoader (num_workers={workers})"
        progress(name)
        times = time_epochs(_torch_epochs(dataset, config, workers, device), device, config.epochs)
        per_epoch = sum(t.numel() * t.element_size() for t in dataset.tensors)
        results.append(LoaderResult(name, times, per_epoch if device.type == "cuda" else 0))

    progress("gpuload DataLoader")
    loader = gpuload.DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(config.seed),
        device=device,
    )
    times = time_epochs(lambda: loader, device, config.epochs)
    steady_bytes = _steady_bytes_per_epoch(loader, device, config)
    results.append(LoaderResult(f"gpuload DataLoader ({loader.stats.path})", times, steady_bytes))
    loader.close()

    progress("ideal: index_select on the device")
    times = time_epochs(_ideal_epochs(dataset, config, device), device, config.epochs)
    results.append(LoaderResult("ideal gather (index_select)", times, 0))
    return results


def _steady_bytes_per_epoch(
    loader: gpuload.DataLoader, device: torch.device, config: InMemoryConfig
) -> int:
    """Host-to-device bytes of one more epoch, read from the loader's own counter."""
    before = loader.stats.bytes_h2d
    for _ in loader:
        pass
    return loader.stats.bytes_h2d - before


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and machine facts stored beside the numbers."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpuload": gpuload.__version__,
        "platform": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info
