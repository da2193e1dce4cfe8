"""Scenario "partial": a dataset larger than the cache budget, beside the same data when it fits.

The same in-memory arrays go through torch's DataLoader, gpuload with the whole dataset cached,
and gpuload with ``cache_size`` smaller than the data. Its cache plan puts the first samples on
the device and the rest in pinned host memory (``cache="auto"``) or leaves them at the source
(``cache="device"``), so epoch 1 fills the device tier and every later epoch copies only the
part that did not fit.

On a CPU device no tier is built: the arrays are served in place and nothing crosses PCIe, so
the rows time the in-place path. What a card would do is then modelled, not measured: the plan
``make_plan`` chooses for a pretended card is stored beside each row (``cache_plan_modelled``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from gpuload.bench.scenarios import (
    BenchConfig,
    LoaderSpec,
    gpuload_spec,
    ideal_gather_spec,
    synthetic_cifar,
    torch_spec,
)
from gpuload.cache import CachePlan, CacheSettings, format_bytes
from gpuload.device import MemoryInfo, host_memory

__all__ = ["partial_loaders", "modelled_plan", "plan_summary", "dataset_nbytes", "DEFAULT_PRETENDED_CARD"]

DEFAULT_PRETENDED_CARD = 16 << 30
_FITS = ("auto", None, "whole dataset cached")


def dataset_nbytes(dataset: TensorDataset) -> int:
    """Bytes of all the dataset's arrays."""
    return sum(t.numel() * t.element_size() for t in dataset.tensors)


def _cached_rows(cache_size: int) -> list[tuple[str, int | None, str]]:
    """(cache mode, cache_size, label) of each gpuload row with a cache; the header gives the size."""
    return [_FITS, ("auto", cache_size, "part cached + pinned host"), ("device", cache_size, "part cached + source")]


def modelled_plan(dataset: TensorDataset, mode: str, cache_size: int | None, device_memory: int) -> CachePlan:
    """The plan gpuload would make for ``dataset`` on an empty card of ``device_memory`` bytes.

    The same steps as the loader's own placement: the settings (keyword, environment,
    gpuload.toml), the reserve, the budget, then ``make_plan`` with this host's free memory.
    """
    settings = CacheSettings.resolve(cache=mode, cache_size=cache_size)
    memory = MemoryInfo(free=device_memory, total=device_memory)
    card = f"a pretended {format_bytes(device_memory)} card"
    num_samples = len(dataset)
    return settings.array_plan(dataset_nbytes(dataset) // num_samples, num_samples, memory, host_memory(),
                               device=card, shared=False)


def plan_summary(plan: CachePlan) -> dict[str, Any]:
    """A plan as JSON-ready numbers, with its readable description."""
    return {
        "kind": plan.kind,
        "device_samples": plan.device_samples,
        "host_samples": plan.host_samples,
        "source_samples": plan.source_samples,
        "h2d_bytes_first_epoch": plan.fill_bytes + plan.h2d_bytes_per_epoch_cached,
        "h2d_bytes_per_epoch": plan.h2d_bytes_per_epoch_cached,
        "describe": plan.describe(),
    }


def partial_loaders(
    config: BenchConfig,
    device: torch.device,
    cache_size: int | None = None,
    dataset: TensorDataset | None = None,
    device_memory: int = DEFAULT_PRETENDED_CARD,
) -> tuple[TensorDataset, int, list[LoaderSpec]]:
    """torch, gpuload cached whole / in part (``cache_size``, default half the data), streaming.

    Returns the dataset, the cache size used and the loaders. On a CPU ``device`` each cached
    row carries the plan modelled for a card of ``device_memory`` bytes.
    """
    dataset = dataset if dataset is not None else synthetic_cifar(config)
    total = dataset_nbytes(dataset)
    cache_size = cache_size if cache_size is not None else total // 2
    if not 0 < cache_size < total:
        raise ValueError(
            f"--cache-size {format_bytes(cache_size)} must be more than 0 and less than the dataset "
            f"({format_bytes(total)}) for the dataset to only partly fit"
        )
    specs = [torch_spec(dataset, config, workers, device) for workers in config.torch_workers]
    for mode, size, label in _cached_rows(cache_size):
        spec = gpuload_spec(dataset, config, device, mode, label, cache_size=size)
        if device.type == "cpu":
            spec.notes["cache_plan_modelled"] = plan_summary(modelled_plan(dataset, mode, size, device_memory))
            spec.notes["cache_plan_modelled_for"] = f"a pretended {format_bytes(device_memory)} card"
        specs.append(spec)
    specs.append(ideal_gather_spec(dataset, config, device))
    # Last, as in the in-memory scenario: its background thread disturbs later allocations.
    specs.append(gpuload_spec(dataset, config, device, "off", "streaming, no cache"))
    return dataset, cache_size, specs
