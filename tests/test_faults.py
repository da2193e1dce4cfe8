"""Fault injection: what a careful user or an attacker does to a loader, kept running in CI.

Each case is one of issue #16's (or one that already held then): two threads on one loader,
out-of-range indices, closing under an open iterator, a worker killed mid-epoch, Ctrl-C in the
loop, hundreds of broken epochs, bad image files with every CPU decoder, and bad settings. A
loader may raise, with a clear error naming the cause; it never ends an epoch short, hangs or
leaks threads.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import image_fixtures as F
import pytest
import torch
import torchvision
from threads import snapshot, wait_threads
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, TensorDataset

import gpuload
import gpuload.cache.settings as settings_module
from gpuload import transforms as T
from gpuload.cache import CacheSettings
from gpuload.cache.budget import CacheSettingError
from gpuload.datasets import ImageFolder, ImageList, make_sample_image_folder
from gpuload.decode import BatchDecoder, ImageDecodeError
from gpuload.decode.batch import resolve_backend
from gpuload.device import DeviceError
from gpuload.iterators import shut_down_workers
from gpuload.prefetch import EpochStoppedError

N = 12
RESIZE = [T.Resize((16, 16))]


class Slow(Dataset):
    """``N`` samples that take ``delay`` seconds each: the loop waits inside ``next()``."""

    def __init__(self, n: int = N, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor([index, 2 * index])


class ListBacked(Dataset):
    """Samples in a Python list: an out-of-range index raises IndexError as torch sees it."""

    def __init__(self, n: int = N) -> None:
        self.items = [torch.tensor(i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> ImageFolder:
    return make_sample_image_folder(tmp_path_factory.mktemp("images"), num_images=N, num_classes=3, seed=1)


# Every path on which the work runs ahead of the loop in the prefetcher's thread.
PREFETCHED: dict[str, Callable[[ImageFolder], gpuload.DataLoader]] = {
    "dataset": lambda folder: gpuload.DataLoader(Slow(delay=0.02), batch_size=2, device="cpu", prefetch_depth=2),
    "arrays-cache-off": lambda folder: gpuload.DataLoader(
        TensorDataset(torch.arange(N)), batch_size=2, device="cpu", cache="off"),
    "images": lambda folder: gpuload.DataLoader(folder, batch_size=2, device="cpu", transforms=RESIZE,
                                                prefetch_depth=2),
}


# ------------------------------------------------------------------- two threads, one loader


@pytest.mark.parametrize("path", PREFETCHED)
def test_a_newer_epoch_makes_the_older_iterator_raise_never_end_short(folder: ImageFolder, path: str) -> None:
    loader = PREFETCHED[path](folder)
    taken, started, resume = [], threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def consume() -> None:
        try:
            for batch in loader:
                taken.append(batch)
                if len(taken) == 2:
                    started.set()
                    resume.wait(10)
            outcome["ended"] = len(taken)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(10)
    newer = iter(loader)  # another consumer starts an epoch while the first one is open
    resume.set()
    thread.join(10)
    assert "ended" not in outcome, f"the stopped epoch ended normally after {outcome.get('ended')} batches"
    assert isinstance(outcome["error"], EpochStoppedError)
    assert "a new epoch of this DataLoader started" in str(outcome["error"])
    assert len(list(newer)) == N // 2  # the newer epoch is whole
    loader.close()


def test_an_iterator_waiting_in_next_when_a_newer_epoch_starts_raises() -> None:
    """The race of issue #16: the first consumer is blocked inside ``next()`` on a slow source."""
    for _ in range(3):
        loader = gpuload.DataLoader(Slow(n=100, delay=0.02), batch_size=None, device="cpu", prefetch_depth=2)
        outcome: dict[str, object] = {}

        def consume() -> None:  # its thread is joined within this iteration: loader and outcome are its own
            count = 0
            try:
                for _ in loader:  # noqa: B023
                    count += 1
                outcome["ended"] = count  # noqa: B023
            except EpochStoppedError:
                outcome["stopped"] = count  # noqa: B023

        thread = threading.Thread(target=consume)
        thread.start()
        time.sleep(0.3)
        next(iter(loader))
        thread.join(10)
        assert outcome.get("ended") in (None, 100) and "stopped" in outcome
        loader.close()


@pytest.mark.parametrize("path", PREFETCHED)
def test_closing_the_loader_under_an_open_iterator_says_it_was_closed(folder: ImageFolder, path: str) -> None:
    baseline = snapshot()
    loader = PREFETCHED[path](folder)
    iterator = iter(loader)
    next(iterator)
    loader.close()
    with pytest.raises(EpochStoppedError, match="the loader was closed"):
        next(iterator)
    assert not wait_threads(baseline)
    assert sum(len(b[-1]) if isinstance(b, list) else len(b) for b in loader) == N  # usable again


# ------------------------------------------------------------------- out-of-range indices

OUT_OF_RANGE = [[0, N, 1000, -N - 1]]  # torch meets index N first
INDEXED: dict[str, Callable[[ImageFolder, list], tuple[gpuload.DataLoader, TorchDataLoader]]] = {
    "arrays-in-place": lambda folder, bs: (
        gpuload.DataLoader(TensorDataset(torch.arange(N)), batch_sampler=bs, device="cpu"),
        TorchDataLoader(TensorDataset(torch.arange(N)), batch_sampler=bs)),
    "arrays-streamed": lambda folder, bs: (
        gpuload.DataLoader(TensorDataset(torch.arange(N)), batch_sampler=bs, device="cpu", cache="off"),
        TorchDataLoader(TensorDataset(torch.arange(N)), batch_sampler=bs)),
    "arrays-streamed-in-loop": lambda folder, bs: (
        gpuload.DataLoader(TensorDataset(torch.arange(N)), batch_sampler=bs, device="cpu", cache="off",
                           prefetch_depth=0),
        TorchDataLoader(TensorDataset(torch.arange(N)), batch_sampler=bs)),
    "images": lambda folder, bs: (
        gpuload.DataLoader(folder, batch_sampler=bs, device="cpu", transforms=RESIZE),
        TorchDataLoader(folder, batch_sampler=bs)),
    "images-ahead": lambda folder, bs: (
        gpuload.DataLoader(folder, batch_sampler=bs, device="cpu", transforms=RESIZE, prefetch_depth=2),
        TorchDataLoader(folder, batch_sampler=bs)),
    "images-cache": lambda folder, bs: (
        gpuload.DataLoader(folder, batch_sampler=bs, device="cpu", transforms=RESIZE, cache="device"),
        TorchDataLoader(folder, batch_sampler=bs)),
    "sample-cache": lambda folder, bs: (
        gpuload.DataLoader(ListBacked(), batch_sampler=bs, device="cpu", cache="host"),
        TorchDataLoader(ListBacked(), batch_sampler=bs)),
    "torch-path": lambda folder, bs: (
        gpuload.DataLoader(ListBacked(), batch_sampler=bs, device="cpu", cache="off"),
        TorchDataLoader(ListBacked(), batch_sampler=bs)),
    "torch-path-workers": lambda folder, bs: (
        gpuload.DataLoader(ListBacked(), batch_sampler=bs, device="cpu", cache="off", num_workers=1),
        TorchDataLoader(ListBacked(), batch_sampler=bs, num_workers=1)),
}


@pytest.mark.parametrize("path", INDEXED)
def test_out_of_range_indices_raise_torchs_error_type_naming_the_index(folder: ImageFolder, path: str) -> None:
    ours, theirs = INDEXED[path](folder, OUT_OF_RANGE)
    reference = iter(theirs)
    with pytest.raises(Exception) as expected:
        list(reference)
    # torch's iterator, held by the error's traceback, would end its worker when a garbage
    # collection frees it, waiting 5 s for it then: it ends it now
    shut_down_workers([reference])
    with ours, pytest.raises(type(expected.value)) as got:
        list(ours)
    assert isinstance(got.value, IndexError)
    if path.startswith(("arrays", "images")):  # gpuload checks these itself, naming the index
        assert f"index {N} is out of bounds" in str(got.value)


@pytest.mark.parametrize("path", ["arrays-in-place", "arrays-streamed", "images", "images-cache", "sample-cache"])
def test_negative_indices_in_range_count_from_the_end_as_in_torch(folder: ImageFolder, path: str) -> None:
    batches = [[-1], [-N], [0]]
    ours, theirs = INDEXED[path](folder, batches)
    for _ in range(2):  # the second epoch from the cache, where there is one
        got, want = list(ours), list(theirs)
        # Labels (images: gpuload's are resized, torch's whole), or the samples themselves.
        labels = [(b[-1] if isinstance(b, list) else b).tolist() for b in got]
        assert labels == [(b[-1] if isinstance(b, list) else b).tolist() for b in want]


# ------------------------------------------------------------------- workers, Ctrl-C, broken epochs


def test_a_killed_worker_is_reported_at_once_without_a_stall() -> None:
    loader = gpuload.DataLoader(Slow(n=400, delay=0.01), batch_size=4, num_workers=2, device="cpu",
                                prefetch_depth=2, cache="off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        killed_at = None
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\)"):
            for k, _ in enumerate(loader):
                if k == 3:
                    children = torch.multiprocessing.active_children()
                    os.kill(children[0].pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        raised_after = time.monotonic() - killed_at
        loader.close()
        closed_after = time.monotonic() - killed_at
    assert raised_after < 3.0 and closed_after < 3.0, (raised_after, closed_after)
    assert not [w for w in caught if "did not stop" in str(w.message)]
    # On a busy machine torch's worker iterator can finish ending its other worker after close()
    # returned; that worker's SIGCHLD then makes torch's handler report the killed worker once more,
    # in whatever this process runs next (it once broke the pytest session): let it land here.
    deadline = time.monotonic() + 120
    while torch.multiprocessing.active_children() and time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except RuntimeError as late:
            assert "DataLoader worker" in str(late), late
    assert not torch.multiprocessing.active_children()


class Gated(Slow):
    """``Slow``'s samples; from sample 2 on, a read waits until the test opens ``gate``."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.gate = threading.Event()

    def __getitem__(self, index: int) -> torch.Tensor:
        if index >= 2:
            assert self.gate.wait(timeout=600), "the test never opened the gate"
        return super().__getitem__(index)


def test_ctrl_c_in_the_loop_stops_at_once_and_the_loader_runs_again(request: pytest.FixtureRequest) -> None:
    baseline = snapshot()
    data = Gated(n=40)
    loader = gpuload.DataLoader(data, batch_size=2, device="cpu", prefetch_depth=2)
    iterator = iter(loader)
    next(iterator)
    main = threading.main_thread().ident
    assert main is not None
    # Python's own Ctrl-C handler, whatever started the suite: a shell's background job ignores
    # SIGINT, and a Python started so keeps ignoring it (the loop would then never be interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    with pytest.raises(KeyboardInterrupt):
        # a real SIGINT, as Ctrl-C sends: it wakes a thread blocked on a lock, which
        # _thread.interrupt_main() (a flag checked between bytecodes) does not; started in here, so
        # that it cannot land before the loop waits in next() (batch 1 is held back)
        threading.Timer(0.02, signal.pthread_kill, (main, signal.SIGINT)).start()
        while True:
            next(iterator)
    # at once: the loop did not wait for the read it was waiting for (it is still held back), on
    # any machine; the prefetch thread's read returns once the gate opens, and the thread ends
    data.gate.set()
    with pytest.raises(EpochStoppedError, match="KeyboardInterrupt was raised while it waited"):
        next(iterator)  # a loop that goes on after Ctrl-C is not told the epoch ended
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "did not stop" warning from the next epoch either
        assert len(list(loader)) == 20
    del iterator
    loader.close()
    assert not wait_threads(baseline)


class BreaksAt(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 5:
            raise ValueError(f"sample {index} is broken")
        return torch.tensor(index)


def test_two_hundred_broken_epochs_leak_no_threads() -> None:
    baseline = snapshot()
    loader = gpuload.DataLoader(BreaksAt(), batch_size=2, device="cpu", prefetch_depth=2)
    for _ in range(200):
        with pytest.raises(ValueError, match="sample 5 is broken"):
            list(loader)
    loader.close()
    assert not wait_threads(baseline)


# ------------------------------------------------------------------- bad image files

CPU_BACKENDS = ["dali-cpu", "torchvision", "pil"]


def available(backend: str) -> bool:
    try:
        resolve_backend(torch.device("cpu"), backend)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory) -> tuple[ImageList, list[str]]:
    root = tmp_path_factory.mktemp("bad")
    samples, bad = [], []
    good = F.jpeg("baseline-420")
    for i, (name, data) in enumerate([("good0.jpg", good), *F.corrupt_inputs().items(), ("good1.jpg", good)]):
        path = root / name
        path.write_bytes(data)
        samples.append((str(path), i))
        if not name.startswith("good"):
            bad.append(name)
    samples.append((str(root / "missing.jpg"), 99))  # unreadable: the file is gone
    bad.append("missing.jpg")
    return ImageList(samples), bad


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bad_files_are_named_or_skipped_by_every_cpu_decoder(bad_folder, backend: str) -> None:
    if not available(backend):
        pytest.skip(f"the {backend} decoder is not installed here")
    images, bad = bad_folder
    loader = gpuload.DataLoader(images, batch_size=3, device="cpu", transforms=RESIZE)
    loader._source.reader.decoder = BatchDecoder("cpu", backend=backend, max_batch=3)
    with pytest.raises(ImageDecodeError, match=bad[0]):
        list(loader)
    skipping = gpuload.DataLoader(images, batch_size=3, device="cpu", transforms=RESIZE, on_error="skip")
    skipping._source.reader.decoder = BatchDecoder("cpu", backend=backend, max_batch=3)
    for epoch in range(3):
        labels = torch.cat([labels for _, labels in skipping]).tolist()
        assert labels == [0, len(bad)]  # the two good files, every epoch
        extra = skipping.stats.extra
        assert extra["skipped"] == len(bad) * (epoch + 1) and extra["skipped_epoch"] == len(bad)
    assert sorted(Path(file).name for _, file, _ in extra["skipped_files"]) == sorted(bad)


def test_the_list_of_skipped_files_stays_bounded(tmp_path: Path) -> None:
    samples = []
    for i in range(130):
        path = tmp_path / f"bad{i:03d}.jpg"
        path.write_bytes(b"not an image")
        samples.append((str(path), 0))
    loader = gpuload.DataLoader(ImageList(samples), batch_size=26, device="cpu", transforms=RESIZE, on_error="skip")
    loader._source.reader.decoder = BatchDecoder("cpu", backend="pil", max_batch=26)  # fast; DALI: below
    for _ in range(2):
        assert list(loader) == []
    extra = loader.stats.extra
    assert extra["skipped"] == 260 and extra["skipped_epoch"] == 130 and len(extra["skipped_files"]) == 100


def test_a_symlink_loop_in_a_class_folder_warns_and_lists_what_torchvision_lists(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.jpg").write_bytes(F.jpeg("baseline-420"))
    (tmp_path / "a" / "loop").symlink_to("..")
    with pytest.warns(UserWarning, match=r"class 'a' reaches \d+ folder\(s\) a second time through symbolic links"):
        ours = ImageFolder(tmp_path)
    theirs = torchvision.datasets.ImageFolder(tmp_path)
    assert [path for path, _ in ours.samples] == [path for path, _ in theirs.samples]


# ------------------------------------------------------------------- bad settings


@pytest.mark.parametrize("device", ["foo", -1, 3.5, "cuda:x", True])
def test_a_bad_device_names_the_setting(device) -> None:
    with pytest.raises(DeviceError, match=rf"device={device!r} "):
        gpuload.DataLoader(torch.arange(4), device=device)


@pytest.mark.parametrize("setting", ["cache_size", "cache_reserve"])
@pytest.mark.parametrize("value", ["9" * 400, int("9" * 400), "9" * 400 + "GiB", "1e400"])
def test_a_size_larger_than_any_memory_names_the_setting(setting: str, value) -> None:
    with pytest.raises(CacheSettingError, match=rf"^{setting}=.*(larger than any memory|not a size)"):
        gpuload.DataLoader(torch.arange(4), device="cpu", **{setting: value})


def test_a_config_file_that_is_not_utf8_or_cannot_be_read_names_itself(tmp_path: Path, monkeypatch) -> None:
    config = tmp_path / "gpuload.toml"
    config.write_bytes(b'cache = "\xff\xfe"\n')
    with pytest.raises(CacheSettingError, match=r"gpuload\.toml.*is not UTF-8"):
        CacheSettings.resolve(cwd=tmp_path, environ={})
    config.write_text('cache = "off"\n')

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(config))

    monkeypatch.setattr(settings_module, "open", unreadable, raising=False)
    with pytest.raises(CacheSettingError, match=r"gpuload\.toml.*cannot be read \(PermissionError"):
        CacheSettings.resolve(cwd=tmp_path, environ={})


def test_gpuload_config_wins_over_the_working_directorys_file(tmp_path: Path) -> None:
    (tmp_path / "gpuload.toml").write_text('cache = "host"\n')
    chosen = tmp_path / "chosen.toml"
    chosen.write_text('cache = "off"\n')
    settings = CacheSettings.resolve(cwd=tmp_path, environ={"GPULOAD_CONFIG": str(chosen)})
    assert settings.mode.value == "off" and settings.config_path == chosen


@pytest.mark.parametrize("transforms", ["flip", 3, {"flip": 1}])
def test_transforms_that_are_not_a_list_name_the_setting(transforms) -> None:
    images = TensorDataset(torch.zeros(4, 3, 8, 8, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"transforms=.* is not a list of transforms"):
        gpuload.DataLoader(images, batch_size=2, device="cpu", transforms=transforms)
