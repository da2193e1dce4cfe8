"""The sample cache's glue (gpuload/sources/sample_cache.py): cache keys of index batches, the
bytes a prepared batch copies, and why a cache stays partial."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpuload
from gpuload.cache.columns import Branch, Column, Objects
from gpuload.sources.sample_cache import _column_bytes, _keys


def test_cache_keys_of_index_batches_are_int64_or_none_when_an_index_is_not_an_integer() -> None:
    assert _keys(torch.tensor([[1, 2], [3, 4]]), True).tolist() == [1, 2, 3, 4]
    assert _keys(torch.tensor([5, 6], dtype=torch.int32), True).tolist() == [5, 6]
    assert _keys([torch.tensor(2), np.int64(7), 3], True).tolist() == [2, 7, 3]
    assert _keys(np.int16(9), False).tolist() == [9]
    assert _keys(["a", 1], True) is None
    assert _keys([True, 1], True) is None


def test_the_bytes_of_a_prepared_batch_count_every_column_and_object() -> None:
    rows = torch.zeros(4, 3, dtype=torch.float32)
    column = Column("tensor", rows.dtype, rows)
    assert _column_bytes(column) == 48
    assert _column_bytes(Branch("tuple", None,
                                [column, Column("tensor", torch.int64, torch.zeros(4, dtype=torch.int64))])) == 80
    assert _column_bytes(Objects([torch.zeros(2, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)])) == 5


class _Opaque:
    """A sample type gpuload cannot copy."""


OPAQUE = _Opaque()  # one object: two reads of a sample are the same, so it does not look random


class _Mixed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.full((2,), i), OPAQUE


def test_a_cache_of_samples_it_cannot_copy_says_so() -> None:
    loader = gpuload.DataLoader(_Mixed(), batch_size=4, cache="host", collate_fn=lambda batch: batch)
    with pytest.warns(UserWarning, match="8 samples are of types gpuload cannot copy"):
        for _ in range(2):
            list(loader)
    loader.close()


class _Numbers(torch.utils.data.Dataset):
    """Fixed-shape samples."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.full((3,), float(i)), i


def _a_job_that_ends(loader) -> None:
    """One epoch of ``loader``, then its end (``close()``, as at a job's exit): the disk tier's
    blocks, published behind the loop, are all listed before the next job opens the entry."""
    list(loader)
    loader.close()


def _assert_same_epochs(loader, reference, epochs: int = 2) -> None:
    for _ in range(epochs):
        for got, want in zip(loader, reference, strict=True):
            assert type(got) is type(want) and len(got) == len(want)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("from_disk", [False, True])
def test_a_sample_drawn_twice_in_a_batch_is_stored_once_and_batches_equal_torch(tmp_path, from_disk: bool) -> None:
    sampler = [0, 0, 1, 2, 3, 3, 4, 5]
    options = {"cache_dir": tmp_path / "c"} if from_disk else {}
    if from_disk:  # a first job publishes every sample on disk: this one reads them from there
        _a_job_that_ends(gpuload.DataLoader(_Numbers(), batch_size=4, cache="host", **options))
    loader = gpuload.DataLoader(_Numbers(), batch_size=2, sampler=sampler, cache="host", **options)
    _assert_same_epochs(loader, torch.utils.data.DataLoader(_Numbers(), batch_size=2, sampler=sampler))
    cache = loader.stats.extra["cache"]
    assert cache["entries"] == 6 and cache["hits"] == 8  # the second epoch, from the cache
    assert cache["disk"]["hits"] == 8 if from_disk else "disk" not in cache  # the first epoch, from disk


@pytest.mark.parametrize("from_disk", [False, True])
def test_a_batch_read_now_and_stored_whole_is_the_columns_read_not_gathered_back(tmp_path, monkeypatch,
                                                                               from_disk: bool) -> None:
    """Issue #40: a batch every sample of which was read now (from the dataset, or from a disk
    tier a first job filled) and that the store took whole is served as the columns read, not
    gathered back out of the store (a third copy of every row of the filling epoch). Changing
    such a batch in place leaves the stored samples as they were."""
    from gpuload.cache.columns import ColumnStore

    options = {"cache_dir": tmp_path / "c"} if from_disk else {}
    if from_disk:
        _a_job_that_ends(gpuload.DataLoader(_Numbers(), batch_size=4, cache="host", **options))
    gathered = []
    gather_rows = ColumnStore.gather_rows
    monkeypatch.setattr(ColumnStore, "gather_rows", lambda store, slots: gathered.append(slots) or gather_rows(
        store, slots))

    def loader_of(kind, **more):
        return kind(_Numbers(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2), **more)

    loader, reference = loader_of(gpuload.DataLoader, cache="host", **options), loader_of(torch.utils.data.DataLoader)
    for got, want in zip(loader, reference, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        got[0].fill_(-1)  # the caller's batch: the store's copy stays
    assert gathered == [] and loader.stats.extra["cache"]["entries"] == 8
    _assert_same_epochs(loader, reference, epochs=1)  # from the store
    assert len(gathered) == 2
    loader.close()


def test_a_partial_cache_with_a_custom_collate_merges_stored_and_read_samples_in_order() -> None:
    def collate(batch):
        return [sample[0] for sample in batch]

    def loader_of(kind, **options):
        return kind(_Numbers(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5),
                    collate_fn=collate, **options)

    loader = loader_of(gpuload.DataLoader, cache="host", cache_size=120)  # room for 4 of the 8 samples
    with pytest.warns(UserWarning, match="holds 4 of 8 samples"):
        _assert_same_epochs(loader, loader_of(torch.utils.data.DataLoader), epochs=3)
    assert loader.stats.extra["cache"]["hits"] > 0


def test_warm_also_fills_the_disk_tier_so_a_later_job_reads_nothing_from_the_dataset(tmp_path) -> None:
    gpuload.DataLoader(_Numbers(), batch_size=4, cache="host", cache_dir=tmp_path / "c").warm()
    loader = gpuload.DataLoader(_Numbers(), batch_size=4, cache="host", cache_dir=tmp_path / "c")
    _assert_same_epochs(loader, torch.utils.data.DataLoader(_Numbers(), batch_size=4), epochs=1)
    disk = loader.stats.extra["cache"]["disk"]
    assert disk["hits"] == 8 and disk["misses"] == disk["rows_written"] == 0


class _TwoDtypes(torch.utils.data.Dataset):
    """Samples 0-3 float32, 4-7 float64: a batch mixing them collates to float64, as torch does."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.full((3,), float(i), dtype=torch.float32 if i < 4 else torch.float64), i


def test_rows_from_disk_that_do_not_fit_the_stored_columns_give_torchs_batch(tmp_path, monkeypatch) -> None:
    """The disk tier keeps the samples of dataset[0]'s structure (float32 rows 0-3); the store's
    columns were made from other samples (float64): a batch of both is read as torch reads it."""
    import gpuload.cache.disk_tier as disk_tier

    monkeypatch.setattr(disk_tier, "BLOCK_BYTES", 3 * 24)  # blocks of 3 rows (of 24 bytes): rows 0-2 publish
    _a_job_that_ends(gpuload.DataLoader(_TwoDtypes(), batch_size=4, cache="host", cache_dir=tmp_path / "c"))
    sampler = [4, 5, 6, 7, 4, 0, 5, 1]
    loader = gpuload.DataLoader(_TwoDtypes(), batch_size=4, sampler=sampler, cache="host", cache_size=128,
                                cache_dir=tmp_path / "c")  # full after the first batch
    with pytest.warns(UserWarning, match="partial"):
        _assert_same_epochs(loader, torch.utils.data.DataLoader(_TwoDtypes(), batch_size=4, sampler=sampler), epochs=1)
    cache = loader.stats.extra["cache"]
    assert cache["full"] and cache["disk"]["hits"] == 2  # rows 0 and 1, read from disk, then from the dataset


class _LabelledArrays(torch.utils.data.Dataset):
    """Samples whose leaves a per-sample view returns as host objects: numbers and arrays."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return {"x": torch.full((2,), float(i)), "label": i, "weight": i / 4,
                "box": np.full((2, 2), i, dtype=np.int16), "score": np.float32(i) / 3}


def test_a_device_cache_serving_per_sample_values_keeps_numbers_and_arrays_on_the_host(tmp_path) -> None:
    """Issue #34: a device-tier sample cache serving a collate_fn other than default_collate (here
    batch_size=None, torch's default_convert) made each view copy its number and array columns
    back from the device (``.tolist()``, ``.cpu()``: a host sync per batch). Those columns are
    kept in host memory instead. META stands in for CUDA: reading a META tensor's values raises
    as a host sync would block, so a view that needed one fails."""
    from torch.utils.data import default_convert

    from gpuload.cache import CacheDecision, CacheSettings
    from gpuload.sources import Setup
    from gpuload.sources.sample_cache import CachedSamples
    from gpuload.stats import LoaderStats

    meta = torch.device("meta")
    settings = CacheSettings.resolve(cache="device", environ={}, cwd=tmp_path)
    setup = Setup(dataset=_LabelledArrays(), map_style=True, device=meta, settings=settings, batched=False,
                  batch_size=None, collate_fn=default_convert, stats=LoaderStats(), owner="views")
    cached = CachedSamples(setup, CacheDecision("device", "samples", 1 << 20, "test"))
    dataset = _LabelledArrays()
    for _epoch in range(2):  # the first fills the cache, the second is served from it
        for i in (3, 0, 5, 1, 4, 2):
            got, want = cached.batch(i), default_convert(dataset[i])
            assert got["x"].device == meta and got["x"].shape == (2,)
            assert (got["label"], got["weight"]) == (want["label"], want["weight"]) == (i, i / 4)
            assert torch.equal(got["box"], want["box"]) and not got["box"].is_meta  # default_convert: a host tensor
            assert type(got["score"]) is type(want["score"]) and torch.equal(got["score"], want["score"])
    assert cached.store.stats.hits == 6 and cached.store.complete
    with pytest.raises(RuntimeError, match="serves per-sample values"):
        cached.store.gather_rows(cached.store.slots(torch.arange(2)))
    cached.close()
