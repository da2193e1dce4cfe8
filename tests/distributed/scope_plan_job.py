"""What each rank of the scope plan's gloo check runs (imported by name in the spawned processes).

Every rank iterates ``EPOCHS`` epochs of gpuload's loader over a ``DistributedSampler`` for
``cache_scope`` ``node`` and ``world`` and writes the bytes its exchange received per epoch to
``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpuload

NUM_SAMPLES = 4000
ROW_BYTES = 16
BATCH_SIZE = 50
EPOCHS = 3
SEED = 11


def run(rank: int, world: int, init_file: str, out_dir: str, local_world_size: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    os.environ["GPULOAD_EXCHANGE_TIMEOUT"] = "30"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        rows = torch.randint(0, 256, (NUM_SAMPLES, ROW_BYTES), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(0))
        data = tud.TensorDataset(rows)
        found = {}
        for scope in ("node", "world"):
            sampler = DistributedSampler(data, shuffle=True, seed=SEED)
            loader = gpuload.DataLoader(data, BATCH_SIZE, sampler=sampler, device="cpu", cache="auto",
                                        cache_scope=scope)
            for epoch in range(EPOCHS):
                sampler.set_epoch(epoch)
                for _ in loader:
                    pass
            found[scope] = loader.stats.extra["exchange"]
            loader.close()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()
