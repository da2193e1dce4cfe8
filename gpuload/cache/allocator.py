"""The device memory torch's CUDA caching allocator takes for one tensor, as a cache counts it.

A cache that keeps one tensor per item (a decoded image) pays more than the tensors' bytes:
the allocator rounds each request up to 512 bytes, carves requests of up to 1 MiB from
2 MiB segments and larger ones below 10 MiB from 20 MiB segments (over 10 MiB: a segment of
its own, rounded to 2 MiB), and a segment's tail too small for the next request is lost
(c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, kSmallSize, kSmallBuffer, kLargeBuffer,
kMinLargeAlloc, kRoundLarge). For ImageNet images decoded at their own size (3 x ~400 x ~350
uint8, 420,000 bytes) four fit a 2 MiB segment: 524,288 bytes each, 25% over their size.
:func:`reserved_bytes` is a tensor's share of its segments when the items are of similar
sizes, the usual case for one dataset (items of mixed sizes fill some tails: a little less);
with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the tails are smaller still. So the
budget, the ledger and a shrink count what the device really gives up, not less.
"""

from __future__ import annotations

__all__ = ["reserved_bytes"]

_BLOCK = 512  # kMinBlockSize: every request is rounded up to it
_SMALL = 1 << 20  # kSmallSize: requests up to it come from the small pool
_SMALL_SEGMENT = 2 << 20  # kSmallBuffer
_LARGE_SEGMENT = 20 << 20  # kLargeBuffer: the segment of a large request below kMinLargeAlloc
_OWN_SEGMENT = 10 << 20  # kMinLargeAlloc: from here a request gets a segment of its own
_ROUND_LARGE = 2 << 20  # kRoundLarge: such a segment's granularity


def reserved_bytes(nbytes: int) -> int:
    """Device bytes a tensor of ``nbytes`` takes from torch's CUDA caching allocator: its
    rounded block and its share of the segment tail that items of its size leave unused."""
    if nbytes <= 0:
        return 0
    block = -(-nbytes // _BLOCK) * _BLOCK
    if block >= _OWN_SEGMENT:
        return -(-block // _ROUND_LARGE) * _ROUND_LARGE
    segment = _SMALL_SEGMENT if block <= _SMALL else _LARGE_SEGMENT
    return -(-segment // (segment // block))
