"""Under host memory pressure (a pretended reading: see ``pretend_host_memory`` in conftest.py)
caches shrink to nothing and the prefetch ring shrinks, and the batches stay torch's."""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_same_epochs
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, TensorDataset

import gpuload
from gpuload import transforms as T
from gpuload.datasets import ImageFolder, make_sample_image_folder
from gpuload.prefetch import Prefetcher, check_ring_fits, default_depth

MiB, GiB = 2**20, 2**30
TOTAL = 64 * GiB  # host reserve: max(4 GiB, 10%) = 6.4 GiB
SQUEEZED = 1 * GiB  # available: under the reserve, so host caches get no room


class Numbers(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, index * index])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> ImageFolder:
    return make_sample_image_folder(tmp_path_factory.mktemp("images"), num_images=8, num_classes=2, seed=3)


def test_the_host_sample_cache_takes_nothing_warns_and_serves_torchs_batches(pretend_host_memory) -> None:
    pretend_host_memory(free=SQUEEZED, total=TOTAL)
    loader = gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", cache="host")
    with pytest.warns(UserWarning, match=r"partial: the budget \(0 B\)"):
        assert_same_epochs(loader, TorchDataLoader(Numbers(), batch_size=4))
    cache = loader.stats.extra["cache"]
    assert cache["budget"] == 0 and cache["entries"] == 0 and cache["hits"] == 0


def test_the_same_loader_caches_with_room(pretend_host_memory) -> None:
    pretend_host_memory(free=32 * GiB, total=TOTAL)
    loader = gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", cache="host")
    assert_same_epochs(loader, TorchDataLoader(Numbers(), batch_size=4))
    assert loader.stats.extra["cache"]["entries"] == 10 and loader.stats.extra["cache"]["hits"] == 10


@pytest.mark.parametrize("cache", ["host", "device"])
def test_the_image_cache_takes_nothing_and_decodes_every_epoch(folder: ImageFolder, pretend_host_memory,
                                                               cache: str) -> None:
    ops = [T.Resize((12, 12))]
    reference = [list(gpuload.DataLoader(folder, batch_size=3, device="cpu", transforms=ops, cache="off"))]
    pretend_host_memory(free=SQUEEZED, total=TOTAL)
    loader = gpuload.DataLoader(folder, batch_size=3, device="cpu", transforms=ops, cache=cache)
    for _ in range(2):
        for (images, labels), (want_images, want_labels) in zip(loader, reference[0], strict=True):
            assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    stats = loader.stats.extra["cache"]
    assert stats["budget"] == 0 and stats["entries"] == 0 and stats["misses"] == 16


def test_the_prefetch_ring_shrinks_to_one_slot(pretend_host_memory) -> None:
    dataset = TensorDataset(torch.zeros(64, 256, 256))  # 256 KiB rows: 4 MiB batches
    assert default_depth(4 * MiB) == 4
    pretend_host_memory(free=32 * MiB, total=TOTAL)  # 1/16 of it: 2 MiB, under one batch
    assert default_depth(4 * MiB) == 1
    loader = gpuload.DataLoader(dataset, batch_size=16, device="cpu", cache="off")
    assert_same_epochs(loader, TorchDataLoader(dataset, batch_size=16), epochs=1)
    assert loader.stats.extra["prefetch"]["depth"] == 1


def test_a_prefetch_depth_past_half_the_available_memory_is_refused(pretend_host_memory) -> None:
    dataset = TensorDataset(torch.zeros(64, 256, 256))
    pretend_host_memory(free=64 * MiB, total=TOTAL)
    loader = gpuload.DataLoader(dataset, batch_size=16, device="cpu", cache="off", prefetch_depth=100)
    with pytest.raises(ValueError,
                       match=r"prefetch_depth=100 needs 100 host slots of 4.00 MiB.*limit of 32.00 MiB.*<= 8"):
        list(loader)
    with pytest.raises(ValueError, match="prefetch_depth=3 needs"):
        check_ring_fits(3, 40 * MiB)
    check_ring_fits(2, 40 * MiB)  # double buffering is always allowed
    deep_enough = gpuload.DataLoader(dataset, batch_size=16, device="cpu", cache="off", prefetch_depth=8)
    assert_same_epochs(deep_enough, TorchDataLoader(dataset, batch_size=16), epochs=1)


@pytest.mark.parametrize("depth", [10**9, 1025, -1, 2.0, True])
def test_an_absurd_prefetch_depth_is_refused_when_the_loader_is_built(depth) -> None:
    with pytest.raises(ValueError, match=rf"prefetch_depth={depth!r} must be an int from 1 to 1024"):
        gpuload.DataLoader(torch.arange(10), prefetch_depth=depth)
    with pytest.raises(ValueError, match="from 1 to 1024"):
        Prefetcher([], "cpu", depth=depth if depth != -1 else 0)
