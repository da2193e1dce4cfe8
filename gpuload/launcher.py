"""Which CUDA device ``device=None`` means under a launcher (torchrun's ``LOCAL_RANK``), as
plain arithmetic free of torch: :mod:`gpuload.device` asks it with torch's current device and
count, ``gpuload doctor`` with the driver's count."""

from __future__ import annotations

__all__ = ["DeviceError", "default_cuda_index"]


class DeviceError(ValueError):
    """A requested device does not exist or cannot be used."""


def default_cuda_index(device: object, current: int, count: int, local_rank: str | None) -> int:
    """The CUDA device a ``device=`` without an index means, given the process's current device,
    the visible device count and ``LOCAL_RANK`` (None when unset).

    Under torchrun every rank's current device is cuda:0 until the job calls
    ``torch.cuda.set_device``; taking it would put every rank on one GPU (NCCL then fails
    with a duplicate-GPU error), so ``LOCAL_RANK`` decides while the current device is still
    cuda:0. A process that sees one GPU (a launcher that sets ``CUDA_VISIBLE_DEVICES`` per
    rank) has only cuda:0 to take.
    """
    if current != 0 or local_rank is None:
        return current
    if count == 1:
        return 0
    try:
        index = int(local_rank)
    except ValueError:
        index = -1
    if not 0 <= index < count:
        raise DeviceError(
            f"device={device!r} means cuda:$LOCAL_RANK under a launcher, but LOCAL_RANK={local_rank!r} "
            f"is not a CUDA device of this machine ({count} devices, cuda:0 to cuda:{count - 1}); "
            "pass device='cuda:N', or call torch.cuda.set_device(N) first"
        )
    return index
