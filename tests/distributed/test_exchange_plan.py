"""The exchange plan, checked without processes: simulating the all_to_all it describes
rebuilds every rank's batch, in order, from the ranks' shares."""

from __future__ import annotations

import pytest
import torch

from gpuload.distributed import Partition, plan_step


def _simulate(batches: list[torch.Tensor], partition: Partition) -> list[torch.Tensor]:
    """Each rank's batch as the planned exchange assembles it, from rows whose value is their index."""
    world = partition.world_size
    data = torch.arange(partition.num_samples) * 10
    plans = [plan_step(rank, batches, partition) for rank in range(world)]
    shares = []
    for rank in range(world):
        start, stop = partition.rows_of(rank)
        shares.append(data[start:stop])
    # What rank s sends to rank d: its segment number d of send_rows.
    sent = [dict(zip(range(world), share[plan.send_rows].split(plan.send_splits)))
            for share, plan in zip(shares, plans)]
    assembled = []
    for rank, plan in enumerate(plans):
        received = [sent[source][rank] for source in range(world) if source != rank]
        assert [r.numel() for r in received] == [n for s, n in enumerate(plan.recv_splits) if s != rank]
        grouped = torch.cat([*received, shares[rank][plan.local_rows]])
        assembled.append(grouped[plan.inverse])
    return assembled


@pytest.mark.parametrize("world,group,num_samples", [(2, 2, 103), (4, 4, 103), (4, 2, 50), (8, 4, 1000), (4, 4, 3)])
def test_simulated_exchange_rebuilds_every_batch(world, group, num_samples):
    generator = torch.Generator().manual_seed(world * 100 + group)
    partition = Partition(num_samples, world, group)
    for _ in range(5):
        batches = [torch.randint(0, num_samples, (int(torch.randint(1, 20, (1,), generator=generator)),),
                                 generator=generator) for _ in range(world)]
        for rank, (batch, got) in enumerate(zip(batches, _simulate(batches, partition))):
            assert torch.equal(got, batch * 10), rank


def test_duplicates_and_own_rows():
    partition = Partition(8, 2, 2)  # rank 0 holds 0..3, rank 1 holds 4..7
    batches = [torch.tensor([5, 1, 5, 0]), torch.tensor([4, 4, 2])]
    plan = plan_step(0, batches, partition)
    assert plan.send_rows.tolist() == [2] and plan.send_splits == [0, 1]
    assert plan.recv_splits == [0, 2] and plan.received == 2
    assert plan.local_rows.tolist() == [1, 0]  # received rows first (5, 5), then 1 and 0
    assert plan.inverse.tolist() == [0, 2, 1, 3]
    assert [b.tolist() for b in _simulate(batches, partition)] == [[50, 10, 50, 0], [40, 40, 20]]


def test_node_scope_never_sends_across_nodes():
    partition = Partition(100, 4, 2)
    batches = [torch.arange(0, 100, 7) for _ in range(4)]
    for rank in range(4):
        plan = plan_step(rank, batches, partition)
        other_node = [r for r in range(4) if r // 2 != rank // 2]
        assert all(plan.send_splits[r] == 0 and plan.recv_splits[r] == 0 for r in other_node)


def test_partition_blocks_and_errors():
    partition = Partition(10, 4, 4)
    assert [partition.rows_of(r) for r in range(4)] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert partition.owners(3, torch.tensor([0, 2, 4, 5, 9])).tolist() == [0, 1, 1, 2, 3]
    node = Partition(10, 4, 2)
    assert list(node.group_of(3)) == [2, 3] and node.owners(3, torch.tensor([0, 5])).tolist() == [2, 3]
    assert "rows [5, 10)" in node.describe(3, 4)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        Partition(10, 6, 4)
    with pytest.raises(ValueError, match="num_samples must be >= 0, got -1"):
        Partition(-1, 2, 2)
    with pytest.raises(ValueError, match="one batch per rank"):
        plan_step(0, [torch.tensor([1])], Partition(10, 2, 2))


def test_array_rows_come_back_whole_from_their_bytes_for_any_count_and_alignment():
    """A row of 75 uint8 bytes puts the next array's float64 at an odd offset: each decoded
    array is its own aligned allocation, also for one row (no copy a slice would skip)."""
    from gpuload.distributed.split_store import ArrayRows

    g = torch.Generator().manual_seed(2)
    columns = [torch.randint(0, 256, (5, 75), dtype=torch.uint8, generator=g),
               torch.rand(5, 2, dtype=torch.float64, generator=g), torch.arange(5, dtype=torch.int16)]
    rows = ArrayRows(columns)
    for count in (0, 1, 3):
        positions = torch.arange(count)
        data = rows.encode([column[:count] for column in columns])
        assert data.numel() == int(rows.sizes(positions).sum())
        decoded = rows.decode(data, positions, rows.sizes(positions))
        assert all(torch.equal(d, c[:count]) and d.dtype == c.dtype for d, c in zip(decoded, columns))


def test_a_share_that_does_not_fit_its_device_is_the_exchanges_error_not_a_fallback(monkeypatch):
    """Other ranks read their rows from a share, so no row of it may fall back to another tier:
    running out of memory placing it is one clear error, its booking given back, no warning."""
    import warnings

    from gpuload.cache.budget import BudgetLedger
    from gpuload.cache.tiers import DeviceTier
    from gpuload.distributed import ExchangeError, ScopeDecision
    from gpuload.distributed.split_store import SplitPlan, array_share

    def no_room(cls, source, first, rows, device):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(DeviceTier, "allocate", classmethod(no_room))
    plan = SplitPlan(ScopeDecision("world", "world", 2, "a test's share"), Partition(8, 2, 2), 0, 8, "cpu")
    ledger = BudgetLedger()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ExchangeError, match="out of memory placing rank 0's share"):
            array_share([torch.arange(4, dtype=torch.int64)], plan, torch.device("cpu"), owner="share", ledger=ledger)
    assert ledger.reserved("cpu") == 0 and ledger.used("cpu") == 0
