"""Moving a batch, whatever its nesting, to a device while keeping its structure and types;
and the :class:`Staging`, the route small per-batch host tensors reach the device by.

Every per-batch host-to-device copy goes through one path: the loader's prefetcher (its pinned
slots and side stream, ``Prefetcher.copy_now``), its :class:`Staging`. The loader hands it to
its source (``Setup.staging``) and to each epoch (``gpuload.epoch.Epoch.staging``); every call
of :func:`to_device` and :func:`move_staged` names the staging it copies through, whether
handed down as an argument or held by the object that was built with it (a cache store, a
source). None (outside a loader: a transform called by hand, a cache filled by ``warm()``):
the tensors go in one non-blocking copy from a pinned buffer on the current stream. Either way
no copy waits for the stream (a copy from pageable memory would: a host sync every batch).
"""

from __future__ import annotations

import collections.abc
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "map_leaves", "move_to_device", "move_staged", "batch_nbytes", "batch_length", "to_device", "Staging",
    "pack", "unpack", "pinned_host_copies",
]

_ALIGN = 16  # bytes: every dtype's view of a packed buffer stays aligned


@dataclass(frozen=True)
class Staging:
    """One epoch's route to the device for the host tensors a batch needs on the way: ``copy``
    is a prefetcher's ``copy_now`` (``Prefetcher.staging``): its own pinned slots, its side
    stream, and an event the caller's current stream waits for (no host sync); the tensors come
    back protected on that stream. The bytes are not counted as batch data."""

    copy: Callable[[Any], Any]


_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})  # leaves map_leaves passes as they are


def map_leaves(data: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``data`` with ``fn`` applied to every tensor (or ``is_leaf`` object); containers keep types.

    Walks a batch the way torch's ``pin_memory`` does (mappings, namedtuples, sequences), except
    that tuples stay tuples. Other leaves (strings, numbers, None) pass through unchanged; a
    tuple's or list's plain items (exactly str, bytes, int, float, bool or None, such as a
    batch's list of names) without a call each, nor a question to ``is_leaf``.
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
        mapping_type: Any = type(data)  # a Mapping subclass, rebuilt from a dict as torch's collate does
        try:
            return mapping_type(mapped)
        except TypeError:
            return mapped
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(map_leaves(value, fn, is_leaf) for value in data))
    if isinstance(data, tuple):
        return tuple([value if type(value) in _PLAIN else map_leaves(value, fn, is_leaf) for value in data])
    if isinstance(data, collections.abc.Sequence):
        items = [value if type(value) in _PLAIN else map_leaves(value, fn, is_leaf) for value in data]
        sequence_type: Any = type(data)  # a Sequence subclass, rebuilt from a list as torch's collate does
        try:
            return sequence_type(items)
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
    # The usual batch (a tensor first in a list, tuple or dict) is told without the walk.
    first = data[0] if type(data) in (list, tuple) and data else (
        next(iter(data.values())) if type(data) is dict and data else data)
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return first.size(0)
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


def to_device(
    tensors: Sequence[torch.Tensor], device: torch.device, staging: Staging | None, keep_layout: bool = False,
) -> list[torch.Tensor]:
    """``tensors`` (host or already on ``device``) on ``device``.

    On a device the host tensors go through ``staging`` (the loader's), or, without one
    (outside a loader), one non-blocking copy from a buffer (pinned on CUDA) on the current
    stream; the results are ready on the current stream and protected on it, contiguous, or
    with their dimensions in the host tensors' order in memory when ``keep_layout`` (an HWC
    image viewed as CHW stays channels-last). On the CPU they are the tensors themselves.
    """
    if device.type == "cpu":
        return [t.to(device) for t in tensors]
    if all(t.device == device for t in tensors):
        return list(tensors)
    orders = [_memory_order(t) if keep_layout and t.device.type == "cpu" else None for t in tensors]
    tensors = [t if order is None else t.permute(order) for t, order in zip(tensors, orders)]
    if staging is not None:
        moved = list(staging.copy(list(tensors)))
    else:
        host = [t for t in tensors if t.device.type == "cpu"]
        buffer, offsets = pack(host, pin_memory=device.type == "cuda")
        copied = iter(unpack(buffer.to(device, non_blocking=True), offsets, host))
        moved = [next(copied) if t.device.type == "cpu" else t.to(device, non_blocking=True) for t in tensors]
    return [t if order is None else t.permute(_inverse(order)) for t, order in zip(moved, orders)]


def pinned_host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (host ones are returned as they are), each in pinned memory
    with its dimensions laid out as on the device, enqueued on the current stream without
    waiting for it: record an event after this call and wait for it (or query it) before
    reading them."""
    copies = []
    for t in tensors:
        if t.device.type == "cpu":
            copies.append(t)
            continue
        order = _memory_order(t)
        source = t if order is None else t.permute(order)
        host = torch.empty(source.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(source, non_blocking=True)
        copies.append(host if order is None else host.permute(_inverse(order)))
    return copies


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The permutation of ``t``'s dimensions that is contiguous in memory (None: the identity,
    or no permutation is: such a tensor is copied contiguous)."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    if order == list(range(t.dim())) or not t.permute(order).is_contiguous():
        return None
    return order


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return inverse


def move_staged(data: Any, device: torch.device, staging: Staging | None) -> Any:
    """``data`` (any nesting) with every tensor on ``device``, the host ones in one copy through
    ``staging`` (:func:`to_device`), each keeping its layout (as ``.to(device)`` does)."""
    leaves: list[torch.Tensor] = []
    map_leaves(data, leaves.append)
    moved = iter(to_device(leaves, device, staging, keep_layout=True))
    return map_leaves(data, lambda tensor: next(moved))


def pack(tensors: Sequence[torch.Tensor], pin_memory: bool = False) -> tuple[torch.Tensor, list[int]]:
    """One uint8 host buffer holding ``tensors`` one after another (aligned), and their offsets."""
    offsets: list[int] = []
    total = 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin_memory)
    for t, offset in zip(tensors, offsets):
        _view(buffer, offset, t).copy_(t)
    return buffer, offsets


def unpack(buffer: torch.Tensor, offsets: Sequence[int], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors ``pack`` put in ``buffer`` (or a copy of it), as views of it."""
    return [_view(buffer, offset, t) for t, offset in zip(like, offsets)]


def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return buffer[offset : offset + nbytes].view(like.dtype).view(like.shape)
