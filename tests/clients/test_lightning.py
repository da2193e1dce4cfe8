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

REPO = Path(__file__).resolve().parents[2]
# What torchrun sets for its ranks; a stale value from the calling process must not reach it.
DISTRIBUTED_ENV = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"}


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


@pytest.fixture(scope="module")
def torchrun_fits(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One torchrun job of 2 ranks fitting each kind in turn (OUT/KIND): the ranks start once."""
    out = tmp_path_factory.mktemp("torchrun")
    env = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        lightning_job.__file__, str(out), *lightning_job.KINDS,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600), out


@pytest.mark.slow
@pytest.mark.parametrize("kind", lightning_job.KINDS)
def test_ddp_under_torchrun_gives_each_rank_half_on_a_gpuload_loader(
        kind: str, torchrun_fits: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, out = torchrun_fits
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_disjoint_halves_on_gpuload(out / kind)
