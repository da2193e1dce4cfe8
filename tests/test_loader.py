"""The constructor, errors, attributes, stats and lifecycle of gpuload.DataLoader."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import sys
import time

import numpy as np
import pytest
import torch
from equivalence import assert_same_epochs
from threads import snapshot, wait_threads
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import gpuload
from gpuload.device import DeviceError
from gpuload.prefetch import EpochStoppedError


def dataset(n: int = 20) -> TensorDataset:
    return TensorDataset(torch.arange(n * 3, dtype=torch.uint8).view(n, 3), torch.arange(n))


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(5)


def test_signature_is_torchs_then_gpuload_keyword_options() -> None:
    ours = list(inspect.signature(gpuload.DataLoader.__init__).parameters.values())
    theirs = list(inspect.signature(TorchDataLoader.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [
        (p.name, p.kind, p.default) for p in theirs
    ]
    extra = ours[len(theirs) :]
    assert [p.name for p in extra] == ["device", "transforms", "cache", "cache_size", "cache_reserve", "cache_scope",
                                       "cache_dir", "disk_cache_size", "cache_key", "job", "prefetch_depth", "on_error",
                                       "timeline_steps"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


INVALID = [
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(batch_sampler=[[0, 1]], batch_size=2),
    dict(batch_sampler=[[0, 1]], shuffle=True),
    dict(batch_sampler=[[0, 1]], drop_last=True),
    dict(batch_sampler=[[0, 1]], sampler=[0, 1]),
    dict(sampler=[0, 1], shuffle=True),
    dict(batch_size=None, drop_last=True),
    dict(prefetch_factor=2),
    dict(persistent_workers=True),
    dict(multiprocessing_context="spawn"),
    dict(num_workers=1, multiprocessing_context="no-such-method"),
    dict(num_workers=1, multiprocessing_context=3),
    dict(num_workers=1, prefetch_factor=-1),
]


@pytest.mark.parametrize("kwargs", INVALID, ids=str)
def test_invalid_combinations_raise_like_torch(kwargs: dict) -> None:
    with pytest.raises(Exception) as theirs:
        TorchDataLoader(dataset(), **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        gpuload.DataLoader(dataset(), device="cpu", **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_iterable_dataset_invalid_options_raise_like_torch() -> None:
    for kwargs in (dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])):
        with pytest.raises(ValueError) as theirs:
            TorchDataLoader(Stream(), **kwargs)
        with pytest.raises(ValueError) as ours:
            gpuload.DataLoader(Stream(), device="cpu", **kwargs)
        assert str(ours.value) == str(theirs.value)


def test_public_attributes_and_len_match_torch() -> None:
    g = torch.Generator()
    kwargs = dict(batch_size=6, shuffle=True, drop_last=True, generator=g)
    ours, theirs = gpuload.DataLoader(dataset(), device="cpu", **kwargs), TorchDataLoader(dataset(), **kwargs)
    for name in ("batch_size", "drop_last", "num_workers", "pin_memory", "timeout", "prefetch_factor",
                 "persistent_workers", "pin_memory_device", "in_order", "worker_init_fn",
                 "multiprocessing_context", "collate_fn"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.generator is g
    assert type(ours.sampler) is type(theirs.sampler) and type(ours.batch_sampler) is type(theirs.batch_sampler)
    assert len(ours) == len(theirs) == 3
    assert isinstance(ours, TorchDataLoader)
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        ours.batch_size = 3


def test_rebuilding_from_constructor_arguments_like_lightning() -> None:
    """Lightning and Accelerate rebuild a loader from attributes named like its arguments."""
    original = gpuload.DataLoader(dataset(), batch_size=4, shuffle=True, device="cpu", cache="off")
    params = inspect.signature(type(original).__init__).parameters
    kwargs = {
        name: getattr(original, name)
        for name in params
        if name not in ("self", "sampler", "batch_sampler", "shuffle") and hasattr(original, name)
    }
    sampler = torch.utils.data.distributed.DistributedSampler(original.dataset, num_replicas=2, rank=1, shuffle=False)
    rebuilt = type(original)(sampler=sampler, **kwargs)
    assert rebuilt.device == original.device and rebuilt.cache == "off"
    assert [b[1].tolist() for b in rebuilt] == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19]]


def test_stats_count_batches_samples_and_wait_time() -> None:
    for data in (dataset(), torch.utils.data.Subset(dataset(), range(20))):
        loader = gpuload.DataLoader(data, batch_size=6, device="cpu")
        for _ in range(2):
            for _ in loader:
                pass
        stats = loader.stats
        assert (stats.epochs, stats.batches, stats.samples) == (2, 8, 40)
        assert stats.wait_time_s > 0
        assert stats.bytes_h2d == 0  # nothing crosses PCIe on the CPU
        assert stats.as_dict()["samples"] == 40 and "samples" in str(stats)
    unbatched = gpuload.DataLoader(dataset(), batch_size=None, device="cpu")
    list(unbatched)
    assert unbatched.stats.samples == unbatched.stats.batches == 20


def test_default_device_is_cpu_without_cuda() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert gpuload.DataLoader(dataset()).device.type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_says_what_to_do() -> None:
    with pytest.raises(DeviceError, match="CUDA is not available.*device='cpu'"):
        gpuload.DataLoader(dataset(), device="cuda")


def test_unknown_device_and_cache_mode_are_clear_errors() -> None:
    with pytest.raises(DeviceError, match="not supported"):
        gpuload.DataLoader(dataset(), device="meta")
    with pytest.raises(DeviceError, match="device=.warp-drive. is not a device"):
        gpuload.DataLoader(dataset(), device="warp-drive")
    with pytest.raises(ValueError, match=r"cache='sometimes' \(from keyword cache=\) is not a cache mode"):
        gpuload.DataLoader(dataset(), device="cpu", cache="sometimes")


def test_empty_dataset_behaves_like_torch() -> None:
    empty = TensorDataset(torch.empty(0, 3), torch.empty(0))
    ours = list(gpuload.DataLoader(empty, batch_size=4, device="cpu"))
    assert ours == list(TorchDataLoader(empty, batch_size=4)) == []
    with pytest.raises(ValueError) as theirs:
        TorchDataLoader(empty, shuffle=True)
    with pytest.raises(ValueError) as ours:
        gpuload.DataLoader(empty, shuffle=True, device="cpu")
    assert str(ours.value) == str(theirs.value)


def test_batch_larger_than_dataset() -> None:
    for drop_last in (False, True):
        ours = gpuload.DataLoader(dataset(5), batch_size=8, drop_last=drop_last, shuffle=True,
                                  generator=torch.Generator().manual_seed(0), device="cpu")
        theirs = TorchDataLoader(dataset(5), batch_size=8, drop_last=drop_last, shuffle=True,
                                 generator=torch.Generator().manual_seed(0))
        assert len(ours) == len(theirs) == (0 if drop_last else 1)
        assert_same_epochs(ours, theirs)


def test_out_of_range_indices_raise_index_error_like_torch() -> None:
    for sampler in ([0, 25], [-21]):
        with pytest.raises(IndexError) as theirs:
            list(TorchDataLoader(dataset(), batch_size=2, sampler=sampler))
        with pytest.raises(IndexError) as ours:
            list(gpuload.DataLoader(dataset(), batch_size=2, sampler=sampler, device="cpu"))
        assert str(ours.value) == str(theirs.value)
    ours = gpuload.DataLoader(dataset(), batch_size=2, sampler=[-1, -20], device="cpu")
    assert next(iter(ours))[1].tolist() == [19, 0]


def test_array_dataset_checks_its_columns() -> None:
    with pytest.raises(ValueError, match="same number of samples.*image: 4, label: 3"):
        gpuload.ArrayDataset(image=np.zeros((4, 2)), label=np.zeros(3))
    with pytest.raises(TypeError, match="numpy dtype <U1"):
        gpuload.ArrayDataset(np.array(["a", "b"]))
    with pytest.raises(ValueError, match="0-dimensional"):
        gpuload.ArrayDataset(torch.tensor(3))
    with pytest.raises(ValueError, match="not both"):
        gpuload.ArrayDataset(np.zeros(2), label=np.zeros(2))
    with pytest.raises(ValueError, match="ArrayDataset needs at least one array"):
        gpuload.ArrayDataset()
    with pytest.raises(TypeError, match="pass torch tensors or numpy arrays"):
        gpuload.ArrayDataset([1, 2, 3])
    assert "image=(4, 2):float64" in repr(gpuload.ArrayDataset(image=np.zeros((4, 2))))


def test_mismatched_tensor_dataset_is_torchs_error() -> None:
    with pytest.raises(AssertionError, match="Size mismatch"):
        TensorDataset(torch.zeros(3), torch.zeros(4))


def test_early_break_and_close_leave_no_threads_or_workers() -> None:
    baseline = snapshot()
    loader = gpuload.DataLoader(torch.utils.data.Subset(dataset(), range(20)), batch_size=2,
                                num_workers=2, persistent_workers=True, device="cpu")
    for _epoch in range(3):
        for i, _ in enumerate(loader):
            if i == 2:
                break
    loader.close()
    loader.close()
    assert loader._iterator is None
    left = wait_threads(baseline, deadline_s=10)  # queue feeder threads exit just after the workers
    assert not left, [t.name for t in left]
    with gpuload.DataLoader(dataset(), batch_size=4, device="cpu") as fast:
        still_open = iter(fast)
        next(still_open)
    with pytest.raises(RuntimeError, match="was closed"):
        next(still_open)
    assert len(list(fast)) == 5  # iterating again places the data again


class Numbers(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        return index


def failing_init(worker_id: int) -> None:
    raise RuntimeError(f"init failed in worker {worker_id}")


# An open epoch on each path: arrays, any dataset in the loop, through the prefetcher, with
# torch's workers (their persistent iterator is reused, so a closed one once ended silently).
OPEN_EPOCHS = {
    "arrays": lambda: gpuload.DataLoader(dataset(), batch_size=2, device="cpu"),
    "in-loop": lambda: gpuload.DataLoader(Numbers(), batch_size=4, device="cpu"),
    "prefetcher": lambda: gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", prefetch_depth=2),
    "workers": lambda: gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", num_workers=2),
    "persistent-workers": lambda: gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", num_workers=2,
                                                     persistent_workers=True),
}


@pytest.mark.parametrize("path", OPEN_EPOCHS)
def test_close_stops_every_open_epoch_and_its_workers_at_once(path: str) -> None:
    loader = OPEN_EPOCHS[path]()
    iterator = iter(loader)
    next(iterator)
    workers = list(iterator._workers)
    assert len(workers) == (2 if "workers" in path else 0)
    loader.close()
    assert not any(worker.is_alive() for worker in workers)  # joined by close(), not at a later GC
    with pytest.raises(EpochStoppedError, match=r"batch 1 and those after it were not delivered\): "
                       r"the loader was closed \(DataLoader.close\(\)\)"):
        next(iterator)
    assert len(list(loader)) == len(loader)  # iterating again starts a whole epoch
    finished = iter(loader)
    list(finished)
    loader.close()
    with pytest.raises(StopIteration):
        next(finished)  # an epoch that ended stays ended
    loader.close()


def test_close_shuts_down_the_workers_of_an_epoch_a_kept_exception_holds() -> None:
    before = set(torch.multiprocessing.active_children())
    loader = gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", num_workers=2, prefetch_depth=2,
                                worker_init_fn=failing_init)
    with pytest.raises(RuntimeError, match="init failed in worker") as kept:
        list(loader)  # the traceback of ``kept`` holds the epoch, and torch's iterator with it
    workers = [p for p in set(torch.multiprocessing.active_children()) - before if p.is_alive()]
    assert len(workers) == 2
    loader.close()
    assert not any(worker.is_alive() for worker in workers)
    assert "init failed in worker" in str(kept.value)


@pytest.mark.parametrize("persistent", [True, False])
def test_a_second_epoch_mid_epoch_stops_the_first_only_where_they_share_torchs_iterator(persistent: bool) -> None:
    with gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", num_workers=2,
                            persistent_workers=persistent) as loader:
        older = iter(loader)
        first = next(older)
        newer = iter(loader)
        assert torch.cat(list(newer)).tolist() == list(range(40))  # the newer epoch is whole
        if persistent:  # torch reset the one iterator both read: the older must not end short
            with pytest.raises(EpochStoppedError, match="a new epoch of this DataLoader started"):
                next(older)
        else:  # two iterators, two sets of workers, as in torch
            assert torch.cat([first, *older]).tolist() == list(range(40))


class SlowFirst(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == 0:
            time.sleep(1.5)
        return index


def test_close_leaves_the_workers_of_a_thread_that_would_not_stop_to_finish_its_batch(monkeypatch) -> None:
    import gpuload.loader
    from gpuload.prefetch import Prefetcher

    class QuickToGiveUp(Prefetcher):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, join_timeout=0.1, **kwargs)

    monkeypatch.setattr(gpuload.loader, "Prefetcher", QuickToGiveUp)
    baseline = snapshot()
    loader = gpuload.DataLoader(SlowFirst(), batch_size=4, device="cpu", num_workers=1, prefetch_depth=1)
    iterator = iter(loader)  # its thread is inside torch's next(), waiting 1.5 s for batch 0
    with pytest.warns(RuntimeWarning, match="did not stop"):
        loader.close()
    with pytest.raises(EpochStoppedError, match="the loader was closed"):
        next(iterator)
    del iterator
    # Shut down under it, the thread would wait for the workers forever; it gets its batch and ends.
    assert not wait_threads(baseline, deadline_s=15)


class Broken(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        raise ValueError(f"sample {index} is broken")


# A worker's error on each path that runs torch's workers: the dataset's, worker_init_fn's,
# through the prefetcher, and an IterableDataset's stream.
WORKER_ERRORS = {
    "dataset": lambda: gpuload.DataLoader(Broken(), batch_size=4, device="cpu", num_workers=2),
    "worker-init": lambda: gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", num_workers=2,
                                              worker_init_fn=failing_init),
    "prefetcher": lambda: gpuload.DataLoader(Numbers(), batch_size=4, device="cpu", num_workers=2,
                                             prefetch_depth=2, worker_init_fn=failing_init),
    "iterable": lambda: gpuload.DataLoader(Stream(), batch_size=2, device="cpu", num_workers=2,
                                           worker_init_fn=failing_init),
}


@pytest.mark.parametrize("path", WORKER_ERRORS)
def test_a_caught_worker_error_leaves_torchs_iterator_to_end_with_its_epoch(path: str) -> None:
    before = set(torch.multiprocessing.active_children())
    loader = WORKER_ERRORS[path]()
    gc.disable()  # what ends here must end without the garbage collector
    try:
        with pytest.raises((RuntimeError, ValueError), match="broken|init failed in worker"):
            next(iter(loader))
        assert not [p for p in set(torch.multiprocessing.active_children()) - before if p.is_alive()]
    finally:
        gc.enable()
    loader.close()


def test_cache_off_serves_identical_batches() -> None:
    data = dataset(33)
    on = gpuload.DataLoader(data, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(1), device="cpu")
    off = gpuload.DataLoader(data, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(1),
                             device="cpu", cache="off")
    assert_same_epochs(on, off)


def test_unbatched_samples_are_copies_not_views_of_the_resident_data() -> None:
    data = dataset(4)
    loader = gpuload.DataLoader(data, batch_size=None, device="cpu")
    x, _ = next(iter(loader))
    x.zero_()
    assert data.tensors[0][0].sum() > 0


class NotDeterministicShapes(Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int):
        return torch.zeros(i + 1)


def test_inconsistent_shapes_in_generic_path_are_torchs_error() -> None:
    with pytest.raises(RuntimeError) as theirs:
        list(TorchDataLoader(NotDeterministicShapes(), batch_size=3))
    with pytest.raises(RuntimeError) as ours:
        list(gpuload.DataLoader(NotDeterministicShapes(), batch_size=3, device="cpu"))
    assert type(ours.value) is type(theirs.value)  # torch's error, then what to do (tests/test_iterators.py)
    assert str(ours.value).startswith(f"{theirs.value}\ngpuload: the samples of this batch have different shapes")


def test_import_is_light_and_leaves_dali_and_cupy_unloaded() -> None:
    import subprocess
    import sys

    code = "import sys, gpuload; print(sorted(m for m in sys.modules if m.split('.')[0] in ('nvidia', 'cupy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_prefetched_paths_raise_torchs_error_type_and_leave_no_threads() -> None:
    before = snapshot()
    for kwargs in (dict(cache="off"), dict(prefetch_depth=3), dict(cache="off", prefetch_depth=0)):
        data = dataset() if "cache" in kwargs else torch.utils.data.Subset(dataset(), range(20))
        loader = gpuload.DataLoader(data, batch_size=2, sampler=[0, 1, 2, 3, 99], device="cpu", **kwargs)
        batches = []
        named_batch = "batch 2.*" if kwargs.get("prefetch_depth") != 0 else ""
        with pytest.raises(IndexError, match=named_batch + "index"):
            for batch in loader:
                batches.append(batch)
        assert len(batches) == 2  # the batches before the failing one arrive first
        for _ in range(50):  # many epochs, each abandoned early
            for i, _ in enumerate(gpuload.DataLoader(data, batch_size=2, device="cpu", **kwargs)):
                if i == 1:
                    break
        loader.close()
    left = wait_threads(before, deadline_s=10)
    assert not left, [t.name for t in left]


def test_prefetch_depth_is_validated() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch_depth"):
            gpuload.DataLoader(dataset(), prefetch_depth=bad, device="cpu")


def test_stats_count_staged_bytes_on_the_prefetched_path() -> None:
    loader = gpuload.DataLoader(dataset(), batch_size=6, device="cpu", cache="off")
    list(loader)
    assert loader.stats.path == "host-gather"
    assert loader.stats.samples == 20
    prefetch = loader.stats.extra["prefetch"]
    assert prefetch["bytes_staged"] == 20 * 3 + 20 * 8  # every uint8 image row and int64 label, once
    assert prefetch["copy_time_s"] > 0 and prefetch["slot_allocations"] <= prefetch["depth"]
    assert loader.stats.bytes_h2d == 0  # staging on a CPU device is no host-to-device transfer


def test_cache_settings_come_from_keyword_env_and_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpuload.toml").write_text('cache_size = "1GiB"\n[jobs.small]\ncache_size = "10MB"\n')
    monkeypatch.setenv("GPULOAD_CACHE_RESERVE", "3GiB")
    loader = gpuload.DataLoader(dataset(), device="cpu", job="small", cache_size=None)
    settings = loader.cache_settings
    assert "gpuload.toml" in settings.size.source and "small" in settings.size.source
    assert settings.reserve.source.startswith("env")
    loader = gpuload.DataLoader(dataset(), device="cpu", cache_size="2GiB")
    assert loader.cache_settings.size.source.startswith("keyword")
    with pytest.raises(ValueError, match="small"):
        gpuload.DataLoader(dataset(), device="cpu", job="nope")
    with pytest.raises(ValueError, match="cache_size='12 parsecs'"):
        gpuload.DataLoader(dataset(), device="cpu", cache_size="12 parsecs")


def _raise_in_worker(worker_id: int) -> None:
    raise RuntimeError(f"worker_init_fn ran in worker {worker_id}")


def test_a_worker_init_fn_runs_in_torchs_workers_on_every_path(tmp_path) -> None:
    from gpuload.datasets import make_sample_image_folder

    folder = make_sample_image_folder(tmp_path, num_images=4, num_classes=2)
    for data in (dataset(), folder):
        loader = gpuload.DataLoader(data, batch_size=2, num_workers=2, worker_init_fn=_raise_in_worker, device="cpu")
        with pytest.raises(RuntimeError, match="worker_init_fn ran in worker"):
            next(iter(loader))
        assert loader.stats.path == "torch"
        assert len(iter(loader)._workers) == 2  # torch's iterator, as torch's own tests read it
        loader.close()  # ends the workers of the iterators opened here
    fast = gpuload.DataLoader(dataset(), batch_size=2, num_workers=2, device="cpu")
    assert fast.stats.path == "" and iter(fast)._workers == []  # served in this process: no workers


class _Failing(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        if index == 5:
            raise ValueError("sample 5 is broken")
        return torch.tensor([index])


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
@pytest.mark.parametrize("keywords", [dict(), dict(prefetch_depth=2), dict(num_workers=2), dict(cache="host")])
def test_a_failing_sample_keeps_its_error_and_names_its_index(keywords) -> None:
    loader = gpuload.DataLoader(_Failing(), batch_size=4, device="cpu", **keywords)
    with pytest.raises(ValueError, match="sample 5 is broken") as raised:
        list(loader)
    notes = " ".join(getattr(raised.value, "__notes__", [])) + str(raised.value)
    assert "dataset index 5" in notes or "dataset indices [4, 5, 6, 7]" in notes, notes
    # torch's iterator lives on after a sample's error (as torch's does: the next batch follows),
    # held here by pytest's record of the error until a garbage collection, which would wait 5 s
    # for each worker in whatever test it falls in: its workers end now.
    loader.close()


def test_a_loader_pickles_without_its_runtime_state_and_yields_the_same_batches() -> None:
    import pickle

    for data in (dataset(), torch.utils.data.Subset(dataset(), range(12))):
        loader = gpuload.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2),
                                    device="cpu", prefetch_depth=2)
        copy = pickle.loads(pickle.dumps(loader))  # before any epoch
        for ours, theirs in zip(list(copy), list(loader), strict=True):
            assert torch.equal(ours[0], theirs[0])
        iterator = iter(loader)
        next(iterator)  # a live epoch, a prefetch thread: none of it travels
        again = pickle.loads(pickle.dumps(loader))
        assert isinstance(again, gpuload.DataLoader) and again._prefetcher is None
        assert len(list(again)) == len(loader)


def test_a_generator_reassigned_after_construction_draws_the_order_as_torchs() -> None:
    # torch lets ``loader.generator`` be set after construction (unlike the sampler): each epoch
    # then draws its workers' base seed from the new one, the sampler's order from the global
    # generator; ours follows it, as does a resumed epoch
    def batches(loader: torch.utils.data.DataLoader) -> list[list[int]]:
        loader.generator = torch.Generator().manual_seed(9)
        torch.manual_seed(3)
        return [batch[1].tolist() for _ in range(2) for batch in loader]

    data = dataset()
    theirs = batches(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    ours = gpuload.DataLoader(data, batch_size=4, shuffle=True, device="cpu", prefetch_depth=0)
    assert batches(ours) == theirs
    ours.generator = torch.Generator().manual_seed(9)
    torch.manual_seed(3)
    iterator = iter(ours)
    first = next(iterator)[1].tolist()
    state = ours.state_dict()
    resumed = gpuload.DataLoader(data, batch_size=4, shuffle=True, device="cpu", prefetch_depth=0)
    resumed.generator = torch.Generator()
    resumed.load_state_dict(state)
    assert [first, *(batch[1].tolist() for batch in resumed)] == theirs[: len(theirs) // 2]


def test_swapped_in_for_torchs_class_it_still_runs() -> None:
    import torch.utils.data.dataloader as torch_dataloader

    original = torch.utils.data.DataLoader
    torch.utils.data.DataLoader = torch_dataloader.DataLoader = gpuload.DataLoader
    try:
        for kwargs in (dict(), dict(num_workers=2), dict(cache="host")):
            loader = torch.utils.data.DataLoader(Subset_(), batch_size=3, device="cpu", **kwargs)
            assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
    finally:
        torch.utils.data.DataLoader = torch_dataloader.DataLoader = original


class Subset_(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        return index


def test_the_class_is_generic_like_torchs() -> None:
    assert gpuload.DataLoader[list[torch.Tensor]] is not None


def test_a_source_whose_staging_changes_gets_a_new_prefetcher_and_keeps_its_counts(monkeypatch) -> None:
    data = TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    loader = gpuload.DataLoader(data, batch_size=4, device="cpu", cache="off", prefetch_depth=2)
    first_epoch = list(loader)
    first = loader._prefetcher
    assert first is not None and first.stage
    staged = first.stats.bytes_copied
    schedule = type(loader._source).schedule  # the source's schedule, now unstaged
    monkeypatch.setattr(type(loader._source), "schedule",
                        lambda source, indices: dataclasses.replace(schedule(source, indices), staged=False))
    second_epoch = list(loader)
    assert loader._prefetcher is not first and not loader._prefetcher.stage
    assert first._ring is None  # the old one was closed: its host slots are freed
    assert loader.stats.extra["prefetch"]["bytes_staged"] == 0  # the new prefetcher staged nothing
    assert staged > 0
    assert len(second_epoch) == len(first_epoch) == 5


@pytest.mark.parametrize("limit", [-1, 1.5, True, "1GiB", None])
def test_shrink_cache_takes_a_non_negative_int_of_bytes(limit: object) -> None:
    loader = gpuload.DataLoader(TensorDataset(torch.arange(8)), batch_size=4)
    with pytest.raises(ValueError, match=r"max_device_bytes=.* must be a non-negative int"):
        loader.shrink_cache(limit)
    assert loader.shrink_cache(0) == 0  # a loader on the CPU holds nothing in device memory
