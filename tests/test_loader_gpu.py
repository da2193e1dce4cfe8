"""On a CUDA device: the same batches as torch's DataLoader, arriving on the GPU."""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_same_epochs
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Subset, TensorDataset

import gpuload
from gpuload.device import DeviceError

pytestmark = pytest.mark.gpu


def data(n: int = 300) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(n))


class OnCpu:
    """Wraps a loader so its batches are compared on the CPU."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            assert all(t.is_cuda for t in batch)
            yield [t.cpu() for t in batch]


@pytest.mark.parametrize("cache", ["auto", "off"])
@pytest.mark.parametrize("generic", [False, True])
def test_cuda_batches_equal_torchs(cache: str, generic: bool) -> None:
    dataset = Subset(data(), range(300)) if generic else data()
    ours = gpuload.DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1),
                              device="cuda", cache=cache)
    theirs = TorchDataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    assert_same_epochs(OnCpu(ours), theirs, epochs=2)
    expected_path = "torch" if generic else ("host-gather" if cache == "off" else "device-gather")
    assert ours.stats.path == expected_path
    assert ours.stats.bytes_h2d > 0
    ours.close()


def test_device_gather_moves_the_dataset_once() -> None:
    dataset = data()
    loader = gpuload.DataLoader(dataset, batch_size=50, device="cuda")
    list(loader)
    first = loader.stats.bytes_h2d
    dataset_bytes = sum(t.numel() * t.element_size() for t in dataset.tensors)
    assert first >= dataset_bytes
    list(loader)
    assert loader.stats.bytes_h2d - first < dataset_bytes / 10  # only indices cross PCIe
    loader.close()


def test_missing_cuda_index_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match="does not exist"):
        gpuload.DataLoader(data(), device=f"cuda:{torch.cuda.device_count()}")


def test_close_gives_device_memory_back() -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loader = gpuload.DataLoader(TensorDataset(torch.zeros(1000, 1024, dtype=torch.uint8)), batch_size=100,
                                device="cuda")
    next(iter(loader))
    assert torch.cuda.memory_allocated() >= before + 1000 * 1024
    loader.close()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + 512  # allocator rounding of small leftovers


@pytest.mark.parametrize("depth", [None, 0])  # host rows staged ahead, or copied in the loop (copy_now)
def test_a_dataset_larger_than_the_budget_is_served_from_tiers(depth) -> None:
    dataset = data(300)
    row = 3 * 8 * 8 + 8
    ours = gpuload.DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1),
                              device="cuda", cache_size=100 * row, cache_reserve=0, prefetch_depth=depth)
    theirs = TorchDataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    assert_same_epochs(OnCpu(ours), theirs, epochs=2)
    assert ours.stats.path.startswith("tiered")
    tiers = ours.stats.extra["cache"]
    assert 0 < tiers["device_samples"] < 300 and tiers["device_hits"] > 0
    assert ours.stats.bytes_h2d_per_epoch[-1] == tiers["h2d_bytes"] // 2  # the host rows, counted once
    ours.close()


def test_two_loaders_share_one_budget() -> None:
    # A fixed size, not a share of free memory: the same test on any card (a quarter of an H200's
    # free memory meant copying tens of GB), and a second or two of the device check.
    budget = min(256 * 2**20, torch.cuda.mem_get_info()[0] // 4)
    big = TensorDataset(torch.zeros(int(budget * 0.6) // 1024, 1024, dtype=torch.uint8))
    train = gpuload.DataLoader(big, batch_size=256, device="cuda", cache_size=budget)
    val = gpuload.DataLoader(big, batch_size=256, device="cuda", cache_size=budget)
    next(iter(train)), next(iter(val))
    held = train.stats.extra["cache"]["device_bytes"] + val.stats.extra["cache"]["device_bytes"]
    assert held <= budget
    train.close(), val.close()


def test_transforms_run_as_cupy_kernels_and_match_the_reference() -> None:
    from gpuload import transforms as T
    from gpuload.transforms import apply_transforms

    ops = [T.RandomResizedCrop(6), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    dataset = data(64)
    loader = gpuload.DataLoader(dataset, batch_size=16, device="cuda", transforms=ops,
                                generator=torch.Generator().manual_seed(3))
    images = torch.cat([x.cpu() for x, _ in loader])
    assert loader.stats.extra["transform_backend"] == "cupy"
    expected = apply_transforms(ops, dataset.tensors[0], 3, 0, torch.arange(64))
    torch.testing.assert_close(images, expected, atol=1e-4, rtol=1e-5)
