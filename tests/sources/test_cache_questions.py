"""The loader's questions about a source's cache (device bytes, shrinking, split over ranks) are
answered by the Source contract from the source's store, the same way for every source: no
source can answer them otherwise (a split image cache once said it was not split, so OOMRetry
changed the batch size on one rank only)."""

from __future__ import annotations

import torch
from store_cases import sample_cache_case, split_images_case

from gpuload.sources import Indices, Schedule, Source
from gpuload.sources.arrays import ArraySource
from gpuload.sources.exchanged import Exchanged, serving
from gpuload.sources.images import ImageFileSource
from gpuload.sources.samples import SampleSource

SOURCES = (ArraySource, ImageFileSource, SampleSource)


def test_no_source_answers_the_cache_questions_itself():
    for source in SOURCES:
        for question in ("device_cache_bytes", "shrink_cache", "split_over_ranks"):
            assert getattr(source, question) is getattr(Source, question), (source.__name__, question)


def test_no_source_knows_it_is_split_or_exchanges_itself():
    """The exchange is served by one wrapper (``sources.exchanged.Exchanged``): no source, nor the
    contract, chooses between its own path and the exchange; a source only says how a batch is
    made of rows gathered for it (``from_rows``)."""
    assert getattr(Source.schedule, "__isabstractmethod__", False)
    for source in (Source, *SOURCES):
        assert not hasattr(source, "exchanged") and not hasattr(source, "exchange_stats"), source.__name__
    for source in SOURCES:
        assert source.from_rows is not Source.from_rows, source.__name__


class _Serving(Source):
    """A source whose store is given: the contract's answers, without a loader."""

    def __init__(self, store, device: str = "cpu") -> None:
        self._store = store
        self.setup = type("Setup", (), {"device": torch.device(device)})()

    def cache_store(self):
        return self._store

    def schedule(self, indices):
        return Schedule(lambda ahead: ("own epoch", ahead))

    def stats(self):
        return {}


def test_a_share_of_decoded_images_is_split_over_ranks():
    case = split_images_case()
    source = _Serving(case.store)
    assert source.split_over_ranks()
    assert source.shrink_cache(0) == 0  # a share frees nothing on one rank
    case.store.close()


def test_a_cache_on_the_loaders_device_counts_and_shrinks():
    case = sample_cache_case()
    source = _Serving(case.store)
    held = source.device_cache_bytes()
    assert held > 0 and not source.split_over_ranks()
    assert source.shrink_cache(0) == held and source.device_cache_bytes() == 0
    elsewhere = sample_cache_case()
    assert _Serving(elsewhere.store, "meta").device_cache_bytes() == 0  # not the loader's device
    assert _Serving(None).shrink_cache(0) == 0 and not _Serving(None).split_over_ranks()


def test_a_share_is_served_by_the_exchange_and_any_other_store_by_the_sources_own_epoch():
    indices = Indices(0, lambda: iter([]))
    case = split_images_case()
    exchange = serving(_Serving(case.store))
    assert isinstance(exchange, Exchanged)
    schedule = exchange.schedule(indices)
    assert not schedule.staged and schedule.ahead_on_cpu and schedule.ahead == case.store.runs_ahead
    in_the_loop = _Serving(case.store)
    in_the_loop.rows_ahead = False  # a source whose rows are gathered in the loop's thread
    assert not serving(in_the_loop).schedule(indices).ahead
    case.store.close()
    for store in (sample_cache_case().store, None):
        source = _Serving(store)
        assert serving(source) is source
        assert source.schedule(indices).start(True) == ("own epoch", True)
