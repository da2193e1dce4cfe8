"""Small per-batch host tensors (parameter tables, constants) put on the device with no host sync.

The transforms' name for :func:`gpuload.transfer.to_device`: inside a loader the tensors go
through its one staging path (the prefetcher's pinned slots and side stream); called by hand,
in one non-blocking copy from a pinned buffer on the current stream.
"""

from __future__ import annotations

from gpuload.transfer import pack, to_device, unpack

__all__ = ["to_device", "pack", "unpack"]
