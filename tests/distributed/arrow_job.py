"""What each rank of tests/distributed/test_sharded_arrow.py runs: a datasets.Dataset over 2 gloo
processes, each scope beside torch's loader, the findings written to ``rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpuload

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import ranks_job
from equivalence import assert_same

NUM_SAMPLES = 103  # uneven shares, padded samplers


def dataset() -> datasets.Dataset:
    rows = range(NUM_SAMPLES)
    return datasets.Dataset.from_dict({
        "embedding": pa.array([[i / 2, -i, 1.0] for i in rows], pa.list_(pa.float32(), 3)),
        "label": pa.array(rows, pa.int16()),
        "tokens": [[i, i + 1] for i in rows],
        "text": [f"row {i}" for i in rows],
    }).shuffle(seed=1).with_format("torch")


def compare(data: datasets.Dataset, scope: str) -> dict:
    theirs = tud.DataLoader(data, 8, sampler=DistributedSampler(data, seed=ranks_job.SEED))
    ours = gpuload.DataLoader(data, 8, sampler=DistributedSampler(data, seed=ranks_job.SEED), device="cpu",
                              cache_scope=scope)
    equal, batches = True, 0
    for epoch in range(2):
        theirs.sampler.set_epoch(epoch)
        ours.sampler.set_epoch(epoch)
        expected, got = list(theirs), list(ours)
        batches += len(got)
        try:
            assert len(expected) == len(got)
            for a, b in zip(got, expected):
                assert_same(a, b)
        except AssertionError:
            equal = False
    exchange = ours.stats.extra.get("exchange")
    result = {"equal": equal, "batches": batches, "path": ours.stats.path,
              "shard_bytes": exchange["shard_bytes"] if exchange else None}
    ours.close()
    return result


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    datasets.disable_progress_bars()
    with ranks_job.gloo_job(rank, world, init_file, None):
        data = dataset()
        found = {scope: compare(data, scope) for scope in ("rank", "world")}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


def whole_bytes() -> int:
    """The fixed-width columns' bytes: what the ranks' shares add up to."""
    return NUM_SAMPLES * (3 * 4 + 2)


