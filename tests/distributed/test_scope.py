"""The cache_scope decision from sizes, and when the split path is not taken at all."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from gpuload.cache import CacheSettings
from gpuload.distributed import decide_scope, every_rank_batches, splittable_sampler
from gpuload.distributed.scope import share_bytes
from gpuload.distributed.split_store import split_arrays

GiB = 1 << 30


@pytest.mark.parametrize(
    "room,expected",
    [(200 * GiB, ("rank", 1)), (50 * GiB, ("node", 8)), (10 * GiB, ("world", 16)), (5 * GiB, ("rank", 1))],
)
def test_auto_picks_the_smallest_scope_that_fits(room, expected):
    decision = decide_scope("auto", 100_000, 1 << 20, room, local_world_size=8, world_size=16)  # 97.7 GiB
    assert (decision.scope, decision.group_size) == expected
    assert decision.requested == "auto" and decision.reason


def test_explicit_scopes_and_cpu():
    assert decide_scope("world", 10, 4, None, 2, 4).group_size == 4
    assert decide_scope("node", 10, 4, 20, 2, 4).group_size == 2
    too_big = decide_scope("node", 10, 4, 19, 2, 4)  # a share is 5 rows of 4 bytes
    assert (too_big.scope, too_big.requested) == ("rank", "node") and "does not fit" in too_big.reason
    assert decide_scope("world", 10, 4, 0, 2, 4).scope == "rank"  # cache_size=0: no device tier to split
    assert decide_scope("auto", 10, 4, None, 2, 4).scope == "rank"  # CPU: served in place as today
    assert decide_scope("auto", 100, 4, 100, 1, 4).scope == "world"  # one rank per node: node is skipped
    with pytest.raises(ValueError, match="not one of"):
        decide_scope("cluster", 10, 4, None, 2, 4)
    assert share_bytes(10, 4, 3) == 16


def test_every_rank_batches_match_torchs_samplers():
    data = TensorDataset(torch.arange(23))
    for shuffle, drop_last in ((True, False), (False, True)):
        mine = DistributedSampler(data, num_replicas=3, rank=1, shuffle=shuffle, seed=5, drop_last=drop_last)
        mine.set_epoch(4)
        everyone = every_rank_batches(BatchSampler(mine, 4, drop_last))
        for rank in range(3):
            theirs = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            theirs.set_epoch(4)
            assert [b.tolist() for b in everyone[rank]] == list(BatchSampler(theirs, 4, drop_last))


def test_every_rank_batches_after_a_batch_size_change_cut_the_rest_of_each_order():
    data = TensorDataset(torch.arange(23))
    for drop_last in (False, True):
        mine = DistributedSampler(data, num_replicas=3, rank=2, seed=5, drop_last=drop_last)
        mine.set_epoch(1)
        everyone = every_rank_batches(BatchSampler(mine, 4, drop_last), rest=(4, 3))
        for rank in range(3):
            theirs = DistributedSampler(data, num_replicas=3, rank=rank, seed=5, drop_last=drop_last)
            theirs.set_epoch(1)
            order = list(theirs)[4:]  # 4 positions left (8 per rank), 3 with drop_last (7 per rank)
            cut = [order[at : at + 3] for at in range(0, len(order), 3)]
            assert [b.tolist() for b in everyone[rank]] == [b for b in cut if len(b) == 3 or not drop_last]


def test_only_torchs_distributed_sampler_over_all_ranks_is_splittable():
    data = TensorDataset(torch.arange(20))
    good = BatchSampler(DistributedSampler(data, num_replicas=2, rank=1), 4, False)
    assert splittable_sampler(good, 20, 2, 1) is None
    assert "RandomSampler" in splittable_sampler(BatchSampler(RandomSampler(data), 4, False), 20, 2, 1)
    assert "num_replicas=2" in splittable_sampler(good, 20, 4, 1)
    assert "20 samples" in splittable_sampler(good, 21, 2, 1)
    assert "BatchSampler" in splittable_sampler(None, 20, 2, 1)


def test_without_a_process_group_nothing_is_split():
    settings = CacheSettings.resolve(cache_scope="world", environ={})
    sampler = BatchSampler(DistributedSampler(TensorDataset(torch.arange(8)), num_replicas=2, rank=0), 2, False)
    assert split_arrays([torch.arange(8)], settings, torch.device("cpu"), sampler, "owner") is None
