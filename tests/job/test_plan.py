"""The job plan on pretended cards: never above the card minus the reserve, the batch size it
recommends, the cache beside it, and the trade-off it prints."""

from __future__ import annotations

from pathlib import Path

import job_models as M
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuload
from gpuload.cache.budget import default_reserve
from gpuload.cache.settings import CacheSettings
from gpuload.device import MemoryInfo
from gpuload.job.dataset_size import DatasetShape
from gpuload.job.plan import JobPlan, plan_from_step, plan_job, resident_bytes
from gpuload.job.step_memory import StepMemory, StepTrace
from gpuload.prefetch import default_depth

GiB, MiB = 2**30, 2**20
HOST = MemoryInfo(free=256 * GiB, total=256 * GiB)
IMAGE = 3 * 224 * 224 + 8
STATE = {"parameters": 100 * MiB, "buffers": 0, "gradients": 100 * MiB, "optimizer state": 200 * MiB}


def _settings(tmp_path: Path, **keywords) -> CacheSettings:
    """Cache settings pinned against the environment and any gpuload.toml."""
    return CacheSettings.resolve(environ={}, cwd=tmp_path, **keywords)


def _step(fixed: int = 400 * MiB, per_sample: int = 30 * MiB) -> StepMemory:
    """A step whose peak is exactly fixed + per_sample * b."""
    traces = [StepTrace(b, fixed + per_sample * b, {}, STATE, 0.0) for b in (8, 64)]
    return StepMemory.fit(traces, "cpu")


def _plan(tmp_path: Path, card: int, dataset: DatasetShape | None, **keywords) -> JobPlan:
    cache = _settings(tmp_path, **keywords.pop("cache", {}))
    return plan_from_step(_step(**keywords.pop("step", {})), memory=MemoryInfo(card, card), settings=cache,
                          dataset=dataset, host=HOST, **keywords)


def test_plan_stays_under_the_card_minus_the_reserve_and_takes_the_largest_batch(tmp_path: Path) -> None:
    imagenet = DatasetShape(1_281_167, IMAGE, "imagenet")
    plan = _plan(tmp_path, 80 * GiB, imagenet)
    assert plan.fits and plan.batch_size % 8 == 0
    assert plan.reserve == default_reserve(80 * GiB) == 8 * GiB
    assert plan.total_bytes <= 80 * GiB - plan.reserve
    # the dataset does not fit whole: the batch comes first, and 8 more would not fit at all
    bigger = plan.batch_size + 8
    depth = default_depth(bigger * IMAGE, HOST.free // 16)
    assert plan.step_peak(bigger) + depth * bigger * IMAGE > plan.room
    assert plan.prefetch_bytes == plan.prefetch_depth * plan.batch_size * IMAGE
    assert plan.cache is not None and plan.cache_bytes == plan.cache.device_bytes
    assert "would cache" in plan.describe()


def test_a_dataset_that_fits_whole_is_cached_and_the_batch_fits_beside_it(tmp_path: Path) -> None:
    small = DatasetShape(50_000, IMAGE, "50k images")  # 7 GiB
    plan = _plan(tmp_path, 24 * GiB, small)
    assert plan.cache.device_samples == 50_000
    assert plan.total_bytes <= plan.room
    bigger = plan.batch_size + 8
    depth = default_depth(bigger * IMAGE, HOST.free // 16)
    assert plan.step_peak(bigger) + depth * bigger * IMAGE + small.num_samples * IMAGE > plan.room
    text = plan.describe()
    assert f"batch {plan.batch_size} + whole dataset cached" in text
    largest = max(b for b in range(8, 4096, 8) if _without_cache(plan, b) <= plan.room)
    other = min(2 * plan.batch_size, largest)
    assert f"batch {other}" in text and "would leave" in text and "of the data on the host" in text


def _without_cache(plan: JobPlan, batch: int) -> int:
    return plan.step_peak(batch) + default_depth(batch * IMAGE, HOST.free // 16) * batch * IMAGE


def test_a_fixed_batch_gets_what_it_needs_and_the_cache_the_rest(tmp_path: Path) -> None:
    imagenet = DatasetShape(1_281_167, IMAGE, "imagenet")
    plan = _plan(tmp_path, 40 * GiB, imagenet, batch_size=300)
    assert plan.batch_size == 300 and plan.batch_fixed and plan.fits
    left = 40 * GiB - plan.reserve - plan.step_bytes - plan.prefetch_bytes
    assert plan.cache_bytes <= left < plan.cache_bytes + IMAGE  # whole samples only
    assert "batch 150 would cache" in plan.describe()


def test_multiple_of_one_and_a_batch_that_does_not_fit(tmp_path: Path) -> None:
    plan = _plan(tmp_path, 16 * GiB, None, batch_multiple=1)
    assert plan.fits and plan.batch_size == (16 * GiB - plan.reserve - 400 * MiB) // (30 * MiB) == 464
    assert plan.cache is None and plan.prefetch_bytes == 0
    too_big = _plan(tmp_path, 16 * GiB, DatasetShape(1000, IMAGE, "small"), batch_size=1000)
    assert not too_big.fits and too_big.cache is None
    assert "does NOT fit" in too_big.describe() and "none: the batch alone does not fit" in too_big.describe()
    hopeless = _plan(tmp_path, 4 * GiB, None, step={"fixed": 3 * GiB})
    assert not hopeless.fits and "no batch fits" in hopeless.describe()


def test_cache_settings_are_the_loaders(tmp_path: Path) -> None:
    imagenet = DatasetShape(1_281_167, IMAGE, "imagenet")
    sized = _plan(tmp_path, 80 * GiB, imagenet, cache={"cache_size": "20GiB"})
    assert sized.cache_bytes <= 20 * GiB and sized.cache_bytes > 19 * GiB  # the user's cache first
    assert sized.total_bytes <= sized.room
    off = _plan(tmp_path, 80 * GiB, imagenet, cache={"cache": "off"})
    assert off.cache_bytes == 0
    reserved = _plan(tmp_path, 80 * GiB, imagenet, cache={"cache_reserve": "20GiB"})
    assert reserved.reserve == 20 * GiB and reserved.total_bytes <= 60 * GiB


@settings(max_examples=150, deadline=None)
@given(
    card=st.integers(1, 160),
    fixed_mib=st.integers(0, 20_000),
    per_sample_kib=st.integers(1, 200_000),
    samples=st.integers(1, 2_000_000),
    sample_kib=st.integers(1, 2000),
    fixed_batch=st.one_of(st.none(), st.integers(1, 4096)),
    multiple=st.sampled_from([1, 8, 32]),
)
def test_never_above_the_card_minus_the_reserve(
    card: int, fixed_mib: int, per_sample_kib: int, samples: int, sample_kib: int, fixed_batch: int | None,
    multiple: int,
) -> None:
    memory = MemoryInfo(card * GiB, card * GiB)
    cache = CacheSettings.resolve(environ={}, cwd="/nonexistent")
    plan = plan_from_step(
        _step(fixed_mib * MiB, per_sample_kib * 1024), memory=memory, settings=cache,
        dataset=DatasetShape(samples, sample_kib * 1024, "random"), batch_size=fixed_batch, batch_multiple=multiple,
        host=HOST,
    )
    if plan.fits:
        assert plan.total_bytes <= card * GiB - plan.reserve
        assert fixed_batch is not None or plan.batch_size % plan.batch_multiple == 0
    if fixed_batch is not None:
        assert plan.batch_size == fixed_batch
    plan.describe()


# ------------------------------------------------------------------ plan_job: traced for real


def test_plan_job_end_to_end_checks_its_batch_with_its_own_trace(tmp_path: Path) -> None:
    data = torch.zeros(20_000, 3, 32, 32, dtype=torch.uint8)
    plan = plan_job(M.cnn, M.SAMPLES["cnn"](), optimizer="adamw", dataset=data, device_memory="3GiB",
                    cache=_settings(tmp_path), host_memory="64GiB", trace_batch_sizes=(8, 64))
    assert plan.fits and plan.batch_size % 8 == 0
    assert plan.batch_size in {t.batch_size for t in plan.step.traces}  # the recommendation was traced
    assert plan.cache.device_samples == 20_000  # 60 MiB of data: cached whole
    assert plan.total_bytes <= 3 * GiB - plan.reserve
    assert plan.dataset.bytes_per_sample == 3 * 32 * 32
    text = plan.describe()
    assert "job plan for a pretended 3.00 GiB card" in text and "whole dataset cached" in text


def test_plan_job_without_a_card_or_dataset(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device_memory='80GiB'"):
            plan_job(M.mlp, M.SAMPLES["mlp"](), cache=_settings(tmp_path))
    plan = plan_job(M.mlp, M.SAMPLES["mlp"](), device_memory=MemoryInfo(free=3 * GiB, total=4 * GiB),
                    cache=_settings(tmp_path), batch_size=64, trace_batch_sizes=(8, 32))
    assert plan.batch_size == 64 and plan.cache is None
    assert plan.prefetch_bytes == plan.prefetch_depth * 64 * 784 * 4  # slots of sample-sized batches
    assert plan.memory.free == 3 * GiB and plan.room == 3 * GiB - plan.reserve


def test_resident_bytes_counts_each_storage_once_on_its_device() -> None:
    model = M.mlp()
    model[0].weight.grad = torch.zeros_like(model[0].weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.state[model[2].weight] = {"momentum_buffer": torch.zeros_like(model[2].weight), "step": 3}
    params = sum(p.numel() * 4 for p in model.parameters())
    expected = params + model[0].weight.numel() * 4 + model[2].weight.numel() * 4
    assert resident_bytes(model, optimizer, torch.device("cpu")) == expected
    assert resident_bytes(M.mlp, "adamw", torch.device("cpu")) == 0  # a factory holds nothing yet
    if torch.cuda.is_available():
        assert resident_bytes(model, optimizer, torch.device("cuda", 0)) == 0


def test_gpuload_exports_plan_job_lazily() -> None:
    assert gpuload.plan_job is plan_job and gpuload.JobPlan is JobPlan
    with pytest.raises(AttributeError):
        gpuload.no_such_thing  # noqa: B018


@pytest.mark.slow
def test_resnet50_at_224_when_torchvision_is_installed(tmp_path: Path) -> None:
    models = pytest.importorskip("torchvision.models", reason="torchvision is not installed here")
    plan = plan_job(models.resnet50, torch.empty(3, 224, 224), optimizer="adamw",
                    dataset=DatasetShape(1_281_167, IMAGE, "imagenet"), device_memory="80GiB",
                    cache=_settings(tmp_path), host_memory="256GiB")
    with torch.device("meta"):  # shapes only: no weights made or initialised
        params = sum(p.numel() for p in models.resnet50().parameters()) * 4
    assert plan.step.state["parameters"] == pytest.approx(params, rel=1e-3)  # CUDA rounds each tensor up
    assert plan.step.state["optimizer state"] >= 2 * params
    assert plan.fits and plan.total_bytes <= 72 * GiB


def test_sizes_and_batch_arguments_that_cannot_be_planned_say_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^device_memory='80%' must be an absolute size such as '80GiB'$"):
        plan_job(M.mlp, M.SAMPLES["mlp"](), device_memory="80%", cache=_settings(tmp_path))
    with pytest.raises(ValueError, match="^batch_multiple must be at least 1, got 0$"):
        _plan(tmp_path, 8 * GiB, None, batch_multiple=0)
    with pytest.raises(ValueError, match="^batch_size must be at least 1, got 0$"):
        _plan(tmp_path, 8 * GiB, None, batch_size=0)


def test_on_a_gpu_the_plan_reads_its_memory_and_counts_the_model_already_there_as_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuload.job import plan as plan_module

    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(plan_module, "cuda_available", lambda: True)
    monkeypatch.setattr(plan_module, "resolve_device", lambda device: cuda0)
    monkeypatch.setattr(plan_module, "read_device_memory", lambda device: MemoryInfo(free=3 * GiB, total=4 * GiB))
    monkeypatch.setattr(plan_module, "resident_bytes", lambda model, optimizer, device: 512 * MiB)
    plan = plan_job(M.mlp, M.SAMPLES["mlp"](), cache=_settings(tmp_path), batch_size=64, trace_batch_sizes=(8, 32),
                    host_memory="64GiB")
    assert plan.memory == MemoryInfo(free=3 * GiB + 512 * MiB, total=4 * GiB)
    assert "cuda:0 (the model's 512.00 MiB already there counted as free)" in plan.describe()
    assert plan.describe().count("\n") > 2 and plan._cached_share() == 0.0  # no dataset: nothing cached


def test_batch_one_with_part_of_the_data_cached_offers_no_smaller_batch(tmp_path: Path) -> None:
    imagenet = DatasetShape(1_281_167, IMAGE, "imagenet")
    plan = _plan(tmp_path, 16 * GiB, imagenet, batch_size=1)
    assert 0 < plan.cache.device_samples < imagenet.num_samples
    (line,) = plan.tradeoff
    assert line.startswith("batch 1 + ") and "of the data cached" in line and "would cache" not in line
