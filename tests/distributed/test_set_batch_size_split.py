"""loader.set_batch_size(n) with the data split over 2 gloo processes (arrays and the sample
cache's columns, cache_scope node and world, the exchange ahead of the loop or in it): made on
every rank at the same batch, the rest of each rank's epoch is its DistributedSampler order cut
at n and a saved state resumes exactly; made on some ranks only, every rank raises an
ExchangeError naming the sizes at once; OOMRetry on one rank keeps the split loaders in step;
shrink_cache on a split cache frees nothing and says why."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import batch_size_job
import ranks_job


@pytest.fixture(scope="module", params=["two", pytest.param("four", marks=pytest.mark.slow)])
def ranks(request, tmp_path_factory) -> list[dict]:
    """Every rank's findings (one spawn per world size)."""
    world, local = ranks_job.JOBS[request.param]
    folder = tmp_path_factory.mktemp(f"batch_size{world}")
    return ranks_job.findings(batch_size_job.run, world, folder, local)


def test_every_rank_changing_at_one_batch_gets_its_order_cut_at_the_new_size(ranks):
    """Two changes at once, a change after an epoch's last batch, node and world, ahead and in
    the loop's thread, drop_last, a rank that reaches the change later: each rank's batches are
    its DistributedSampler order cut at the sizes in force, made by the exchange."""
    for rank, found in enumerate(ranks):
        assert len(found["every_rank"]) == 13
        for key, seen in found["every_rank"].items():
            assert seen["equal"], (rank, key)
            assert seen["warnings"] == [], (rank, key)
            assert seen["split"], (rank, key)  # the exchange, not a per-rank copy
            assert seen["path"].startswith("sharded-"), (rank, key)
            assert seen["lengths"] == [len(sizes) for sizes in seen["sizes"]], (rank, key)
            exchange = seen["exchange"]
            assert len(exchange["bytes_received_per_epoch"]) == 3, (rank, key)  # a change opens no epoch
            assert exchange["ahead"] is ("depth=0" not in key and key.startswith("arrays")), (rank, key)
    if len(ranks) == 2:  # 52 samples a rank: 8 until batch 2, then 5; epoch 1: 5, 5, then 11; then 7
        sizes = ranks[0]["every_rank"]["arrays/world/depth=None"]["sizes"]
        assert sizes == [[8, 8, 8, 5, 5, 5, 5, 5, 3], [5, 5, 11, 11, 11, 9], [7] * 7 + [3]]
        dropped = ranks[0]["every_rank"]["arrays/world/shuffle=True/drop_last=True"]["sizes"]
        # 51 a rank: no shorter last batch; the 8 samples a batch of 11 leaves out, cut at 7: one more
        assert dropped == [[8, 8, 8, 5, 5, 5, 5, 5], [5, 5, 11, 11, 11, 7], [7] * 7]


def test_a_state_saved_after_a_change_resumes_exactly(ranks):
    for rank, found in enumerate(ranks):
        for key, seen in found["resume"].items():
            assert seen["equal"], (rank, key)
            assert seen["split"] and seen["batch_size"] == 5, (rank, key)


@pytest.mark.parametrize("case", [f"{name}/at={at}/depth={depth}" for name in ("one_rank", "different")
                                  for at, depth in ((0, None), (0, 0), (2, None))]
                         + ["samples/one_rank/at=0", "one_rank/between_epochs"])
def test_ranks_that_disagree_all_raise_an_error_naming_the_sizes_at_once(ranks, case):
    """A change at batch 0 meets the other ranks' batches of the same epoch; one at batch 2, made
    ahead up to the epoch's end, meets their next epoch, as one between epochs does: either way
    every rank raises, at once."""
    other = 6 if case.startswith("different") else 8
    for rank, found in enumerate(ranks):
        seen = found["disagree"][case]
        assert seen["error"] is not None, (rank, case)
        assert "set_batch_size" in seen["error"], (rank, seen["error"])
        assert "batch size 5" in seen["error"] and f"batch size {other}" in seen["error"], (rank, seen["error"])
        assert seen["seconds"] < ranks_job.EXCHANGE_TIMEOUT_S, (rank, case)  # no collective waited out
        assert seen["received"] <= 7, (rank, case)  # epoch 0's 7 batches at most: none of a mixed-up epoch


def test_a_rank_that_runs_fewer_batches_at_the_same_size_is_not_blamed_on_set_batch_size(ranks):
    for rank, found in enumerate(ranks):
        error = found["restart_same_epoch"]["error"]
        assert error is not None and "different numbers of batches" in error, (rank, error)
        assert "set_batch_size" not in error, (rank, error)


def test_oom_retry_on_one_rank_keeps_the_split_loaders_in_step(ranks):
    for rank, found in enumerate(ranks):
        seen = found["oom_retry"]
        assert seen["error"] is None, (rank, seen["error"])
        assert seen["seen_in_order"], rank  # every sample once, in torch's order
        assert seen["loader_batch_size"] == 8, rank
    ran_out = ranks[0]["oom_retry"]
    assert ran_out["retry_batch_size"] == 4 and max(ran_out["sizes"]) == 4
    assert len(ran_out["warnings"]) == 1
    assert "batch size stays 8" in ran_out["warnings"][0] and "all_reduce" in ran_out["warnings"][0]
    assert ranks[1]["oom_retry"]["warnings"] == [] and ranks[1]["oom_retry"]["retry_batch_size"] is None


@pytest.mark.parametrize("kind", ["arrays", "samples"])
def test_shrink_cache_on_a_split_cache_frees_nothing_and_says_why(ranks, kind):
    for rank, found in enumerate(ranks):
        seen = found[f"shrink/{kind}"]
        assert seen["freed"] == 0 and seen["equal"], rank
        assert len(seen["warnings"]) == 1 and "freed nothing" in seen["warnings"][0], seen["warnings"]
        assert "split over ranks" in seen["warnings"][0]


@pytest.mark.gpu
def test_nccl_ranks_changing_together_get_their_order_cut_at_the_new_size(tmp_path):
    world = ranks_job.nccl_world()
    for rank, found in enumerate(ranks_job.findings(batch_size_job.run_nccl, world, tmp_path)):
        for key, seen in found["every_rank"].items():
            assert seen["equal"] and seen["split"] and seen["warnings"] == [], (rank, key)
            assert seen["exchange"]["ahead"] is False, (rank, key)  # NCCL's: from the loop's thread
        for key, seen in found["resume"].items():
            assert seen["equal"] and seen["split"], (rank, key)
