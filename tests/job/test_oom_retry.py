"""OOMRetry on the CPU, with CUDA's out-of-memory error injected: every sample runs once, in
order, on a batch size lowered by the plan's estimate."""

from __future__ import annotations

import pytest
import torch

from gpuload.cache.settings import CacheSettings
from gpuload.device import MemoryInfo
from gpuload.job.oom_retry import BatchSizeLoweredWarning, OOMRetry
from gpuload.job.plan import plan_from_step
from gpuload.job.step_memory import StepMemory, StepTrace

MiB = 2**20
STATE = {"parameters": 100 * MiB, "buffers": 0, "gradients": 100 * MiB, "optimizer state": 200 * MiB}


def _plan():
    """A step of 400 MiB + 30 MiB per sample, whose model state (less gradients) is 300 MiB."""
    traces = [StepTrace(b, 400 * MiB + 30 * MiB * b, {}, STATE, 0.0) for b in (8, 64)]
    return plan_from_step(StepMemory.fit(traces, "cpu"), memory=MemoryInfo(2**34, 2**34),
                          settings=CacheSettings.resolve(environ={}, cwd="/nonexistent"),
                          host=MemoryInfo(2**36, 2**36))


class RunsOutAbove:
    """A step that raises CUDA's out-of-memory error for more than ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        self.limit, self.seen, self.sizes = limit, [], []

    def __call__(self, batch):
        images, labels = batch
        self.sizes.append(len(labels))
        if len(labels) > self.limit:
            held = torch.zeros(len(labels), 1000)  # freed with the failed step's frame
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {held.numel()} B.")
        self.seen.extend(labels.tolist())
        return images.sum().item()


def _batch(n: int, first: int = 0):
    return torch.ones(n, 3, 2, 2), torch.arange(first, first + n)


def test_lowers_by_the_plans_estimate_and_runs_every_sample_once_in_order() -> None:
    step = RunsOutAbove(24)
    retry = OOMRetry(step, plan=_plan(), free_bytes=lambda: 1000 * MiB)
    with pytest.warns(BatchSizeLoweredWarning) as caught:
        results = retry(_batch(64))
    messages = [str(w.message) for w in caught]
    assert "batch size 64" in messages[0] and "pieces of 26" in messages[0] and "30.00 MiB per sample" in messages[0]
    assert "batch size 26" in messages[1] and "pieces of 22" in messages[1] and len(messages) == 2
    # 0.9 x 1000 MiB free + 300 MiB resident - 400 MiB fixed = 800 MiB: 26 samples of 30 MiB; still
    # too many for this step, so an eighth less (22), then pieces of 22
    assert retry.batch_size == 22 and retry.retries == 2
    assert step.seen == list(range(64))
    assert sum(results) == 64 * 12
    step.sizes.clear()
    retry(_batch(50, first=64))  # later batches go straight to the lowered size
    assert step.sizes == [22, 22, 6] and step.seen == list(range(114))


def test_without_a_plan_it_halves() -> None:
    step = RunsOutAbove(10)
    retry = OOMRetry(step)
    with pytest.warns(BatchSizeLoweredWarning):
        retry(_batch(40))
    assert retry.batch_size == 10 and step.seen == list(range(40))


def test_no_error_no_split() -> None:
    step = RunsOutAbove(100)
    assert OOMRetry(step, plan=_plan())(_batch(64)) == [64 * 12] and step.sizes == [64]


def test_other_errors_pass_through_and_the_smallest_batch_gives_up() -> None:
    def broken(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        OOMRetry(broken)(_batch(8))
    retry = OOMRetry(RunsOutAbove(0), min_batch_size=4)
    with pytest.warns(BatchSizeLoweredWarning), pytest.raises(torch.cuda.OutOfMemoryError, match="min_batch_size=4"):
        retry(_batch(16))


def test_nested_batches_split_on_their_tensors() -> None:
    seen = []

    def step(batch):
        if len(batch["x"]) > 3:
            raise torch.cuda.OutOfMemoryError("out of memory")
        seen.append((batch["x"].tolist(), batch["meta"]["y"].tolist(), batch["name"]))

    with pytest.warns(BatchSizeLoweredWarning):
        OOMRetry(step)({"x": torch.arange(6), "meta": {"y": torch.arange(6) * 10}, "name": "run"})
    assert seen == [([0, 1, 2], [0, 10, 20], "run"), ([3, 4, 5], [30, 40, 50], "run")]
