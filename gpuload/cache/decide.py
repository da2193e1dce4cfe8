"""Whether and where a dataset's data is cached, in one vocabulary for every data path.

A :class:`CacheDecision` says what a cache keeps (``holds``: dataset ``"samples"``,
``"decoded"`` images or ``"encoded"`` file bytes), on which tier (``tier``: ``"device"``, the
loader's device, or ``"host"`` memory; ``"none"`` for no cache), within how many bytes, and why.
In-memory arrays are placed by a :class:`~gpuload.cache.plan.CachePlan` instead
(``CacheSettings.array_plan``), since they can be split over tiers row by row.

Everything here is decided from settings and memory readings passed in (or read once), so
each decision is testable on a CPU with any pretended card.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpuload.cache.budget import format_bytes
from gpuload.cache.identity import IdentityError
from gpuload.cache.probe import estimate_image_bytes, looks_deterministic
from gpuload.cache.settings import CacheSettings
from gpuload.datasets.images import ImageFiles
from gpuload.device import MemoryInfo, device_memory, host_memory

__all__ = ["CacheDecision", "decide_samples", "decide_images"]


@dataclass(frozen=True)
class CacheDecision:
    """What a cache keeps, on which tier, within how many bytes, and why.

    ``tier`` is ``"device"`` (the loader's device, host memory when that is the CPU),
    ``"host"`` or ``"none"``; ``holds`` is ``"samples"``, ``"decoded"`` or ``"encoded"``
    (empty without a cache); ``warn``: the reason deserves a one-time warning to the user.
    """

    tier: str
    holds: str
    budget: int
    reason: str
    warn: bool = False

    @property
    def caches(self) -> bool:
        return self.tier != "none"


def _none(reason: str, warn: bool = False) -> CacheDecision:
    return CacheDecision("none", "", 0, reason, warn)


def decide_samples(
    dataset: Any,
    settings: CacheSettings,
    device: torch.device,
    *,
    default_collate: bool,
    num_workers: int,
    in_order: bool,
    owner: Any = None,
    device_memory_info: MemoryInfo | None = None,
    host_memory_info: MemoryInfo | None = None,
    probe: Callable[[Any], tuple[bool, str]] = looks_deterministic,
) -> CacheDecision:
    """Where a map-style dataset's samples are kept, and why.

    ``cache="auto"`` caches on a CUDA device only, and only a dataset whose samples read the
    same twice (``probe``); on a CPU device the dataset itself already serves the loop, so auto
    leaves it alone. ``cache="device"`` / ``"host"`` cache without declining, but probe too and
    warn once (``warn``) when the samples look random (the first epoch's augmentation is frozen).
    The device tier needs torch's default collation (batches are collated from device
    tensors); with a custom ``collate_fn`` samples are kept in host memory.
    """
    mode = settings.mode.value
    off = settings.off_reason()
    if off:
        return _none(off)
    try:
        count = len(dataset)
    except TypeError:
        return _none(f"{type(dataset).__name__} has no len(): samples cannot be counted")
    if count == 0:
        return _none("the dataset is empty")
    if num_workers > 0 and not in_order:
        return _none("in_order=False with workers: batches cannot be matched to their samples", warn=mode != "auto")
    host = host_memory_info or host_memory()
    if device.type == "cpu" and mode == "auto":
        return _none("on a CPU device the dataset serves the loop itself; cache='host' keeps its samples in memory")
    try:
        deterministic, why = probe(dataset)
    except IdentityError:  # cache_dir's disk tier refuses the dataset: the user must pass cache_key=
        raise
    except Exception as error:  # indices that are not 0..len-1 (a dict, a keyed store): no probe
        if mode == "auto":
            return _none(f"reading dataset[0] for the determinism probe failed ({type(error).__name__}: {error})")
        deterministic, why = True, ""
    if not deterministic and mode == "auto":
        return _none(f"{why}, so it is not cached (pass cache='device' or 'host' to cache it anyway, "
                     "freezing the first epoch's samples)", warn=True)
    frozen = "" if deterministic else (
        f"; {why}, and the first epoch's samples are kept and served again: use cache='off', or "
        "gpuload's transforms= for the random part"
    )
    if device.type == "cpu":
        return CacheDecision("host", "samples", settings.host_room(host),
                             f"cache={mode!r} on a CPU device: host memory{frozen}", bool(frozen))
    if mode == "host" or not default_collate:
        why = f"cache={mode!r}" if mode == "host" else "a custom collate_fn runs on host samples"
        return CacheDecision("host", "samples", settings.host_room(host), f"{why}: host memory{frozen}", bool(frozen))
    budget = settings.device_room(device, device_memory_info or device_memory(device), owner)
    if budget == 0 and mode == "auto":
        return CacheDecision("host", "samples", settings.host_room(host),
                             f"no device budget left on {device}: host memory")
    return CacheDecision("device", "samples", budget,
                         f"device memory on {device} (budget {format_bytes(budget)}){frozen}", bool(frozen))


def decide_images(
    source: ImageFiles,
    settings: CacheSettings,
    device: torch.device,
    *,
    owner: Any = None,
    device_memory_info: MemoryInfo | None = None,
    host_memory_info: MemoryInfo | None = None,
) -> CacheDecision:
    """Whether an image source keeps decoded images or encoded bytes, from estimated sizes and budgets.

    ``cache="device"`` keeps decoded images (on the device; in host memory on a CPU device),
    ``cache="host"`` keeps encoded bytes in host memory. ``"auto"`` on CUDA keeps decoded images
    when they all fit the device budget, else encoded bytes when they fit in host memory, else
    as many decoded images as fit. On a CPU device ``"auto"`` caches nothing.
    """
    mode = settings.mode.value
    off = settings.off_reason()
    if off:
        return _none(off)
    if device.type == "cpu" and mode == "auto":
        return _none(
            "on a CPU device images are decoded every epoch; cache='device' keeps them decoded in "
            "memory, cache='host' keeps the files' bytes"
        )
    decoded, encoded = estimate_image_bytes(source, on_device=device.type != "cpu")
    host = host_memory_info or host_memory()
    estimate = f"decoded ~{format_bytes(decoded)}, encoded ~{format_bytes(encoded)}"
    if mode == "host":
        return CacheDecision("host", "encoded", settings.host_room(host),
                             f"cache='host': encoded bytes in host memory ({estimate})")
    if device.type == "cpu":
        return CacheDecision("device", "decoded", settings.host_room(host),
                             f"cache='device' on a CPU device: decoded images in host memory ({estimate})")
    budget = settings.device_room(device, device_memory_info or device_memory(device), owner)
    if mode == "auto" and decoded > budget:
        room = settings.host_room(host, sized=False)
        if encoded <= room:
            return CacheDecision(
                "host", "encoded", room, f"decoded images would not fit the device budget ({format_bytes(budget)}); "
                f"encoded bytes in host memory ({estimate})",
            )
    fits = "all" if decoded <= budget else "part"
    return CacheDecision("device", "decoded", budget, f"decoded images on {device}, {fits} of them within the "
                         f"budget {format_bytes(budget)} ({estimate})")
