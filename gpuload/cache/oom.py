"""Running out of memory, told apart from every other error, and the warning a cache gives
when it falls back to the next tier because of it."""

from __future__ import annotations

import torch

__all__ = ["CacheFallbackWarning", "is_oom"]


class CacheFallbackWarning(UserWarning):
    """A cache tier could not be allocated and its samples went to the next tier."""


def is_oom(error: BaseException) -> bool:
    """True for an out-of-memory error (device or host), never for a CUDA fault or bad data."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate" in text)
