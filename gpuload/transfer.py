"""Moving a batch, whatever its nesting, to a device while keeping its structure and types."""

from __future__ import annotations

import collections.abc
import copy
from typing import Any

import torch

__all__ = ["move_to_device", "batch_nbytes", "batch_length"]


def move_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Return ``data`` with every tensor on ``device``; containers keep their types.

    Mirrors how torch's ``pin_memory`` walks a batch (mappings, namedtuples, sequences), except
    that tuples stay tuples: the batch differs from torch's only in where its tensors live.
    Non-tensor leaves (strings, numbers, None) pass through unchanged.
    """
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        moved = {key: move_to_device(value, device, non_blocking) for key, value in data.items()}
        if isinstance(data, collections.abc.MutableMapping):
            clone = copy.copy(data)
            clone.update(moved)
            return clone
        try:
            return type(data)(moved)
        except TypeError:
            return moved
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(move_to_device(value, device, non_blocking) for value in data))
    if isinstance(data, tuple):
        return tuple(move_to_device(value, device, non_blocking) for value in data)
    if isinstance(data, collections.abc.Sequence):
        moved_items = [move_to_device(value, device, non_blocking) for value in data]
        try:
            return type(data)(moved_items)
        except TypeError:
            return moved_items
    return data


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


def batch_nbytes(data: Any) -> int:
    """Bytes held by all tensors in a (nested) batch."""
    return sum(t.numel() * t.element_size() for t in _tensors(data))


def batch_length(data: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor, else its len()."""
    for tensor in _tensors(data):
        return tensor.shape[0] if tensor.dim() > 0 else 1
    if isinstance(data, collections.abc.Sized) and not isinstance(data, (str, bytes)):
        return len(data)
    return 1
