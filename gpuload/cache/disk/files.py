"""The disk tier's file operations: durable writes (write, fsync, rename, fsync the folder),
whole writes at an offset, room reserved up front, a block's checksum."""

from __future__ import annotations

import errno
import os
import threading
import zlib
from pathlib import Path

import numpy as np


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




def crc32(data: np.ndarray, crc: int = 0) -> int:
    """The CRC-32 of ``data``'s bytes (continuing ``crc``), 16 MiB at a time."""
    step = 16 << 20
    for start in range(0, data.size, step):
        crc = zlib.crc32(memoryview(data[start:start + step]), crc)  # type: ignore[arg-type]  # numpy stubs: no __buffer__ before 3.12
    return crc
