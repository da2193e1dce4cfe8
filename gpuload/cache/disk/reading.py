"""Reading an entry: which rows are published and intact, and their bytes copied out of the
blocks' memory maps. A block is checked (size, CRC-32, a ragged block's table) the first time
this process looks at it (``present`` or a read); its CRC-32 is usually taken already, on the
background thread that checks the published blocks from the entry's open on
(:mod:`~gpuload.cache.disk.checking`). One that fails is named once, unpublished and filled again."""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Any

import numpy as np
import torch

from gpuload.cache.disk.blocks import distinct, itemsize, ragged_table, ragged_table_problem
from gpuload.cache.disk.entry import DiskCacheWarning, Entry
from gpuload.cache.entries import MANIFEST

_OPEN_MAPS = 64  # memory maps (each holds a file descriptor) kept open per cache


class EntryReader(Entry):
    """An entry's published rows, read (``present``, ``read``, ``read_items``)."""

    def present(self, rows: Any) -> torch.Tensor:
        """Which of ``rows`` are published and intact (a bool tensor, one per row). The first
        look at a block in this process checks its size and checksum."""
        array = self._as_rows(rows)
        self._settle(distinct(array // self.block_rows))  # this process's own blocks, if about to be published
        return self._present(array)

    def _present(self, array: np.ndarray) -> torch.Tensor:
        with self._mutex:
            if self._closed:
                return torch.zeros(len(array), dtype=torch.bool)
            blocks = array // self.block_rows
            wanted = distinct(blocks)
            if any(b not in self._manifest.blocks for b in wanted):
                self._reload()
            good = np.zeros(len(array), dtype=bool)
            for block in wanted:
                if block in self._verified or (block in self._manifest.blocks and self._map(block) is not None):
                    good[blocks == block] = True
            return torch.from_numpy(good)

    def read(self, rows: Any) -> list[torch.Tensor]:
        """The columns of ``rows`` (published ones; LookupError names an absent row), one tensor
        of ``len(rows)`` rows per column. Each run of consecutive rows is one copy from one
        memory map."""
        array = self._as_rows(rows)
        if self.ragged:
            raise TypeError(f"the disk cache {self.root} holds ragged rows: read them with read_items")
        self._settle(distinct(array // self.block_rows))
        with self._mutex:
            self._check_present(array)
            n = len(array)
            outs = [torch.empty((n, *column.shape), dtype=column.dtype) for column in self.columns]
            # Each column's rows copied straight out of the maps (one copy, no record buffer).
            targets = [(out.reshape(n, -1).view(torch.uint8).numpy(), offset, column.row_bytes)
                       for out, column, offset in zip(outs, self.columns, self.offsets) if column.row_bytes and n]
            if n:
                blocks = array // self.block_rows
                cuts = np.flatnonzero((np.diff(array) != 1) | (np.diff(blocks) != 0)) + 1
                starts = np.concatenate(([0], cuts))
                ends = np.concatenate((cuts, [n]))
                for start, end in zip(starts.tolist(), ends.tolist()):
                    block = int(blocks[start])
                    first = int(array[start]) - block * self.block_rows
                    records = self._map(block)
                    if records is None:
                        raise LookupError(f"block {block} of the disk cache {self.root} was dropped while reading")
                    run = records[first:first + end - start]
                    for target, offset, size in targets:
                        target[start:end] = run[:, offset:offset + size]
            self._stats.hits += n
        return outs

    def read_items(self, rows: Any) -> list[torch.Tensor]:
        """The rows of a ragged entry (published ones; LookupError names an absent row), each a
        tensor of its own shape and dimension order, copied out of its block's memory map."""
        array = self._as_rows(rows)
        if not self.ragged:
            raise TypeError(f"the disk cache {self.root} holds fixed-size rows: read them with read")
        column, words = self.columns[0], self._entry_words
        ndim = len(column.shape)
        items = []
        self._settle(distinct(array // self.block_rows))
        with self._mutex:
            self._check_present(array)
            for row in array.tolist():
                block = row // self.block_rows
                view = self._map(block)
                if view is None:
                    raise LookupError(f"block {block} of the disk cache {self.root} was dropped while reading")
                entry = ragged_table(view, self._rows_in(block), words)[row - block * self.block_rows].tolist()
                offset, shape, order = entry[0], entry[1:1 + ndim], entry[1 + ndim:words]
                stored = [shape[d] for d in order]
                size = int(np.prod(stored, dtype=np.int64)) * itemsize(column.dtype)
                out = torch.empty(size, dtype=torch.uint8)
                out.numpy()[:] = view[offset:offset + size]
                items.append(out.view(column.dtype).reshape(stored).permute(np.argsort(order).tolist()))
            self._stats.hits += len(array)
        return items

    def _check_present(self, array: np.ndarray) -> None:
        """LookupError naming the first of ``array`` that is not published (misses counted)."""
        ok = self._present(array).numpy()
        if not ok.all():
            self._stats.misses += int((~ok).sum())
            raise LookupError(
                f"row {int(array[~ok][0])} is not in the disk cache {self.root} (present() says which are)"
            )

    def _map(self, block: int) -> np.ndarray | None:
        """Block ``block``'s records, memory-mapped; checked (size, CRC-32) at first use. None
        (and the block dropped, with a warning naming the file) if it fails the check."""
        if block in self._maps:
            self._maps.move_to_end(block)
            return self._maps[block][1]
        size, crc = self._manifest.blocks[block]
        path = self._block_path(block, "bin")
        expected = size if self.ragged else self._rows_in(block) * self.record_bytes
        try:
            with open(path, "rb") as file:
                status = os.fstat(file.fileno())
                actual = status.st_size
                if actual != size or size != expected:
                    problem = f"{path} is {actual} bytes, the manifest says {size} (expected {expected})"
                    self._drop(block, problem)
                    return None
                mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) if size else None
        except OSError as error:
            self._drop(block, f"{path} cannot be read ({error.strerror or error})")
            return None
        view = np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else np.empty(0, np.uint8)
        if block not in self._verified:
            if self._checks.crc(block, (block, status.st_ino, size), lambda: view) != crc:
                del view, mapped  # unmapped when the last reference goes
                self._drop(block, f"{path} fails its checksum (its bytes changed after it was written)")
                return None
            problem = ragged_table_problem(view, self._rows_in(block), self.columns[0]) if self.ragged else ""
            if problem:
                del view, mapped
                self._drop(block, f"{path} {problem}")
                return None
            self._verified.add(block)
        records = view if self.ragged else view.reshape(self._rows_in(block), self.record_bytes)
        self._maps[block] = (mapped, records)
        while len(self._maps) > _OPEN_MAPS:
            self._maps.popitem(last=False)  # unmapped when the last reference goes
        return records

    def _drop(self, block: int, problem: str) -> None:
        """Unpublish a damaged block so it is filled again; one warning naming the file."""
        warnings.warn(
            f"gpuload disk cache: {problem}; its rows are read from the source and the block is written again",
            DiskCacheWarning, stacklevel=4,
        )
        self._stats.blocks_dropped += 1
        try:
            with self._entry_lock():
                self._reload()
                if self._manifest.blocks.get(block) is not None:
                    del self._manifest.blocks[block]
                    self._write_manifest()
                    first = block * self.block_rows
                    os.pwrite(self._flags_fd, bytes(self._rows_in(block)), first)
                    self._block_path(block, "bin").unlink(missing_ok=True)
        except OSError as error:
            self._manifest.blocks.pop(block, None)  # at least this process reads it no more
            self._stop(error, self.root / MANIFEST)
        self._forget(block)
        return None
