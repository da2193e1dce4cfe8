"""Decode failures: a bad file (:class:`ImageDecodeError`) or a failing device (:class:`DecodeDeviceError`).

The two must never be confused. A bad file is named and, with ``on_error="skip"``, skipped; an
out-of-memory or CUDA error says nothing about the file and is raised as it is, whatever
``on_error`` says, so that a job short of GPU memory is not silently turned into a job that
decodes on the CPU, or one that skips every image.

DALI and torchvision's nvJPEG raise plain ``RuntimeError`` for both, so
:func:`is_device_failure` classifies their messages by text. The phrases are the ones their
sources print:

- DALI ``CUDABadAlloc``: "CUDA allocation failed", "Can't allocate N bytes on device D." (and
  "... on host.");
- DALI ``CUDAError``: "CUDA runtime API error cudaErrorX (n)", "CUDA driver API error CUDA_ERROR_X (n)";
- nvJPEG through DALI: ``NVJPEG error "5" : NVJPEG_STATUS_ALLOCATOR_FAILURE`` (also ``ARCH_MISMATCH``);
- nvImageCodec through DALI: "nvImageCodec failure: '#5'" (allocator failure) or '#7'
  (architecture mismatch);
- torch (the output allocation inside torchvision's call): "CUDA out of memory", "CUDA error: ...";
- torchvision's nvJPEG wrapper: "Failed to synchronize CUDA stream: n", and nvJPEG status 5
  (allocator failure) or 7 (architecture mismatch) after "Failed to ...: ".

nvJPEG's ``EXECUTION_FAILED`` (6) and ``INTERNAL_ERROR`` (8) are also reported for corrupt
streams, so they stay file errors: a device that is really broken fails the next batch with one
of the phrases above.
"""

from __future__ import annotations

import re

__all__ = ["ImageDecodeError", "DecodeDeviceError", "is_device_failure"]


class ImageDecodeError(RuntimeError):
    """A sample's image could not be read or decoded.

    ``index`` is the sample index in the dataset, ``name`` the file (or whatever names the
    sample), ``backend`` what tried (``"read"`` when the file could not even be read) and
    ``reason`` the underlying error.
    """

    def __init__(self, index: int, name: str, backend: str, reason: str, others: int = 0) -> None:
        self.index, self.name, self.backend, self.reason = index, name, backend, reason
        more = f" ({others} more sample(s) in this batch failed too)" if others else ""
        verb = "read" if backend == "read" else f"decode (backend {backend})"
        super().__init__(
            f"could not {verb} image {name!r}, sample index {index}: {reason}{more}. Check or "
            "remove the file, or pass on_error='skip' to skip bad samples and count them"
        )


class DecodeDeviceError(RuntimeError):
    """The decoder's device failed (out of memory, a CUDA error): no file is to blame.

    Raised whatever ``on_error`` says. ``backend`` is the decoder, ``reason`` what it said,
    ``out_of_memory`` whether it ran out of memory (then a smaller batch, a smaller
    ``cache_size`` or a larger ``cache_reserve`` helps).
    """

    def __init__(self, backend: str, reason: str, names: list[str] | None = None) -> None:
        self.backend, self.reason = backend, reason
        self.out_of_memory = bool(_OUT_OF_MEMORY.search(reason))
        batch = f" while decoding a batch of {len(names)} starting with {names[0]!r}" if names else ""
        advice = (
            "The device ran out of memory: decode smaller batches, or leave more memory free "
            "(a smaller cache_size, a larger cache_reserve)"
            if self.out_of_memory
            else "This is a device error, not a bad file; the CUDA context may be unusable"
        )
        super().__init__(f"decoder {backend} failed{batch}: {reason}. {advice}")


_OUT_OF_MEMORY = re.compile(
    r"out of memory|CUDA allocation failed|Can't allocate \d+ bytes|ALLOCATOR_FAILURE"
    r"|nvImageCodec (failure: '#5'|status 5)|Failed to [^:]*: 5\b",
    re.IGNORECASE,
)
_DEVICE = re.compile(
    r"CUDA (runtime|driver) API error|CUDA error|cudaError|CUDA_ERROR_|ARCH_MISMATCH"
    r"|Failed to synchronize CUDA stream|nvImageCodec (failure: '#7'|status 7)|Failed to [^:]*: 7\b",
)


def is_device_failure(message: str) -> bool:
    """True when a decoder's error message is an out-of-memory or CUDA failure, not a bad file."""
    return bool(_OUT_OF_MEMORY.search(message) or _DEVICE.search(message))
