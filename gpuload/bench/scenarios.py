"""Benchmark scenarios: the same data through each loader, side by side, in one run.

Each scenario lists loaders as ``LoaderSpec``: a name and a factory returning a fresh epoch
iterable plus a counter of host-to-device bytes. torch's DataLoader gets the settings a tuned
job would use (persistent workers; pinned memory and non-blocking copies on a GPU). The ideals
need no loader at all: a bare ``index_select`` gather from data already on the device, and a
replay of batches prepared on the device in advance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

import gpuload
from gpuload.transfer import batch_nbytes, move_to_device

__all__ = [
    "LoaderSpec", "BenchConfig", "inmemory_loaders", "synthetic_cifar", "torch_spec", "gpuload_spec",
    "ideal_gather_spec", "served_from",
]


@dataclass(frozen=True)
class BenchConfig:
    """What a benchmark run measures; every field is recorded in the JSON output."""

    num_samples: int = 50_000
    image_shape: tuple[int, int, int] = (3, 32, 32)
    batch_size: int = 512
    epochs: int = 5
    torch_workers: tuple[int, ...] = (0, 2)
    step: str = "none"
    step_ms: float = 5.0
    seed: int = 0


@dataclass
class LoaderSpec:
    """One loader in a scenario. ``open()`` returns (epoch factory, bytes counter, closer)."""

    name: str
    open: Callable[[], tuple[Callable[[], Iterable[Any]], Callable[[], int], Callable[[], None]]]
    kind: str = "loader"  # "loader", "baseline" (torch, num_workers=0) or "ideal"
    notes: dict[str, Any] = field(default_factory=dict)


def synthetic_cifar(config: BenchConfig) -> TensorDataset:
    """Random uint8 images and int64 labels with CIFAR's shapes and dtypes, from a fixed seed."""
    generator = torch.Generator().manual_seed(config.seed)
    shape = (config.num_samples, *config.image_shape)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (config.num_samples,), dtype=torch.int64, generator=generator)
    return TensorDataset(images, labels)


class CountingEpochs:
    """torch's DataLoader with the copy a tuned loop does, counting the bytes it copies."""

    def __init__(self, loader: TorchDataLoader, device: torch.device) -> None:
        self.loader, self.device, self.bytes_h2d = loader, device, 0

    def __call__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.device.type == "cuda":
                self.bytes_h2d += batch_nbytes(batch)
                batch = move_to_device(batch, self.device, non_blocking=True)
            yield batch

    def close(self) -> None:
        iterator = self.loader._iterator
        if iterator is not None:
            iterator._shutdown_workers()


def torch_spec(dataset: TensorDataset, config: BenchConfig, workers: int, device: torch.device) -> LoaderSpec:
    def open_():
        loader = TorchDataLoader(
            dataset,
            batch_size=config.batch_size,
            shuffle=True,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(config.seed),
        )
        epochs = CountingEpochs(loader, device)
        return epochs, lambda: epochs.bytes_h2d, epochs.close

    kind = "baseline" if workers == 0 else "loader"
    return LoaderSpec(f"torch DataLoader (num_workers={workers})", open_, kind)


def served_from(loader: gpuload.DataLoader) -> dict[str, Any]:
    """Where a gpuload loader's batches came from: its path, and the cache tiers when it has them."""
    stats = loader.stats
    notes: dict[str, Any] = {"path": stats.path}
    if "cache" in stats.extra:
        notes.update(cache=stats.extra["cache"], cache_plan=stats.extra["cache_plan"])
    return notes


def gpuload_spec(
    dataset: TensorDataset, config: BenchConfig, device: torch.device, cache: str, label: str,
    cache_size: int | None = None,
) -> LoaderSpec:
    """gpuload over the arrays with ``cache`` (and ``cache_size`` bytes); notes say what served."""
    def open_():
        loader = gpuload.DataLoader(
            dataset,
            batch_size=config.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(config.seed),
            device=device,
            cache=cache,
            cache_size=cache_size,
        )

        def close() -> None:
            spec.notes.update(served_from(loader))
            loader.close()

        return (lambda: loader), lambda: loader.stats.bytes_h2d, close

    spec = LoaderSpec(f"gpuload DataLoader ({label})", open_)
    return spec


def ideal_gather_spec(dataset: TensorDataset, config: BenchConfig, device: torch.device) -> LoaderSpec:
    def open_():
        columns = [t.to(device) for t in dataset.tensors]
        generator = torch.Generator().manual_seed(config.seed)

        def epoch() -> Iterator[Any]:
            order = torch.randperm(columns[0].shape[0], generator=generator).to(device)
            for index in order.split(config.batch_size):
                yield [column.index_select(0, index) for column in columns]

        return epoch, lambda: 0, lambda: None

    return LoaderSpec("ideal: index_select on the device", open_, "ideal")


def _ideal_replay_spec(dataset: TensorDataset, config: BenchConfig, device: torch.device) -> LoaderSpec:
    def open_():
        columns = [t.to(device) for t in dataset.tensors]
        order = torch.randperm(columns[0].shape[0], generator=torch.Generator().manual_seed(config.seed))
        batches = [
            [column.index_select(0, i.to(device)) for column in columns]
            for i in order.split(config.batch_size)
        ]
        return (lambda: iter(batches)), lambda: 0, batches.clear

    return LoaderSpec("ideal: replay of prepared batches", open_, "ideal")


def load_arrays(path: str) -> TensorDataset:
    """A user's .npy (one array, one row per sample) or .npz (several aligned arrays)."""
    import numpy as np

    loaded = np.load(path, allow_pickle=False)
    arrays = [loaded[key] for key in loaded.files] if hasattr(loaded, "files") else [loaded]
    return TensorDataset(*gpuload.ArrayDataset(*arrays).columns.values())


def inmemory_loaders(
    config: BenchConfig, device: torch.device, dataset: TensorDataset | None = None
) -> tuple[TensorDataset, list[LoaderSpec]]:
    """Tensors in memory (CIFAR-shaped unless given): torch, gpuload streaming and cached, ideals."""
    dataset = dataset if dataset is not None else synthetic_cifar(config)
    specs = [torch_spec(dataset, config, workers, device) for workers in config.torch_workers]
    specs.append(gpuload_spec(dataset, config, device, "auto", "device cache"))
    specs.append(ideal_gather_spec(dataset, config, device))
    specs.append(_ideal_replay_spec(dataset, config, device))
    # Last: on a CPU, its background thread's allocations can leave glibc's malloc returning
    # memory to the OS, which slows every later large allocation of the process (page faults).
    specs.append(gpuload_spec(dataset, config, device, "off", "streaming, no cache"))
    return dataset, specs
