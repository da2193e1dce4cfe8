"""Free and total bytes of a memory pool, and the host's reading: free of torch, so that
``gpuload doctor`` and the cache's budget arithmetic use them without importing it.
:mod:`gpuload.device` re-exports both and reads a GPU's."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["MemoryInfo", "host_memory"]


@dataclass(frozen=True)
class MemoryInfo:
    """Free and total bytes of one memory pool (a GPU, or host RAM).

    ``torch_cached`` (GPUs only) is what torch's caching allocator holds without using it; it
    is reported, and is not part of ``free`` (see :func:`gpuload.device.device_memory`).
    """

    free: int
    total: int
    torch_cached: int = 0

    @property
    def free_to_torch(self) -> int:
        """What a torch allocation in this process can get now: the driver's free memory plus
        the blocks torch's caching allocator holds unused (a failed step's activations, just
        released, sit there; they are not the driver's to report)."""
        return self.free + self.torch_cached


def host_memory() -> MemoryInfo:
    """Available and total host RAM, from /proc/meminfo where it exists."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            fields = {
                line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo if ":" in line
            }
        return MemoryInfo(free=fields["MemAvailable"], total=fields["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(
            free=page * os.sysconf("SC_AVPHYS_PAGES"), total=page * os.sysconf("SC_PHYS_PAGES")
        )
