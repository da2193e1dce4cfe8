"""PyTorch Lightning fits with a gpuload loader passed to ``trainer.fit`` (2 CPU ranks).

Lightning re-creates the loader on each rank with a ``DistributedSampler``; each rank must see
a disjoint half of the samples, and ``trainer.train_dataloader`` must still be gpuload's.
``ddp_spawn`` pickles the loader to send it to the ranks; ``ddp`` under ``torchrun`` does not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is a test dependency: pip install -e '.[test]'")

sys.path.insert(0, str(Path(__file__).parent))  # lightning_job must import in spawned ranks too
import lightning_job  # noqa: E402


def assert_disjoint_halves_on_gpuload(out_dir: Path) -> None:
    records = lightning_job.read_records(out_dir)
    assert [r["rank"] for r in records] == [0, 1] and all(r["world_size"] == 2 for r in records), records
    halves = [set(r["seen"]) for r in records]
    assert all(len(r["seen"]) == lightning_job.NUM_SAMPLES // 2 for r in records), records
    assert not halves[0] & halves[1]
    assert halves[0] | halves[1] == set(range(lightning_job.NUM_SAMPLES))
    assert all(r["loader"] == "gpuload.loader.DataLoader" for r in records), records
    assert all(r["sampler"] == "DistributedSampler" for r in records), records


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "arrays",
        "generic",
    ],
)
def test_ddp_spawn_fit_gives_each_rank_half_on_a_gpuload_loader(kind: str, tmp_path: Path) -> None:
    saved = dict(os.environ)
    try:
        lightning_job.fit(str(tmp_path), kind, "ddp_spawn")
    finally:  # Lightning sets MASTER_PORT in this process: keep it to this test
        os.environ.clear()
        os.environ.update(saved)
    assert_disjoint_halves_on_gpuload(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", lightning_job.KINDS)
def test_ddp_under_torchrun_gives_each_rank_half_on_a_gpuload_loader(
        kind: str, lightning_ddp_fits: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, out = lightning_ddp_fits  # one torchrun job, shared with test_lightning_scope.py (conftest.py)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-8000:]
    assert_disjoint_halves_on_gpuload(out / kind)
