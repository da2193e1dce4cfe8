"""What each rank of the cache_scope agreement test runs (imported by name in the spawned processes)."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.data as tud
from ranks_job import gloo_job
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload.distributed import ExchangeError

#: Long enough that a rank waiting it out (the defect) is told apart from one told at once.
EXCHANGE_TIMEOUT_S = 60


def run(rank: int, world: int, init_file: str, out_dir: str, scopes: list[str]) -> None:
    """Rank ``r`` builds the same loader with ``cache_scope=scopes[r]`` and reads an epoch."""
    with gloo_job(rank, world, init_file, None):
        os.environ["GPULOAD_EXCHANGE_TIMEOUT"] = str(EXCHANGE_TIMEOUT_S)
        data = tud.TensorDataset(torch.arange(40))
        loader = gpuload.DataLoader(data, 4, sampler=DistributedSampler(data, seed=3), cache_scope=scopes[rank])
        began, error, batches = time.perf_counter(), None, 0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                batches = sum(1 for _ in loader)
        except ExchangeError as caught:
            error = str(caught)
        seconds, path = time.perf_counter() - began, loader.stats.path
        loader.close()
        dist.barrier()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"error": error, "seconds": seconds, "batches": batches,
                                                                 "path": path}))
