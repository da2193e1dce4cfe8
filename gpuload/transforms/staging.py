"""Small per-batch host tensors (parameter tables, constants) put on the device with no host sync.

A blocking ``.to(device)`` from pageable memory waits for the stream: every batch, the CPU
would wait for the training step queued before it. Here the tensors are packed into one pinned
buffer and copied with one non-blocking copy on the current stream, which the kernels and torch
ops that read them run on.

The pinned buffer is allocated per batch from torch's pinned caching allocator rather than kept
in a ring guarded by our own events: a non-blocking copy from a pinned block records an event on
the copy's stream, and the allocator hands that block out again only once the event completed.
So the buffer may be dropped right after the copy, blocks are reused across batches without a
host wait in the common case, and it is safe from any thread (the loop's and the prefetcher's
both transform batches) without a lock of ours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device", "pack", "unpack"]

_ALIGN = 16  # bytes: every dtype's view of the packed buffer stays aligned


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (on the CPU) as tensors on ``device``, in one non-blocking copy on CUDA.

    The results are contiguous views of one device buffer, ordered on the current stream; on a
    non-CUDA device they are the tensors moved there as usual (no copy when already there).
    """
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    host, offsets = pack(tensors, pin_memory=True)
    return unpack(host.to(device, non_blocking=True), offsets, tensors)


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
