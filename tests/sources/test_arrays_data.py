"""Array datasets: every dtype torch collates, and arrays the dataset is given after the loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from equivalence import assert_same_epochs
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset, default_collate, default_convert

import gpuload
from gpuload.cache import TieredArrayStore
from gpuload.cache.array_store import gatherable
from gpuload.cache.plan import make_plan
from gpuload.datasets import ArrayDataset
from gpuload.prefetch import Prefetcher
from gpuload.sources.placed_arrays import ResidentColumns, find_columns

# Every dtype torch's default_collate stacks (it accepts any tensor dtype).
DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
]
MODES = [{}, {"cache": "off"}, {"cache": "off", "prefetch_depth": 0}, {"cache": "device"}, {"cache": "host"}]


def column(dtype: torch.dtype, n: int = 13, width: int | None = None) -> torch.Tensor:
    """Values spread over the dtype's range (the top bit set for unsigned ones)."""
    values = torch.arange(n, dtype=torch.int64) * 977 + 3
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        bits = {torch.uint16: 16, torch.uint32: 32, torch.uint64: 64}[dtype]
        signed = {16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]
        values = (values - 2 ** (min(bits, 63) - 1)).to(signed).view(dtype)  # high bit set
    elif dtype is torch.bool:
        values = values % 3 == 0
    else:
        values = values.to(dtype)
    return values if width is None else values.unsqueeze(1).repeat(1, width)


@pytest.mark.parametrize("options", MODES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_torch_collates_gives_torchs_batches(dtype: torch.dtype, options: dict) -> None:
    dataset = TensorDataset(column(dtype), column(dtype, width=3), torch.zeros(13, 2, 2, dtype=torch.uint8))
    ours = gpuload.DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3),
                              device="cpu", **options)
    theirs = TorchDataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    assert_same_epochs(ours, theirs)
    assert ours.stats.path in ("device-gather", "host-gather")  # the array path served them


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64, np.bool_, np.float16])
def test_numpy_columns_of_unusual_dtypes_unbatched_and_batched(dtype) -> None:
    images = np.random.default_rng(0).integers(0, 256, (10, 3, 4, 4), dtype=np.uint8)
    dataset = ArrayDataset(image=images, label=np.arange(10).astype(dtype))
    for batch_size in (None, 4):
        ours = gpuload.DataLoader(dataset, batch_size=batch_size, device="cpu", cache="off")
        assert_same_epochs(ours, TorchDataLoader(dataset, batch_size=batch_size), epochs=1)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.bool])
def test_the_tiered_store_gathers_across_tiers_for_unsigned_dtypes(dtype: torch.dtype) -> None:
    data = {"x": column(dtype, 40, width=2), "y": column(dtype, 40)}
    bps = 3 * data["y"].element_size()
    plan = make_plan(bps, 40, device_free=2**30, host_free=10 * bps, budget=15 * bps, reserve=0,
                     mode="auto", host_reserve=0)
    index = torch.tensor([39, 0, 20, 14, 15, 25, 26, 3])  # device, host and source rows mixed
    with TieredArrayStore(data, plan, "cpu") as store:
        got = store.gather(index)
        stats = store.stats
    assert stats.device_samples and stats.host_samples and stats.source_samples
    for key, array in data.items():
        assert got[key].dtype == dtype and torch.equal(got[key], array[index])


@pytest.mark.parametrize("batched", [True, False])
def test_a_tiered_cache_reaches_the_loop_through_the_prefetchers_staging(batched: bool) -> None:
    """The CUDA path of a tiered cache, run on the CPU: each batch's device-tier rows are
    gathered in the prefetcher's thread, its host and source rows straight into a staging slot,
    and the loop's finish puts them back in order: the batches torch's fetch + collate gives.
    The same requests copied in the loop's thread (``copy_now``: ``prefetch_depth=0``) agree."""
    data = [column(torch.uint16, 60, width=3), column(torch.float32, 60)]
    dataset = TensorDataset(*data)
    columns = find_columns(dataset, default_collate if batched else default_convert, batched)
    bps = sum(c[0].numel() * c.element_size() for c in data)
    plan = make_plan(bps, 60, device_free=2**30, host_free=20 * bps, budget=25 * bps, reserve=0, mode="auto",
                     host_reserve=0)
    store = TieredArrayStore(list(columns.columns), plan, "cpu", stage_host_rows=True)
    resident = ResidentColumns(columns, columns.columns, torch.device("cpu"), "tiered", False, store=store)
    assert resident.copies_batches  # host and source rows: the source streams its batches
    batches = [torch.tensor([59, 0, 30, 24, 25, 45, 46, 3]), torch.tensor([1, 2]), torch.tensor([50, 51])]
    if not batched:
        batches = [torch.tensor([k]) for k in (0, 30, 59)]
    prefetcher = Prefetcher(None, "cpu", depth=2)
    delivered = list(prefetcher.epoch(resident.request(index, batched) for index in batches))
    inline = [resident.gather(index, batched, copy=prefetcher.copy_now)[0] for index in batches]
    for index, ahead, now in zip(batches, delivered, inline):
        theirs = default_collate([dataset[k] for k in index.tolist()]) if batched else dataset[int(index)]
        for got in (resident.finished(ahead), now):
            for mine, expected in zip(got, theirs):
                assert mine.dtype == expected.dtype and torch.equal(mine, expected)
    assert prefetcher.stats.bytes_copied > 0
    store.close()


# ------------------------------------------------------------------- arrays changed later


@pytest.mark.parametrize("options", MODES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_arrays_given_to_the_dataset_later_are_served_at_the_next_epoch(options: dict) -> None:
    dataset = TensorDataset(torch.arange(8))
    loader = gpuload.DataLoader(dataset, batch_size=4, device="cpu", **options)
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    dataset.tensors = (torch.arange(100, 108),)  # same shape, other tensor
    assert [b[0].tolist() for b in loader] == [[100, 101, 102, 103], [104, 105, 106, 107]]
    dataset.tensors = (torch.arange(200, 210),)  # longer
    assert_same_epochs(loader, TorchDataLoader(dataset, batch_size=4))
    dataset.tensors = (torch.arange(300, 303),)  # shorter
    assert_same_epochs(loader, TorchDataLoader(dataset, batch_size=4))


def test_in_place_changes_are_read_each_epoch_without_a_cache() -> None:
    dataset = TensorDataset(torch.arange(8))
    loader = gpuload.DataLoader(dataset, batch_size=8, device="cpu", cache="off")
    assert next(iter(loader))[0].tolist() == list(range(8))
    dataset.tensors[0].mul_(10)
    assert next(iter(loader))[0].tolist() == [10 * i for i in range(8)]


def test_a_numpy_dataset_re_wrapped_each_epoch_keeps_its_placement() -> None:
    array = np.arange(12, dtype=np.int32)
    loader = gpuload.DataLoader(array, batch_size=5, device="cpu", cache="off")
    for _ in range(2):
        assert_same_epochs(loader, TorchDataLoader(array, batch_size=5), epochs=1)
    placed = loader._source.resident
    list(loader)
    assert loader._source.resident is placed  # the same memory: not rebuilt


def test_arrays_changed_into_another_structure_raise_a_clear_error() -> None:
    dataset = TensorDataset(torch.arange(8))
    loader = gpuload.DataLoader(dataset, batch_size=4, device="cpu")
    list(loader)
    dataset.tensors = (torch.arange(8), torch.arange(8))
    with pytest.raises(ValueError, match="changed since the DataLoader was built"):
        iter(loader)
    dataset.tensors = (torch.arange(8.0),)
    with pytest.raises(ValueError, match="dtype"):
        iter(loader)


UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def test_unsigned_columns_are_gathered_through_same_width_signed_views() -> None:
    # torch lacks some kernels for them (index_select on CUDA, index_copy_ on the CPU).
    data = TensorDataset(*(column(dtype) for dtype in UNSIGNED))
    loader = gpuload.DataLoader(data, batch_size=4, device="cpu", cache="off")
    list(loader)
    assert not {c.dtype for c in loader._source.resident.columns} & set(UNSIGNED)
    assert gatherable(column(torch.uint16)).dtype == torch.int16
    plan = make_plan(2 + 4 + 8, 13, device_free=2**30, host_free=0, budget=2**20, reserve=0, mode="auto",
                     host_reserve=0)
    with TieredArrayStore(list(data.tensors), plan, "cpu") as store:
        assert not {c.dtype for c in store._source} & set(UNSIGNED)
        assert [t.dtype for t in store.gather([1, 2])] == list(UNSIGNED)


@pytest.mark.gpu
@pytest.mark.parametrize("options", MODES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_every_dtype_on_cuda_gives_torchs_batches(options: dict) -> None:
    dataset = TensorDataset(*(column(dtype) for dtype in DTYPES))
    ours = gpuload.DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3),
                              device="cuda", **options)
    theirs = TorchDataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    assert_same_epochs(ours, theirs)
