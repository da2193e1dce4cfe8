"""What a card would copy, modelled where nothing crosses to a device (a CPU run).

On a CPU every host-to-device counter reads 0, so the report's bytes panel would be empty. Each
row then carries the figures a card would see, labelled as modelled: for torch's DataLoader the
bytes of the batches it yielded (what a training loop's ``.to(device)`` copies every epoch), for
gpuload over arrays the plan ``make_plan`` chooses for a pretended card of ``device_memory``.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import TensorDataset

from gpuload.cache import CachePlan, CacheSettings, format_bytes
from gpuload.device import MemoryInfo, host_memory

__all__ = [
    "DEFAULT_PRETENDED_CARD", "dataset_nbytes", "modelled_plan", "plan_summary", "modelled_h2d", "pretended_card",
    "plan_notes",
]

DEFAULT_PRETENDED_CARD = 16 << 30


def pretended_card(device_memory: int) -> str:
    """How the report names the card a CPU run models."""
    return f"a pretended {format_bytes(device_memory).replace('.00 ', ' ')} card"


def dataset_nbytes(dataset: TensorDataset) -> int:
    """Bytes of all the dataset's arrays."""
    return sum(t.numel() * t.element_size() for t in dataset.tensors)


def modelled_plan(dataset: TensorDataset, mode: str, cache_size: int | None, device_memory: int) -> CachePlan:
    """The plan gpuload would make for ``dataset`` on an empty card of ``device_memory`` bytes.

    The same steps as the loader's own placement: the settings (keyword, environment,
    gpuload.toml), the reserve, the budget, then ``make_plan`` with this host's free memory.
    """
    num_samples = len(dataset)
    if num_samples == 0:
        raise ValueError("the dataset holds no samples: there is nothing to place")
    settings = CacheSettings.resolve(cache=mode, cache_size=cache_size)
    memory = MemoryInfo(free=device_memory, total=device_memory)
    return settings.array_plan(dataset_nbytes(dataset) // num_samples, num_samples, memory, host_memory(),
                               device=pretended_card(device_memory), shared=False)


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


def modelled_h2d(first_epoch: int, per_epoch: int, basis: str, card: str | None = None) -> dict[str, Any]:
    """A row's modelled host-to-device bytes: epoch 1, each later epoch, what they rest on and,
    for gpuload's rows, the card pretended."""
    figures = {"first_epoch": int(first_epoch), "per_epoch": int(per_epoch), "basis": basis}
    return {**figures, "card": card} if card else figures


def plan_notes(dataset: TensorDataset, mode: str, cache_size: int | None, device_memory: int) -> dict[str, Any]:
    """A gpuload row's notes on a CPU: the modelled plan and the bytes it would copy."""
    card = pretended_card(device_memory)
    plan = plan_summary(modelled_plan(dataset, mode, cache_size, device_memory))
    return {
        "cache_plan_modelled": plan,
        "cache_plan_modelled_for": card,
        "h2d_modelled": modelled_h2d(plan["h2d_bytes_first_epoch"], plan["h2d_bytes_per_epoch"],
                                     f"gpuload's cache plan for {card}", card),
    }
