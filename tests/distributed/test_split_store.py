"""The wrapper's exchange step over any store holding a rank's share, without a process group:
two ranks in two threads, the collective replaced by a stand-in that swaps the bytes each rank
sends (the gloo jobs run the real one)."""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuload.cache import CacheSettings
from gpuload.cache.budget import BudgetLedger
from gpuload.distributed import (
    DistributedContext,
    ExchangeError,
    Partition,
    ScopeDecision,
    every_rank_batches,
    plan_step,
)
from gpuload.distributed.exchange_steps import LoaderClosedError
from gpuload.distributed.image_shares import image_share
from gpuload.distributed.joined_rows import joined
from gpuload.distributed.split_store import SplitPlan, SplitStore, agree_on_split, split_array_store, split_arrays

sys.path.insert(0, str(Path(__file__).parent))
import fake_peers

N, WORLD = 37, 2


def _plan(rank: int, bytes_per_sample: int) -> SplitPlan:
    return SplitPlan(ScopeDecision("world", "world", WORLD, "a test"), Partition(N, WORLD, WORLD), rank,
                     bytes_per_sample, "cpu")


def _run(stores: list[SplitStore], batches: list[torch.Tensor]) -> list[Any]:
    wire, found = fake_peers.Wire(WORLD), [None] * WORLD
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
        stores.append(split_array_store([c[start:stop].clone() for c in data], _plan(rank, 13), torch.device("cpu"),
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


def test_one_exchange_carries_a_table_s_array_rows_and_its_images_together():
    """Arrays and images of differing sizes joined (``joined``): each rank's item is its arrays'
    rows and its whole images, in batch order, from one collective per step."""
    g = torch.Generator().manual_seed(8)
    data = [torch.rand(N, 2, generator=g), torch.arange(N, dtype=torch.int16)]
    images = [torch.randint(0, 256, (3, 2 + k % 3, 1 + k % 4), dtype=torch.uint8, generator=g) for k in range(N)]
    table = torch.tensor([[0, *image.shape, 0] for image in images], dtype=torch.int64)
    stores, swaps = [], [0] * WORLD
    for rank in range(WORLD):
        start, stop = Partition(N, WORLD, WORLD).rows_of(rank)
        arrays = split_array_store([c[start:stop].clone() for c in data], _plan(rank, 10), torch.device("cpu"),
                                (None, None), owner=("share", rank), ledger=BudgetLedger())
        mine = [images[k].reshape(-1) for k in range(start, stop)]
        chunk = torch.cat(mine)
        pictures = image_share([chunk], list(chunk.split([m.numel() for m in mine])), table, {}, _plan(rank, 50),
                               torch.device("cpu"), (None, None), on_error="raise", name=str, failure=RuntimeError,
                               owner=("images", rank), ledger=BudgetLedger())
        both = joined(arrays, [(pictures.inner, pictures.rows, pictures.share_bytes)])
        assert arrays.closed and both.share_bytes == arrays._share_bytes + pictures.share_bytes
        stores.append(both)
    order = torch.randperm(N, generator=g)
    batches = [order[:11], order[11:20]]
    wire = fake_peers.Wire(WORLD)
    for rank, store in enumerate(stores):
        wire.connect(store, rank)
        swap = store._swap

        def counted(*args: Any, rank: int = rank, swap: Any = swap) -> None:
            swaps[rank] += 1
            swap(*args)

        store._swap = counted
    found = [None] * WORLD

    def step(rank: int) -> None:
        found[rank] = stores[rank]._step(batches, (0, 0, 1, 0, 8, 0), stores[rank].exchange_stats.begin_epoch())

    threads = [threading.Thread(target=step, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert swaps == [1, 1]
    for rank, ((leaves, indices), pictures) in enumerate(found):
        assert torch.equal(indices, batches[rank])
        assert all(torch.equal(leaf, c.index_select(0, batches[rank])) for leaf, c in zip(leaves, data))
        assert pictures.positions == batches[rank].tolist()
        assert all(torch.equal(a, images[k]) for a, k in zip(pictures.images, batches[rank].tolist()))
    stats = [store.exchange_stats.as_dict() for store in stores]
    assert stats[0]["bytes_sent"] == stats[1]["bytes_received"] > 0
    for store in stores:
        store.close()
        assert store.inner.parts[1]._closed  # the images' share is closed with the arrays'


# ---------------------------------------------------------------- rank 0 against a pretended peer


def test_ranks_that_built_their_loaders_otherwise_or_died_fail_the_agreement(monkeypatch):
    settings = CacheSettings.resolve(cache_scope="world", environ={})

    def agree() -> Any:
        return agree_on_split(settings, torch.device("cpu"), fake_peers.batches(N), "t", fake_peers.CONTEXT, N, 13)

    def longer_dataset(mine: torch.Tensor) -> torch.Tensor:
        mine[2] += 1  # (scope, room, samples, ...)
        return mine

    fake_peers.FakePeers(monkeypatch, [longer_dataset, RuntimeError("Connection closed by peer")])
    with pytest.raises(ExchangeError, match=r"ranks disagree on the split cache: .* is \[3, -1, 37, 13, .* on rank 0 "
                                            r"but \[3, -1, 38, 13, .* on rank 1; every rank must build the loader"):
        agree()
    with pytest.raises(ExchangeError, match=r"rank 0 could not agree on the split cache with the other ranks "
                                            r"\(cache_scope='world'\): .* or died. Cause: Connection closed by peer"):
        agree()


def test_node_scope_on_nodes_of_one_rank_keeps_the_arrays_whole_on_each_rank(monkeypatch):
    """One copy per node is every row on each rank: the ranks agree, then nothing is split."""
    peers = fake_peers.FakePeers(monkeypatch)
    context = DistributedContext(rank=0, world_size=WORLD, local_world_size=1, backend="gloo")
    settings = CacheSettings.resolve(cache_scope="node", environ={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert split_arrays([torch.arange(N)], settings, torch.device("cpu"), fake_peers.batches(N), "t",
                            context) is None
    assert peers.calls == 1


def _store(groups: tuple[Any, Any] = (None, None)) -> SplitStore:
    """Rank 0's share of 37 rows of one int64 array."""
    start, stop = Partition(N, WORLD, WORLD).rows_of(0)
    return split_array_store([torch.arange(start, stop)], _plan(0, 8), torch.device("cpu"), groups, owner="t",
                          ledger=BudgetLedger())


def test_batches_other_than_the_samplers_or_a_closed_store_are_refused_before_any_step():
    store, sampler = _store(), fake_peers.batches(N)
    mine = every_rank_batches(sampler)[0]
    with pytest.raises(ExchangeError, match="rank 0's batches differ from the ones its DistributedSampler gives"):
        store.epoch(sampler, [mine[0] + 1, *mine[1:]])
    steps = store.epoch(sampler, mine)
    store.close()
    with pytest.raises(RuntimeError, match="this gpuload.DataLoader was closed"):
        next(steps)  # made after the loader closed
    with pytest.raises(RuntimeError, match="this gpuload.DataLoader was closed"):
        store.epoch(sampler, mine)


class _Peer:
    """``all_to_all_single`` of rank 1 as rank 0 sees it: the step's header comes back as rank 1
    sends it (``rows``: the row count it sends, given what rank 0 expects); the rows' swap
    raises ``fails`` or, without it, never completes (a peer that stopped)."""

    def __init__(self, rows: Any, fails: Exception | None = None) -> None:
        self.rows, self.fails = rows, fails
        self.waiting = threading.Event()

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if group == fake_peers.GROUPS[0]:
            header = input.tolist()
            output.copy_(torch.tensor([*header[:-1], self.rows(header)]))
            return _Done()
        if self.fails is not None:
            raise self.fails
        return _NeverDone(self.waiting)


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


class _NeverDone:
    def __init__(self, waiting: threading.Event) -> None:
        self.waiting = waiting

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        self.waiting.set()
        threading.Event().wait(timeout.total_seconds())
        raise RuntimeError("Operation timed out!")


def _first_step(monkeypatch, peer: _Peer) -> tuple[SplitStore, Any]:
    """Rank 0's store and the steps of epoch 0, collectives by ``peer``."""
    monkeypatch.setattr(torch.distributed, "all_to_all_single", peer.all_to_all_single)
    store, sampler = _store(fake_peers.GROUPS), fake_peers.batches(N)
    return store, store.epoch(sampler, every_rank_batches(sampler)[0])


def test_a_peer_sending_other_row_counts_than_planned_fails_the_step(monkeypatch):
    store, steps = _first_step(monkeypatch, _Peer(rows=lambda header: 99))
    with pytest.raises(ExchangeError, match=r"rank 1 sends 99 rows at batch 1 of epoch 0 where rank 0 planned \d+: "
                                            r"the ranks' datasets or samplers differ"):
        next(steps)
    store.close()


def _planned(header: list[int]) -> int:
    """The rows rank 1 sends rank 0 at the first step (what rank 0 expects)."""
    batches = [everyone[0] for everyone in every_rank_batches(fake_peers.batches(N))]
    return plan_step(0, batches, Partition(N, WORLD, WORLD)).recv_splits[1]


def test_a_peer_gone_between_the_header_and_the_rows_is_named_as_a_stopped_rank(monkeypatch):
    store, steps = _first_step(monkeypatch, _Peer(_planned, fails=RuntimeError("Connection closed by peer")))
    with pytest.raises(ExchangeError, match=r"rank 0 waited \(up to 600 s, GPULOAD_EXCHANGE_TIMEOUT\) for the other "
                                            r"ranks at batch 1 of 5 of epoch 0 .* Cause: Connection closed by peer"):
        next(steps)
    store.close()


def test_closing_the_loader_abandons_a_rows_swap_its_peer_never_joins(monkeypatch):
    """The abandoned swap is the loader's closing (``LoaderClosedError``), not a peer that stopped."""
    peer = _Peer(_planned)
    store, steps = _first_step(monkeypatch, peer)
    raised: list[BaseException] = []

    def first() -> None:
        try:
            next(steps)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            raised.append(error)

    runner = threading.Thread(target=first)
    runner.start()
    assert peer.waiting.wait(10)
    store.close()
    runner.join(10)
    assert not runner.is_alive()
    assert len(raised) == 1 and type(raised[0]) is LoaderClosedError


class _SlowerPeer(_Peer):
    """Rank 1 alive but slower than rank 0: every step's rows' swap completes once ``release``
    is set. ``swaps``: the rows' swaps rank 0 started."""

    def __init__(self) -> None:
        super().__init__(_planned_at)
        self.release = threading.Event()
        self.swaps = 0

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if group == fake_peers.GROUPS[0]:
            return super().all_to_all_single(output, input, group=group)
        self.swaps += 1
        output.zero_()
        return _DoneOnceReleased(self.release, self.waiting)


class _DoneOnceReleased:
    def __init__(self, release: threading.Event, waiting: threading.Event) -> None:
        self.release, self.waiting = release, waiting

    def is_completed(self) -> bool:
        return self.release.is_set()

    def wait(self, timeout=None) -> bool:
        self.waiting.set()
        if self.release.wait(None if timeout is None else timeout.total_seconds()):
            return True
        raise RuntimeError("Operation timed out!")


def _planned_at(header: list[int]) -> int:
    """The rows rank 1 sends rank 0 at the header's step."""
    batches = [everyone[header[1]] for everyone in every_rank_batches(fake_peers.batches(N))]
    return plan_step(0, batches, Partition(N, WORLD, WORLD)).recv_splits[1]


def test_closing_after_the_loop_stopped_lets_the_epochs_completing_steps_end_first(monkeypatch):
    """The loop stopped after its first batch; the thread that ran the steps ahead completes them
    to the bound every rank reaches (batch 1 + RUN_AHEAD_LIMIT) while the loader closes. close()
    lets them end: abandoned, this rank's part of a collective stays in flight, a peer waits for
    it, and the groups are destroyed under it (the torchrun example's rare abort at exit)."""
    peer = _SlowerPeer()
    monkeypatch.setattr(torch.distributed, "all_to_all_single", peer.all_to_all_single)
    store, sampler = _store(fake_peers.GROUPS), fake_peers.batches(N)
    steps = store.epoch(sampler, every_rank_batches(sampler)[0], ahead=True)
    assert len(every_rank_batches(sampler)[0]) == 5
    peer.release.set()
    next(steps)
    steps.handed_over()
    steps.cancel()  # the loop stopped after that batch
    peer.release.clear()
    peer.waiting.clear()
    raised: list[BaseException] = []

    def completing() -> None:  # what the prefetcher's thread does when its epoch stops
        try:
            steps.close()
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            raised.append(error)

    thread = threading.Thread(target=completing)
    thread.start()
    assert peer.waiting.wait(10)  # inside step 1's swap
    settling = threading.Event()
    settle = steps.settle if hasattr(steps, "settle") else None
    monkeypatch.setattr(steps, "settle", lambda timeout: settling.set() or settle(timeout), raising=False)
    closer = threading.Thread(target=store.close)
    closer.start()
    for _ in range(1000):  # until close() waits for the steps, or gave them up and returned
        if settling.wait(0.01) or not closer.is_alive():
            break
    peer.release.set()
    thread.join(30)
    closer.join(30)
    assert not thread.is_alive() and not closer.is_alive()
    assert raised == [] and peer.swaps == 5  # steps 0 to 4, the last one every rank makes
