"""What each rank of the rank-waits test runs (imported by name in the spawned processes): rank 1
reads slowly (a straggler's disk), rank 0 does not; both gather their waits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload.distributed.rank_waits import gather_waits

SLOW_RANK = 1


class Reads(tud.Dataset):
    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return torch.full((2,), float(index))


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import ranks_job  # the suite's gloo group (this folder is on the path of spawned ranks)

    with ranks_job.gloo_job(rank, world, init_file, None):
        loader = gpuload.DataLoader(Reads(0.025 if rank == SLOW_RANK else 0.0), batch_size=4, timeline_steps=100)
        for _batch in loader:
            time.sleep(0.005)  # the step
        waits = gather_waits(loader.timeline)
        slowest = waits.slowest
        # One copy of the arrays split over the ranks: each batch's rows from the other rank come
        # through the exchange, a stage of the batches it serves.
        data = ranks_job.dataset()
        split = gpuload.DataLoader(data, 8, sampler=DistributedSampler(data, seed=ranks_job.SEED), device="cpu",
                                   cache_scope="world", timeline_steps=100)
        for _batch in split:
            pass
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
            "ranks": [wait.rank for wait in waits.ranks], "slowest": slowest.rank if slowest else None,
            "stage": slowest.stage if slowest else None, "summary": loader.timeline.summary(),
            "split_path": split.stats.path, "split_stages": sorted(split.timeline.stage_seconds()),
        }))
        split.close()
