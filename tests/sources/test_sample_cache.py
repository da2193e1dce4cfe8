"""The sample cache's glue (gpuload/sources/sample_cache.py): cache keys of index batches, the
bytes a prepared batch copies, and why a cache stays partial."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpuload
from gpuload.cache.columns import Branch, Column, Objects
from gpuload.sources.sample_cache import _column_bytes, _keys


def test_cache_keys_of_index_batches_are_int64_or_none_when_an_index_is_not_an_integer() -> None:
    assert _keys(torch.tensor([[1, 2], [3, 4]]), True).tolist() == [1, 2, 3, 4]
    assert _keys(torch.tensor([5, 6], dtype=torch.int32), True).tolist() == [5, 6]
    assert _keys([torch.tensor(2), np.int64(7), 3], True).tolist() == [2, 7, 3]
    assert _keys(np.int16(9), False).tolist() == [9]
    assert _keys(["a", 1], True) is None
    assert _keys([True, 1], True) is None


def test_the_bytes_of_a_prepared_batch_count_every_column_and_object() -> None:
    rows = torch.zeros(4, 3, dtype=torch.float32)
    column = Column("tensor", rows.dtype, rows)
    assert _column_bytes(column) == 48
    assert _column_bytes(Branch("tuple", None, [column, Column("tensor", torch.int64, torch.zeros(4, dtype=torch.int64))])) == 80
    assert _column_bytes(Objects([torch.zeros(2, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)])) == 5


class _Opaque:
    """A sample type gpuload cannot copy."""


OPAQUE = _Opaque()  # one object: two reads of a sample are the same, so it does not look random


class _Mixed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.full((2,), i), OPAQUE


def test_a_cache_of_samples_it_cannot_copy_says_so() -> None:
    loader = gpuload.DataLoader(_Mixed(), batch_size=4, cache="host", collate_fn=lambda batch: batch)
    with pytest.warns(UserWarning, match="8 samples are of types gpuload cannot copy"):
        for _ in range(2):
            list(loader)
    loader.close()
