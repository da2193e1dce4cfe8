"""Generic datasets through the sample cache: the decision, filling, serving, warm(), close()."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from counting import Counted
from equivalence import assert_same, assert_same_epochs

import gpuload
from gpuload.cache import CacheSettings
from gpuload.device import MemoryInfo
from gpuload.sources.torch_fetch import RecordingSampler, per_batch

GiB = 1 << 30


class Augmented(Counted):
    def __getitem__(self, index: int):
        self.reads += 1
        return torch.rand(3)


def settings(**keywords) -> CacheSettings:
    return CacheSettings.resolve(environ={}, cwd="/", **keywords)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_size", [4, None])
def test_cached_batches_equal_torchs_and_read_each_sample_once(workers: int, batch_size) -> None:
    data = Counted()
    ours = gpuload.DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=workers,
                              generator=torch.Generator().manual_seed(3), cache="host")
    theirs = tud.DataLoader(data, batch_size=batch_size, shuffle=True, num_workers=workers,
                            generator=torch.Generator().manual_seed(3))
    reads = []

    def count(_epoch: int) -> None:
        reads.append(data.reads)

    assert_same_epochs(ours, theirs, epochs=3, before_epoch=count)
    assert ours.generator.get_state().equal(theirs.generator.get_state())
    cache = ours.stats.extra["cache"]
    assert cache["complete"] and cache["entries"] == len(data)
    assert ours.stats.bytes_h2d_per_epoch == [0, 0, 0]  # a CPU device: nothing crosses PCIe
    assert ours.stats.path == "sample-cache (host)"
    if workers == 0:
        # Epoch 1 read the samples for both loaders, and gpuload's probe read 4 of them 6 times
        # (cache="host" on a dataset whose samples could be random); later epochs only torch's read.
        assert reads[1] - reads[0] == 2 * len(data) + 24
        assert reads[2] - reads[1] == len(data)


def test_persistent_workers_fill_then_serve() -> None:
    data = Counted()
    kw = dict(batch_size=5, shuffle=True, num_workers=2, persistent_workers=True)
    ours = gpuload.DataLoader(data, generator=torch.Generator().manual_seed(4), cache="host", **kw)
    theirs = tud.DataLoader(data, generator=torch.Generator().manual_seed(4), **kw)
    assert_same_epochs(ours, theirs, epochs=3)
    assert ours.generator.get_state().equal(theirs.generator.get_state())
    ours.close()


def test_partial_cache_warns_once_and_reads_only_misses() -> None:
    data = Counted(40)
    ours = gpuload.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5),
                              cache="host", cache_size="400B")
    theirs = tud.DataLoader(Counted(40), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))
    with pytest.warns(UserWarning, match="partial"):
        assert_same_epochs(ours, theirs, epochs=1)
    held = ours.stats.extra["cache"]["entries"]
    assert 0 < held < len(data)
    before = data.reads
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning came once
        assert_same_epochs(ours, theirs, epochs=1)
    assert data.reads - before == len(data) - held


def test_partial_cache_with_workers_is_given_up() -> None:
    data = Counted(40)
    ours = gpuload.DataLoader(data, batch_size=8, num_workers=2, cache="host", cache_size="300B")
    with pytest.warns(UserWarning, match="partial"):
        assert_same_epochs(ours, tud.DataLoader(data, batch_size=8), epochs=2)
    assert ours.stats.path == "torch"
    assert ours.stats.extra["cache"]["entries"] == 0  # released


def test_an_explicit_cache_on_random_samples_warns_once_and_keeps_caching() -> None:
    ours = gpuload.DataLoader(Augmented(12), batch_size=4, cache="host")
    with pytest.warns(UserWarning, match="caching this Augmented: .*first epoch's samples are kept"):
        first = torch.cat(list(ours))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(torch.cat(list(ours)), first)  # served again, as asked
    assert ours.stats.path == "sample-cache (host)"


def test_in_place_changes_to_a_batch_do_not_reach_the_cache() -> None:
    data = Counted(6)
    ours = gpuload.DataLoader(data, batch_size=None, cache="host")
    for sample in ours:
        sample["x"].mul_(0)
    for index, sample in enumerate(ours):
        assert_same(sample, tud.default_convert(data[index]))


def test_a_custom_collate_gets_fresh_samples() -> None:
    data = Counted(6)
    ours = gpuload.DataLoader(data, batch_size=3, collate_fn=list, cache="host")
    for batch in ours:
        for sample in batch:
            sample["x"].zero_()
    assert_same_epochs(ours, tud.DataLoader(data, batch_size=3, collate_fn=list), epochs=1)


def test_an_early_break_while_filling_with_workers_loses_nothing() -> None:
    data = Counted()
    ours = gpuload.DataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                              generator=torch.Generator().manual_seed(6), cache="host")
    theirs = tud.DataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(6))
    for a, b in zip(ours, theirs):
        assert_same(a, b)
        break  # both loaders abandon their first epoch
    assert_same_epochs(ours, theirs, epochs=2)


def test_non_integer_indices_are_served_uncached() -> None:
    table = {"a": torch.tensor([1.0]), "b": torch.tensor([2.0]), "c": torch.tensor([3.0])}
    keys = ["c", "a", "b"]
    ours = gpuload.DataLoader(table, sampler=keys, batch_size=2, cache="host")
    with pytest.warns(UserWarning, match="not integers"):
        assert_same_epochs(ours, tud.DataLoader(table, sampler=keys, batch_size=2), epochs=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_warm_fills_before_the_first_epoch_without_touching_randomness(workers: int) -> None:
    data = Counted()
    ours = gpuload.DataLoader(data, batch_size=4, shuffle=True, num_workers=workers,
                              generator=torch.Generator().manual_seed(7), cache="host")
    theirs = tud.DataLoader(Counted(), batch_size=4, shuffle=True, num_workers=workers,
                            generator=torch.Generator().manual_seed(7))
    global_state = torch.get_rng_state()
    stats = ours.warm(progress=False)
    assert torch.equal(torch.get_rng_state(), global_state)
    assert stats.extra["cache"]["complete"]
    reads = data.reads
    assert_same_epochs(ours, theirs, epochs=2)
    assert data.reads == reads  # the epochs read nothing from the dataset
    assert ours.warm(progress=False).extra["cache"]["entries"] == len(data)


def test_warm_without_a_cache_reads_nothing() -> None:
    data = Counted()
    loader = gpuload.DataLoader(data, batch_size=4)  # auto on a CPU device: no sample cache
    stats = loader.warm(progress=False)
    assert data.reads == 0 and "cache" not in stats.extra
    assert stats.extra["sample_cache_decision"].startswith("none")


def test_warm_places_array_data() -> None:
    data = tud.TensorDataset(torch.arange(10))
    loader = gpuload.DataLoader(data, batch_size=4)
    assert loader.warm(progress=False).path == "device-gather"


def test_close_drops_the_samples_and_iteration_starts_again() -> None:
    data = Counted(10)
    loader = gpuload.DataLoader(data, batch_size=4, cache="host")
    list(loader)
    loader.close()
    released = loader.stats.extra["cache"]
    assert released["released"] and released["entries"] == 0 and released["bytes"] == 0
    assert_same_epochs(loader, tud.DataLoader(data, batch_size=4), epochs=1)


def test_recording_sampler_draws_what_the_sampler_draws() -> None:
    g1, g2 = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    sampler = tud.BatchSampler(tud.RandomSampler(range(20), generator=g1), 3, False)
    recorder = RecordingSampler(sampler)
    drawn = list(recorder)
    assert drawn == list(tud.BatchSampler(tud.RandomSampler(range(20), generator=g2), 3, False))
    assert list(recorder.drawn) == drawn and len(recorder) == 7


@pytest.mark.gpu
def test_device_tier_serves_epochs_without_copies() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    data = Counted()
    ours = gpuload.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9),
                              device="cuda")
    theirs = tud.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9))
    assert_same_epochs(ours, theirs, epochs=1)
    assert ours.stats.path == "sample-cache (device)"
    moved = ours.stats.bytes_h2d
    batches = list(ours)
    assert all(batch["x"].is_cuda for batch in batches)
    assert ours.stats.bytes_h2d == moved  # epoch 2 copied nothing
    assert ours.stats.bytes_h2d_per_epoch[1] == 0 < ours.stats.bytes_h2d_per_epoch[0]
    ours.close()
    assert ours.stats.extra["cache"]["entries"] == 0


@pytest.mark.gpu
def test_auto_declines_a_randomly_augmented_dataset_with_one_warning() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    loader = gpuload.DataLoader(Augmented(), batch_size=4, device="cuda")
    with pytest.warns(UserWarning, match="not caching"):
        list(loader)
    assert loader.stats.path == "torch" and "cache" not in loader.stats.extra


@pytest.mark.gpu
def test_device_tier_shrinks_when_the_model_grows_into_the_reserve(monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import gpuload.cache.sample_store as sample_store

    data = Counted()
    loader = gpuload.DataLoader(data, batch_size=4, device="cuda", cache="device")
    list(loader)
    real = sample_store.device_memory
    monkeypatch.setattr(
        sample_store, "device_memory", lambda d: MemoryInfo(free=0, total=real(d).total)
    )
    with pytest.warns(UserWarning, match="below the reserve"):
        batches = list(loader)
    assert loader.stats.extra["cache"]["entries"] == 0
    assert_same_epochs(loader, tud.DataLoader(data, batch_size=4), epochs=1)
    assert len(batches) == len(list(tud.DataLoader(data, batch_size=4)))


class Batched(Counted):
    """A dataset that reads a batch's samples in one call, as torch's fetcher allows."""

    def __getitems__(self, indices):
        self.calls = getattr(self, "calls", 0) + 1
        return [self[i] for i in indices]


def test_a_dataset_with_getitems_is_read_a_batch_at_a_time() -> None:
    data = Batched(12)
    ours = gpuload.DataLoader(data, batch_size=4, cache="host")
    assert_same_epochs(ours, tud.DataLoader(Batched(12), batch_size=4), epochs=2)
    assert data.calls == 3  # the first epoch's three batches; the second came from the cache


@pytest.mark.gpu
def test_host_tier_on_cuda_is_collated_on_the_host_and_prefetched() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    data = Counted()
    ours = gpuload.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(12),
                              device="cuda", cache="host")
    theirs = tud.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(12))
    assert_same_epochs(ours, theirs, epochs=2)
    assert ours.stats.path == "sample-cache (host)" and ours.stats.extra["cache"]["complete"]
    assert ours.stats.bytes_h2d_per_epoch[1] > 0  # host batches still cross PCIe
    ours.close()


def test_prefetched_cache_epochs_equal_torchs() -> None:
    data = Counted()
    ours = gpuload.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(13),
                              cache="host", prefetch_depth=2)
    theirs = tud.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(13))
    assert_same_epochs(ours, theirs, epochs=3)
    assert ours.stats.extra["cache"]["complete"] and "prefetch" in ours.stats.extra
    assert ours.generator.get_state().equal(theirs.generator.get_state())
    ours.close()


@pytest.mark.gpu
def test_filling_stops_when_free_memory_reaches_the_reserve(monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import gpuload.device
    from gpuload.cache import CacheFallbackWarning

    real = gpuload.device.device_memory
    total = real(torch.device("cuda")).total
    reserve = max(2 * GiB, total // 10)
    # The model has taken everything but the reserve and 100 bytes: about 4 samples' worth.
    monkeypatch.setattr(gpuload.device, "device_memory", lambda d: MemoryInfo(free=reserve + 100, total=total))
    data = Counted()
    loader = gpuload.DataLoader(data, batch_size=4, device="cuda", cache="device")
    with pytest.warns(CacheFallbackWarning, match="reached the reserve"):
        assert_same_epochs(loader, tud.DataLoader(data, batch_size=4), epochs=2)
    assert 0 < loader.stats.extra["cache"]["entries"] < len(data)


class Structured(tud.Dataset):
    """Samples of one nested structure: tensors, numpy arrays and scalars, Python numbers, strings."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        x = torch.arange(3, dtype=torch.float16) * index
        return {"pair": (x, [np.int32(index), float(index) / 3]), "flag": index % 2 == 0,
                "array": np.full((2,), index, dtype=np.uint8), "name": f"n{index}", "id": index}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_nested_structure_is_stored_by_column_and_equals_torchs(workers: int) -> None:
    data = Structured()
    kw = dict(batch_size=5, shuffle=True, num_workers=workers)
    ours = gpuload.DataLoader(data, generator=torch.Generator().manual_seed(14), cache="host", **kw)
    theirs = tud.DataLoader(data, generator=torch.Generator().manual_seed(14), **kw)
    assert_same_epochs(ours, theirs, epochs=2)
    decision = ours.stats.extra["sample_cache_decision"]
    assert "by column: 6 column(s)" in decision and "1 leaf(s) per sample" in decision
    assert ours.stats.extra["cache"]["complete"] and ours.stats.path == "sample-cache (host)"
    ours.close()


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_custom_collate_or_no_batching_gets_per_sample_copies_of_the_columns(batch_size) -> None:
    data = Structured(9)
    collate = tud.default_convert if batch_size is None else list
    ours = gpuload.DataLoader(data, batch_size=batch_size, collate_fn=collate, cache="host")
    theirs = tud.DataLoader(data, batch_size=batch_size, collate_fn=collate)
    assert_same_epochs(ours, theirs, epochs=2)
    assert ours.stats.extra["cache"]["complete"]
    assert "by column" in ours.stats.extra["sample_cache_decision"]


def test_samples_without_fixed_shape_leaves_are_stored_per_sample() -> None:
    words = [f"word {i}" * (i % 3) for i in range(10)]
    ours = gpuload.DataLoader(words, batch_size=3, cache="host")
    assert_same_epochs(ours, tud.DataLoader(words, batch_size=3), epochs=2)
    assert "per sample" in ours.stats.extra["sample_cache_decision"]


def test_variable_length_samples_in_length_buckets() -> None:
    """Tensors of two lengths, batched by length: the leaf becomes per-sample, batches stay torch's."""
    data = [(torch.arange(2 if i < 6 else 4) + i, i) for i in range(12)]
    buckets = [[0, 3, 1], [7, 6], [2, 4, 5], [11, 8, 9, 10]]
    ours = gpuload.DataLoader(data, batch_sampler=buckets, cache="host")
    assert_same_epochs(ours, tud.DataLoader(data, batch_sampler=buckets), epochs=2)
    assert ours.stats.extra["sample_cache_decision"].endswith("by column: 1 column(s) [int64[]], 8 B per row, "
                                                              "rows for every sample, 1 leaf(s) per sample")


def test_a_partly_cached_batch_is_gathered_and_read_in_order() -> None:
    data = Counted(40)
    kw = dict(batch_size=8, shuffle=True)
    ours = gpuload.DataLoader(data, generator=torch.Generator().manual_seed(15), cache="host", cache_size="700B", **kw)
    theirs = tud.DataLoader(Counted(40), generator=torch.Generator().manual_seed(15), **kw)
    with pytest.warns(UserWarning, match="partial"):
        assert_same_epochs(ours, theirs, epochs=1)
    assert_same_epochs(ours, theirs, epochs=2)
    cache = ours.stats.extra["cache"]
    assert 0 < cache["entries"] < len(data) and cache["hits"] > 0 and cache["misses"] > 0


def test_indices_out_of_range_and_empty_batches_fail_or_pass_as_torchs() -> None:
    class Wrapping(Counted):
        def __getitem__(self, index: int):
            return super().__getitem__(index % self.n)

    class Columns(Counted):
        def __getitem__(self, index: int):  # any integer, each its own sample
            return torch.tensor([float(index)])

    batches = [[-1, 2], [0, 1], [3, 4, 5], [7, 2], [-2, 9]]  # -1, 7...: read, never kept
    for data in (Wrapping(6), Columns(6)):
        ours = gpuload.DataLoader(data, batch_sampler=batches, cache="host")
        assert_same_epochs(ours, tud.DataLoader(data, batch_sampler=batches), epochs=2)
        assert ours.stats.extra["cache"]["complete"]
    data = Wrapping(6)
    empty = gpuload.DataLoader(data, batch_sampler=[[]], cache="host")
    with pytest.raises(IndexError):
        list(tud.DataLoader(data, batch_sampler=[[]]))
    with pytest.raises(IndexError):
        list(empty)


def test_a_batch_made_in_the_loops_thread_reaches_the_device_through_the_loaders_staging() -> None:
    """Nothing ran ahead: torch's host batch goes to the device only through ``copy_now`` (the
    prefetcher's staging, which counts the bytes), never a copy of the source's own."""
    from types import SimpleNamespace

    from gpuload.sources.samples import SampleSource

    source = SampleSource.__new__(SampleSource)
    source.setup = SimpleNamespace(device=torch.device("meta"), batched=True)
    staged = []

    def copy(batch):
        staged.append(batch)
        return [tensor.to("meta") for tensor in batch]

    batch, count = source._moved([torch.zeros(4, 2), torch.arange(4)], copy)
    assert len(staged) == 1 and count == 4 and all(tensor.device.type == "meta" for tensor in batch)
    with pytest.raises(RuntimeError, match="only through the loader's staging"):
        source._moved([torch.zeros(1)], None)


def test_two_threads_each_with_its_own_iterator_fill_one_sample_cache() -> None:
    """#25 item 9: two threads, each iterating its own epoch of one loader (no workers,
    ``cache="host"``), while the cache fills. Each sample is stored once (a thread that found
    a sample missing may meet it stored by the other), the cache is complete only when every
    sample is in it, and every batch is the one its indices ask for (20 trials: before the fix
    about half raised an IndexError from the cache's gather)."""
    import threading

    class Numbered(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 400

        def __getitem__(self, index: int):
            return torch.full((8,), float(index)), index

    for _ in range(20):
        loader = gpuload.DataLoader(Numbered(), batch_size=16, shuffle=True, cache="host", device="cpu")
        failures: list[BaseException] = []

        def iterate() -> None:  # its threads are joined within this iteration: loader and failures are its own
            try:
                for x, y in loader:  # noqa: B023
                    assert torch.equal(x[:, 0].long(), y)
            except BaseException as error:  # noqa: BLE001 - reported below
                failures.append(error)  # noqa: B023

        threads = [threading.Thread(target=iterate) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures and not any(thread.is_alive() for thread in threads)
        cache = loader.stats.extra["cache"]
        assert cache["complete"] and cache["entries"] == 400
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_that_visits_part_of_the_dataset_each_epoch_fills_the_cache_over_epochs(workers: int) -> None:
    """#25 item 11: a DistributedSampler's share (and sampling with replacement) leaves samples
    for later epochs. No warning blames the budget, which is ample, and with workers the cache
    is kept while epochs add to it, then serves once complete."""
    from torch.utils.data.distributed import DistributedSampler

    data = Counted(24)
    kw = dict(batch_size=4, num_workers=workers)
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    ours = gpuload.DataLoader(data, sampler=sampler, cache="host", **kw)
    theirs = tud.DataLoader(Counted(24), sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=True,
                                                                     seed=3), **kw)
    # Recorded, not raised: torch's forked workers inherit the filter, and an "error" filter
    # there fails on warnings that are not the loader's (a tool's own at the worker's exit).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(12):
            ours.sampler.set_epoch(epoch)
            theirs.sampler.set_epoch(epoch)
            assert_same_epochs(ours, theirs, epochs=1)
            if ours.stats.extra["cache"].get("complete"):
                break
    assert [str(w.message) for w in caught if "gpuload" in str(w.message)] == []  # no "partial: the budget ..."
    cache = ours.stats.extra["cache"]
    assert cache["complete"] and cache["entries"] == 24 and not cache.get("released")
    before = data.reads
    assert_same_epochs(ours, theirs, epochs=1)
    assert data.reads == before and ours.stats.path == "sample-cache (host)"  # served from the cache
    ours.close()


def test_with_workers_a_cache_whose_epochs_add_nothing_is_dropped_saying_why() -> None:
    """The same share every epoch (no shuffle): the cache holds all it will ever get; with
    workers only a complete cache serves, so it is dropped, with the reason, not the budget."""
    from torch.utils.data.distributed import DistributedSampler

    data = Counted(24)
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)
    ours = gpuload.DataLoader(data, sampler=sampler, batch_size=4, num_workers=2, cache="host")
    theirs = tud.DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False),
                            batch_size=4)
    with pytest.warns(UserWarning, match=r"dropped: the sampler's epochs read 12 of its 24 samples and no more"):
        assert_same_epochs(ours, theirs, epochs=2)
    assert ours.stats.path == "torch" and ours.stats.extra["cache"]["entries"] == 0
    ours.close()


def test_per_batch_goes_on_after_a_batch_that_raised_and_ends_once() -> None:
    """As torch's iterators: the failed batch is consumed, the next ``next()`` makes the one
    after; ``at_end`` runs once, when the items run out (not again on a later ``next()``)."""
    ended = []

    def make(item: int) -> int:
        if item == 1:
            raise ValueError("bad batch 1")
        return item * 10

    batches = per_batch(iter(range(3)), make, lambda: ended.append(True))
    assert next(batches) == 0
    with pytest.raises(ValueError, match="bad batch 1"):
        next(batches)
    assert next(batches) == 20
    assert not ended
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(batches)
    assert ended == [True]
