"""transforms= in the loader: per-sample randomness by (seed, epoch, index), on every path."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

import gpuload
from gpuload import transforms as T
from gpuload.transforms import apply_transforms

OPS = [T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.ToDtype(torch.float32), T.Normalize([0.5] * 3, [0.25] * 3)]


def images(n: int = 30) -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randint(0, 256, (n, 3, 17, 21), dtype=torch.uint8, generator=g), torch.arange(n))


def by_sample(loader) -> dict[int, torch.Tensor]:
    out = {}
    for x, y in loader:
        for image, label in zip(x, y):
            out[int(label)] = image
    return out


@pytest.mark.parametrize("cache", ["auto", "off"])
def test_outputs_equal_the_reference_for_each_sample(cache: str) -> None:
    data = images()
    g = torch.Generator().manual_seed(11)
    loader = gpuload.DataLoader(data, batch_size=8, shuffle=True, generator=g, device="cpu", transforms=OPS,
                                cache=cache)
    got = by_sample(loader)
    expected = apply_transforms(OPS, data.tensors[0], g.initial_seed(), 0, torch.arange(30))
    assert expected.shape == (30, 3, 12, 12) and expected.dtype == torch.float32
    for index, image in got.items():
        torch.testing.assert_close(image, expected[index])
    assert loader.stats.extra["transform_backend"] == "batched"


def test_a_sample_looks_the_same_in_any_batch_and_changes_with_the_epoch() -> None:
    data = images()
    a = gpuload.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1), device="cpu",
                           transforms=OPS)
    b = gpuload.DataLoader(data, batch_size=7, generator=torch.Generator().manual_seed(1), device="cpu", transforms=OPS)
    epoch0_a, epoch0_b = by_sample(a), by_sample(b)
    for index in range(30):
        torch.testing.assert_close(epoch0_a[index], epoch0_b[index])
    epoch1 = by_sample(a)
    assert any(not torch.equal(epoch0_a[i], epoch1[i]) for i in range(30))
    a.set_epoch(0)  # resuming replays epoch 0's augmentation exactly
    replay = by_sample(a)
    assert all(torch.equal(epoch0_a[i], replay[i]) for i in range(30))


def test_unbatched_samples_are_transformed_too() -> None:
    data = images(5)
    loader = gpuload.DataLoader(data, batch_size=None, device="cpu", transforms=OPS,
                                generator=torch.Generator().manual_seed(3))
    image, label = next(iter(loader))
    assert image.shape == (3, 12, 12)
    expected = apply_transforms(OPS, data.tensors[0][:1], 3, 0, torch.tensor([0]))[0]
    torch.testing.assert_close(image, expected)


def test_transforms_need_image_arrays_gpuload_serves() -> None:
    with pytest.raises(ValueError, match="apply transforms inside the dataset"):
        gpuload.DataLoader(Subset(images(), range(30)), device="cpu", transforms=OPS)
    with pytest.raises(ValueError, match=r"uint8 images shaped N,C,H,W.*permute"):
        gpuload.DataLoader(TensorDataset(torch.zeros(4, 8, 8, 3, dtype=torch.uint8)), device="cpu", transforms=OPS)
    with pytest.raises(ValueError):
        gpuload.DataLoader(images(), device="cpu",
                           transforms=[T.Normalize([0.5] * 3, [0.2] * 3), T.ToDtype(torch.float32)])
