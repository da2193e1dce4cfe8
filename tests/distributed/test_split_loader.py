"""gpuload.DataLoader over 2 and 4 gloo processes on the CPU: the split cache gives each rank
exactly torch's batches, holds about 1/N of the dataset per rank, and fails clearly (never
hangs) when a rank stops an epoch early."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import ranks_job


def _run_job(tmp_path_factory: pytest.TempPathFactory, world: int, local_world_size: int | None) -> list[dict]:
    folder = tmp_path_factory.mktemp(f"world{world}")
    return ranks_job.findings(ranks_job.run, world, folder, local_world_size)




@pytest.fixture(scope="module", params=["two", pytest.param("four", marks=pytest.mark.slow)])
def job(request, tmp_path_factory):
    """Every rank's findings, the world size and the node size."""
    world, local = ranks_job.JOBS[request.param]
    return _run_job(tmp_path_factory, world, local), world, local or world


def test_every_rank_gets_torchs_batches_for_every_scope(job):
    ranks, _, _ = job
    for rank, found in enumerate(ranks):
        for key, result in found["compare"].items():
            assert result["equal"], f"rank {rank}, {key}: batches differ from torch's"
            assert result["batches"] > 0


def test_node_and_world_hold_a_share_and_exchange(job):
    ranks, world, node = job
    shares = {"node": node, "world": world}
    total = ranks[0]["total_bytes"]
    held = {scope: 0 for scope in shares}
    for found in ranks:
        for key, result in found["compare"].items():
            scope = key.split("/")[0]
            if scope not in shares:
                assert result["exchange"] is None, key  # rank, and auto on a CPU device
                continue
            exchange = result["exchange"]
            assert result["path"] == f"sharded-{scope}"
            assert exchange["ranks_per_copy"] == shares[scope], key
            assert abs(exchange["shard_bytes"] - total / shares[scope]) <= total / ranks_job.NUM_SAMPLES, key
            assert len(exchange["bytes_received_per_epoch"]) == 3
            assert all(b > 0 for b in exchange["bytes_received_per_epoch"]), key
            assert exchange["wait_s"] >= 0
            if key.endswith("shuffle=True/drop_last=False"):
                held[scope] += exchange["shard_bytes"]
    for scope, group in shares.items():
        assert held[scope] == total * world // group  # one whole copy per group of ranks


def test_all_ranks_stopping_at_one_batch_then_resuming_gives_torchs_batches(job):
    ranks, world, _ = job
    for rank, found in enumerate(ranks):
        assert found["resume"]["equal"], rank
        assert found["resume"]["exchange"]["ranks_per_copy"] == world


def test_another_sampler_keeps_a_copy_per_rank_and_says_why(job):
    for found in job[0]:
        seen = found["other_sampler"]
        assert seen["equal"] and seen["exchange"] is None
        assert any("not torch's DistributedSampler" in w and "cache_scope='node'" in w for w in seen["warnings"])


def test_rank_that_stops_early_makes_the_others_fail_within_the_timeout(job):
    ranks, _, _ = job
    for seen in ranks_job.others_failed_within_the_timeout(ranks, "stop_then_wait"):
        assert "README" in seen["error"]


def test_rank_that_starts_the_next_epoch_early_makes_every_rank_fail(job):
    ranks, _, _ = job
    for rank, found in enumerate(ranks):
        seen = found["stop_then_next_epoch"]
        assert seen["error"] is not None, rank
        assert "different numbers of batches" in seen["error"], seen["error"]
        assert seen["seconds"] < ranks_job.EXCHANGE_TIMEOUT_S  # the headers disagree: no wait


@pytest.mark.gpu
def test_nccl_ranks_get_torchs_batches(tmp_path):
    world = ranks_job.nccl_world()
    for rank, found in enumerate(ranks_job.findings(ranks_job.run_nccl, world, tmp_path)):
        for key, result in found.items():
            assert result["equal"], f"rank {rank}, {key}"
            assert result["path"] == f"sharded-{key.split('/')[0]}"
            assert result["exchange"]["shard_bytes"] > 0
            # NCCL's exchange is issued from the loop's thread whatever the depth (SplitStore.runs_ahead)
            assert result["exchange"]["ahead"] is False


def test_exchange_runs_ahead_of_the_loop_and_reports_its_time_and_the_loops_wait(job):
    ranks, _, _ = job
    for rank, found in enumerate(ranks):
        for depth in (0, 2, 4):
            result = found["compare"][f"world/ahead={depth}"]
            assert result["equal"], (rank, depth)
            exchange = result["exchange"]
            assert exchange["ahead"] is (depth > 0), (rank, depth)
            assert (result["prefetch"] or {}).get("depth") == (depth or None), (rank, depth)
            for key in ("exchange_s_per_epoch", "loop_wait_s_per_epoch", "bytes_sent_per_epoch"):
                assert len(exchange[key]) == 3, key
            assert all(s > 0 for s in exchange["exchange_s_per_epoch"])
            assert all(s >= 0 for s in exchange["loop_wait_s_per_epoch"])
            assert exchange["loop_wait_s"] == pytest.approx(sum(exchange["loop_wait_s_per_epoch"]))
            if depth == 0:  # in the loop's thread, the loop waits for the whole exchange
                assert all(wait >= own for wait, own in zip(exchange["loop_wait_s_per_epoch"],
                                                            exchange["exchange_s_per_epoch"]))


def test_ranks_stopping_at_one_batch_while_running_ahead_stay_in_step_and_leave_no_thread(job):
    ranks, _, _ = job
    for rank, found in enumerate(ranks):
        for key, seen in found["all_stop"].items():
            assert seen["equal"], (rank, key)  # the next epoch on the same loader is torch's
            assert seen["exchange"]["ahead"], (rank, key)
            assert seen["threads_left"] == [], (rank, key)
            assert not seen["warnings"], (rank, key, seen["warnings"])
            assert seen["seconds"] < ranks_job.EXCHANGE_TIMEOUT_S, (rank, key)  # no collective waited out


def test_rank_that_stops_early_with_a_deep_prefetch_still_makes_the_others_fail(job):
    ranks, _, _ = job
    ranks_job.others_failed_within_the_timeout(ranks, "stop_then_wait_depth4")


def test_closing_a_loader_abandons_an_exchange_the_other_ranks_never_join(job):
    seen = job[0][0]["close_while_waiting"]
    # At once: not the exchange timeout (60 s), nor the 5 s close waits for a thread that does
    # not stop (the margin is for a busy machine: 4 ranks at load 8 on 2 cores).
    assert seen["seconds"] < 4.5
    assert seen["threads_left"] == []
    assert seen["error"] is not None and "closed" in seen["error"]
