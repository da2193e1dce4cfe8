"""looks_deterministic: a dataset read twice, random generators left as they were."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

from gpuload.cache import estimate_image_bytes, looks_deterministic
from gpuload.datasets.images import make_sample_image_folder


class Fixed(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i)), "y": np.array([i, float("nan")]), "i": i}


class Augmenting(Fixed):
    def __getitem__(self, i):
        sample = super().__getitem__(i)
        sample["x"] = sample["x"] + torch.rand(3)
        return sample


def test_looks_deterministic_true_for_fixed_data():
    ok, reason = looks_deterministic(Fixed())
    assert ok and "equal" in reason and "dataset[0, 5, 9]" in reason


def test_looks_deterministic_false_for_random_augmentation_and_restores_rng():
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    expected_next = (torch.rand(1), np.random.rand(), random.random())
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    ok, reason = looks_deterministic(Augmenting(), [2])
    assert not ok
    assert "dataset[2]" in reason and "['x']" in reason and "augmented" in reason
    assert torch.equal(torch.rand(1), expected_next[0])
    assert np.random.rand() == expected_next[1] and random.random() == expected_next[2]


def test_looks_deterministic_numpy_augmentation():
    class NumpyAug(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.random.rand(2), i

    ok, reason = looks_deterministic(NumpyAug())
    assert not ok and "[0]: array values differ" in reason


def test_image_estimates_come_from_real_headers_and_sizes(tmp_path) -> None:
    folder = make_sample_image_folder(tmp_path, num_images=12, num_classes=3)
    decoded, encoded = estimate_image_bytes(folder)
    exact_decoded = exact_encoded = 0
    for index in range(len(folder)):
        data, _ = folder.read_encoded(index)
        exact_encoded += len(data)
        exact_decoded += folder[index][0].numel()
    assert decoded == exact_decoded and encoded == exact_encoded  # 12 files: all probed
    assert 4 < decoded / encoded < 60  # JPEG at quality ~90 against 3 bytes a pixel
