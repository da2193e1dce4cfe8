"""Ranks that ask for different cache_scope values fail within seconds, each told every rank's
setting, before any process group is made (issue 25, item 10); three gloo ranks on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from gpuload.distributed import DistributedContext, ExchangeError
from gpuload.distributed.group import agree_on_scope

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


def test_a_rank_that_never_builds_the_loader_is_named_once_the_timeout_is_out(monkeypatch) -> None:
    """Without a process: rank 0 of two publishes its scope in a store rank 1 never writes to."""
    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setenv("GPULOAD_EXCHANGE_TIMEOUT", "0.1")
    context = DistributedContext(rank=0, world_size=2, local_world_size=2, backend="gloo")
    with pytest.raises(ExchangeError, match=r"rank 0 waited 0.1 s \(GPULOAD_EXCHANGE_TIMEOUT\) for rank\(s\) \[1\] "
                                            r"to build this loader \(cache_scope='world'\)"):
        agree_on_scope("world", "keyword cache_scope=", True, context, "a loader rank 1 never builds")
    assert store.get("gpuload/cache_scope/a loader rank 1 never builds/0/0") == b"world\nkeyword cache_scope="
