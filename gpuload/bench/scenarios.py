"""Benchmark scenarios: the same data through each loader, side by side, in one run.

Each scenario lists loaders as ``LoaderSpec``: a name and a factory returning a fresh epoch
iterable plus a counter of host-to-device bytes. torch's DataLoader gets the settings a tuned
job would use (persistent workers; pinned memory and non-blocking copies on a GPU). The ideals
need no loader at all: a bare ``index_select`` gather from data already on the device, and, with
a training step, a replay of batches prepared on the device in advance (the step alone: without
a step it would time a list's iteration, which says nothing). On a CPU each row carries the
host-to-device bytes a card would see (``h2d_modelled``, see ``gpuload.bench.modelled``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

import gpuload
from gpuload.array_files import read_array_file
from gpuload.bench.modelled import DEFAULT_PRETENDED_CARD, modelled_h2d, plan_notes
from gpuload.timeline import Timeline
from gpuload.transfer import batch_nbytes, move_to_device

__all__ = [
    "LoaderSpec", "BenchConfig", "inmemory_loaders", "synthetic_cifar", "torch_spec", "gpuload_spec",
    "ideal_gather_spec", "served_from", "top_stage", "LoaderEpochs",
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


Opened = tuple[Callable[[], Iterable[Any]], Callable[[], int], Callable[[], None]]


def not_opened() -> Opened:
    """A ``LoaderSpec.open`` until the scenario sets its own (which reads the spec's notes)."""
    raise RuntimeError("this LoaderSpec's open() was not set")


@dataclass
class LoaderSpec:
    """One loader in a scenario. ``open()`` returns (epoch factory, bytes counter, closer)."""

    name: str
    open: Callable[[], Opened]
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
    """torch's DataLoader with the copy a tuned loop does, counting the bytes it copies.

    On a CPU nothing is copied; the bytes of each epoch's batches are still counted and, at
    ``close()``, put in ``notes`` as the modelled copy (``h2d_modelled``), on ``modelled_basis``.
    """

    modelled_basis = "its batches, copied to the device by the loop"

    def __init__(self, loader: TorchDataLoader, device: torch.device, notes: dict[str, Any]) -> None:
        self.loader, self.device, self.notes = loader, device, notes
        self.bytes_h2d = 0
        self.batch_bytes_per_epoch: list[int] = []

    def __call__(self) -> Iterator[Any]:
        epoch_bytes = 0
        for batch in self.loader:
            nbytes = batch_nbytes(batch)
            epoch_bytes += nbytes
            if self.device.type == "cuda":
                self.bytes_h2d += nbytes
                batch = move_to_device(batch, self.device, non_blocking=True)
            yield batch
        self.batch_bytes_per_epoch.append(epoch_bytes)  # whole epochs only

    def close(self) -> None:
        iterator = self.loader._iterator
        if iterator is not None:
            iterator._shutdown_workers()  # type: ignore[attr-defined]  # torch's iterators have it; its stub does not
        if self.device.type != "cuda" and self.batch_bytes_per_epoch:
            per_epoch = self.batch_bytes_per_epoch
            self.notes["h2d_modelled"] = modelled_h2d(per_epoch[0], per_epoch[-1], self.modelled_basis)


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
        epochs = CountingEpochs(loader, device, spec.notes)
        return epochs, lambda: epochs.bytes_h2d, epochs.close

    spec = LoaderSpec(f"torch DataLoader (num_workers={workers})", open_, "baseline" if workers == 0 else "loader")
    return spec


class LoaderEpochs:
    """A gpuload loader as a scenario's epoch factory: each call is an epoch (the loader's next
    ``iter()``); ``timeline`` is the loader's, which the bench turns on for one traced epoch after the
    timed ones (``gpuload.bench.measure.trace_epoch``)."""

    def __init__(self, loader: gpuload.DataLoader) -> None:
        self.loader = loader

    def __call__(self) -> gpuload.DataLoader:
        return self.loader

    @property
    def timeline(self) -> Timeline:
        return self.loader.timeline


def top_stage(loader: gpuload.DataLoader) -> str | None:
    """The stage most of a gpuload loader's time went to over its timeline's totals (the bench's
    traced epoch); None when nothing was recorded."""
    return next(iter(loader.timeline.stage_seconds()), None)


def served_from(loader: gpuload.DataLoader) -> dict[str, Any]:
    """Where a gpuload loader's batches came from: its path, the cache tiers when it has them, and
    its :func:`top_stage`."""
    stats = loader.stats
    notes: dict[str, Any] = {"path": stats.path, "top_stage": top_stage(loader)}
    if "cache" in stats.extra:
        notes.update(cache=stats.extra["cache"], cache_plan=stats.extra["cache_plan"])
    return notes


def gpuload_spec(
    dataset: TensorDataset, config: BenchConfig, device: torch.device, cache: str, label: str,
    cache_size: int | None = None, device_memory: int = DEFAULT_PRETENDED_CARD,
) -> LoaderSpec:
    """gpuload over the arrays with ``cache`` (and ``cache_size`` bytes); notes say what served.

    On a CPU the notes also carry the plan for a pretended card of ``device_memory`` bytes.
    """
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

        return LoaderEpochs(loader), lambda: loader.stats.bytes_h2d, close

    spec = LoaderSpec(f"gpuload DataLoader ({label})", open_)
    if device.type != "cuda":
        spec.notes.update(plan_notes(dataset, cache, cache_size, device_memory))
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
    """A user's .npy (one array, one row per sample) or .npz (several aligned arrays).

    Raises ``ValueError`` naming the file when it is missing, not NumPy's format, or holds no
    usable arrays (:func:`gpuload.array_files.read_array_file` says which).
    """
    import zipfile

    import numpy as np

    arrays = read_array_file(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        columns = [loaded[key] for key in arrays.columns] if hasattr(loaded, "files") else [loaded]
        return TensorDataset(*gpuload.ArrayDataset(*columns).columns.values())
    except (OSError, ValueError, TypeError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"cannot load {path} as .npy/.npz arrays: {error}") from None


def inmemory_loaders(
    config: BenchConfig, device: torch.device, dataset: TensorDataset | None = None,
    device_memory: int = DEFAULT_PRETENDED_CARD,
) -> tuple[TensorDataset, list[LoaderSpec]]:
    """Tensors in memory (CIFAR-shaped unless given): torch, gpuload streaming and cached, ideals.

    The replay ideal only with a training step: without one it times nothing but a list.
    """
    dataset = dataset if dataset is not None else synthetic_cifar(config)
    specs = [torch_spec(dataset, config, workers, device) for workers in config.torch_workers]
    specs.append(gpuload_spec(dataset, config, device, "auto", "device cache", device_memory=device_memory))
    specs.append(ideal_gather_spec(dataset, config, device))
    if config.step != "none":
        specs.append(_ideal_replay_spec(dataset, config, device))
    # Last: on a CPU, its background thread's allocations can leave glibc's malloc returning
    # memory to the OS, which slows every later large allocation of the process (page faults).
    specs.append(gpuload_spec(dataset, config, device, "off", "streaming, no cache", device_memory=device_memory))
    return dataset, specs
