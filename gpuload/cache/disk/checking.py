"""Checksums of an entry's published blocks taken ahead of their first read, on one background
thread, so a job that opens a filled entry does not spend its first batch checking every block
(a 64 MiB block takes about 30 ms of CRC-32 on one core).

The reading thread still decides: the first time it looks at a block it asks :meth:`AheadChecks.crc`
for the block's checksum, which is the background's result when it has one, waits for it when the
background is at that block, or is taken in the reading thread (the block leaves the queue) when the
background has not reached it. A result belongs to one file (block, inode, size): a block dropped
and written again is checked again. The background only computes: a failed check is named, and
the block dropped, by the reader (in its thread, where warnings are seen).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from gpuload.cache.disk.files import crc32

FileKey = tuple[int, int, int]
"""(block, inode, size) of one block file."""


class AheadChecks:
    """The CRC-32s of blocks queued with :meth:`start`, taken by one daemon thread in the order
    queued; :meth:`crc` hands them to the reader. :meth:`close` stops and joins the thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._todo: OrderedDict[int, Path] = OrderedDict()  # block -> its file, in the order to check
        self._done: dict[FileKey, int] = {}
        self._busy: int | None = None  # the block the background is checking now
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self, blocks: Iterable[tuple[int, Path]]) -> None:
        """Queue ``blocks`` (number, file) and start the thread if it is not running."""
        with self._cond:
            if self._closed:
                return
            self._todo.update(blocks)
            if self._todo and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpuload-disk-check", daemon=True)
                self._thread.start()

    def crc(self, block: int, key: FileKey, data: Callable[[], np.ndarray]) -> int:
        """The CRC-32 of block file ``key``: the background's, or taken now over ``data()``."""
        with self._cond:
            self._todo.pop(block, None)  # the reader takes it now, unless it is being checked
            while self._busy == block:
                self._cond.wait()
            found = self._done.pop(key, None)
        return found if found is not None else crc32(data())

    def close(self) -> None:
        """Stop checking (the block in hand is abandoned at its next 16 MiB) and join the thread."""
        with self._cond:
            self._closed = True
            self._todo.clear()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wait(self) -> None:
        """Until every queued block is checked (the thread has ended)."""
        with self._cond:
            while self._thread is not None:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._todo:
                    self._thread = None
                    self._cond.notify_all()
                    return
                block, path = self._todo.popitem(last=False)
                self._busy = block
            try:
                key, value = self._file_crc(block, path)
            except (OSError, ValueError):  # gone or unreadable: the reader finds out and names it
                key, value = None, None
            with self._cond:
                if key is not None and value is not None:
                    self._done[key] = value
                self._busy = None
                self._cond.notify_all()

    def _file_crc(self, block: int, path: Path) -> tuple[FileKey, int | None]:
        """The file's key and CRC-32 (None when closed meanwhile), 16 MiB at a time."""
        with open(path, "rb") as file:
            status = os.fstat(file.fileno())
            key = (block, status.st_ino, status.st_size)
            if not status.st_size:
                return key, None
            with mmap.mmap(file.fileno(), status.st_size, access=mmap.ACCESS_READ) as mapped:
                view = np.frombuffer(mapped, dtype=np.uint8)
                value, step = 0, 16 << 20
                try:
                    for start in range(0, view.size, step):
                        if self._closed:
                            return key, None
                        value = crc32(view[start:start + step], value)
                finally:
                    del view  # the map closes only once no view of it is left
        return key, value
