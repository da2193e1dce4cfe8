"""The one module that probes CUDA: which device, how much memory is free, streams.

Everything else in gpuload asks here instead of calling ``torch.cuda`` directly, so that a
machine without a GPU takes one code path and tests can pretend any card size.
"""

from __future__ import annotations

import os

import torch

from gpuload.launcher import DeviceError, default_cuda_index
from gpuload.memory import MemoryInfo, host_memory

__all__ = [
    "DeviceError",
    "MemoryInfo",
    "cuda_available",
    "resolve_device",
    "device_memory",
    "host_memory",
    "new_side_stream",
]


def cuda_available() -> bool:
    """True when torch sees at least one usable CUDA device."""
    return torch.cuda.is_available()


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """Turn the user's ``device=`` into a concrete ``torch.device``, or raise a clear error.

    ``None`` means, when CUDA is available: the current CUDA device if the process chose one
    (``torch.cuda.set_device``), else ``cuda:$LOCAL_RANK`` when the launcher (torchrun, SLURM
    wrappers) set ``LOCAL_RANK``, else cuda:0; without CUDA, the CPU. ``cuda`` without an
    index is the same choice. A CUDA device that this machine does not have raises
    :class:`DeviceError` saying what exists.
    """
    if device is None:
        if cuda_available():
            return torch.device("cuda", _default_cuda_index(device))
        return torch.device("cpu")
    resolved = _as_torch_device(device)
    if resolved.type == "cuda":
        if not cuda_available():
            raise DeviceError(
                f"device={str(device)!r} was requested but CUDA is not available on this machine "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                "pass device='cpu' or leave device unset to use the CPU"
            )
        count = torch.cuda.device_count()
        index = _default_cuda_index(device) if resolved.index is None else resolved.index
        if not 0 <= index < count:
            raise DeviceError(
                f"device={str(device)!r} does not exist: this machine has {count} CUDA "
                f"device(s), cuda:0 to cuda:{count - 1}"
            )
        return torch.device("cuda", index)
    if resolved.type != "cpu":
        raise DeviceError(
            f"device={str(device)!r} is not supported: gpuload runs on 'cuda' or 'cpu'"
        )
    return resolved


def _default_cuda_index(device: object) -> int:
    """The CUDA device a ``device=`` without an index means (see :func:`resolve_device`)."""
    return default_cuda_index(device, torch.cuda.current_device(), torch.cuda.device_count(),
                              os.environ.get("LOCAL_RANK"))


def _as_torch_device(device: object) -> torch.device:
    """``device`` as a torch.device, or a DeviceError naming the setting and what it accepts."""
    accepted = (
        "pass 'cuda', 'cuda:N', an int N >= 0 (the CUDA device N), 'cpu', a torch.device, or None "
        "(the current CUDA device when there is one, else the CPU)"
    )
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise DeviceError(f"device={device!r} is a {type(device).__name__}, not a device; {accepted}")
    if isinstance(device, int) and device < 0:
        raise DeviceError(f"device={device!r} is a negative device index; {accepted}")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise DeviceError(f"device={device!r} is not a device ({error}); {accepted}") from None


def device_memory(device: torch.device) -> MemoryInfo:
    """Free and total memory of a CUDA device: ``free`` is what the driver reports free
    (``cudaMemGetInfo``; other processes' use counts against it).

    Memory that torch's caching allocator has reserved but not allocated is *not* free for the
    cache budget: between two training steps that is mostly the step's activations and
    workspaces, freed back to torch's pool at the end of one step and taken again by the next.
    Counting it as free at an epoch start would let a cache grow into the model's working set
    and make the next step run out of memory. It is reported as ``torch_cached``; a job that
    wants it counted can call ``torch.cuda.empty_cache()`` first, which gives it back to the
    driver. A cache deciding what it may keep counts it (``MemoryInfo.free_to_torch``): its own
    shrinks leave their bytes there.
    """
    if device.type != "cuda":
        raise DeviceError(f"{device} has no device memory of its own; ask host_memory()")
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return MemoryInfo(free=int(free), total=int(total), torch_cached=max(0, int(cached)))


def usable_cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and taskset set)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS)
        return max(1, os.cpu_count() or 1)


def new_side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A new CUDA stream on ``device`` for copies, or None on the CPU (no streams there)."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)
