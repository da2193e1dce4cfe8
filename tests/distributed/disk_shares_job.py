"""What each rank of the disk-tier-under-a-split tests runs (imported by name in the spawned
processes): loaders with ``cache_scope="node"`` and ``cache_dir=`` one folder, for a map-style
dataset's samples and for gpuload's own image source. Each rank counts what it reads from the
dataset (samples by index, image files) and writes its findings to ``rank<r>.json``."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import images_job
import ranks_job
import samples_job
import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpuload
import gpuload.cache.disk_tier as disk_tier
import gpuload.decode.batch as decode_batch
from gpuload.cache.probe import probed_indices
from gpuload.datasets import ImageList


class CountedPairs(samples_job.Pairs):
    """``samples_job.Pairs`` counting the reads of each index (in this process: no workers)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[int] = Counter()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.reads[index] += 1
        return super().__getitem__(index)


class CountedImages(ImageList):
    """An ImageList counting the files it reads."""

    def __init__(self, samples: list) -> None:
        super().__init__([tuple(s) for s in samples])
        self.reads = 0

    def read_encoded(self, index: int) -> Any:
        self.reads += 1
        return super().read_encoded(index)


def _disk_budget(cache_dir: str | None) -> dict[str, str]:
    """A named disk budget (as ``child_processes.CHILD_DISK_CACHE_SIZE``): a rank reads the real
    disk, where ``auto`` is no tier at all with under 8 GiB free."""
    return {} if cache_dir is None else {"disk_cache_size": "4GiB"}


def sample_epochs(data: tud.Dataset, scope: str, cache_dir: str | None, epochs: int = 2,
                  **options: Any) -> dict[str, Any]:
    """gpuload's epochs against torch's, the indices read from the dataset while the loader was
    made and ran (beyond the determinism probe's), and its disk tier's stats."""
    def sampler() -> DistributedSampler:
        return DistributedSampler(data, shuffle=True, seed=ranks_job.SEED)

    theirs = tud.DataLoader(data, 8, sampler=sampler())
    expected = []
    for epoch in range(epochs):
        theirs.sampler.set_epoch(epoch)
        expected.append(list(theirs))
    data.reads.clear()
    with ranks_job.recorded_warnings() as caught:
        ours = gpuload.DataLoader(data, 8, sampler=sampler(), device="cpu", cache_scope=scope, cache_dir=cache_dir,
                                  **_disk_budget(cache_dir), **options)
        got = []
        for epoch in range(epochs):
            ours.sampler.set_epoch(epoch)
            got.append(list(ours))
    equal = all(samples_job.same(a, b) for a, b in zip(expected, got, strict=True))
    probed = set(probed_indices(len(data)))  # looks_deterministic reads these
    result = {"equal": equal, "path": ours.stats.path, "read": sorted(i for i in data.reads if i not in probed),
              "disk": ours.stats.extra.get("cache", {}).get("disk"), "warnings": [str(w.message) for w in caught]}
    ours.close()
    return result


def image_epochs(samples: list, scope: str, cache_dir: str | None, epochs: int = 2) -> dict[str, Any]:
    """gpuload's image loader with ``scope``: its batches, the files it read, its disk stats."""
    data = CountedImages(samples)
    with ranks_job.recorded_warnings() as caught:
        ours = gpuload.DataLoader(data, images_job.BATCH, sampler=images_job.sampler(data), device="cpu",
                                  transforms=images_job.OPS, cache_scope=scope, cache_dir=cache_dir,
                                  **_disk_budget(cache_dir))
        batches = []
        for epoch in range(epochs):
            ours.sampler.set_epoch(epoch)
            batches.append(images_job.outcomes(ours))
    result = {"batches": batches, "path": ours.stats.path, "reads": data.reads,
              "disk": ours.stats.extra["cache"].get("disk"), "warnings": [str(w.message) for w in caught]}
    ours.close()
    return result


def run(rank: int, world: int, init_file: str, out_dir: str, local_world_size: int | None) -> None:
    with ranks_job.gloo_job(rank, world, init_file, local_world_size):
        folder = Path(out_dir)
        found: dict[str, Any] = {}
        pairs = CountedPairs()
        # One job fills the entry, each rank its share; the next jobs (either scope) read it.
        disk_tier.BLOCK_BYTES = 20 * samples_job.ROW_BYTES  # blocks of about 20 samples
        cache = folder / "samples-cache"
        for key, scope, options in (("samples_fill", "node", {}), ("samples_again", "node", {}),
                                    ("samples_rank", "rank", {"cache": "host"})):  # host: a CPU device's cache
            found[key] = sample_epochs(pairs, scope, str(cache), **options)
            dist.barrier()
        found["samples_without"] = sample_epochs(pairs, "node", None)
        found["samples_damaged"] = damage_one_block(cache, rank)
        found["samples_after_damage"] = sample_epochs(pairs, "node", str(cache))
        dist.barrier()
        found["samples_refilled"] = sample_epochs(pairs, "node", str(cache))
        disk_tier.BLOCK_BYTES = 16 << 10  # blocks of a few images
        if rank == 0:
            images_job.write_images(folder)  # the JPEGs, written once
        dist.barrier()
        samples = _image_samples(folder)
        without = image_epochs(samples, "node", None)
        filled = image_epochs(samples, "node", str(folder / "images-cache"))
        dist.barrier()
        again = image_epochs(samples, "node", str(folder / "images-cache"))
        found["images_damaged"] = damage_one_block(folder / "images-cache", rank)
        after_damage = image_epochs(samples, "node", str(folder / "images-cache"))
        dist.barrier()
        refilled = image_epochs(samples, "node", str(folder / "images-cache"))
        with without_dali():  # as on the README's CPU install: torchvision decodes, and warns
            by_torchvision = image_epochs(samples, "node", str(folder / "images-cache-torchvision"))
        found["images_by_torchvision"] = {key: by_torchvision[key] for key in ("path", "reads", "warnings")}
        found["images"] = {
            "same_as_without": [images_job.same(a, b) for run in (filled, again, after_damage, refilled)
                                for a, b in zip(without["batches"], run["batches"], strict=True)],
            **{f"{name}_{key}": run[key] for name, run in (("without", without), ("filled", filled), ("again", again),
                                                          ("after_damage", after_damage), ("refilled", refilled))
               for key in ("path", "reads", "disk", "warnings")},
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


@contextmanager
def without_dali() -> Iterator[None]:
    """The image decoders made inside pick a backend as where DALI is not installed."""
    installed = decode_batch._dali_installed
    decode_batch._dali_installed = lambda: False
    try:
        yield
    finally:
        decode_batch._dali_installed = installed


def damage_one_block(cache: Path, rank: int) -> str:
    """Rank 0 overwrites the entry's second block with garbage of its size, once every rank has
    closed its loaders; the block's file name."""
    (entry,) = [path for path in cache.iterdir() if path.is_dir()]
    block = sorted(entry.glob("block-*.bin"))[1]
    dist.barrier()
    if rank == 0:
        size = block.stat().st_size
        block.write_bytes(bytes(reversed(range(256))) * (size // 256) + b"x" * (size % 256))
    dist.barrier()
    return block.name


def _image_samples(folder: Path) -> list[tuple[str, int]]:
    return [(str(folder / f"image{index:03d}.jpg"), index) for index in range(images_job.NUM_IMAGES)]
