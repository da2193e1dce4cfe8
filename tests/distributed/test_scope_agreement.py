"""Ranks that ask for different cache_scope values fail within seconds, each told every rank's
setting, before any process group is made (issue 25, item 10); three gloo ranks on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ranks_job
import scope_agree_job


def test_ranks_that_disagree_on_the_scope_fail_at_once_naming_each_setting(tmp_path: Path) -> None:
    found = ranks_job.findings(scope_agree_job.run, 3, tmp_path, ["rank", "world", "world"])
    assert found[0]["error"] is None and found[0]["batches"] == 4  # its own copy: nothing to wait for
    for rank in (1, 2):
        error = found[rank]["error"]
        assert error is not None and "ranks disagree on cache_scope" in error, (rank, found[rank])
        assert "rank 0: 'rank' (keyword cache_scope=)" in error
        assert f"rank {rank}: 'world' (keyword cache_scope=)" in error
        assert "\n" not in error
        assert found[rank]["seconds"] < scope_agree_job.EXCHANGE_TIMEOUT_S / 3, found[rank]


def test_ranks_that_agree_split_the_dataset(tmp_path: Path) -> None:
    found = ranks_job.findings(scope_agree_job.run, 2, tmp_path, ["world", "world"])
    assert [f["error"] for f in found] == [None, None]
    assert [f["batches"] for f in found] == [5, 5]
    assert [f["path"] for f in found] == ["sharded-world", "sharded-world"]
