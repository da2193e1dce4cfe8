"""Where a dataset's arrays are served from (gpuload/sources/placed_arrays.py): which datasets
qualify, the batch structure, and the errors of a closed or empty request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

from gpuload.cache.settings import CacheSettings
from gpuload.sources.placed_arrays import find_columns, raw_columns, staged_copier


def test_a_numpy_array_torch_cannot_wrap_is_not_served_as_columns() -> None:
    assert raw_columns(np.arange(10)[::-1]) is None  # negative strides
    assert raw_columns(np.arange(10))[0].tolist() == list(range(10))


@pytest.mark.parametrize(
    "collate",
    [
        lambda batch: [*default_collate(batch), torch.zeros(1)],  # another number of leaves
        lambda batch: [c.double() for c in default_collate(batch)],  # another dtype
        lambda batch: [c + 1 for c in default_collate(batch)],  # other values
        lambda batch: [c.view(1, 1, -1) for c in default_collate(batch)],  # another shape
    ],
)
def test_a_collate_fn_that_changes_the_rows_keeps_torchs_path(collate) -> None:
    data = TensorDataset(torch.arange(12.0).view(6, 2), torch.arange(6))
    assert find_columns(data, collate, batched=True) is None


def test_tuple_and_nested_batch_structures_are_rebuilt_as_the_collate_fn_gives_them() -> None:
    images, labels = torch.arange(12.0).view(6, 2), torch.arange(6)
    data = TensorDataset(images, labels)
    as_tuple = find_columns(data, lambda batch: tuple(default_collate(batch)), batched=True)
    built = as_tuple.build([images[:2], labels[:2]])
    assert type(built) is tuple and torch.equal(built[0], images[:2]) and torch.equal(built[1], labels[:2])
    nested = find_columns(data, lambda batch: {"x": tuple(default_collate(batch))}, batched=True)
    built = nested.build([images[:2], labels[:2]])
    assert list(built) == ["x"] and torch.equal(built["x"][1], labels[:2])


def test_served_in_place_on_the_cpu_and_a_closed_or_empty_request_fails_like_torch(tmp_path: Path) -> None:
    data = TensorDataset(torch.arange(12.0).view(6, 2), torch.arange(6))
    columns = find_columns(data, default_collate, batched=True)
    placed = columns.place(torch.device("cpu"), CacheSettings.resolve(environ={}, cwd=tmp_path), owner="test")
    assert placed.stats is None and not placed.copies_batches
    with pytest.raises(IndexError, match="list index out of range"):
        placed.checked_index([])
    batch, flat, moved = placed.gather([4, 1], batched=True)
    assert torch.equal(batch[1], torch.tensor([4, 1])) and flat.tolist() == [4, 1] and moved == 0
    placed.release()
    with pytest.raises(RuntimeError, match="this gpuload.DataLoader was closed"):
        placed.checked_index([0])
    with pytest.raises(RuntimeError, match="this gpuload.DataLoader was closed"):
        placed.gather([0], batched=True)
    assert staged_copier(None) is None
