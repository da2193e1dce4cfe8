"""OOMRetry on the CPU, with CUDA's out-of-memory error injected: every sample runs once, in
order, on a batch size lowered by the plan's estimate."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud

import gpuload
from counting import Counted
from equivalence import assert_same
from gpuload.cache.settings import CacheSettings
from gpuload.device import MemoryInfo
from gpuload.job.dataset_size import DatasetShape
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


def _shuffled_loader(n: int = 30, batch_size: int = 8, **keywords):
    data = tud.TensorDataset(torch.ones(n, 3, 2, 2), torch.arange(n))
    return gpuload.DataLoader(data, batch_size=batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(3), **keywords)


def _torch_order(n: int = 30) -> list[int]:
    data = tud.TensorDataset(torch.arange(n))
    loader = tud.DataLoader(data, batch_size=n, shuffle=True, generator=torch.Generator().manual_seed(3))
    return next(iter(loader))[0].tolist()


@pytest.mark.parametrize("prefetch_depth", [0, 3])
def test_with_the_loader_later_batches_arrive_at_the_new_size(prefetch_depth: int) -> None:
    step = RunsOutAbove(5)
    loader = _shuffled_loader(prefetch_depth=prefetch_depth, cache="off")
    retry = OOMRetry(step, loader=loader)  # no plan: halves, 8 -> 4
    with pytest.warns(BatchSizeLoweredWarning, match="the loader's next batches come at that size"):
        for batch in loader:
            retry(batch)
    assert loader.batch_size == 4 and retry.batch_size == 4
    assert step.sizes == [8, 4, 4] + [4] * 5 + [2]  # the failed batch split, then whole batches of 4
    assert step.seen == _torch_order()  # the epoch's order: no sample skipped or repeated
    step.sizes.clear()
    for batch in loader:
        retry(batch)
    assert step.sizes == [4] * 7 + [2]


def test_a_loader_that_cannot_change_its_batch_size_is_refused_up_front() -> None:
    data = tud.TensorDataset(torch.arange(10))
    with pytest.raises(ValueError, match="batch_size=None"):
        OOMRetry(RunsOutAbove(4), loader=gpuload.DataLoader(data, batch_size=None))


def _tiny_plan(fixed: int, per_sample: int):
    """A step of ``fixed`` + ``per_sample`` bytes per sample and no model state."""
    state = {"parameters": 0, "buffers": 0, "gradients": 0, "optimizer state": 0}
    traces = [StepTrace(b, fixed + per_sample * b, {}, state, 0.0) for b in (8, 64)]
    return plan_from_step(StepMemory.fit(traces, "cpu"), memory=MemoryInfo(2**34, 2**34),
                          settings=CacheSettings.resolve(environ={}, cwd="/nonexistent"),
                          host=MemoryInfo(2**36, 2**36))


def test_frees_the_cache_the_new_batch_lacks_and_says_so() -> None:

    # On a CPU device the host-memory sample cache is in the device's memory.
    loader = gpuload.DataLoader(Counted(40), batch_size=8, cache="host", device="cpu")
    list(loader)  # the first epoch fills the cache
    held = loader.device_cache_bytes
    assert held > 0
    plan = _tiny_plan(fixed=9_000, per_sample=900)
    needed = -(-(9_000 + 4 * 900) * 10 // 9)  # a step of 4 samples, at 90% of free memory

    def step(batch):
        if len(batch["label"]) > 4:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return len(batch["label"])

    retry = OOMRetry(step, plan=plan, loader=loader, min_batch_size=4, free_bytes=lambda: needed - held // 2)
    with pytest.warns(BatchSizeLoweredWarning, match=r"freed .* of the loader's device cache") as caught:
        assert retry(next(iter(loader))) == [4, 4]
    assert len(caught) == 1
    after = loader.device_cache_bytes
    assert held // 2 <= held - after and after > 0  # what the batch lacked, not the whole cache
    assert loader.batch_size == 4
    # the samples let go are read from the dataset again; the batches are the same
    plain = gpuload.DataLoader(Counted(40), batch_size=4, cache="off", device="cpu")
    for ours, theirs in zip(loader, plain, strict=True):
        assert_same(ours, theirs)


class FakeLoader:
    """The loader's side of OOMRetry, recorded."""

    def __init__(self, held: int) -> None:
        self.batch_size, self.device_cache_bytes, self.shrunk = 64, held, []
        self.cache_split_over_ranks = False

    def set_batch_size(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def shrink_cache(self, max_device_bytes: int) -> int:
        self.shrunk.append(max_device_bytes)
        freed, self.device_cache_bytes = self.device_cache_bytes - max_device_bytes, max_device_bytes
        return freed


def test_shrinks_the_cache_to_what_the_plan_gives_it_beside_the_new_batch() -> None:
    data = DatasetShape(100_000, 100_000, "100k samples of 100 kB")  # 9.3 GiB
    plan = _plan().replan(dataset=data, device_memory="8GiB")
    new = 22
    beside = plan.replan(new).cache_bytes
    assert 0 < beside < 8 * 2**30
    loader = FakeLoader(held=beside + 512 * MiB)  # more than the plan gives the cache
    retry = OOMRetry(RunsOutAbove(new), plan=plan, loader=loader, free_bytes=lambda: 1000 * MiB)
    with pytest.warns(BatchSizeLoweredWarning, match=r"freed 512.00 MiB"):
        retry(_batch(26))
    assert retry.batch_size == new and loader.batch_size == new and loader.shrunk == [beside]
