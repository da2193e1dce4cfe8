"""The per-sample geometry map and its plain-window form (``crop_windows``)."""

from __future__ import annotations

import pytest
import torch

from gpuload import transforms as T
from gpuload.transforms import geometry
from gpuload.transforms.reference import batch_sizes


def _plan(ops, n=16, h=32, w=32, seed=0):
    sizes = batch_sizes(torch.zeros((n, 3, h, w), dtype=torch.uint8))
    params = T.sample_params(ops, seed, 0, torch.arange(n), sizes)
    table, fill = geometry.geometry_plan(params, sizes)
    return params, table, fill


def test_a_padded_random_crop_with_a_flip_is_one_window_per_sample() -> None:
    params, table, fill = _plan([T.RandomCrop(32, padding=4, fill=7), T.RandomHorizontalFlip()])
    top, left, mirror = geometry.crop_windows(table, (32, 32), (32, 32))
    crop, flip = params.per_op
    assert fill == 7.0
    assert torch.equal(top, crop["top"]) and torch.equal(mirror, flip["flip"])
    # A mirrored sample's window is the crop's window seen in the mirrored image.
    assert torch.equal(left, torch.where(flip["flip"], 32 - 32 - crop["left"], crop["left"]))
    assert bool(mirror.any()) and not bool(mirror.all())


def test_a_crop_inside_the_image_needs_no_fill() -> None:
    _, table, _ = _plan([T.CenterCrop((20, 24))])
    top, left, mirror = geometry.crop_windows(table, (20, 24), (32, 32))
    assert top.tolist() == [6] * 16 and left.tolist() == [4] * 16 and not bool(mirror.any())


@pytest.mark.parametrize(
    "ops",
    [
        # The second crop's padding lies inside the image: fill there, not the image's pixels.
        [T.CenterCrop(20), T.RandomCrop(20, padding=4)],
        [T.RandomResizedCrop(16)],
        [T.Resize((40, 40)), T.RandomCrop(32, padding=2)],
    ],
)
def test_maps_that_are_not_plain_windows_say_so(ops) -> None:
    params, table, _ = _plan(ops)
    assert geometry.crop_windows(table, params.output_size(), (32, 32)) is None


def test_two_resizes_have_no_plan() -> None:
    sizes = batch_sizes(torch.zeros((2, 3, 32, 32), dtype=torch.uint8))
    params = T.sample_params([T.Resize(20), T.Resize(10)], 0, 0, torch.arange(2), sizes)
    assert geometry.geometry_plan(params, sizes) is None
