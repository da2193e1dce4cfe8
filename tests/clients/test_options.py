"""Every gpuload option (``gpuload.loader.OPTIONS``, read from the constructor) survives every
integration that rebuilds or builds a loader: Accelerate's rebuilt shard, the Trainer mixin's
``gpuload_options``, Lightning's re-creation with a DistributedSampler. The values below must
name every option, so an option added later is checked here or fails the first test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset, default_collate
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload import transforms as T
from gpuload.loader import OPTIONS

pytestmark = pytest.mark.slow  # importing Accelerate, Transformers and Lightning takes seconds

JOB = "options"


@pytest.fixture
def values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A value other than the default for each option (``job`` names a table of a config file)."""
    config = tmp_path / "gpuload.toml"
    config.write_text(f'[jobs.{JOB}]\ncache_size = "2MiB"\n')
    monkeypatch.setenv("GPULOAD_CONFIG", str(config))
    return {
        "device": "cpu", "transforms": [T.ToDtype(torch.float32, scale=True)], "cache": "host", "cache_size": "1MiB",
        "cache_reserve": "3MiB", "cache_scope": "rank", "cache_dir": str(tmp_path / "disk"),
        "disk_cache_size": "4MiB", "cache_key": "my-dataset-v1", "job": JOB, "prefetch_depth": 1, "on_error": "skip",
        "timeline_steps": 50,
    }


def dataset() -> TensorDataset:
    return TensorDataset(torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8), torch.arange(32))


def assert_kept(loader: gpuload.DataLoader, values: dict[str, Any], *, but: tuple[str, ...] = ()) -> None:
    for name in OPTIONS:
        if name in but:
            continue
        kept, given = getattr(loader, name), values[name]
        if name == "device":
            kept, given = torch.device(kept), torch.device(given)
        assert kept == given, f"{name}: {kept!r}, given {given!r}"


def test_the_values_name_every_option_and_a_loader_keeps_them(values: dict[str, Any]) -> None:
    assert set(values) == set(OPTIONS)
    loader = gpuload.DataLoader(dataset(), batch_size=4, **values)
    assert_kept(loader, values)
    assert loader.cache_settings.disk_dir.value is not None and loader.cache_settings.job == JOB


def test_accelerates_rebuilt_shard_keeps_every_option(values: dict[str, Any]) -> None:
    pytest.importorskip("accelerate", reason="HF Accelerate is a test dependency: pip install -e '.[test]'")
    import accelerate.data_loader

    from gpuload.integrations.accelerate import GPULOAD_OPTIONS, serve_from_gpuload

    assert set(GPULOAD_OPTIONS) == set(OPTIONS) - {"device"}  # the device is the shard's
    loader = gpuload.DataLoader(dataset(), batch_size=4, **values)
    shard = accelerate.data_loader.prepare_data_loader(loader, num_processes=2, process_index=1, split_batches=True)
    served = serve_from_gpuload(shard, loader)
    assert served.base_dataloader is not loader  # rebuilt over Accelerate's batch sampler
    assert_kept(served.base_dataloader, values)


def test_the_trainer_mixin_takes_every_option(values: dict[str, Any], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers", reason="HF Transformers is a test dependency")
    import transformers.trainer  # noqa: F811 (the submodule, after the importorskip)

    # tests/datasets/ on sys.path looks like HF datasets to Trainer (see test_transformers.py)
    monkeypatch.setattr(transformers.trainer, "is_datasets_available", lambda: False)

    from gpuload.integrations.transformers import GpuloadTrainerMixin

    class Trainer(GpuloadTrainerMixin, transformers.Trainer):
        pass

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                                          report_to=[], use_cpu=True, remove_unused_columns=False,
                                          dataloader_pin_memory=False)
    options = {name: value for name, value in values.items() if name != "device"}  # always args.device
    trainer = Trainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=dataset(), data_collator=default_collate,
                      gpuload_options=options)
    loader = trainer.get_train_dataloader().base_dataloader
    assert_kept(loader, values, but=("device",))
    assert loader.device == args.device
    with pytest.raises(TypeError, match="device"):
        Trainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=dataset(), gpuload_options={"device": "cpu"})


def test_lightning_re_creates_the_loader_with_every_option(values: dict[str, Any]) -> None:
    pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is a test dependency")
    from pytorch_lightning.utilities.data import _update_dataloader

    loader = gpuload.DataLoader(dataset(), batch_size=4, **values)
    sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False)
    rebuilt = _update_dataloader(loader, sampler)
    assert type(rebuilt) is gpuload.DataLoader and rebuilt is not loader and rebuilt.sampler is sampler
    assert_kept(rebuilt, values)


def test_torchs_loader_is_what_accelerate_builds_without_the_integration() -> None:
    """Why the integrations carry the options: Accelerate's plain prepare drops them all."""
    accelerate = pytest.importorskip("accelerate", reason="HF Accelerate is a test dependency")
    prepared = accelerate.Accelerator(cpu=True).prepare(gpuload.DataLoader(dataset(), batch_size=4, cache_dir="x"))
    assert type(prepared.base_dataloader) is TorchDataLoader
