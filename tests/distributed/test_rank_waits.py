"""Under torch.distributed the slowest rank's wait and stage are named on every rank
(gpuload/distributed/rank_waits.py): 2 gloo ranks, rank 1 with slow reads."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import gpuload
from gpuload.distributed.rank_waits import RankWait, RankWaits, gather_waits

sys.path.insert(0, str(Path(__file__).parent))  # the job must import in spawned ranks too
import rank_waits_job  # noqa: E402
import ranks_job  # noqa: E402


def test_every_rank_names_the_straggler_and_its_stage(tmp_path: Path) -> None:
    found = ranks_job.findings(rank_waits_job.run, 2, tmp_path)
    for rank, seen in enumerate(found):
        assert seen["ranks"] == [0, 1], seen
        assert (seen["slowest"], seen["stage"]) == (rank_waits_job.SLOW_RANK, "read"), (rank, seen)
        assert "slowest rank 1 of 2" in seen["summary"] and "dataset reads" in seen["summary"], seen
        assert "exchange" in seen["split_stages"], seen  # the rows of the other rank's share


def test_without_torch_distributed_it_is_this_process_alone() -> None:
    loader = gpuload.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2, timeline_steps=10)
    for _batch in loader:
        pass
    waits = gather_waits(loader.timeline)
    assert [wait.rank for wait in waits.ranks] == [0] and loader.timeline.ranks is waits


def test_the_slowest_is_the_largest_wait_share_and_unmeasured_ranks_are_left_out() -> None:
    waits = RankWaits((RankWait(0, 0.1, "copy", 9), RankWait(1, None, None, 0), RankWait(2, 0.6, "decode", 9)))
    assert waits.slowest == waits.ranks[2]
    assert waits.line() == "slowest rank 2 of 3: 60% of step time waiting, mostly image decoding"
    assert RankWaits((RankWait(0, None, None, 0),)).line() == "no rank of 1 measured a step yet"
