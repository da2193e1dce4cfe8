"""The "partial" scenario: a dataset larger than the cache budget, beside torch, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpuload.bench.modelled import dataset_nbytes, modelled_plan
from gpuload.bench.partial import partial_loaders
from gpuload.bench.scenarios import BenchConfig, synthetic_cifar
from gpuload.cache import make_plan
from gpuload.cli import main

CPU = torch.device("cpu")
ROW_BYTES = 3 * 32 * 32 + 8  # a CIFAR image and its int64 label


def test_modelled_plan_is_the_loaders_plan_for_a_pretended_card() -> None:
    dataset = synthetic_cifar(BenchConfig(num_samples=100))
    plan = modelled_plan(dataset, "device", 40 * ROW_BYTES, device_memory=8 << 30)
    assert (plan.kind, plan.device_samples, plan.source_samples) == ("device+stream", 40, 60)
    assert plan.fill_bytes == 40 * ROW_BYTES and plan.h2d_bytes_per_epoch_cached == 60 * ROW_BYTES
    reserve = 2 << 30  # max(2 GiB, 10% of 8 GiB)
    expected = make_plan(ROW_BYTES, 100, 8 << 30, plan.host_free, 40 * ROW_BYTES, reserve, "device",
                         device_total=8 << 30, host_total=plan.host_total)
    assert plan == expected
    whole = modelled_plan(dataset, "auto", None, device_memory=8 << 30)
    assert whole.kind == "device" and whole.h2d_bytes_per_epoch_cached == 0


def test_cache_size_must_leave_the_dataset_only_partly_fitting() -> None:
    config = BenchConfig(num_samples=64, batch_size=16)
    dataset = synthetic_cifar(config)
    for size in (0, dataset_nbytes(dataset)):
        with pytest.raises(ValueError, match="only partly fit"):
            partial_loaders(config, CPU, size, dataset)
    _, size, specs = partial_loaders(config, CPU, None, dataset)
    assert size == 32 * ROW_BYTES and len(specs) == 7  # torch x2, gpuload x3, ideal, streaming


def test_partial_scenario_quick_on_cpu_writes_json_and_chart(tmp_path: Path, capsys) -> None:
    args = ["bench", "--scenario", "partial", "--quick", "--samples", "2048", "--epochs", "1",
            "--torch-workers", "0", "--device", "cpu", "--out", str(tmp_path)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "modelled for a pretended 16 GiB card" in printed and "each later" in printed
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["scenario"] == "partial" and document["cache_size_bytes"] == 1024 * ROW_BYTES
    rows = {r["name"]: r for r in document["results"]}
    assert rows["torch DataLoader (num_workers=0)"]["h2d_bytes_first_epoch"] == 0
    whole = rows["gpuload DataLoader (whole dataset cached)"]["cache_plan_modelled"]
    assert whole["kind"] == "device" and whole["h2d_bytes_first_epoch"] == 2048 * ROW_BYTES
    for name in ("gpuload DataLoader (part cached + host memory)", "gpuload DataLoader (part cached + source)"):
        row = rows[name]
        assert row["path"] == "device-gather"  # on the CPU the arrays are served in place
        assert row["h2d_bytes_per_epoch"] == 0 and row["loader_device_peak_bytes"] is None
        plan = row["cache_plan_modelled"]
        assert plan["device_samples"] == 1024 and plan["h2d_bytes_per_epoch"] == 1024 * ROW_BYTES
        assert plan["h2d_bytes_first_epoch"] == 2048 * ROW_BYTES
        assert row["batches_per_epoch"] == 4 and row["samples_per_s"] > 0
    assert rows["gpuload DataLoader (part cached + source)"]["cache_plan_modelled"]["kind"] == "device+stream"
    assert rows["gpuload DataLoader (streaming, no cache)"]["path"] == "host-gather"
    assert document["model_memory"] is None  # no step, no model


def test_partial_options_are_checked(tmp_path: Path, capsys) -> None:
    out = ["--device", "cpu", "--out", str(tmp_path)]
    assert main(["bench", "--cache-size", "1MiB", *out]) == 2
    assert "argument --cache-size: only applies to --scenario partial" in capsys.readouterr().err
    assert main(["bench", "--scenario", "partial", "--samples", "100", "--cache-size", "1GiB", *out]) == 2
    assert "only partly fit" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.gpu
def test_partial_rows_on_a_gpu_fill_the_device_tier_once_then_copy_the_rest() -> None:
    from gpuload.bench.run import run_loaders

    device = torch.device("cuda")
    config = BenchConfig(num_samples=1024, batch_size=128, epochs=2, torch_workers=(0,))
    _, size, specs = partial_loaders(config, device)
    rows = {r["name"]: r for r in run_loaders(specs, device, config.epochs, None)}
    everything = 1024 * ROW_BYTES
    torch_row = rows["torch DataLoader (num_workers=0)"]
    assert torch_row["h2d_bytes_first_epoch"] == torch_row["h2d_bytes_per_epoch"] == everything
    whole = rows["gpuload DataLoader (whole dataset cached)"]
    assert whole["path"] == "device-gather" and whole["cache"]["device_samples"] == 1024
    assert whole["h2d_bytes_first_epoch"] == everything and whole["h2d_bytes_per_epoch"] == 0
    for name, tier in (("part cached + host memory", "host_samples"), ("part cached + source", "source_samples")):
        row = rows[f"gpuload DataLoader ({name})"]
        assert row["path"].startswith("tiered (device+") and row["cache"]["device_samples"] == 512
        assert row["cache"][tier] == 512
        assert row["h2d_bytes_first_epoch"] == everything  # the fill, and the other half copied
        assert row["h2d_bytes_per_epoch"] == everything // 2
        assert row["loader_device_peak_bytes"] >= size


def test_device_memory_is_for_modelling_on_a_cpu_only() -> None:
    import argparse

    from gpuload.cli.bench import _options_problem

    args = argparse.Namespace(cache_size=None, device_memory=80 << 30)
    assert "on a GPU the real card decides" in _options_problem(args, "partial", torch.device("cuda"))
    assert _options_problem(args, "partial", CPU) is None and _options_problem(args, "inmemory", CPU) is None
