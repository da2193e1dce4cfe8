"""The images scenario's torchvision baseline gives batches like gpuload's: same shapes, dtypes, values."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import gpuload
from gpuload import transforms as T
from gpuload.bench.images import MEAN, STD, image_loaders, open_image_folder
from gpuload.bench.report import display_name
from gpuload.bench.scenarios import BenchConfig
from gpuload.bench.torchvision_baseline import EncodedFiles, TorchvisionOnDevice, encoded_batch, torchvision_spec

pytest.importorskip("torchvision", reason="the baseline is torchvision's")
CPU = torch.device("cpu")
TORCHVISION_ROW = "torchvision decode_jpeg + v2 transforms (on cpu)"


def photo_folder(root: Path, count: int = 6, size: tuple[int, int] = (40, 30)) -> Path:
    """One colour each with a little noise, saved as JPEGs in two classes: any crop of an image has
    its mean colour, and all are ``size`` (so gpuload can batch them uncropped)."""
    rng = np.random.default_rng(0)
    for k in range(count):
        folder = root / f"class_{k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        colour = np.array([40 + 30 * k, 200 - 25 * k, 90 + 10 * k])
        pixels = colour + rng.integers(-12, 13, (size[1], size[0], 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{k}.jpg", quality=95)
    return root


def config(batch_size: int) -> BenchConfig:
    return BenchConfig(batch_size=batch_size, num_samples=batch_size, epochs=1, torch_workers=(0,))


def first_batch(spec) -> tuple[torch.Tensor, torch.Tensor]:
    epochs, _, close = spec.open()
    try:
        return next(iter(epochs()))
    finally:
        close()


def test_without_crops_the_baseline_normalizes_like_gpuloads_todtype_and_normalize(tmp_path: Path) -> None:
    """The crop and flip taken out of both: the same pixels (two JPEG decoders, a level or two
    apart at most) scaled to [0, 1] and normalized, in float16."""
    folder = open_image_folder(photo_folder(tmp_path))
    loader = torch.utils.data.DataLoader(EncodedFiles(folder), batch_size=6, collate_fn=encoded_batch)
    baseline = TorchvisionOnDevice(loader, CPU, 16, MEAN, STD, {})
    baseline.augment = lambda image: image  # no crop, no flip
    theirs, their_labels = next(iter(baseline()))
    ours, our_labels = next(iter(gpuload.DataLoader(
        folder, batch_size=6, device=CPU, transforms=[T.ToDtype(torch.float16), T.Normalize(MEAN, STD)])))
    assert theirs.shape == ours.shape == (6, 3, 30, 40) and theirs.dtype == ours.dtype == torch.float16
    assert torch.equal(their_labels, our_labels)
    one_level = 1 / 255 / min(STD)  # a decoded level, normalized
    difference = (theirs.float() - ours.float()).abs()
    assert difference.max() <= 3 * one_level and difference.mean() <= 0.5 * one_level


def test_one_batch_has_the_shape_dtype_and_value_range_of_gpuloads(tmp_path: Path) -> None:
    folder = open_image_folder(photo_folder(tmp_path))
    specs = {spec.name: spec for spec in image_loaders(config(6), CPU, folder, size=16)}
    theirs, their_labels = first_batch(specs[TORCHVISION_ROW])
    ours, our_labels = first_batch(specs["gpuload DataLoader (decode + transforms)"])
    assert theirs.shape == ours.shape == (6, 3, 16, 16) and theirs.dtype == ours.dtype == torch.float16
    assert their_labels.dtype == our_labels.dtype == torch.int64
    assert sorted(their_labels.tolist()) == sorted(our_labels.tolist()) == [0, 0, 0, 1, 1, 1]
    assert torch.isfinite(theirs).all()
    low = torch.tensor([-m / s for m, s in zip(MEAN, STD)]).view(1, 3, 1, 1)
    high = torch.tensor([(1 - m) / s for m, s in zip(MEAN, STD)]).view(1, 3, 1, 1)
    assert ((theirs.float() >= low - 1e-2) & (theirs.float() <= high + 1e-2)).all()
    # Different random crops of the same pictures, each of one colour: the same channel means.
    assert torch.allclose(theirs.float().mean((0, 2, 3)), ours.float().mean((0, 2, 3)), atol=0.03)


def test_its_notes_model_the_files_bytes_and_labels_each_epoch_on_a_cpu(tmp_path: Path) -> None:
    folder = open_image_folder(photo_folder(tmp_path))
    (spec,) = torchvision_spec(folder, config(4), CPU, 16, MEAN, STD, print)
    epochs, copied, close = spec.open()
    for _ in range(2):
        assert [len(labels) for _, labels in epochs()] == [4, 2]
    close()
    files = sum(Path(path).stat().st_size for path, _ in folder.samples)
    assert copied() == 0 and spec.notes["num_workers"] == 0
    assert spec.notes["h2d_modelled"] == {
        "first_epoch": files + 6 * 8, "per_epoch": files + 6 * 8,
        "basis": "the files' bytes and labels, decoded on the device every epoch",
    }


def test_it_is_left_out_with_a_line_on_png_files_or_without_torchvision(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a" / "x.png")
    lines: list[str] = []
    assert torchvision_spec(open_image_folder(tmp_path), config(2), CPU, 8, MEAN, STD, lines.append) == []
    assert lines == [f"  1 of the folder's files are not JPEGs ({tmp_path / 'a' / 'x.png'}): the torchvision "
                     "decode_jpeg baseline is left out"]
    jpegs = open_image_folder(photo_folder(tmp_path / "jpegs", count=2))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "torchvision" else real_find_spec(name, *args))
    names = [spec.name for spec in image_loaders(config(2), CPU, jpegs, 8, say=lines.append)]
    assert TORCHVISION_ROW not in names and len(names) == 3
    assert lines[-1] == "  torchvision is not installed: its decode_jpeg + v2 transforms baseline is left out"


def test_its_name_fits_the_table_whole_on_either_device() -> None:
    assert display_name(TORCHVISION_ROW) == "torchvision decode_jpeg + v2 (on cpu)"
    assert display_name(TORCHVISION_ROW.replace("cpu", "cuda")) == "torchvision decode_jpeg + v2 (on cuda)"
