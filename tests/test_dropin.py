"""gpuload.DataLoader goes wherever torch's DataLoader goes (issue #11).

Pickling, the global swap ``torch.utils.data.DataLoader = gpuload.DataLoader``, subscripting
the class, worker processes (``_workers``, ``worker_init_fn``), dataset errors that name the
sample, and explicit caches of randomly augmented datasets, on each of the loader's paths.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import typing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.utils.data as tud
from equivalence import assert_same_epochs
from torch.utils.data import Dataset, TensorDataset

import gpuload
from gpuload.datasets import ImageFolder, make_sample_image_folder

TORCH_DATALOADER = tud.DataLoader



# ----------------------------------------------------------------- datasets (module level: picklable)


class Squares(Dataset):
    """A map-style dataset gpuload cannot gather from: torch fetches and collates it."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, typing.Any]:
        return {"x": torch.full((3,), float(index)), "y": index * index}


class SampleError(ValueError):
    """A dataset's own exception type, which must reach the loop as it is."""


class Broken(Squares):
    BAD = 37

    def __getitem__(self, index: int) -> dict[str, typing.Any]:
        if index == self.BAD:
            raise SampleError("cannot read this sample")
        return super().__getitem__(index)


class Noise(Dataset):
    """Randomly augmented: two reads of one sample differ."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(4)


class RecordInit:
    """worker_init_fn that leaves a file per worker id, so the test process can see it ran."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        (self.folder / f"worker-{worker_id}").write_text(str(os.getpid()))


def failing_init(worker_id: int) -> None:
    raise RuntimeError(f"init failed in worker {worker_id}")


def tensors(n: int = 64, width: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, width, generator=g), torch.arange(n))


@pytest.fixture(autouse=True)
def worker_queues_end_with_the_test() -> Iterator[None]:
    """End the worker iterators a failing (xfail) test leaves behind now, not at a later GC.

    Its traceback (kept by pytest in ``sys.last_traceback``) holds torch's worker iterator, whose
    queue threads would otherwise end during some later test, upsetting its thread count.
    """
    yield
    sys.last_type = sys.last_value = sys.last_traceback = None
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.name == "QueueFeederThread" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> ImageFolder:
    return make_sample_image_folder(tmp_path_factory.mktemp("images"), num_images=6, num_classes=2, seed=3)


# Each of the loader's paths, as (dataset maker, gpuload-only options).
PATHS: dict[str, tuple[Callable[[], Dataset], dict[str, typing.Any]]] = {
    "arrays": (tensors, {}),
    "arrays-streamed": (tensors, {"cache": "off", "prefetch_depth": 2}),
    "generic": (Squares, {}),
    "generic-prefetcher": (Squares, {"prefetch_depth": 2}),
    "sample-cache": (Squares, {"cache": "host"}),
}


def make(
    path: str, loader_class: type = gpuload.DataLoader, dataset: Dataset | None = None, **options: typing.Any
) -> tud.DataLoader:
    """A shuffled loader of ``path`` (torch's class gets torch's arguments only)."""
    make_dataset, own = PATHS[path]
    if loader_class is gpuload.DataLoader:
        options = {**own, **options}
    dataset = make_dataset() if dataset is None else dataset
    return loader_class(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1), **options)


# ----------------------------------------------------------------- pickling


@pytest.mark.parametrize("path, epochs_before", [(p, e) for p in PATHS for e in (0, 2)])
def test_an_unpickled_loader_yields_the_same_batches(path: str, epochs_before: int) -> None:
    with make(path) as loader:
        for _ in range(epochs_before):
            list(loader)
        with pickle.loads(pickle.dumps(loader)) as clone:
            assert type(clone) is gpuload.DataLoader
            assert_same_epochs(clone, loader, epochs=2)


def test_torchs_loader_passes_the_same_pickling_check() -> None:
    """The check above is what torch's own loader does (so its xfails are gpuload's)."""
    loader = make("generic", TORCH_DATALOADER)
    list(loader)
    assert_same_epochs(pickle.loads(pickle.dumps(loader)), loader, epochs=2)


@pytest.mark.parametrize("epochs_before", [0, 1])
def test_an_unpickled_image_folder_loader_yields_the_same_batches(folder: ImageFolder, epochs_before: int) -> None:
    with gpuload.DataLoader(folder, batch_size=None, shuffle=True,
                            generator=torch.Generator().manual_seed(4)) as loader:
        for _ in range(epochs_before):
            list(loader)
        with pickle.loads(pickle.dumps(loader)) as clone:
            assert_same_epochs(clone, loader, epochs=1)


@pytest.mark.parametrize(
    "path",
    ["arrays", "arrays-streamed",
     "sample-cache"],
)
def test_pickling_carries_no_cache_or_staging_memory(path: str) -> None:
    """After epochs (device copy, pinned slots, sample cache filled) the pickle is no larger."""
    with make(path, dataset=tensors(4096, 16) if path.startswith("arrays") else Squares(2048)) as loader:
        fresh = len(pickle.dumps(loader))
        for _ in range(2):
            list(loader)
        assert len(pickle.dumps(loader)) <= fresh + 16 * 1024


# ----------------------------------------------------------------- the global swap

# Run in a child process: today the swap raises RecursionError, after which CPython 3.11 can
# no longer format tracebacks in that process ("AST constructor recursion depth mismatch"),
# which would crash pytest at the next failing test.
SWAP_CASES = {**{path: {} for path in PATHS}, "generic-workers": {"num_workers": 2}}


def check_swapped(case: str) -> str:
    """Under ``torch.utils.data.DataLoader = gpuload.DataLoader``: "ok" or the error, one line."""
    path = "generic" if case == "generic-workers" else case
    options = SWAP_CASES[case]
    saved = tud.DataLoader, tud.dataloader.DataLoader
    tud.DataLoader = tud.dataloader.DataLoader = gpuload.DataLoader
    try:
        assert_same_epochs(make(path, **options), make(path, TORCH_DATALOADER, **options), epochs=2)
    except Exception as error:  # noqa: BLE001 (reported to the parent test, by name)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        tud.DataLoader, tud.dataloader.DataLoader = saved
    return "ok"


_SWAP_CHILD = """
import importlib.util, json, sys
sys.path.insert(0, sys.argv[2])
spec = importlib.util.spec_from_file_location("test_dropin", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["test_dropin"] = module
spec.loader.exec_module(module)
print(json.dumps({case: module.check_swapped(case) for case in module.SWAP_CASES}))
"""


@pytest.fixture(scope="module")
def swapped_results() -> dict[str, str]:
    here = Path(__file__).resolve()
    done = subprocess.run(
        [sys.executable, "-c", _SWAP_CHILD, str(here), str(here.parent)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [c for c in SWAP_CASES])
def test_loaders_work_with_torchs_class_swapped_for_gpuloads(case: str, swapped_results: dict[str, str]) -> None:
    assert swapped_results[case] == "ok"


# ----------------------------------------------------------------- typing


def test_the_class_subscripts_like_torchs() -> None:
    alias = gpuload.DataLoader[list[torch.Tensor]]
    assert typing.get_origin(alias) is gpuload.DataLoader
    assert typing.get_args(alias) == (list[torch.Tensor],)
    assert isinstance(alias(tensors(), batch_size=8), gpuload.DataLoader)


# ----------------------------------------------------------------- worker processes


@pytest.mark.parametrize("path", [p for p in PATHS])
def test_the_iterator_lists_its_workers(path: str) -> None:
    """``iter(loader)._workers``, which torch's tests and some libraries read, is a list of processes."""
    with make(path, num_workers=2) as loader:
        it = iter(loader)
        next(it)
        workers = it._workers
        assert isinstance(workers, list)
        assert all(hasattr(w, "pid") and hasattr(w, "is_alive") for w in workers)
        if path.startswith("generic"):
            assert len(workers) == 2 and all(w.is_alive() for w in workers)


@pytest.mark.parametrize("path", PATHS)
def test_worker_init_fn_runs_once_per_worker_id(path: str, tmp_path: Path) -> None:
    with make(path, num_workers=2, worker_init_fn=RecordInit(tmp_path)) as loader:
        list(loader)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]


@pytest.mark.parametrize("path", PATHS)
def test_an_error_in_worker_init_fn_reaches_the_loop(path: str) -> None:
    with make(path, num_workers=2, worker_init_fn=failing_init) as loader:
        with pytest.raises(RuntimeError, match="init failed in worker"):
            list(loader)


def test_worker_init_fn_runs_for_an_image_folder(folder: ImageFolder, tmp_path: Path) -> None:
    with gpuload.DataLoader(folder, batch_size=None, num_workers=2, worker_init_fn=RecordInit(tmp_path)) as loader:
        list(loader)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]


# ----------------------------------------------------------------- errors name the sample

# How a generic dataset is read: in the loop (the CPU default), by the prefetcher's thread, by
# torch's workers (with and without the prefetcher), or through the sample cache.
READS = {
    "in-loop": {},
    "prefetcher": {"prefetch_depth": 2},
    "workers": {"num_workers": 2},
    "workers-prefetcher": {"num_workers": 2, "prefetch_depth": 2},
    "sample-cache": {"cache": "host"},
}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python >= 3.11")
@pytest.mark.parametrize("read", READS)
def test_a_dataset_error_keeps_its_type_and_message_and_names_the_index(read: str) -> None:
    with gpuload.DataLoader(Broken(), batch_size=4, **READS[read]) as loader:
        with pytest.raises(SampleError, match="cannot read this sample") as caught:
            list(loader)
    notes = getattr(caught.value, "__notes__", [])
    # In this process the note names the sample; torch's workers report only the exception, so
    # there it names the indices of the batch the sample was in.
    exact = rf"\bindex {Broken.BAD}\b"
    among = rf"\bindices \[[0-9, ]*\b{Broken.BAD}\b[0-9, ]*\]"
    assert any(re.search(among if "workers" in read else exact, note) for note in notes), notes


# ----------------------------------------------------------------- explicit caches of random datasets


def _random_warnings(loader: gpuload.DataLoader, epochs: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught, loader:
        warnings.simplefilter("always")
        for _ in range(epochs):
            list(loader)
    return [str(w.message) for w in caught if re.search("random", str(w.message), re.IGNORECASE)]


@pytest.mark.parametrize("cache", ["device", "host"])
def test_an_explicit_cache_of_a_random_dataset_warns_once_and_still_caches(cache: str) -> None:
    loader = gpuload.DataLoader(Noise(), batch_size=4, cache=cache, device="cpu")
    assert len(_random_warnings(loader, epochs=3)) == 1
    assert loader.stats.path.startswith("sample-cache")


@pytest.mark.parametrize("cache", ["device", "host"])
def test_an_explicit_cache_of_a_deterministic_dataset_does_not_warn(cache: str) -> None:
    loader = gpuload.DataLoader(Squares(), batch_size=4, cache=cache, device="cpu")
    assert _random_warnings(loader, epochs=2) == []
    assert loader.stats.path.startswith("sample-cache")
