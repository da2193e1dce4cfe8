"""Lightning's ``ddp`` strategy under torchrun keeps a gpuload loader's ``cache_scope``: the loader
it re-creates with a ``DistributedSampler`` splits one copy of the arrays over the 2 CPU ranks,
each rank gets torch's batches in torch's order, and ``limit_train_batches`` stops every rank at
the same batch, epoch after epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from gpuload.distributed.exchange_steps import RUN_AHEAD_LIMIT

pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is a test dependency: pip install -e '.[test]'")

sys.path.insert(0, str(Path(__file__).parent))
import lightning_scope_job as job


def torchs_batches(rank: int, epoch: int) -> list[list[int]]:
    """What torch's DataLoader with Lightning's DistributedSampler (seed 0) gives ``rank``."""
    sampler = DistributedSampler(job.dataset(), num_replicas=2, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(BatchSampler(sampler, job.BATCH_SIZE, drop_last=False))[: job.LIMIT_BATCHES]


@pytest.mark.slow
def test_ddp_fit_splits_the_arrays_and_gives_each_rank_torchs_batches(
        lightning_ddp_fits: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, out = lightning_ddp_fits  # lightning_job.py's torchrun job runs this file's fit too (conftest.py)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-8000:]
    fitted = out / "scope"
    records = [{**json.loads((fitted / f"rank-{rank}.json").read_text()),
                **json.loads((fitted / f"batches-{rank}.json").read_text())} for rank in range(2)]
    sample_bytes = 4 + 8  # float32 feature, int64 id
    for rank, record in enumerate(records):
        assert record["loader"] == "gpuload.loader.DataLoader" and record["sampler"] == "DistributedSampler"
        assert record["cache_scope"] == "world" and record["sampler_seed"] == 0
        for epoch in range(job.EPOCHS):
            assert record["batches"][str(epoch)] == torchs_batches(rank, epoch), (rank, epoch)
        exchange = record["exchange"]
        assert exchange["scope"] == "world" and exchange["ranks_per_copy"] == 2
        assert exchange["shard_bytes"] == job.NUM_SAMPLES // 2 * sample_bytes
        assert len(exchange["bytes_received_per_epoch"]) == job.EPOCHS
        # the exchange runs ahead of the loop, bounded: Lightning's fetcher pulls one batch past
        # its limit, and each rank completes the exchange up to RUN_AHEAD_LIMIT batches past that
        exchanged = exchange["local_rows"] + exchange["received_rows"]
        needed = job.EPOCHS * job.LIMIT_BATCHES * job.BATCH_SIZE
        assert needed <= exchanged <= needed + job.EPOCHS * (1 + RUN_AHEAD_LIMIT) * job.BATCH_SIZE
        assert exchanged % job.BATCH_SIZE == 0
