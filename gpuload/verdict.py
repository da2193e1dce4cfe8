"""The one line ``loader.timeline.summary()`` prints: is the loop waiting on data, on which stage,
and which of this loader's settings would help.

The verdict is derived from what the timeline measured over its recent steps: the share of step
time the loop waited (data-bound above :data:`DATA_BOUND`), and the stage most of the loader's
time went to. Each stage has its own suggestions (:data:`SUGGESTIONS`), each chosen from the
loader's actual settings (device, workers, prefetch depth, cache, the decode and transform
backends that ran), so the line names a change that applies to this loader.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DATA_BOUND", "STAGES", "SUGGESTIONS", "LoaderSettings", "Verdict", "suggestions", "verdict"]

#: Each stage a timeline measures (``gpuload.timeline.stage``) and what a person calls it.
STAGES: dict[str, str] = {
    "read": "dataset reads",
    "decode": "image decoding",
    "transform": "transforms",
    "gather.device": "cache gather (device tier)",
    "gather.host": "cache gather (host tier)",
    "gather.disk": "cache gather (disk tier)",
    "gather.source": "gather from the uncached arrays",
    "copy": "host-to-device copy",
    "exchange": "exchange between ranks",
    "slot_wait": "waiting for a free pinned slot",
    "other": "other loader work (collation, Python)",
}

#: Waiting more than this share of step time is data-bound.
DATA_BOUND = 0.05

_CPU_DECODERS = ("pil", "torchvision", "dali-cpu")


@dataclass(frozen=True)
class LoaderSettings:
    """What the suggestions look at: a loader's settings and what ran (``LoaderSettings.of``)."""

    device: str = "cpu"
    num_workers: int = 0
    prefetch_depth: int | None = None
    depth_in_use: int | None = None  # the prefetcher's ring, when one ran
    cache: str | None = None
    cache_dir: str | None = None
    cache_scope: str | None = None
    path: str = ""
    decode_backend: str = ""
    transform_backend: str = ""

    @classmethod
    def of(cls, loader: Any) -> LoaderSettings:
        """``loader``'s settings (a ``gpuload.DataLoader``, or settings as they are; None: the defaults)."""
        if loader is None:
            return cls()
        if isinstance(loader, LoaderSettings):
            return loader
        stats = loader.stats
        prefetch = stats.extra.get("prefetch") or {}
        return cls(
            device=loader.device.type, num_workers=loader.num_workers, prefetch_depth=loader.prefetch_depth,
            depth_in_use=prefetch.get("depth"), cache=loader.cache,
            cache_dir=None if loader.cache_dir is None else str(loader.cache_dir), cache_scope=loader.cache_scope,
            path=stats.path, decode_backend=str(stats.extra.get("decode_backend") or ""),
            transform_backend=str(stats.extra.get("transform_backend") or ""),
        )

    @property
    def torch_path(self) -> bool:
        """Batches come from torch's fetching (the dataset's ``__getitem__``), not a gpuload source."""
        return self.path.startswith(("torch", "sample"))


def _workers(s: LoaderSettings) -> str:
    return f"num_workers={max(2, min(8, (os.cpu_count() or 2) - 1))}"


def _read(s: LoaderSettings) -> list[str]:
    tips = []
    if s.torch_path and s.num_workers == 0:
        tips.append(f"{_workers(s)} (the dataset's __getitem__ runs in this process)")
    if s.cache == "off":
        tips.append('cache="auto" (later epochs read from the cache, not the dataset)')
    elif s.path.startswith("image-files"):
        tips.append('cache="device" or cache="host" (later epochs read no file)')
    else:
        tips.append("a faster __getitem__ (read less, transform on the device with transforms=), or a "
                    "larger cache_size so later epochs read from the cache")
    return tips


def _decode(s: LoaderSettings) -> list[str]:
    tips = []
    if s.decode_backend in _CPU_DECODERS:
        if s.device == "cpu":
            tips.append('device="cuda": on a GPU images decode there (DALI or nvJPEG), not on the CPU')
        else:
            tips.append(f"install DALI (gpuload[cuda13]) to decode on the GPU (now: {s.decode_backend} on the CPU)")
    tips.append('cache="device" (decoded images kept: no decode after the first epoch)')
    return tips


def _transform(s: LoaderSettings) -> list[str]:
    if s.device == "cpu":
        return ['device="cuda": transforms run there as fused kernels, not on the CPU']
    if s.transform_backend == "torch":
        return ["install cupy (gpuload[cuda13]): the fused kernels replace the torch reference ops"]
    return ["fewer or cheaper transforms (the crop first: later ops see fewer pixels)"]


def _gather_device(s: LoaderSettings) -> list[str]:
    return ["larger batches (a gather's fixed cost is per batch)"]


def _gather_host(s: LoaderSettings) -> list[str]:
    if s.device == "cpu":
        return ["smaller samples (uint8 until transforms=ToDtype)"]
    return ["a larger cache_size: rows on the device need no host gather or copy"]


def _gather_disk(s: LoaderSettings) -> list[str]:
    where = f" (now {s.cache_dir})" if s.cache_dir else ""
    return [f"a larger cache_size so fewer rows come from disk, or cache_dir on a faster disk{where}"]


def _gather_source(s: LoaderSettings) -> list[str]:
    if s.cache == "off":
        return ['cache="auto" (cached rows are gathered without reading the source arrays)']
    return ["a larger cache_size (rows past the cache are gathered from the source arrays)"]


def _copy(s: LoaderSettings) -> list[str]:
    tips = []
    if s.cache == "off":
        tips.append('cache="auto" (rows the cache keeps on the device are not copied again)')
    elif s.device != "cpu":
        tips.append("a larger cache_size so rows stay on the device")
    tips.append("fewer bytes per batch: uint8 data, converted on the device (transforms=[..., ToDtype]), "
                "copies 4x fewer than float32")
    return tips


def _exchange(s: LoaderSettings) -> list[str]:
    return ['cache_scope="rank" if each rank can hold its own copy (no exchange per batch)',
            "a faster interconnect between ranks (NCCL over NVLink or InfiniBand)"]


def _slot_wait(s: LoaderSettings) -> list[str]:
    depth = s.prefetch_depth if s.prefetch_depth is not None else s.depth_in_use
    now = f" (now {depth})" if depth is not None else ""
    return [f"a deeper ring: prefetch_depth={max(2, 2 * (depth or 1))}{now}, so a slot is free while earlier "
            "copies finish"]


def _other(s: LoaderSettings) -> list[str]:
    if s.torch_path and s.num_workers == 0:
        return [f"{_workers(s)} (collation runs in workers)"]
    return ["larger batches (per-batch Python costs are fixed)"]


#: Each stage's suggestions, from a loader's settings, most relevant first.
SUGGESTIONS: dict[str, Callable[[LoaderSettings], list[str]]] = {
    "read": _read, "decode": _decode, "transform": _transform, "gather.device": _gather_device,
    "gather.host": _gather_host, "gather.disk": _gather_disk, "gather.source": _gather_source, "copy": _copy,
    "exchange": _exchange, "slot_wait": _slot_wait, "other": _other,
}
assert set(SUGGESTIONS) == set(STAGES)


def suggestions(name: str, settings: LoaderSettings) -> list[str]:
    """What would shorten stage ``name`` for a loader with ``settings``, most relevant first."""
    tips = SUGGESTIONS[name](settings)
    if settings.prefetch_depth == 0 and name != "slot_wait":
        tips.insert(0, "prefetch_depth unset (0 makes each batch in the loop's thread: nothing overlaps the step)")
    return tips


@dataclass(frozen=True)
class Verdict:
    """``bound``: "data", "compute" or "unknown"; ``wait_fraction`` over the recent steps;
    ``stage``: the stage most of the loader's time went to; ``line``: all of it in one line."""

    bound: str
    wait_fraction: float | None
    stage: str | None
    suggestions: tuple[str, ...]
    line: str


def verdict(fraction: float | None, means: dict[str, float], loader: Any = None) -> Verdict:
    """The verdict for a loop that waited ``fraction`` of its step time (None: not measured yet)
    while the loader's stages took ``means`` seconds per step, with suggestions for ``loader``'s
    settings (a ``gpuload.DataLoader`` or its ``LoaderSettings``; None: the defaults)."""
    if fraction is None:
        return Verdict("unknown", None, None, (), "not enough steps measured yet")
    top = max(means, key=means.__getitem__) if means else None
    share = ""
    if top is not None:
        total = sum(means.values())
        label = STAGES.get(top, top)
        share = f"{label} ({100 * means[top] / total:.0f}% of the loader's time)" if total > 0 else label
    if fraction < DATA_BOUND:
        line = f"compute-bound: {100 * fraction:.1f}% of step time waiting for data"
        return Verdict("compute", fraction, top, (), line + (f"; top stage: {share}" if top else ""))
    tips = tuple(suggestions(top, LoaderSettings.of(loader))) if top in SUGGESTIONS else ()
    line = f"data-bound: {100 * fraction:.0f}% of step time waiting for data"
    if top is not None:
        line += f", mostly {share}"
    if tips:
        line += f"; try {tips[0]}"
    return Verdict("data", fraction, top, tips, line)
