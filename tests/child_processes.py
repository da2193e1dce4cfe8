"""The environment of a test's child process: gpuload importable from this checkout, and the disk
tier's budget named. conftest's pretended disk space does not reach a child, which reads the real
disk, and ``disk_cache_size='auto'`` on a disk with under 8 GiB free is no tier at all (CI's
disk once torch is installed)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD_DISK_CACHE_SIZE = "4GiB"  # far above what a test fills (a few MiB)


def child_environment() -> dict[str, str]:
    """``os.environ`` with this checkout on ``PYTHONPATH`` and ``GPULOAD_DISK_CACHE_SIZE`` set."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "GPULOAD_DISK_CACHE_SIZE": CHILD_DISK_CACHE_SIZE}
