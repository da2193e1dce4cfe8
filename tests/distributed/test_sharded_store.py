"""The wrapper's exchange step over any store holding a rank's share, without a process group:
two ranks in two threads, the collective replaced by a stand-in that swaps the bytes each rank
sends (the gloo jobs run the real one)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpuload.cache.budget import BudgetLedger
from gpuload.distributed import Partition, ScopeDecision
from gpuload.distributed.sharded_images import image_share
from gpuload.distributed.sharded_store import ShardedStore, ShardPlan, sharded_arrays

N, WORLD = 37, 2


class _Wire:
    """``all_to_all_single`` between the ranks of one process: each posts its outgoing bytes and
    splits, and takes its part of every other rank's once all have posted."""

    def __init__(self) -> None:
        self.posted: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self.barrier = threading.Barrier(WORLD)

    def connect(self, store: ShardedStore, rank: int) -> None:
        def swap(received, outgoing, recv_splits, send_splits, header) -> None:
            self.posted[rank] = (outgoing, send_splits)
            self.barrier.wait(timeout=10)
            parts = []
            for peer in range(WORLD):
                data, splits = self.posted[peer]
                begin = sum(splits[:rank])
                parts.append(data[begin : begin + splits[rank]])
                assert splits[rank] == recv_splits[peer]
            received.copy_(torch.cat(parts))
            self.barrier.wait(timeout=10)

        store._swap = swap
        store._check_peers = lambda plan, header: None


def _plan(rank: int, bytes_per_sample: int) -> ShardPlan:
    return ShardPlan(ScopeDecision("world", "world", WORLD, "a test"), Partition(N, WORLD, WORLD), rank,
                     bytes_per_sample, "cpu")


def _run(stores: list[ShardedStore], batches: list[torch.Tensor]) -> list[Any]:
    wire, found = _Wire(), [None] * WORLD
    for rank, store in enumerate(stores):
        wire.connect(store, rank)

    def step(rank: int) -> None:
        slot = stores[rank].exchange_stats.begin_epoch()
        found[rank] = stores[rank]._step(batches, (0, 0, 1, 0, 8, 0), slot)

    threads = [threading.Thread(target=step, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return found


def test_every_rank_gets_its_batch_of_arrays_in_order_from_every_share():
    g = torch.Generator().manual_seed(4)
    data = [torch.randint(0, 256, (N, 3), dtype=torch.uint8, generator=g), torch.rand(N, 2, generator=g),
            torch.arange(N, dtype=torch.int16)]
    stores = []
    for rank in range(WORLD):
        start, stop = Partition(N, WORLD, WORLD).rows_of(rank)
        stores.append(sharded_arrays([c[start:stop].clone() for c in data], _plan(rank, 13), torch.device("cpu"),
                                     (None, None), owner=("share", rank), ledger=BudgetLedger()))
    order = torch.randperm(N, generator=g)
    batches = [order[:9], order[9:20]]
    found = _run(stores, batches)
    for rank, (leaves, indices) in enumerate(found):
        assert torch.equal(indices, batches[rank])
        assert all(torch.equal(leaf, c.index_select(0, batches[rank])) for leaf, c in zip(leaves, data))
    stats = [store.exchange_stats.as_dict() for store in stores]
    assert sum(s["received_rows"] + s["local_rows"] for s in stats) == 20
    assert stats[0]["bytes_sent"] == stats[1]["bytes_received"] and stats[0]["bytes_sent"] > 0
    for store in stores:
        store.close()


def test_every_rank_gets_its_whole_images_in_order_from_every_share():
    g = torch.Generator().manual_seed(6)
    images = [torch.randint(0, 256, (3, 2 + k % 4, 3 + k % 2), dtype=torch.uint8, generator=g) for k in range(N)]
    table = torch.tensor([[0, *image.shape, 0] for image in images], dtype=torch.int64)
    stores = []
    for rank in range(WORLD):
        start, stop = Partition(N, WORLD, WORLD).rows_of(rank)
        mine = [images[k].reshape(-1) for k in range(start, stop)]
        chunk = torch.cat(mine)
        views = list(chunk.split([m.numel() for m in mine]))
        stores.append(image_share([chunk], views, table, {}, _plan(rank, 50), torch.device("cpu"), (None, None),
                                  on_error="raise", name=str, failure=RuntimeError, owner=("share", rank),
                                  ledger=BudgetLedger()))
    order = torch.randperm(N, generator=g)
    batches = [order[:12], order[12:19]]
    for rank, item in enumerate(_run(stores, batches)):
        assert item.positions == batches[rank].tolist() and not item.skipped
        assert all(torch.equal(a, images[k]) for a, k in zip(item.images, batches[rank].tolist()))
    for store in stores:
        store.close()
