"""The disk tier's file operations: durable writes (write, fsync, rename, fsync the folder),
whole writes at an offset, room reserved up front, the checksums of a block's stripes."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import xxhash


def dangling_link(folder: Path) -> Path | None:
    """The symbolic link on the way to ``folder`` (itself or a folder above it) whose target
    does not exist, if any."""
    for path in (folder, *folder.parents):
        if path.is_symlink():
            return None if path.exists() else path
        if path.exists():
            return None
    return None


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name: write, fsync, rename, fsync the folder."""
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            pwrite_all(fd, memoryview(data), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def fsync_folder(path: Path) -> None:
    """Make the folder's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` at ``offset`` (``os.pwrite`` may write less)."""
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes now, so a full disk shows at the block's start, not halfway."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)



STRIPE_BYTES = 64 << 10
"""Bytes of one stripe: a block's data is checked a stripe at a time, the first time a read
touches it, against the stripe's checksum in the block's trailer (part of the format)."""

_SUM = np.dtype("<u8")


def checksum(data: np.ndarray | bytes) -> int:
    """The 64-bit xxHash (XXH3) of ``data``'s bytes: a 64 MiB block in 11-15 ms on a 2-core
    machine, zlib's CRC-32 in 62-68 ms, so checking what a read touches costs about a copy of it."""
    return xxhash.xxh3_64_intdigest(memoryview(data))  # type: ignore[arg-type]  # numpy stubs: no __buffer__ before 3.12


def trailer_bytes(size: int) -> int:
    """Bytes of the stripe checksums after ``size`` bytes of data: one uint64 a stripe."""
    return -(-size // STRIPE_BYTES) * _SUM.itemsize


def stripe_sums(data: np.ndarray) -> np.ndarray:
    """The checksum of each :data:`STRIPE_BYTES` stripe of ``data`` (uint8; the last may be short)."""
    return np.array([checksum(data[start:start + STRIPE_BYTES]) for start in range(0, data.size, STRIPE_BYTES)],
                    dtype=_SUM)


def read_sums(trailer: np.ndarray) -> np.ndarray:
    """A block's stripe checksums from its trailer's bytes (copied: the map may go)."""
    return np.frombuffer(trailer.tobytes(), dtype=_SUM)
