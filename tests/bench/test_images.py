"""The images scenario's per-sample PIL pipeline (torch's side) and the folder it reads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from PIL import Image

from gpuload.bench.images import PilTrainSet, open_image_folder


def test_a_panorama_no_random_box_fits_is_cropped_to_its_centre_square(tmp_path: Path) -> None:
    """A 400x2 image: every area torchvision's RandomResizedCrop samples is taller than 2 rows."""
    (tmp_path / "wide").mkdir()
    Image.new("RGB", (400, 2), (200, 10, 10)).save(tmp_path / "wide" / "strip.png")
    train_set = PilTrainSet(open_image_folder(tmp_path), size=8, seed=0)
    assert train_set._crop_box(random.Random(0), 400, 2) == (199, 0, 201, 2)
    image, label = train_set[0]
    assert tuple(image.shape) == (3, 8, 8) and label == 0


def test_a_class_folder_without_images_is_named(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "dog" / "a.png")
    with pytest.raises(ValueError, match="no .* files for the class\\(es\\) cat under"):
        open_image_folder(tmp_path)
