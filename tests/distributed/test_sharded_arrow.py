"""A datasets.Dataset split over 2 gloo processes (``cache_scope="world"``): each rank holds half
of its fixed-width columns and gets exactly torch's batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
sys.path.insert(0, str(Path(__file__).parent))
import arrow_job  # noqa: E402
import ranks_job  # noqa: E402


@pytest.mark.slow  # two processes import torch and datasets (about 20 s at load 4 on 2 cores)
def test_each_rank_gets_torch_s_batches_and_holds_a_share_of_the_columns(tmp_path: Path) -> None:
    ranks = ranks_job.findings(arrow_job.run, 2, tmp_path)
    for rank, found in enumerate(ranks):
        for scope, result in found.items():
            assert result["equal"], f"rank {rank}, {scope}: batches differ from torch's"
            assert result["batches"] == 2 * 7
        assert found["world"]["path"] == "sharded-world"
        assert found["rank"]["shard_bytes"] is None
    held = sum(found["world"]["shard_bytes"] for found in ranks)
    assert held == arrow_job.whole_bytes()
