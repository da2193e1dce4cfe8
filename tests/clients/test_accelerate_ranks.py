"""``gpuload.integrations.accelerate`` on 2 CPU processes (gloo, set up by Accelerate itself):
each rank gets, epoch after epoch, the batches Accelerate's own ``prepare`` gives for torch's
loader (default settings, ``split_batches``, ``even_batches=False``), served by gpuload; a loader
whose sampler is a DistributedSampler over the two processes keeps it (no second sharding) and
with ``cache_scope="world"`` each rank holds half of the arrays."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpuload

accelerate = pytest.importorskip("accelerate", reason="HF Accelerate is a test dependency: pip install -e '.[test]'")
from accelerate.utils import DataLoaderConfiguration

from gpuload.integrations.accelerate import prepare_data_loader

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
import ranks_job

pytestmark = pytest.mark.slow  # a spawn of 2 processes that import torch and Accelerate

CONFIGS = {
    "default": {},
    "split_batches": {"split_batches": True},
    "uneven": {"even_batches": False},
}


def batches_of(loader: Any, epochs: int = 2) -> list[list[list[int]]]:
    """Each epoch's label lists (the dataset's labels are its indices)."""
    seen = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):  # Accelerate's shards set their samplers' epoch
            loader.set_epoch(epoch)
        elif isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        seen.append([batch[2].tolist() for batch in loader])
    return seen


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    data = ranks_job.dataset()
    found: dict[str, Any] = {}
    for name, config in CONFIGS.items():
        accelerator = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
        assert accelerator.num_processes == world
        shuffled = {"batch_size": 8, "shuffle": True}
        theirs = accelerator.prepare(tud.DataLoader(data, generator=torch.Generator().manual_seed(3), **shuffled))
        ours = prepare_data_loader(accelerator, gpuload.DataLoader(
            data, generator=torch.Generator().manual_seed(3), cache_size="1MiB", **shuffled))
        found[name] = {"theirs": batches_of(theirs), "ours": batches_of(ours), "cache_size": ours.cache_size,
                       "served": type(ours.base_dataloader).__name__}
    sampler = DistributedSampler(data, shuffle=True, seed=ranks_job.SEED)
    ours = prepare_data_loader(accelerator, gpuload.DataLoader(data, 8, sampler=sampler, cache_scope="world"))
    reference = tud.DataLoader(data, 8, sampler=DistributedSampler(data, shuffle=True, seed=ranks_job.SEED))
    found["distributed"] = {"ours": batches_of(ours), "torch": batches_of(reference), "path": ours.stats.path,
                            "shard_bytes": ours.stats.extra["exchange"]["shard_bytes"]}
    accelerator.wait_for_everyone()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("accelerate")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(run_rank, args=(2, port, str(folder)), nprocs=2)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("config", CONFIGS)
def test_each_rank_gets_accelerates_batches_from_gpuload(ranks, config: str) -> None:
    for rank, found in enumerate(ranks):
        seen = found[config]
        assert seen["served"] == "DataLoader" and seen["cache_size"] == "1MiB", rank
        assert seen["ours"] == seen["theirs"], rank
    first = [ranks[rank][config]["ours"][0] for rank in range(2)]
    labels = [label for batches in first for batch in batches for label in batch]
    assert set(labels) == set(range(ranks_job.NUM_SAMPLES))  # the ranks share the epoch
    if config == "uneven":  # no padding: each sample once
        assert len(labels) == ranks_job.NUM_SAMPLES
    if config == "split_batches":  # each rank half of every batch of 8
        assert {len(batch) for batch in first[0][:-1]} == {4}


def test_a_distributed_sampler_is_kept_and_the_cache_split_over_ranks(ranks) -> None:
    for rank, found in enumerate(ranks):
        seen = found["distributed"]
        assert seen["ours"] == seen["torch"], rank  # not dealt out a second time
        assert len(seen["ours"][0]) == 7, rank  # 52 samples a rank, batches of 8
        assert seen["path"].startswith("sharded-"), rank
    total = sum(t.numel() * t.element_size() for t in ranks_job.dataset().tensors)
    assert sum(found["distributed"]["shard_bytes"] for found in ranks) == total
