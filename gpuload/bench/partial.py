"""Scenario "partial": a dataset larger than the cache budget, beside the same data when it fits.

The same in-memory arrays go through torch's DataLoader, gpuload with the whole dataset cached,
and gpuload with ``cache_size`` smaller than the data. Its cache plan puts the first samples on
the device and the rest in host memory (``cache="auto"``) or leaves them at the source
(``cache="device"``), so epoch 1 fills the device tier and every later epoch copies only the
part that did not fit.

On a CPU device no tier is built: the arrays are served in place and nothing crosses PCIe, so
the rows time the in-place path. What a card would do is then modelled, not measured: the plan
``make_plan`` chooses for a pretended card is stored beside each row (``cache_plan_modelled``,
see ``gpuload.bench.modelled``).
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from gpuload.bench.modelled import DEFAULT_PRETENDED_CARD, dataset_nbytes
from gpuload.bench.scenarios import (
    BenchConfig,
    LoaderSpec,
    gpuload_spec,
    ideal_gather_spec,
    synthetic_cifar,
    torch_spec,
)
from gpuload.cache import format_bytes

__all__ = ["partial_loaders"]

_FITS = ("auto", None, "whole dataset cached")


def _cached_rows(cache_size: int) -> list[tuple[str, int | None, str]]:
    """(cache mode, cache_size, label) of each gpuload row with a cache; the header gives the size."""
    return [_FITS, ("auto", cache_size, "part cached + host memory"), ("device", cache_size, "part cached + source")]


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
        specs.append(gpuload_spec(dataset, config, device, mode, label, cache_size=size, device_memory=device_memory))
    specs.append(ideal_gather_spec(dataset, config, device))
    # Last, as in the in-memory scenario: its background thread disturbs later allocations.
    specs.append(gpuload_spec(dataset, config, device, "off", "streaming, no cache", device_memory=device_memory))
    return dataset, cache_size, specs
