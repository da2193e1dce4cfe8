"""Image folders through gpuload.DataLoader: batch decoding, transforms, bad files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from equivalence import assert_same_epochs
from image_fixtures import diff_stats
from torch.utils.data import DataLoader as TorchDataLoader

import gpuload
from gpuload import transforms as T
from gpuload.datasets import ImageFolder, make_sample_image_folder
from gpuload.decode import ImageDecodeError
from gpuload.decode import batch as batch_module
from gpuload.transforms import apply_transforms


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> ImageFolder:
    return make_sample_image_folder(tmp_path_factory.mktemp("images"), num_images=12, num_classes=3, seed=1)


def test_unbatched_images_match_torchs_loader_over_the_same_folder(folder: ImageFolder) -> None:
    ours = gpuload.DataLoader(folder, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(2),
                              device="cpu")
    theirs = TorchDataLoader(folder, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(2))
    assert_same_epochs(ours, theirs, epochs=1)
    assert ours.stats.path == "image-decode"
    assert ours.stats.extra["decode_backend"] in ("dali-cpu", "pil", "torchvision")


def test_batches_are_decoded_then_transformed_per_sample(folder: ImageFolder) -> None:
    ops = [T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToDtype(torch.float16)]
    g = torch.Generator().manual_seed(5)
    loader = gpuload.DataLoader(folder, batch_size=5, shuffle=True, generator=g, device="cpu", transforms=ops)
    torch_order = TorchDataLoader(range(12), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(5))
    for (images, labels), indices in zip(loader, torch_order, strict=True):
        assert images.shape == (len(indices), 3, 24, 24) and images.dtype == torch.float16
        assert labels.tolist() == [folder.targets[i] for i in indices.tolist()]
        decoded = [folder[i][0] for i in indices.tolist()]
        expected = apply_transforms(ops, decoded, g.initial_seed(), 0, indices)
        torch.testing.assert_close(images, expected, atol=2e-3, rtol=2e-3)
    assert loader.stats.samples == 12 and loader.stats.extra["transform_backend"] == "batched"
    # The transforms take the decoder's images in any layout: DALI's stay HWC (no transpose).
    assert loader._source.reader.decoder.channels_last


def test_a_corrupt_file_names_itself_or_is_skipped(folder: ImageFolder, tmp_path: Path) -> None:
    samples = list(folder.samples)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(Path(samples[3][0]).read_bytes()[:200])
    samples[3] = (str(bad), samples[3][1])
    broken = gpuload.datasets.ImageList(samples)
    ops = [T.Resize((16, 16)), T.ToDtype(torch.float32)]
    with pytest.raises(ImageDecodeError, match=r"broken\.jpg") as error:
        list(gpuload.DataLoader(broken, batch_size=4, device="cpu", transforms=ops))
    assert "3" in str(error.value)
    skipping = gpuload.DataLoader(broken, batch_size=4, device="cpu", transforms=ops, on_error="skip")
    sizes = [len(labels) for _, labels in skipping]
    assert sizes == [3, 4, 4] and skipping.stats.extra["skipped"] == 1


def test_on_error_is_validated() -> None:
    with pytest.raises(ValueError, match="on_error"):
        gpuload.DataLoader(range(3), on_error="ignore")


def test_each_files_header_is_read_once_per_dataset(folder: ImageFolder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Crop windows and the decoder's checks share one read per file, and later epochs none."""
    from gpuload.decode import batch as batch_module
    from gpuload.decode import headers

    reads = []
    peek = headers.peek_header

    def counted(data: bytes):
        reads.append(len(data))
        return peek(data)

    monkeypatch.setattr(headers, "peek_header", counted)
    monkeypatch.setattr(batch_module, "peek_header", counted)
    ops = [T.RandomResizedCrop(16), T.ToDtype(torch.float32)]
    loader = gpuload.DataLoader(folder, batch_size=5, shuffle=True, device="cpu", transforms=ops, cache="off")
    for _ in range(2):
        assert sum(len(labels) for _, labels in loader) == 12
    assert len(reads) == 12


class _TorchvisionStyle(torch.utils.data.Dataset):
    """A torchvision-style image dataset (``samples``) with its own transform."""

    def __init__(self, folder: ImageFolder) -> None:
        self.samples, self.classes, self.transform = list(folder.samples), list(folder.classes), abs

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


def test_transforms_asked_of_a_dataset_gpuload_cannot_read_raise_the_reason(folder: ImageFolder) -> None:
    dataset = _TorchvisionStyle(folder)
    with pytest.raises(ValueError, match="_TorchvisionStyle has a transform .* would not run"):
        list(gpuload.DataLoader(dataset, batch_size=4, device="cpu", transforms=[T.Resize((16, 16))]))
    plain = gpuload.DataLoader(dataset, batch_size=4, device="cpu")
    next(iter(plain))
    assert plain.stats.path == "torch"  # without transforms=, torch's path reads it as it is


# nvJPEG against libjpeg-turbo (the CPU decoders) on the same file: their IDCT and 4:2:0 chroma
# upsampling differ, a few levels on average and up to ~20 at sharp edges; a wrong, stale or
# half-written image is off by tens on average. The bounds of the nvjpeg backend's own tests
# (tests/decode/test_nvjpeg.py, GPU_MEAN_TOL and GPU_MAX_TOL: DALI's mixed decoder's too).
NVJPEG_MEAN_TOL, NVJPEG_MAX_TOL = 1.0, 24


@pytest.mark.gpu
def test_on_cuda_without_dali_a_folder_is_decoded_by_nvjpeg_close_to_the_cpu_decoder(
    folder: ImageFolder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image source's CUDA branch as a CUDA machine without DALI runs it (the device check's
    image): the nvjpeg backend decoding ahead on the side stream, the decoded-image cache filled in
    epoch 1 and serving epoch 2; every image within nvJPEG's tolerance of the CPU decode."""
    monkeypatch.setattr(batch_module, "_dali_installed", lambda: False)  # as on a machine without DALI
    loader = gpuload.DataLoader(folder, batch_size=None, device="cuda", cache="device", cache_reserve=0)
    for epoch in range(2):
        for position, (image, label) in enumerate(loader):
            expected, expected_label = folder[position]
            assert image.is_cuda and image.dtype == torch.uint8 and label == expected_label
            mean, worst = diff_stats(image.cpu(), expected)
            assert mean <= NVJPEG_MEAN_TOL and worst <= NVJPEG_MAX_TOL, (epoch, position, mean, worst)
    assert loader.stats.extra["decode_backend"] == "nvjpeg"
    assert loader.stats.extra["image_cache_decision"].startswith("decoded")
    loader.close()
