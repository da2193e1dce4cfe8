"""A disk that fills up, for the disk tier's tests: a write function that works a few times, then
raises what a full disk raises (``ENOSPC``)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any


def filling_up(write: Callable[..., Any], calls_allowed: int) -> Callable[..., Any]:
    """``write`` for its first ``calls_allowed`` calls; from the next on, ``OSError(ENOSPC)``."""
    calls = 0

    def write_until_full(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > calls_allowed:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(*args)

    return write_until_full
