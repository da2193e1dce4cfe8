"""Comparing what gpuload's and torch's loaders yield: same values, same types, same order."""

from __future__ import annotations

import collections.abc
from typing import Any

import numpy as np
import torch


def assert_same(ours: Any, theirs: Any, where: str = "batch") -> None:
    """Recursively assert equal structure, container types, dtypes and values."""
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} != {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{where}: shape {ours.shape} != {theirs.shape}"
        assert torch.equal(ours.cpu(), theirs.cpu()), f"{where}: values differ"
    elif isinstance(theirs, np.ndarray):
        np.testing.assert_array_equal(ours, theirs)
    elif isinstance(theirs, collections.abc.Mapping):
        assert list(ours.keys()) == list(theirs.keys()), f"{where}: keys differ"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{where}: length {len(ours)} != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def assert_same_epochs(ours: Any, theirs: Any, epochs: int = 2, before_epoch=None) -> None:
    """Iterate both loaders for ``epochs`` epochs and compare every batch."""
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(epoch)
        our_batches = list(ours)
        their_batches = list(theirs)
        assert len(our_batches) == len(their_batches), (
            f"epoch {epoch}: {len(our_batches)} batches != {len(their_batches)}"
        )
        for i, (a, b) in enumerate(zip(our_batches, their_batches)):
            assert_same(a, b, f"epoch {epoch} batch {i}")
