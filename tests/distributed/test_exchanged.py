"""Sharding as a wrapper source: ``Exchanged`` serves any source whose store is split over ranks,
here a toy source that knows nothing of ranks (its own path and how it makes a batch of rows),
on two ranks run as threads of this process with the exchange's collective stood in for
(``fake_peers.Wire``; the gloo jobs run the real one through the loader)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler

from gpuload.cache import CacheSettings, SampleStore, Store
from gpuload.cache.budget import BudgetLedger
from gpuload.distributed import Partition, ScopeDecision
from gpuload.distributed.split_store import SplitPlan, SplitStore, split_array_store
from gpuload.sources import FromRows, Indices, Schedule, Setup, Source, Work
from gpuload.sources.exchanged import Exchanged, serving
from gpuload.stats import LoaderStats

sys.path.insert(0, str(Path(__file__).parent))
import fake_peers

N, WORLD, BATCH = 23, 2, 4
DATA = torch.arange(N * 3, dtype=torch.int32).view(N, 3)


class Doubled(Source):
    """A toy source: its store's rows, doubled. Nothing here knows of ranks or an exchange."""

    def __init__(self, setup: Setup, store: Store) -> None:
        super().__init__(setup)
        self.store = store

    def schedule(self, indices: Indices) -> Schedule:
        def start(ahead: bool) -> Work:
            return Work(iter(indices.batches(ahead)), lambda index: (self.store.gather(index)[0] * 2, len(index)))
        return Schedule(start)

    def from_rows(self, number: int, ahead: bool) -> FromRows:
        def finish(item: tuple[list[torch.Tensor], torch.Tensor]) -> tuple[Any, int]:
            (rows,), indices = item
            return rows * 2, indices.numel()
        return FromRows(finish)

    def stats(self) -> dict[str, Any]:
        return {"doubled": True}

    def cache_store(self) -> Store | None:
        return self.store

    def close(self) -> None:
        self.store.close()


def _batch_sampler(rank: int) -> BatchSampler:
    sampler = DistributedSampler(range(N), num_replicas=WORLD, rank=rank, shuffle=True, seed=5)
    sampler.set_epoch(3)
    return BatchSampler(sampler, BATCH, drop_last=False)


def _setup(rank: int) -> Setup:
    return Setup(dataset=DATA, map_style=True, device=torch.device("cpu"), settings=CacheSettings.resolve(),
                 batched=True, batch_size=BATCH, collate_fn=lambda rows: rows, stats=LoaderStats(),
                 owner=("exchanged", rank), batch_sampler=_batch_sampler(rank))


def _share(rank: int) -> SplitStore:
    start, stop = Partition(N, WORLD, WORLD).rows_of(rank)
    plan = SplitPlan(ScopeDecision("world", "world", WORLD, "a test"), Partition(N, WORLD, WORLD), rank, 12, "cpu")
    return split_array_store([DATA[start:stop].clone()], plan, torch.device("cpu"), (None, None),
                          owner=("exchanged", rank), ledger=BudgetLedger())


@pytest.mark.parametrize("ahead", [False, True])
def test_a_source_that_knows_nothing_of_ranks_gets_every_ranks_rows_through_the_wrapper(ahead: bool) -> None:
    sources = [Doubled(_setup(rank), _share(rank)) for rank in range(WORLD)]
    wire = fake_peers.Wire(WORLD)
    for rank, source in enumerate(sources):
        wire.connect(source.store, rank)
    served = [serving(source) for source in sources]
    assert all(isinstance(s, Exchanged) and s.inner is source for s, source in zip(served, sources))
    got: list[list[torch.Tensor] | BaseException] = [[] for _ in range(WORLD)]

    def run(rank: int) -> None:
        try:
            sampler = served[rank].setup.batch_sampler
            schedule = served[rank].schedule(Indices(3, lambda: iter(sampler)))
            assert not schedule.staged and schedule.ahead  # gloo's exchange may run ahead, on a CPU too
            work = schedule.start(ahead)
            for item in work.items:
                finished = work.finish(item)
                assert finished is not None
                got[rank].append(finished[0])  # type: ignore[union-attr]
        except BaseException as error:  # re-raised in the test's thread
            got[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for rank in range(WORLD):
        batches = got[rank]
        if isinstance(batches, BaseException):
            raise batches
        expected = list(DataLoader(DATA, batch_sampler=_batch_sampler(rank), collate_fn=torch.stack))
        assert len(batches) == len(expected) == 3
        assert all(torch.equal(a, b * 2) for a, b in zip(batches, expected))
        stats = served[rank].stats()
        assert stats["doubled"] and stats["exchange"]["local_rows"] + stats["exchange"]["received_rows"] == 12
    for source in served:
        source.close()  # closes the wrapped source, which closes its share
    assert all(source.store.closed for source in sources)


def test_a_source_serves_itself_while_its_store_is_whole_and_is_unwrapped_when_it_is_decided_whole_again() -> None:
    source = Doubled(_setup(0), _share(0))
    wrapped = serving(source)
    assert isinstance(wrapped, Exchanged) and serving(wrapped) is wrapped
    source.close()
    source.store = SampleStore(1 << 20, "cpu", ledger=BudgetLedger(), num_samples=N)  # its cache decided again
    assert serving(wrapped) is source and serving(source) is source
    with pytest.raises(RuntimeError, match="Doubled holds no store split over ranks"):
        wrapped.schedule(Indices(0, lambda: iter([])))
    work = source.schedule(Indices(0, lambda: iter([]))).start(False)
    assert list(work.items) == []  # its own path
    source.close()
