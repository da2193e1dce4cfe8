"""The augmentation scenario: torch's per-sample Dataset does gpuload's ops, and ``gpuload bench
--scenario augment`` runs end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from gpuload import transforms as T
from gpuload.bench.augment import PerSampleAugment, augment_loaders, augment_ops
from gpuload.bench.scenarios import BenchConfig
from gpuload.cli import main


def test_the_torch_baseline_does_the_same_work_as_the_op_list() -> None:
    """For the same crop offset and flip, torch's per-sample output is gpuload's reference's."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8, generator=g)
    ops = augment_ops((32, 32))
    params = T.sample_params(ops, 1, 0, torch.arange(6), [(32, 32)] * 6)
    baseline = PerSampleAugment(images, torch.zeros(6))
    crop, flip = params.per_op[0], params.per_op[1]["flip"]
    expected = T.apply_reference(params, images)
    for k in range(6):
        top, left = int(crop["top"][k]) + 4, int(crop["left"][k]) + 4  # in the padded image
        torch.testing.assert_close(baseline.augment(images[k], top, left, bool(flip[k])), expected[k])
    top, left, flipped = baseline.draw()
    assert 0 <= top <= 8 and 0 <= left <= 8 and isinstance(flipped, bool)


def test_loaders_need_uint8_images_and_labels() -> None:
    config = replace(BenchConfig(), num_samples=8)
    with pytest.raises(ValueError, match="uint8 N,C,H,W images and labels"):
        augment_loaders(config, torch.device("cpu"), TensorDataset(torch.zeros(8, 3, 4, 4)))


def test_bench_augment_quick_runs_torch_and_gpuload(tmp_path: Path, capsys) -> None:
    args = ["bench", "--scenario", "augment", "--quick", "--samples", "1024", "--epochs", "1",
            "--torch-workers", "0", "--device", "cpu", "--out", str(tmp_path)]
    assert main(args) == 0
    document = json.loads((tmp_path / "bench.json").read_text())
    results = {r["name"]: r for r in document["results"]}
    assert document["scenario"] == "augment"
    assert set(results) == {"torch DataLoader (num_workers=0)", "gpuload DataLoader (batched transforms)"}
    gpuload_run = results["gpuload DataLoader (batched transforms)"]
    assert gpuload_run["transform_backend"] == "batched"
    assert all(r["batches_per_epoch"] == 2 and r["samples_per_s"] > 0 for r in results.values())
    assert "gpuload (batched transforms)" in capsys.readouterr().out  # the report's short row name
