"""SampleStore: samples kept by index within a budget, complete, settled, shrunk, closed."""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch

from gpuload.cache import CacheFallbackWarning, SampleStore
from gpuload.cache.allocator import reserved_bytes
from gpuload.cache.budget import BudgetLedger

GiB = 2**30
gpu = pytest.mark.gpu


def test_sample_cache_budget_and_counts():
    sample = {"image": torch.zeros(10, dtype=torch.uint8), "label": 3, "name": "a"}
    per_sample = 10 + 8 + 1
    cache = SampleStore(per_sample * 3 + 5)
    for i in range(5):
        cache.keep(i, sample)
    assert len(cache) == 3 and cache.full
    assert 3 not in cache and 2 in cache
    stats = cache.stats
    assert stats.bytes == 3 * per_sample and stats.rejected == 2
    got = cache.get(1)
    assert torch.equal(got["image"], sample["image"]) and got["label"] == 3 and got["name"] == "a"
    assert cache.get(4) is None
    assert cache.stats.hits == 1 and cache.stats.misses == 1


def test_sample_cache_copies_and_keeps_structure():
    tensor = torch.arange(4)
    array = np.arange(3)
    cache = SampleStore(10**6)
    assert cache.keep(0, (tensor, [array, 1.5], {"k": tensor}))
    tensor += 100  # the dataset reuses its buffer
    array += 100
    got = cache.get(0)
    assert isinstance(got, tuple) and isinstance(got[1], list) and isinstance(got[2], dict)
    assert torch.equal(got[0], torch.arange(4)) and np.array_equal(got[1][0], np.arange(3))
    assert not cache.keep(1, object())  # not a cacheable type
    assert cache.stats.uncacheable == 1


def test_sample_cache_close():
    ledger = BudgetLedger()
    cache = SampleStore(100, ledger=ledger)
    cache.keep(0, torch.zeros(4))
    stored = weakref.ref(cache.get(0))
    cache.close()
    gc.collect()
    assert stored() is None and len(cache) == 0
    assert not cache.keep(1, torch.zeros(1))
    cache.close()


@gpu
def test_cuda_sample_cache_books_ledger():
    ledger = BudgetLedger()
    cache = SampleStore(1000, "cuda", ledger=ledger, owner="s")
    cache.keep(0, torch.zeros(100, dtype=torch.uint8))
    assert cache.get(0).device.type == "cuda"
    assert ledger.used("cuda:0") == reserved_bytes(100) == 512  # the allocator's block, not the 100 bytes
    cache.close()
    assert ledger.owners("cuda:0") == {}


def test_sample_cache_settle_stops_adding_and_shrinks_the_budget():
    cache = SampleStore(1000)
    assert cache.keep(0, torch.zeros(100, dtype=torch.uint8))
    cache.settle()
    assert cache.stats.budget == 100 and cache.full
    assert not cache.keep(1, torch.zeros(1, dtype=torch.uint8))
    assert cache.peek(0) is not None and cache.stats.hits == 0  # peek counts nothing


@gpu
def test_cuda_sample_cache_settle_gives_the_unused_booking_back():
    ledger = BudgetLedger()
    cache = SampleStore(1000, "cuda", ledger=ledger, owner="s")
    cache.keep(0, torch.zeros(100, dtype=torch.uint8))
    assert ledger.reserved("cuda:0") == 1000
    cache.settle()
    assert ledger.reserved("cuda:0") == 512 and ledger.used("cuda:0") == 512  # reserved_bytes(100)
    cache.close()
    assert ledger.owners("cuda:0") == {}


def test_sample_cache_shrink_drops_the_newest_and_stops_adding():
    cache = SampleStore(1000)
    for index in range(5):
        cache.keep(index, torch.zeros(100, dtype=torch.uint8))
    assert cache.shrink(250) == 300
    assert sorted(i for i in range(5) if i in cache) == [0, 1]
    assert cache.stats.bytes == 200 and cache.full
    assert not cache.keep(9, torch.zeros(1, dtype=torch.uint8))
    assert cache.shrink(1000) == 0


def test_sample_cache_asks_for_room_before_adding_and_stops_with_one_warning():
    calls = []

    def ask() -> int:  # 250 bytes free above the reserve at first; the cache then took 200
        calls.append(1)
        return 250 if len(calls) == 1 else 50

    cache = SampleStore(10_000, room=ask)
    assert cache.keep(0, torch.zeros(100, dtype=torch.uint8))
    assert cache.keep(1, torch.zeros(100, dtype=torch.uint8))
    assert len(calls) == 1  # the first answer covered both
    with pytest.warns(CacheFallbackWarning, match="reached the reserve after caching 2 samples"):
        assert not cache.keep(2, torch.zeros(100, dtype=torch.uint8))  # 50 bytes left, 100 asked
    assert len(calls) == 2 and cache.full and cache.stats.entries == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cache.keep(3, torch.zeros(1, dtype=torch.uint8))


def test_keeps_decoded_images_until_the_budget() -> None:
    image = torch.randint(0, 256, (3, 8, 6), dtype=torch.uint8)
    cache = SampleStore(2 * image.numel(), num_samples=3, ledger=BudgetLedger())
    assert cache.keep(0, image) and cache.keep(1, image)
    assert not cache.keep(2, image)  # over the budget
    assert torch.equal(cache.get(0), image) and cache.get(2) is None
    assert not cache.complete and not cache.accepting
    summary = cache.summary(mode="decoded")
    assert summary["mode"] == "decoded" and summary["entries"] == 2 and summary["hits"] == 1
    cache.close()
    assert cache.get(0) is None


def test_keeps_encoded_bytes_completes_and_settles() -> None:
    blobs = [b"\xff\xd8" + bytes(10), b"\xff\xd8" + bytes(20)]
    cache = SampleStore(GiB, num_samples=2, ledger=BudgetLedger())
    for index, data in enumerate(blobs):
        assert cache.accepting and cache.keep(index, data)
    assert cache.complete and not cache.accepting and cache.get(1) == blobs[1]
    assert cache.summary()["budget"] == sum(map(len, blobs))  # settled to what it holds


class _Pair(tuple):
    """A tuple subclass with no fields: rebuilt from its items."""


class _Point(tuple):
    """A tuple subclass whose constructor takes the coordinates, not an iterable."""

    def __new__(cls, x: int, y: int):
        return super().__new__(cls, (x, y))


class _Tagged(torch.Tensor):
    """A tensor subclass torch's functions keep (detach() returns one)."""


class _Plain(torch.Tensor):
    """A tensor subclass torch's functions do not keep (detach() returns a torch.Tensor)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def test_copies_keep_container_and_tensor_subclasses_and_name_what_they_cannot_copy():
    from gpuload.cache.sample_store import Uncacheable, copy_value

    pair, size = copy_value(_Pair((torch.arange(2), 3)), torch.device("cpu"))
    assert type(pair) is _Pair and torch.equal(pair[0], torch.arange(2)) and size == 16 + 8
    for kind in (_Tagged, _Plain):
        tagged = torch.arange(3).as_subclass(kind)
        tagged.note = "kept"
        copied, _ = copy_value(tagged, torch.device("cpu"))
        assert type(copied) is kind and copied.note == "kept" and copied.data_ptr() != tagged.data_ptr()
    with pytest.raises(Uncacheable, match="numpy object array"):
        copy_value(np.array([1, "a"], dtype=object), torch.device("cpu"))
    with pytest.raises(Uncacheable, match=r"_Point \(TypeError: .*\)"):
        copy_value(_Point(1, 2), torch.device("cpu"))


def test_a_negative_budget_is_refused_and_a_closed_cache_settles_to_nothing():
    with pytest.raises(ValueError, match="budget_bytes must be >= 0, got -1"):
        SampleStore(-1)
    cache = SampleStore(100)
    assert cache.keep(0, 1) and cache.keep(0, 1) and len(cache) == 1  # kept once
    cache.close()
    cache.settle()
    assert not cache.full


def test_a_cache_closed_while_a_sample_is_copied_does_not_keep_it(monkeypatch):
    import gpuload.cache.sample_store as sample_store

    cache = SampleStore(10**6)
    copy = sample_store.copy_value

    def copied_while_closed(value, device):
        result = copy(value, device)
        cache.close()  # as another thread closing the cache while this one copies (outside the lock)
        return result

    monkeypatch.setattr(sample_store, "copy_value", copied_while_closed)
    assert not cache.keep(0, torch.zeros(2))
    assert len(cache) == 0 and cache.stats.bytes == 0


def test_out_of_memory_while_copying_stops_filling_with_one_warning_and_other_errors_surface(monkeypatch):
    import gpuload.cache.sample_store as sample_store

    cache = SampleStore(10**6)
    assert cache.keep(0, torch.zeros(2))

    def failing(value, device):
        raise RuntimeError(value)

    monkeypatch.setattr(sample_store, "copy_value", failing)
    with pytest.raises(RuntimeError, match="a bad sample"):
        cache.keep(1, "a bad sample")
    with pytest.warns(CacheFallbackWarning, match="out of memory on cpu"):
        assert not cache.keep(2, "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert cache.full and cache.stats.rejected == 1 and len(cache) == 1
    assert not cache.keep(3, torch.zeros(2))
