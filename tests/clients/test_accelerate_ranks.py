"""``gpuload.integrations.accelerate`` on 2 CPU processes (gloo, set up by Accelerate itself):
each rank gets, epoch after epoch, the batches Accelerate's own ``prepare`` gives for torch's
loader (default settings, ``split_batches``, ``even_batches=False``), served by gpuload; a loader
whose sampler is a DistributedSampler over the two processes keeps it (no second sharding) and
with ``cache_scope="world"`` each rank holds half of the arrays."""

from __future__ import annotations

import json
import os
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
from gpuload.resume import ResumeError

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
import ranks_job

pytestmark = pytest.mark.slow  # a spawn of 2 processes that import torch and Accelerate

RANKS_DEADLINE_S = 480  # the job takes under a minute on a busy machine: past this, it hangs

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
    found["resume"] = resume_uneven(out_dir)
    accelerator.wait_for_everyone()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


def uneven_loader() -> tuple[Any, Any]:
    """A new Accelerator (even_batches=False: rank 0 has 7 batches an epoch, rank 1 has 6) and
    its gpuload loader."""
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
    loader = gpuload.DataLoader(ranks_job.dataset(), batch_size=8, shuffle=True,
                                generator=torch.Generator().manual_seed(5))
    return accelerator, prepare_data_loader(accelerator, loader)


def resume_uneven(out_dir: str) -> dict[str, Any]:
    """Two epochs whole; then 3 batches, ``save_state`` into one folder for both ranks, and a new
    Accelerator and loader after ``load_state``: the batches each rank sees."""
    _, loader = uneven_loader()
    whole = batches_of(loader)
    accelerator, loader = uneven_loader()
    epoch = iter(loader)
    before = [next(epoch)[2].tolist() for _ in range(3)]
    accelerator.save_state(str(Path(out_dir, "uneven")))
    # Every rank's position file written before any rank loads: a rank that loaded first saw one
    # file of two, raised, and waited in a barrier the other never joined (480 s, at load 8).
    accelerator.wait_for_everyone()
    accelerator, loader = uneven_loader()
    try:
        accelerator.load_state(str(Path(out_dir, "uneven")))
        after = [[batch[2].tolist() for batch in loader] for _ in range(2)]
    except Exception as error:  # noqa: BLE001 (reported to the test process, which shows it)
        return {"whole": whole, "before": before, "error": repr(error)}
    return {"whole": whole, "before": before, "after": after, "error": None, "folder": str(Path(out_dir, "uneven"))}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return ranks_job.spawned(run_rank, 2, tmp_path_factory.mktemp("accelerate"), RANKS_DEADLINE_S)


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


def test_save_state_with_uneven_batches_resumes_each_rank_at_its_own_position(ranks) -> None:
    """even_batches=False: the ranks' epochs have 7 and 6 batches, so their positions differ;
    ``save_state`` writes each rank's (not one dl_state_dict.bin for both) and ``load_state``
    gives each its own: every rank sees the batches of its uninterrupted run."""
    for rank, found in enumerate(ranks):
        seen = found["resume"]
        assert seen["error"] is None, (rank, seen["error"])
        assert [len(epoch) for epoch in seen["whole"]] == [7 - rank] * 2
        assert seen["before"] + seen["after"][0] == seen["whole"][0], rank
        assert seen["after"][1] == seen["whole"][1], rank
    accelerator, _ = uneven_loader()  # this process alone: one process of the two is not the job
    with pytest.raises(ResumeError, match="for 2 processes, but this job has 1"):
        accelerator.load_state(ranks[0]["resume"]["folder"])
