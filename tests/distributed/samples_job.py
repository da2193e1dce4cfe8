"""What each rank of the sample-cache tests runs (imported by name in the spawned processes).

The datasets are map-style datasets gpuload cannot gather from (any ``__getitem__``), so their
samples go through the sample cache. One job per world size runs every scenario, so the
processes start once; each rank writes its findings to ``rank<r>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ranks_job
import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpuload

NUM_SAMPLES = ranks_job.NUM_SAMPLES
SEED = ranks_job.SEED
ROW_BYTES = 3 * 4 * 4 + 8  # Pairs: a float32 3x4 tensor and an int (int64 once collated)


class Pairs(tud.Dataset):
    """``(tensor, int)`` per index, the same every read."""

    def __init__(self) -> None:
        self.features = torch.randn(NUM_SAMPLES, 3, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.features[index].clone(), index * 10


class Records(Pairs):
    """A dict with a nested tuple: floats, bools and a uint8 tensor (structure and dtypes)."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        pixels = (self.features[index] * 40).abs().to(torch.uint8)
        return {"pixels": pixels, "meta": (index * 0.5, index % 3 == 0), "label": index}


class Random(Pairs):
    """Augmented at random: two reads differ."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.features[index] + torch.rand(3, 4), index


class RandomOnLastRank(Pairs):
    """Augmented at random on the last rank only: that rank alone finds it random."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        noise = torch.rand(3, 4) if dist.get_rank() == dist.get_world_size() - 1 else torch.zeros(3, 4)
        return self.features[index] + noise, index


class Named(Pairs):
    """A string leaf: no fixed-shape column."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        return self.features[index].clone(), f"sample-{index}"


class OddOne(Pairs):
    """Row 1 has another shape; the probe (rows 0, n/2, n-1) does not see it."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return (self.features[index, :2] if index == 1 else self.features[index]).clone(), index


class Broken(Pairs):
    """Reading row 5 raises."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index == 5:
            raise KeyError(f"row {index} is missing")
        return super().__getitem__(index)


def same(expected: Any, got: Any) -> bool:
    """Equal batches of the same structure, types and dtypes."""
    if type(expected) is not type(got):
        return False
    if isinstance(expected, torch.Tensor):
        return expected.dtype == got.dtype and expected.shape == got.shape and torch.equal(expected, got.cpu())
    if isinstance(expected, dict):
        return list(expected) == list(got) and all(same(expected[k], got[k]) for k in expected)
    if isinstance(expected, (list, tuple)):
        return len(expected) == len(got) and all(same(a, b) for a, b in zip(expected, got))
    return expected == got


def outcomes(loader: Any) -> list[Any]:
    """Each step's batch, or the type name of what it raised (torch's iterators go on after)."""
    found, batches = [], iter(loader)
    for _ in range(len(loader)):
        try:
            found.append(next(batches))
        except Exception as error:  # noqa: BLE001
            found.append(type(error).__name__)
    return found


def compare(data: tud.Dataset, scope: str, *, shuffle: bool = True, drop_last: bool = False,
            batch_size: int = 8, epochs: int = 3, warm: bool = False, device: str = "cpu", **options: Any) -> dict:
    """Epochs of torch's loader and gpuload's side by side on this rank, with the warnings;
    ``warm``: gpuload's loader is warmed first (its share read before the first epoch)."""
    def sampler() -> DistributedSampler:
        return DistributedSampler(data, shuffle=shuffle, seed=SEED, drop_last=drop_last)

    collate = {"collate_fn": options["collate_fn"]} if "collate_fn" in options else {}
    theirs = tud.DataLoader(data, batch_size, sampler=sampler(), drop_last=drop_last, **collate)
    with ranks_job.recorded_warnings() as caught:
        ours = gpuload.DataLoader(data, batch_size, sampler=sampler(), drop_last=drop_last, device=device,
                                  cache_scope=scope, **options)
        warmed = ours.warm(progress=False).path if warm else None
        equal, batches = True, 0
        for epoch in range(epochs):
            theirs.sampler.set_epoch(epoch)
            ours.sampler.set_epoch(epoch)
            expected, got = outcomes(theirs), outcomes(ours)
            batches += len(got)
            equal = equal and len(expected) == len(got) and all(same(a, b) for a, b in zip(expected, got))
    extra = ours.stats.extra
    result = {"equal": equal, "batches": batches, "exchange": extra.get("exchange"), "path": ours.stats.path,
              "decision": extra.get("sample_cache_decision"), "warnings": [str(w.message) for w in caught],
              "warmed": warmed}
    ours.close()
    return result


def first_rows(batch: list[Any]) -> list[Any]:
    return [batch[0][:1].tolist(), batch[1][:1].tolist()]


def run(rank: int, world: int, init_file: str, out_dir: str, local_world_size: int | None) -> None:
    with ranks_job.gloo_job(rank, world, init_file, local_world_size):
        pairs = Pairs()
        found: dict = {"compare": {}, "total_bytes": NUM_SAMPLES * ROW_BYTES}
        for scope in ("rank", "node", "world", "auto"):
            for shuffle, drop_last in ((True, False), (False, False), (True, True)):
                key = f"{scope}/shuffle={shuffle}/drop_last={drop_last}"
                found["compare"][key] = compare(pairs, scope, shuffle=shuffle, drop_last=drop_last)
        found["records"] = compare(Records(), "world", batch_size=5)
        # Forked workers (torch's default on Linux before Python 3.14): a rank started from the fork
        # server would start its workers from a server of its own, which imports torch afresh in
        # each rank (39 s of a 2-rank epoch at load 11, 2 s forked); how they start is not what is tested.
        found["workers"] = compare(pairs, "node", num_workers=2, epochs=2, multiprocessing_context="fork")
        found["warm"] = compare(pairs, "world", epochs=1, warm=True)
        found["random"] = compare(Random(), "node", epochs=1)
        found["random_on_one"] = compare(RandomOnLastRank(), "world", epochs=1)
        found["strings"] = compare(Named(), "world", epochs=1)
        found["odd_one"] = compare(OddOne(), "world", batch_size=1, epochs=1)
        found["broken"] = compare(Broken(), "world", epochs=1)
        found["collate_fn"] = compare(pairs, "world", epochs=1, collate_fn=first_rows)
        found["host"] = compare(pairs, "world", epochs=1, cache="host")
        found["other_sampler"] = ranks_job.other_sampler(pairs)
        found["resume"] = ranks_job.stop_together_and_resume(pairs)
        found["stop_early"] = ranks_job.stop_early(pairs, then_next_epoch=False)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


def run_nccl(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The split scopes over NCCL, one GPU per rank, the share on each rank's device."""
    with ranks_job.nccl_job(rank, world, init_file):
        found = {scope: compare(Records(), scope, device=f"cuda:{rank}") for scope in ("world", "node")}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
