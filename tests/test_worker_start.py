"""A forked worker never collects its parent's garbage: the parent's unreachable objects are
frozen out of the workers' collections while they start (a released gloo process group,
destroyed in a worker, waited there for threads it does not have: the worker hung for good)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import gpuload
from gpuload.cache.columns import column_rows
from gpuload.sources.torch_fetch import read_prepared


class _LeftUnreachable:
    """Kept only by its own cycle until a collection; says where it was collected."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.parent, self.cycle = folder, os.getpid(), self

    def __del__(self) -> None:
        where = "parent" if os.getpid() == self.parent else "worker"
        (self.folder / f"collected-in-{where}").touch()


class _Collecting(tud.Dataset):
    """Each read collects garbage, as a worker's allocations make Python do on their own."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        gc.collect()
        return torch.tensor(index)


def _loader(cache: str) -> Callable[[tud.Dataset], list[Any]]:
    def read(data: tud.Dataset) -> list[Any]:
        with gpuload.DataLoader(data, batch_size=2, num_workers=1, multiprocessing_context="fork",
                                cache=cache) as loader:
            return [batch.tolist() for batch in loader]
    return read


def _read_prepared(data: tud.Dataset) -> list[Any]:
    with read_prepared(data, [[0, 1], [2, 3]], 1, {"multiprocessing_context": "fork"}) as parts:
        return [column_rows(part)[0].tolist() for part in parts]


@pytest.mark.parametrize("read", [_loader("off"), _loader("auto"), _read_prepared],
                         ids=["the loader's torch epoch", "the loader filling its cache", "a share read by workers"])
def test_a_forked_worker_leaves_what_its_parent_left_unreachable_to_the_parent(tmp_path, read):
    gc.disable()  # so that it is still there, unreachable, when the worker forks
    try:
        _LeftUnreachable(tmp_path)
        batches = read(_Collecting())
    finally:
        gc.enable()
    gc.collect()
    assert batches == [[0, 1], [2, 3]]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["collected-in-parent"]


def test_a_heap_the_user_froze_stays_frozen_as_they_left_it():
    """Users freeze their heap before forking workers (Python's recipe against copy-on-write):
    starting gpuload's workers must not thaw it."""
    gc.freeze()
    try:
        assert _loader("off")(_Collecting()) == [[0, 1], [2, 3]]
        assert gc.get_freeze_count() > 0  # thawed: 0 (objects freed meanwhile leave it a little lower)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
