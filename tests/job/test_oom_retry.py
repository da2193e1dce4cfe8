"""OOMRetry on the CPU, with CUDA's out-of-memory error injected: every sample runs once, in
order, on a batch size lowered by the plan's estimate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from counting import Counted
from equivalence import assert_same

import gpuload
from gpuload.cache.settings import CacheSettings
from gpuload.device import MemoryInfo
from gpuload.job.dataset_size import DatasetShape
from gpuload.job.oom_retry import BatchSizeLoweredWarning, BatchSplitError, OOMRetry
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


def test_with_a_plan_but_no_free_memory_known_it_lowers_by_an_eighth() -> None:
    """A batch off CUDA and no ``free_bytes``: the plan cannot say what fits, so each retry
    takes an eighth off (26 -> 22 -> 19)."""
    step = RunsOutAbove(20)
    retry = OOMRetry(step, plan=_plan())
    with pytest.warns(BatchSizeLoweredWarning) as caught:
        retry(_batch(26))
    assert ["pieces of 22" in str(w.message) for w in caught] == [True, False]
    assert retry.batch_size == 19 and step.sizes == [26, 22, 19, 7] and step.seen == list(range(26))


def test_a_loader_without_a_device_cache_only_gets_the_new_batch_size() -> None:
    loader = FakeLoader(held=0)
    retry = OOMRetry(RunsOutAbove(22), plan=_plan(), loader=loader, free_bytes=lambda: 1000 * MiB)
    with pytest.warns(BatchSizeLoweredWarning) as caught:
        retry(_batch(26))
    assert loader.shrunk == [] and loader.batch_size == retry.batch_size == 22
    assert "freed" not in str(caught[0].message) and "next batches come at that size" in str(caught[0].message)


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


# --- what a split hands each piece ---------------------------------------------------------------


class RunsOutAboveOn:
    """A step that records every piece it got and runs out of memory above ``limit`` samples of ``field``."""

    def __init__(self, limit: int, size) -> None:  # type: ignore[no-untyped-def]
        self.limit, self.size, self.pieces = limit, size, []

    def __call__(self, batch):  # type: ignore[no-untyped-def]
        if self.size(batch) > self.limit:
            raise torch.cuda.OutOfMemoryError("out of memory")
        self.pieces.append(batch)


def test_default_collates_names_are_split_with_the_images() -> None:
    samples = [(torch.full((3, 2, 2), float(i)), f"img{i}.jpg") for i in range(8)]
    batch = tud.default_collate(samples)  # [images (8, 3, 2, 2), ('img0.jpg', ..., 'img7.jpg')]
    step = RunsOutAboveOn(4, lambda b: len(b[0]))
    with pytest.warns(BatchSizeLoweredWarning, match="batch size 8"):
        OOMRetry(step)(batch)
    assert [(images[:, 0, 0, 0].tolist(), list(names)) for images, names in step.pieces] == [
        ([0.0, 1.0, 2.0, 3.0], ["img0.jpg", "img1.jpg", "img2.jpg", "img3.jpg"]),
        ([4.0, 5.0, 6.0, 7.0], ["img4.jpg", "img5.jpg", "img6.jpg", "img7.jpg"]),
    ]


def test_every_kind_of_per_sample_leaf_is_split_and_per_batch_values_go_whole() -> None:
    batch = {
        "images": torch.arange(6),
        "captions": tuple(f"caption {i}" for i in range(6)),  # a tuple of one item per sample
        "boxes": [torch.zeros(i + 1, 4) for i in range(6)],  # a custom collate's list of per-sample tensors
        "arrays": np.arange(12).reshape(6, 2),
        "step": torch.tensor(7),  # 0-d: per batch
        "epoch": 2,
        "split": "train",
    }
    step = RunsOutAboveOn(3, lambda b: len(b["images"]))
    with pytest.warns(BatchSizeLoweredWarning):
        OOMRetry(step)(batch)
    first, second = step.pieces
    assert first["images"].tolist() == [0, 1, 2] and second["images"].tolist() == [3, 4, 5]
    assert second["captions"] == ("caption 3", "caption 4", "caption 5")
    assert [len(b) for b in second["boxes"]] == [4, 5, 6]
    assert second["arrays"].tolist() == [[6, 7], [8, 9], [10, 11]]
    assert all(p["step"].item() == 7 and p["epoch"] == 2 and p["split"] == "train" for p in step.pieces)


def test_fields_nested_in_mappings_beside_per_batch_values_are_split() -> None:
    batch = [{"x": torch.arange(8), "tag": "run", "names": [f"n{i}" for i in range(8)]}, torch.arange(8) * 10]
    step = RunsOutAboveOn(4, lambda b: len(b[1]))
    with pytest.warns(BatchSizeLoweredWarning):
        OOMRetry(step)(batch)
    (first, labels), _ = step.pieces
    assert first["x"].tolist() == [0, 1, 2, 3] and first["tag"] == "run" and first["names"] == ["n0", "n1", "n2", "n3"]
    assert labels.tolist() == [0, 10, 20, 30]


def test_a_0d_tensor_first_does_not_make_the_batch_one_sample() -> None:
    step = RunsOutAboveOn(4, lambda b: len(b[1]))
    with pytest.warns(BatchSizeLoweredWarning, match="batch size 8"):
        OOMRetry(step)((torch.tensor(0.5), torch.arange(8)))
    assert [(p[0].item(), p[1].tolist()) for p in step.pieces] == [(0.5, [0, 1, 2, 3]), (0.5, [4, 5, 6, 7])]


@pytest.mark.parametrize("leaf, named", [
    (torch.ones(10), r"batch\['weights'\] \(Tensor of shape \(10,\)\) has 10 rows, not the batch's 8 samples"),
    (["a", "b", "c"], r"batch\['weights'\] \(list of 3 items\) has 3 items, not the batch's 8 samples"),
    (object(), r"batch\['weights'\] \(object\) has no batch dimension"),
])
def test_a_leaf_that_cannot_be_split_is_one_error_naming_it(leaf, named: str) -> None:
    step = RunsOutAboveOn(4, lambda b: len(b["x"]))
    with pytest.warns(BatchSizeLoweredWarning), pytest.raises(BatchSplitError, match=named):
        OOMRetry(step)({"x": torch.arange(8), "weights": leaf})
    assert step.pieces == []  # no piece ran with a misaligned part


def test_an_unsplit_batch_is_handed_over_as_it_is() -> None:
    batch = {"x": torch.arange(8), "weights": torch.ones(10)}
    step = RunsOutAboveOn(100, lambda b: len(b["x"]))
    OOMRetry(step)(batch)
    assert step.pieces == [batch] and step.pieces[0] is batch


@pytest.mark.parametrize("value", [2.5, 0, -1, True, "2", None])
def test_min_batch_size_must_be_a_whole_number_of_samples(value) -> None:
    with pytest.raises(ValueError,
                       match=rf"min_batch_size must be a whole number of samples, at least 1; got {value!r}"):
        OOMRetry(RunsOutAbove(4), min_batch_size=value)


# --- free memory after an out-of-memory error ----------------------------------------------------


def test_the_failed_steps_memory_in_torchs_pool_counts_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the error, the failed step's activations are back in torch's caching allocator:
    reserved but not allocated. The driver sees 200 MiB free, torch can reuse 800 MiB more."""
    import gpuload.job.oom_retry as oom_module

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (200 * MiB, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 1500 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 700 * MiB)
    monkeypatch.setattr(oom_module, "_first_device", lambda batch: torch.device("cuda", 0))
    loader = FakeLoader(held=2 * 2**30)
    retry = OOMRetry(RunsOutAbove(26), plan=_plan(), loader=loader)
    with pytest.warns(BatchSizeLoweredWarning) as caught:
        retry(_batch(64))
    # 0.9 x 1000 MiB + 300 MiB resident - 400 MiB fixed = 800 MiB: 26 samples of 30 MiB, as with
    # free_bytes=1000 MiB; counting only the driver's 200 MiB would give 2 and free cache for nothing
    assert retry.batch_size == 26 and len(caught) == 1
    assert loader.shrunk == [] and "freed" not in str(caught[0].message)


def test_named_tuples_read_only_mappings_and_own_sequences_are_split_into_what_they_can_be() -> None:
    import collections
    from collections.abc import Sequence

    from containers import Fields

    Pair = collections.namedtuple("Pair", "x y")

    class Columns(Sequence):
        """A sequence of two fields whose constructor takes no list: its pieces are plain lists."""

        def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
            self._columns = (first, second)

        def __getitem__(self, index):  # type: ignore[no-untyped-def]
            return self._columns[index]

        def __len__(self) -> int:
            return len(self._columns)

    batch = Pair(x=Fields(a=torch.arange(4), tag="run"), y=Columns(torch.arange(4) * 10, torch.arange(4) * 100))
    step = RunsOutAboveOn(2, lambda b: len(b.x["a"]))
    with pytest.warns(BatchSizeLoweredWarning):
        OOMRetry(step)(batch)
    first, second = step.pieces
    assert type(second) is Pair and type(second.x) is dict and type(second.y) is list
    assert second.x["a"].tolist() == [2, 3] and second.x["tag"] == "run"
    assert [c.tolist() for c in second.y] == [[20, 30], [200, 300]]


def test_a_batch_without_a_batch_dimension_is_one_sample_and_is_not_split() -> None:
    step = RunsOutAboveOn(0, lambda b: 1)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        OOMRetry(step)(object())
    assert step.pieces == []


def test_a_loader_split_over_ranks_keeps_its_size_and_the_warning_says_how_to_change_it() -> None:
    loader = FakeLoader(held=0)  # nothing cached on the device: nothing to free
    loader.cache_split_over_ranks = True
    retry = OOMRetry(RunsOutAbove(24), plan=_plan(), free_bytes=lambda: 1000 * MiB, loader=loader)
    with pytest.warns(BatchSizeLoweredWarning, match=r"the loader's batch size stays 64 and this rank splits its "
                      r"later batches: .*loader.set_batch_size\(n\) on every rank") as caught:
        retry(_batch(64))
    assert loader.batch_size == 64 and loader.shrunk == [] and "freed" not in str(caught[0].message)


def test_a_plan_whose_step_does_not_grow_with_the_batch_lowers_by_an_eighth() -> None:
    flat = [StepTrace(b, 400 * MiB, {}, STATE, 0.0) for b in (8, 64)]
    plan = plan_from_step(StepMemory.fit(flat, "cpu"), memory=MemoryInfo(2**34, 2**34),
                          settings=CacheSettings.resolve(environ={}, cwd="/nonexistent"), host=MemoryInfo(2**36, 2**36))
    assert plan.step.per_sample <= 0
    retry = OOMRetry(RunsOutAbove(40), plan=plan, free_bytes=lambda: 1000 * MiB)
    with pytest.warns(BatchSizeLoweredWarning):
        retry(_batch(64))
    # the estimate cannot say: an eighth less each time, 64 56 49 42 36
    assert retry.batch_size == 36 and retry.retries == 4
