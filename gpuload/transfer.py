"""Moving a batch, whatever its nesting, to a device while keeping its structure and types."""

from __future__ import annotations

import collections.abc
import copy
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_leaves", "move_to_device", "batch_nbytes", "batch_length"]


def map_leaves(data: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``data`` with ``fn`` applied to every tensor (or ``is_leaf`` object); containers keep types.

    Walks a batch the way torch's ``pin_memory`` does (mappings, namedtuples, sequences), except
    that tuples stay tuples. Other leaves (strings, numbers, None) pass through unchanged.
    """
    if isinstance(data, torch.Tensor) or (is_leaf is not None and is_leaf(data)):
        return fn(data)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        mapped = {key: map_leaves(value, fn, is_leaf) for key, value in data.items()}
        if isinstance(data, collections.abc.MutableMapping):
            clone = copy.copy(data)
            clone.update(mapped)
            return clone
        try:
            return type(data)(mapped)
        except TypeError:
            return mapped
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(map_leaves(value, fn, is_leaf) for value in data))
    if isinstance(data, tuple):
        return tuple(map_leaves(value, fn, is_leaf) for value in data)
    if isinstance(data, collections.abc.Sequence):
        items = [map_leaves(value, fn, is_leaf) for value in data]
        try:
            return type(data)(items)
        except TypeError:
            return items
    return data


def move_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Return ``data`` with every tensor on ``device``: the batch differs only in where it lives."""
    return map_leaves(data, lambda tensor: tensor.to(device, non_blocking=non_blocking))


def _tensors(data: Any):
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, (str, bytes)):
        return
    elif isinstance(data, collections.abc.Mapping):
        for value in data.values():
            yield from _tensors(value)
    elif isinstance(data, collections.abc.Sequence):
        for value in data:
            yield from _tensors(value)


def batch_nbytes(data: Any, host_only: bool = False) -> int:
    """Bytes held by all tensors in a (nested) batch, or only by those on the CPU."""
    return sum(t.numel() * t.element_size() for t in _tensors(data) if not host_only or t.device.type == "cpu")


def batch_length(data: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor that has one, else its len().

    A 0-d leaf (a step counter, a loss scale) says nothing about the batch, so it is passed over.
    """
    scalars_only = False
    for tensor in _tensors(data):
        if tensor.dim() > 0:
            return tensor.size(0)  # size(): nested tensors have no .shape
        scalars_only = True
    if scalars_only:
        return 1
    if isinstance(data, collections.abc.Sized) and not isinstance(data, (str, bytes)):
        return len(data)
    return 1
