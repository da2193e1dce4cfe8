"""Filling an entry: rows written into their blocks' ``.part`` files under the entry lock
(``pwrite`` at a row's offset; a ragged row at the part's end, its ``rows.index`` entry after
it), each row's flag set after its bytes; a block whose last row arrives is queued for
publication (:mod:`~gpuload.cache.disk.publishing`): on the publishing thread its stripes are
checksummed into its trailer and it is fsync'ed (no lock held: nothing writes a complete part's
rows), then renamed to ``.bin`` and only then listed in the manifest (under the locks). Within
the budget; a full disk or another I/O error stops the tier growing, with one warning."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuload.cache.budget import default_disk_reserve, disk_space
from gpuload.cache.disk.blocks import distinct, itemsize, pack_items, pack_records
from gpuload.cache.disk.entry import Entry
from gpuload.cache.disk.files import checksum, fsync_folder, preallocate, pwrite_all, stripe_sums

_OPEN_PARTS = 64


class EntryWriter(Entry):
    """An entry's rows stored as they pass (``write``, ``write_items``), blocks published as they complete."""

    @property
    def accepting(self) -> bool:
        """Whether ``write`` still stores rows (not closed, not stopped by an error)."""
        return not self._closed and not self._stats.stopped

    @property
    def full(self) -> bool:
        """Whether the budget or the disk has refused a new block (as of now: no wait for the
        blocks queued for publication, unlike ``stats()``)."""
        return self._stats.full

    @property
    def growing(self) -> bool:
        """Whether writes may still store rows: accepting, and not full unless a block this
        process started is unfinished (its rows still fit: its room was taken at its start)."""
        with self._mutex:
            return self.accepting and (not self._stats.full or bool(self._parts))

    def write(self, rows: Any, columns: Sequence[torch.Tensor]) -> int:
        """Store ``rows`` (their ``columns``, one tensor per column with ``len(rows)`` rows of the
        column's shape and dtype); rows already stored or beyond the budget are skipped. Returns
        how many rows were written. A full disk, a read-only folder or another I/O error stops
        the tier from growing, with one warning; what was published stays readable."""
        array = self._as_rows(rows)
        if self.ragged:
            raise TypeError(f"the disk cache {self.root} holds ragged rows: write them with write_items")
        return self._store(array, pack_records(self.columns, self.offsets, self.record_bytes, len(array), columns))

    def write_items(self, rows: Any, items: Sequence[torch.Tensor]) -> int:
        """:meth:`write` for a ragged entry: ``items``, one tensor per row of the column's dtype
        and number of dimensions, each of its own shape (and dimension order, kept)."""
        array = self._as_rows(rows)
        if not self.ragged:
            raise TypeError(f"the disk cache {self.root} holds fixed-size rows: write them with write")
        return self._store(array, pack_items(self.columns[0], len(array), items))

    def _store(self, array: np.ndarray, records: np.ndarray) -> int:
        """Write ``records`` (one per row of ``array``) into their blocks' parts, publishing
        the blocks they complete."""
        if not len(array):
            return 0
        order = np.argsort(array, kind="stable")
        array, records = array[order], records[order]
        keep = np.concatenate(([True], np.diff(array) != 0))
        array, records = array[keep], records[keep]
        written = 0
        self._settle(())  # what stopped publishing, if anything, is said here
        self._publisher.room()  # at most PENDING_BLOCKS complete blocks wait for publication
        with self._mutex:
            if not self.accepting:
                return 0
            blocks = array // self.block_rows
            path: Path = self.root
            try:
                with self._entry_lock():
                    self._reload()
                    for block in distinct(blocks):
                        if block in self._manifest.blocks:
                            continue
                        path = self._block_path(block, "part")
                        fd = self._part(block)
                        if fd is None:
                            continue
                        mine = blocks == block
                        fill = self._append_rows if self.ragged else self._write_rows
                        wrote = fill(block, fd, array[mine], records[mine])
                        written += wrote
                        path = self._block_path(block, "bin")
                        self._queue_if_complete(block, fd, wrote)
            except OSError as error:
                self._stop(error, Path(error.filename) if error.filename else path)
            self._stats.rows_written += written
        return written

    def _part(self, block: int) -> int | None:
        """A descriptor of block ``block``'s ``.part`` (opened, or created within the budget);
        None when the budget or the disk's reserve has no room for it. Entry lock held."""
        path = self._block_path(block, "part")
        cached = self._parts.get(block)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            inode = None
        if cached is not None and cached[1] == inode:
            self._parts.move_to_end(block)
            return cached[0]
        if cached is not None:
            self._close_part(block)
        size = self._rows_in(block) * self.record_bytes
        if inode is None:
            if not self._room_for(size):
                self._stats.full = True
                return None
            # No row of the new part is written yet: its flags are cleared before it exists, so
            # a process killed at any point after leaves no set flag over a part's zeros (flags
            # a block left set when its process died between its rename and the manifest).
            os.pwrite(self._flags_fd, bytes(self._rows_in(block)), block * self.block_rows)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                preallocate(fd, 0 if self.ragged else size)  # a ragged block grows row by row
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        self._parts[block] = (fd, os.fstat(fd).st_ino)
        while len(self._parts) > _OPEN_PARTS:
            self._close_part(next(iter(self._parts)))
        return fd

    def _room_for(self, size: int) -> bool:
        """Whether a new block of ``size`` bytes fits (for a ragged entry: ``size`` bytes more)."""
        return self._room_left() >= size

    def _room_left(self) -> int:
        """Bytes the entry may still take: the budget less what is published and the parts being
        filled (each counts a whole block, a ragged one its estimate or more once it grew past
        it), or with the default budget the disk's free space less its reserve, checked now."""
        if self._auto_budget:
            free, total = disk_space(self.root)
            return free - default_disk_reserve(total)
        parts = [e for e in os.scandir(self.root) if e.name.endswith(".part")]
        whole = self.block_rows * self.record_bytes
        held = sum(max(whole, e.stat().st_size) for e in parts) if self.ragged else len(parts) * whole
        return self.budget - self._stats.published_bytes - held

    def _write_rows(self, block: int, fd: int, rows: np.ndarray, records: np.ndarray) -> int:
        first = block * self.block_rows
        flags = np.frombuffer(os.pread(self._flags_fd, self._rows_in(block), first), dtype=np.uint8)
        todo = flags[rows - first] == 0
        rows, records = rows[todo], records[todo]
        if not len(rows):
            return 0
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        for run_rows, run_records in zip(np.split(rows, cuts), np.split(records, cuts)):
            offset = (int(run_rows[0]) - first) * self.record_bytes
            pwrite_all(fd, memoryview(np.ascontiguousarray(run_records)).cast("B"), offset)  # type: ignore[arg-type]  # numpy stubs
        for run_rows in np.split(rows, cuts):  # flags after the bytes: a set flag means written
            os.pwrite(self._flags_fd, b"\x01" * len(run_rows), int(run_rows[0]))
        return len(rows)

    def _append_rows(self, block: int, fd: int, rows: np.ndarray, items: np.ndarray) -> int:
        """A ragged block's rows not written yet appended to its part, each with its entry in
        ``rows.index`` (offset, shape, order), while the budget has room. Entry lock held."""
        first = block * self.block_rows
        flags = os.pread(self._flags_fd, self._rows_in(block), first)
        align = itemsize(self.columns[0].dtype)
        end, written = os.fstat(fd).st_size, 0
        room = self._room_left() + max(0, self.block_rows * self.record_bytes - end)  # this part's reserve
        for row, (data, shape, order) in zip(rows.tolist(), items):
            if flags[row - first]:
                continue
            end = -(-end // align) * align
            if data.size > room:
                self._stats.full = True
                break
            pwrite_all(fd, memoryview(data), end)
            entry = np.array([end, *shape, *order], dtype=np.int64)
            os.pwrite(self._index_fd, entry.tobytes(), row * self._entry_words * 8)
            os.pwrite(self._flags_fd, b"\x01", row)  # after the bytes and the entry: a set flag means written
            end, room, written = end + data.size, room - data.size, written + 1
        return written

    def _seal(self, block: int, fd: int) -> int:
        """The block's final size: a ragged block gets its row table appended (from
        ``rows.index``, offsets within the block). Entry lock held."""
        if not self.ragged:
            return self._rows_in(block) * self.record_bytes
        words = self._rows_in(block) * self._entry_words
        table = os.pread(self._index_fd, words * 8, block * self.block_rows * self._entry_words * 8)
        if len(table) != words * 8:
            raise OSError(errno.EIO, "rows.index is shorter than its rows", str(self.root / "rows.index"))
        start = -(-os.fstat(fd).st_size // 8) * 8
        pwrite_all(fd, memoryview(table), start)
        return start + len(table)

    def _queue_if_complete(self, block: int, fd: int, wrote: int) -> None:
        """Publish the block once every row of it is written: behind the loop when the entry was
        opened with ``publish_behind``, else now (a ragged block gets its table first, only from the
        process whose rows completed it: sealed once). Entry lock held."""
        first = block * self.block_rows
        if os.pread(self._flags_fd, self._rows_in(block), first).count(0):
            return
        if self._behind and self.ragged and not wrote:
            return
        size = self._seal(block, fd)  # never 0: a record is at least 1 byte, a ragged table 8 per row
        if self._behind:
            self._publisher.queue(block, size, os.fstat(fd).st_ino)
        else:
            self._list(block, size, _seal_stripes(fd, size))

    def _publish_behind(self, block: int, size: int, inode: int) -> None:
        """On the publishing thread: checksum the complete part ``inode``'s stripes and fsync it (no
        lock held: nothing writes its rows any more; a process that completed it too appends the
        same trailer), then under the locks list it, unless another process published it meanwhile."""
        part = self._block_path(block, "part")
        try:
            fd = os.open(part, os.O_RDWR)
        except FileNotFoundError:  # published (or dropped) by another process meanwhile
            return
        try:
            if os.fstat(fd).st_ino != inode:
                return
            trailer_sum = _seal_stripes(fd, size)
        finally:
            os.close(fd)
        with self._mutex, self._entry_lock():
            self._reload()
            try:
                current = os.stat(part).st_ino
            except FileNotFoundError:
                current = None
            if block not in self._manifest.blocks and current == inode:
                self._list(block, size, trailer_sum)

    def _salvage(self, block: int, rows: np.ndarray, records: np.ndarray) -> None:
        """Write ``rows`` (records as ``write`` packs them: their stripes passed their checks) of the
        block just dropped as damaged into its new part, so a reader of this epoch that already had
        them from the disk does not leave the block short, and only its damaged rows come from the
        source (published once they are written too). Mutex held; nothing when the tier no longer
        writes or the block has no room."""
        if not len(rows) or not self.accepting:
            return
        path = self._block_path(block, "part")
        try:
            with self._entry_lock():
                self._reload()
                if block in self._manifest.blocks:  # another process refilled it meanwhile
                    return
                fd = self._part(block)
                if fd is None:
                    return
                fill = self._append_rows if self.ragged else self._write_rows
                self._queue_if_complete(block, fd, fill(block, fd, rows, records))
        except OSError as error:
            self._stop(error, Path(error.filename) if error.filename else path)

    def _list(self, block: int, size: int, trailer_sum: int) -> None:
        """Rename the block's complete part to ``.bin`` and list it in the manifest (undone, and
        the OSError raised, when the manifest cannot be written). Entry lock held."""
        target = self._block_path(block, "bin")
        os.rename(self._block_path(block, "part"), target)
        fsync_folder(self.root)
        self._close_part(block)
        self._manifest.blocks[block] = (size, trailer_sum)
        try:
            self._write_manifest()
        except OSError:
            del self._manifest.blocks[block]
            target.unlink(missing_ok=True)
            os.pwrite(self._flags_fd, bytes(self._rows_in(block)), block * self.block_rows)
            raise
        self._verified.add(block)
        self._stats.blocks_published += 1


def _seal_stripes(fd: int, size: int) -> int:
    """Append to a complete part the checksums of its ``size`` bytes' stripes (its trailer), make
    it durable; the trailer's own checksum, which the manifest lists."""
    mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    try:
        trailer = stripe_sums(np.frombuffer(mapped, dtype=np.uint8)).tobytes()
    finally:
        try:
            mapped.close()
        except BufferError:  # a view is still held (by an error's traceback): unmapped when it goes
            pass
    pwrite_all(fd, memoryview(trailer), size)
    os.fsync(fd)
    return checksum(trailer)
