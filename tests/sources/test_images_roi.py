"""Decode windows: a transform list that starts with a crop decodes only the crop's window.

The oracle is the whole image decoded by PIL (``ImageFiles.__getitem__``) and the full list
applied to it. The windowed path must give the same output within the decoders' rounding:
the CPU decoders are libjpeg-turbo like PIL (test_decode.py: mean |diff| <= 0.5, max <= 4 per
pixel, measured bit-exact), so after a bilinear resize and /255 the float outputs agree to
4/255 + fp16 rounding; we allow atol 2e-2 on [0, 1] values and check the mean is tiny.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import image_fixtures as F
import pytest
import torch

import gpuload
from gpuload import transforms as T
from gpuload.datasets import ImageList
from gpuload.decode import BatchDecoder, ImageDecodeError
from gpuload.decode._dali import dali_installed
from gpuload.sources import images as image_source
from gpuload.transforms import apply_transforms, sample_params
from gpuload.transforms.reference import apply_reference
from gpuload.transforms.windows import decode_windows, params_in_windows, starts_with_crop

ATOL = 2e-2  # on values in [0, 1]: decoder rounding (<= 4/255) through a bilinear resize
MEAN_TOL = 1e-3


def _tiny_png() -> bytes:
    """5 x 7 pixels: every RandomResizedCrop attempt fails at most scales, so it falls back."""
    return F.encode(F.photo().resize((7, 5)), "PNG")


def _files(tmp_path: Path) -> list[tuple[str, int]]:
    kinds = {
        "baseline-420.jpg": F.jpeg("baseline-420"),
        "progressive-444.jpg": F.jpeg("progressive-444"),
        "grayscale.jpg": F.jpeg("grayscale"),
        "exif-6.jpg": F.jpeg_with_orientation(6),
        "exif-3.jpg": F.jpeg_with_orientation(3),
        "exif-8-444.jpg": F.jpeg_with_orientation(8, subsampling=0),
        "exif-5.jpg": F.jpeg_with_orientation(5),
        "rgba.png": F.png("RGBA"),
        "p.png": F.png("P"),
        "tiny.png": _tiny_png(),
    }
    samples = []
    for label, (name, data) in enumerate(kinds.items()):
        path = tmp_path / name
        path.write_bytes(data)
        samples.append((str(path), label))
    return samples


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> ImageList:
    return ImageList(_files(tmp_path_factory.mktemp("roi")))


OPS = [T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToDtype(torch.float16)]  # values in [0, 1]


def _expected(dataset: ImageList, ops, seed: int, epoch: int, indices: list[int]) -> torch.Tensor:
    whole = [dataset[i][0] for i in indices]  # PIL, whole image, EXIF applied
    return apply_transforms(ops, whole, seed, epoch, indices)


def _assert_matches(images: torch.Tensor, expected: torch.Tensor) -> None:
    assert images.shape == expected.shape and images.dtype == expected.dtype
    diff = (images.float() - expected.float()).abs()
    assert float(diff.max()) <= ATOL and float(diff.mean()) <= MEAN_TOL, (float(diff.max()), float(diff.mean()))


# --- the window arithmetic, on exact uint8 images (no decoder involved) -------------------


@pytest.mark.parametrize(
    "first",
    [
        T.RandomResizedCrop(20),
        T.RandomResizedCrop((12, 30), scale=(0.5, 1.0)),
        T.CenterCrop(24),
        T.CenterCrop((80, 10)),  # taller than some images: pads
        T.RandomCrop(5),
        T.RandomCrop((30, 20), padding=(8, 14), fill=17),  # reaches outside: pads with the fill
    ],
)
def test_transforming_the_window_equals_transforming_the_whole_image(first) -> None:
    ops = [first, T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2)]
    generator = torch.Generator().manual_seed(3)
    sizes = [(45, 60), (64, 33), (5, 7), (70, 70), (40, 41), (33, 64)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for h, w in sizes]
    indices = torch.arange(10, 10 + len(images))
    whole = apply_reference(sample_params(ops, 11, 2, indices, sizes), images)
    windows = decode_windows(ops, 11, 2, indices, sizes)
    for (y0, x0, h, w), (height, width) in zip(windows, sizes):
        assert 0 <= y0 and 0 <= x0 and h > 0 and w > 0 and y0 + h <= height and x0 + w <= width
    parts = [image[:, y0 : y0 + h, x0 : x0 + w].clone() for image, (y0, x0, h, w) in zip(images, windows)]
    params = params_in_windows(sample_params(ops, 11, 2, indices, sizes), windows)
    assert torch.equal(apply_reference(params, parts), whole)


def test_tiny_images_fall_back_to_the_center_crop_window() -> None:
    op = T.RandomResizedCrop(8, scale=(0.9, 1.0), ratio=(3.0, 4.0))  # 5x7 never fits 3:1
    (window,) = decode_windows([op], 0, 0, [4], [(5, 7)])
    assert window == (1, 0, 2, 7)  # torchvision's fallback: whole width, height 7 / 3 rounded, centred


def test_only_lists_that_start_with_a_crop_have_windows() -> None:
    assert starts_with_crop([T.RandomResizedCrop(8), T.ToDtype(torch.float16)])
    assert starts_with_crop([T.CenterCrop(8)]) and starts_with_crop([T.RandomCrop(8, padding=2)])
    assert not starts_with_crop([T.Resize(8), T.CenterCrop(8)])
    assert not starts_with_crop([T.RandomHorizontalFlip(), T.RandomResizedCrop(8)])
    with pytest.raises(ValueError, match="does not start with a crop"):
        decode_windows([T.Resize(8)], 0, 0, [0], [(9, 9)])


def test_windows_that_do_not_match_the_images_are_a_clear_error() -> None:
    from gpuload.transforms import transform_batch

    image = torch.zeros(3, 10, 10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="window"):
        transform_batch([T.CenterCrop(4)], [image], 0, 0, [0], windows=[(0, 0, 4, 4)], image_sizes=[(20, 20)])
    with pytest.raises(ValueError, match="image_sizes"):
        transform_batch([T.CenterCrop(4)], [image], 0, 0, [0], windows=[(0, 0, 10, 10)])


# --- the loader ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [
    pytest.param("dali-cpu", marks=pytest.mark.skipif(not dali_installed(), reason="needs nvidia.dali (DALI), "
                                                                                   "which is not installed here")),
    "pil",
])
def test_loader_decodes_only_the_windows_and_matches_whole_decoding(
    mixed: ImageList, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(image_source, "BatchDecoder", partial(BatchDecoder, backend=backend))
    g = torch.Generator().manual_seed(7)
    loader = gpuload.DataLoader(mixed, batch_size=4, shuffle=True, generator=g, device="cpu", transforms=OPS)
    order = torch.utils.data.DataLoader(range(len(mixed)), batch_size=4, shuffle=True,
                                        generator=torch.Generator().manual_seed(7))
    for epoch in range(2):
        for (images, labels), indices in zip(loader, order, strict=True):
            assert labels.tolist() == [mixed.targets[i] for i in indices.tolist()]
            _assert_matches(images, _expected(mixed, OPS, g.initial_seed(), epoch, indices.tolist()))
    assert loader.stats.extra["roi"] == ("decoder" if backend == "dali-cpu" else "crop")
    assert loader.stats.extra["decode_backend"] == backend


def test_a_sample_gets_the_same_crop_in_any_batch(mixed: ImageList) -> None:
    """Parameters are a pure function of (seed, epoch, index): batch composition is irrelevant."""
    ops = [T.RandomResizedCrop(16), T.RandomHorizontalFlip()]
    big = gpuload.DataLoader(mixed, batch_size=len(mixed), device="cpu", transforms=ops,
                             generator=torch.Generator().manual_seed(1))
    single = gpuload.DataLoader(mixed, batch_size=1, device="cpu", transforms=ops,
                                generator=torch.Generator().manual_seed(1))
    (together, _), = list(big)
    alone = torch.cat([images for images, _ in single])
    assert torch.equal(together, alone)


def test_lists_without_a_leading_crop_decode_whole_images(mixed: ImageList) -> None:
    ops = [T.Resize((20, 20)), T.CenterCrop(16)]
    loader = gpuload.DataLoader(mixed, batch_size=5, device="cpu", transforms=ops)
    for images, _ in loader:
        assert images.shape[1:] == (3, 16, 16)
    assert loader.stats.extra["roi"] == "none"


@pytest.mark.parametrize("bad_name", ["header-only.jpg", "truncated.jpg", "not-an-image.jpg", "empty.jpg"])
def test_a_bad_file_among_windowed_samples_is_named_or_skipped(mixed: ImageList, tmp_path: Path, bad_name: str) -> None:
    samples = list(mixed.samples)
    bad = tmp_path / bad_name
    bad.write_bytes(F.corrupt_inputs()[bad_name])
    samples[2] = (str(bad), samples[2][1])
    broken = ImageList(samples)
    with pytest.raises(ImageDecodeError, match=rf"{bad_name.replace('.', '[.]')}.*sample index 2"):
        list(gpuload.DataLoader(broken, batch_size=4, device="cpu", transforms=OPS))
    skipping = gpuload.DataLoader(broken, batch_size=4, device="cpu", transforms=OPS, on_error="skip",
                                  generator=torch.Generator().manual_seed(4))
    batches = list(skipping)
    assert [len(labels) for _, labels in batches] == [3, 4, 2]
    assert skipping.stats.extra["skipped"] == 1
    first_kept = [0, 1, 3]
    _assert_matches(batches[0][0], _expected(broken, OPS, 4, 0, first_kept))
    _assert_matches(batches[1][0], _expected(broken, OPS, 4, 0, [4, 5, 6, 7]))
