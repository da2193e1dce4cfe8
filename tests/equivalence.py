"""Comparing what gpuload's and torch's loaders yield: same values, same types, same order."""

from __future__ import annotations

import collections.abc
from typing import Any

import numpy as np
import torch


def assert_same(ours: Any, theirs: Any, where: str = "batch", exact: bool = False) -> None:
    """Recursively assert equal structure, container types, dtypes and values. ``exact``: also
    numpy arrays' and scalars' dtypes and shapes, and tensors' ``requires_grad``."""
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} != {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{where}: shape {ours.shape} != {theirs.shape}"
        assert not exact or ours.requires_grad == theirs.requires_grad, f"{where}: requires_grad differs"
        ours, theirs = ours.detach().cpu(), theirs.detach().cpu()
        if theirs.is_floating_point():  # NaN where torch's batch has NaN (a null read by datasets)
            assert torch.equal(ours.isnan(), theirs.isnan()), f"{where}: NaNs differ"
            ours, theirs = ours.nan_to_num(0.0, float("inf"), float("-inf")), theirs.nan_to_num(0.0, float("inf"),
                                                                                                float("-inf"))
        assert torch.equal(ours, theirs), f"{where}: values differ"
    elif exact and isinstance(theirs, (np.ndarray, np.generic)):
        assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} != {theirs.dtype}"
        assert np.shape(ours) == np.shape(theirs), f"{where}: shape {np.shape(ours)} != {np.shape(theirs)}"
        assert np.array_equal(ours, theirs), f"{where}: values differ"
    elif isinstance(theirs, np.ndarray):
        np.testing.assert_array_equal(ours, theirs)
    elif isinstance(theirs, collections.abc.Mapping):
        if exact:  # a subclass's own state: a defaultdict's factory, attributes
            assert getattr(ours, "default_factory", None) == getattr(theirs, "default_factory", None), where
            assert getattr(ours, "__dict__", None) == getattr(theirs, "__dict__", None), f"{where}: attributes differ"
        assert list(ours.keys()) == list(theirs.keys()), f"{where}: keys differ"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]", exact)
    elif isinstance(theirs, (list, tuple)):
        if exact:
            assert getattr(ours, "__dict__", None) == getattr(theirs, "__dict__", None), f"{where}: attributes differ"
        assert len(ours) == len(theirs), f"{where}: length {len(ours)} != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{where}[{i}]", exact)
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


def assert_resumes_exactly(make: Any, batches: int, epochs: int = 2) -> None:
    """A loader from ``make()`` saved after ``batches`` batches, and one made anew that loads the
    state, yield together exactly what one loader yields in ``epochs`` epochs."""
    straight = make()
    whole = [batch for _ in range(epochs) for batch in straight]
    first = make()
    iterator = iter(first)
    seen = [next(iterator) for _ in range(batches)]
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [batch for _ in range(epochs) for batch in resumed]  # the rest of the first epoch, then the others
    assert_same(seen + rest, whole)
