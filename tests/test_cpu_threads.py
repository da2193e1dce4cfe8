"""gpuload's own CPU batch ops run with the threads the free CPUs allow, torch's setting restored."""

from __future__ import annotations

import os

import pytest
import torch

from gpuload import cpu_threads
from gpuload.cpu_threads import free_cpu_threads, give_back_cpu_threads, own_cpu_threads, take_cpu_threads


@pytest.mark.parametrize("current,usable,load,own,expected", [
    (2, 2, 14.0, 0.2, 1),    # 2 cores at load 14: one thread, no spinning partner
    (2, 2, 2.0, 1.0, 1),     # one busy neighbour beside the loop's thread
    (2, 2, 1.0, 1.0, 2),     # quiet: the load is this process's own
    (64, 64, 64.0, 64.0, 64),  # a big quiet machine whose load is all this process's threads
    (8, 16, 3.0, 1.0, 8),    # never above torch's setting
    (4, 4, 0.0, 1.0, 4),
])
def test_threads_from_the_free_cpus(current: int, usable: int, load: float, own: float, expected: int) -> None:
    assert free_cpu_threads(current, usable, load, own) == expected


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_fewer_threads_inside_and_the_setting_restored(two_threads, monkeypatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (14.0, 14.0, 14.0))
    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: 2)
    with own_cpu_threads(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="inside"), own_cpu_threads(torch.device("cpu")):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_untouched_off_the_cpu_and_when_free(two_threads, monkeypatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (14.0, 14.0, 14.0))
    with own_cpu_threads(torch.device("meta")):
        assert torch.get_num_threads() == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: 2)
    with own_cpu_threads(torch.device("cpu")):
        assert torch.get_num_threads() == 2


def test_the_choice_is_kept_a_second_unless_torchs_setting_changed(two_threads, monkeypatch) -> None:
    """A batch does not read the load again within a second of the last choice (it moves every
    5 s); a choice made for another torch setting, or an older one, is made again."""
    now = [100.0]
    load = [14.0]
    monkeypatch.setattr(cpu_threads, "_clock", lambda: now[0])
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], load[0], load[0]))
    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: 4)
    cpu = torch.device("cpu")

    def threads_inside() -> int:
        taken = take_cpu_threads(cpu)
        try:
            return torch.get_num_threads()
        finally:
            give_back_cpu_threads(taken)
            assert torch.get_num_threads() == before

    before = 2
    assert threads_inside() == 1  # 4 CPUs at load 14
    load[0] = 0.0
    now[0] += 0.5
    assert threads_inside() == 1  # kept: the load is not read again yet
    torch.set_num_threads(before := 3)
    assert threads_inside() == 3  # another setting: chosen again, from the quiet load
    torch.set_num_threads(before := 2)
    load[0] = 14.0
    now[0] += 0.2
    assert threads_inside() == 1  # chosen again for 2 (the kept one was for 3)
    load[0] = 0.0
    now[0] += 1.0
    assert threads_inside() == 2  # a second later: the load is read again


def test_the_loaders_transforms_run_with_the_chosen_threads(two_threads, monkeypatch) -> None:
    """The arrays source's batch (gather and transforms) runs inside own_cpu_threads."""
    import gpuload
    from gpuload import transforms as T

    seen = []
    real = gpuload.augment.transform_batch

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(gpuload.augment, "transform_batch", recording)
    monkeypatch.setattr(os, "getloadavg", lambda: (14.0, 14.0, 14.0))
    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: 2)
    images = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    data = torch.utils.data.TensorDataset(images, torch.arange(16))
    loader = gpuload.DataLoader(data, batch_size=8, device="cpu", transforms=[T.RandomHorizontalFlip()])
    assert len(list(loader)) == 2
    assert seen == [1, 1]
    assert torch.get_num_threads() == 2


def test_the_sample_caches_copies_run_with_the_chosen_threads_and_the_datasets_with_the_users(two_threads,
                                                                                              monkeypatch) -> None:
    """The sample cache's batch-sized copies (storing, gathering, merging with the disk tier's
    rows) run inside own_cpu_threads; the dataset's own ``__getitem__`` keeps the user's threads
    (its results could depend on them)."""
    import tempfile

    import gpuload
    from gpuload.cache.columns import ColumnStore

    ours: list[tuple[str, int]] = []
    for name in ("put", "gather_rows", "assemble"):
        real = getattr(ColumnStore, name)

        def recording(self, *args, _real=real, _name=name, **kwargs):
            ours.append((_name, torch.get_num_threads()))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(ColumnStore, name, recording)

    class Squares(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.threads: list[int] = []

        def __len__(self) -> int:
            return 32

        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            self.threads.append(torch.get_num_threads())
            return torch.full((4, 4), float(index)), index

    monkeypatch.setattr(os, "getloadavg", lambda: (14.0, 14.0, 14.0))
    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: 2)
    data = Squares()
    with tempfile.TemporaryDirectory() as folder:
        # A host tier of half the samples (the rest merged from the disk tier in later epochs),
        # then one of every sample (later epochs gathered from it alone).
        for cache_size in (16 * 72, "1MiB"):
            loader = gpuload.DataLoader(data, batch_size=8, shuffle=True, device="cpu", cache="host",
                                        cache_size=cache_size, cache_dir=folder)
            for _ in range(3):
                assert sorted(torch.cat([labels for _, labels in loader]).tolist()) == list(range(32))
            loader.close()
    assert {name for name, _ in ours} == {"put", "gather_rows", "assemble"}
    assert {threads for _, threads in ours} == {1}
    assert data.threads and set(data.threads) == {2}
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("setting,load,usable,expected", [
    (1, 0.0, 2, 2),    # quiet, torch at 1 thread: the other core takes its share of the images
    (1, 14.0, 2, 2),   # busy: still both, as torch's two worker processes each take a share
    (2, 0.0, 2, 1),    # torch's 2 intra-op threads have both cores already
    (1, 0.0, 16, 8),   # at most 8 threads
])
def test_per_image_work_spreads_over_the_usable_cpus(monkeypatch, setting, load, usable, expected) -> None:
    import threading

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: usable)
    monkeypatch.setattr(cpu_threads._own_use, "now", lambda: 1.0)
    monkeypatch.setattr(cpu_threads, "_pools", {})
    before = torch.get_num_threads()
    torch.set_num_threads(setting)
    seen: list[tuple[int, list[int]]] = []
    lock = threading.Lock()

    def work(run):
        with lock:
            seen.append((threading.get_ident(), list(run)))

    try:
        cpu_threads.spread_over_cpus(work, list(range(20)), torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    assert len({ident for ident, _ in seen}) <= expected
    runs = 1 if expected == 1 else len(range(0, 20, -(-20 // (expected * cpu_threads._RUNS_PER_THREAD))))
    assert len(seen) == runs  # small runs from one queue, several per thread
    assert sorted(item for _, run in seen for item in run) == list(range(20))  # each item once
    assert all(run == list(range(run[0], run[0] + len(run))) for _, run in seen)  # consecutive runs


def test_a_thread_that_loses_its_core_does_fewer_images(monkeypatch) -> None:
    """The runs come from one queue: while the calling thread is held up (its core taken by a
    neighbour, here a wait), the other thread does every run left, instead of the caller's
    fixed half waiting for it."""
    import threading

    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: 2)
    monkeypatch.setattr(cpu_threads, "_pools", {})
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    caller = threading.get_ident()
    done: list[int] = []
    lock = threading.Lock()
    others_finished = threading.Event()
    items = list(range(16))

    def work(run):
        if threading.get_ident() == caller and not done:
            others_finished.wait(timeout=10)  # held up until the rest is done (10 s: a safety net)
        with lock:
            done.extend(run)
            if len(done) == len(items) - len(run) and threading.get_ident() != caller:
                others_finished.set()

    try:
        cpu_threads.spread_over_cpus(work, items, torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    assert others_finished.is_set()  # the pool thread did all but the caller's first run
    assert sorted(done) == items


def test_per_image_work_stays_in_the_callers_thread_off_the_cpu_and_errors_reach_it(monkeypatch) -> None:
    import threading

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(cpu_threads, "usable_cpu_count", lambda: 2)
    monkeypatch.setattr(cpu_threads._own_use, "now", lambda: 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        idents: set[int] = set()
        cpu_threads.spread_over_cpus(lambda run: idents.add(threading.get_ident()), [1, 2, 3],
                                          torch.device("meta"))
        assert idents == {threading.get_ident()}

        def failing(run):
            if 3 in run:
                raise ValueError("image 3 is bad")

        with pytest.raises(ValueError, match="image 3 is bad"):
            cpu_threads.spread_over_cpus(failing, [1, 2, 3, 4], torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
