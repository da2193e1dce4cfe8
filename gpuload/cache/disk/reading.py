"""Reading an entry: which rows are published and intact, and their bytes copied out of the
blocks' memory maps. The first time this process maps a block it checks the file's size and its
trailer of stripe checksums (against the manifest); each stripe of the block's data is checked the
first time a row it holds is looked at (``present`` or a read: :mod:`~gpuload.cache.disk.checking`),
a ragged block's row table (and its stripes) at the map. A block that fails is named once (with the
rows of the failing stripe), unpublished and filled again."""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Any

import numpy as np
import torch

from gpuload.cache.disk.blocks import distinct, itemsize, ragged_table, ragged_table_problem
from gpuload.cache.disk.checking import StripeChecks
from gpuload.cache.disk.entry import DiskCacheWarning, Entry
from gpuload.cache.disk.files import STRIPE_BYTES, checksum, read_sums, trailer_bytes
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
                mine = blocks == block
                if block in self._verified:
                    good[mine] = True
                elif block in self._manifest.blocks and self._map(block) is not None:
                    good[mine] = self._check_stripes(block, array[mine] - block * self.block_rows)
            return torch.from_numpy(good)

    def _check_stripes(self, block: int, rows: np.ndarray) -> bool:
        """Check the stripes that ``rows`` (of block ``block``, mapped) lie in; False (and the
        block dropped, naming the stripe's rows) when one fails."""
        checks = self._stripes[block]
        data = self._maps[block][1].reshape(-1)
        starts, ends = self._byte_ranges(block, data, rows)
        failed = checks.check(data, starts, ends)
        if failed is not None:
            self._drop_damaged(block, data, failed)
            return False
        if not checks.left:
            del self._stripes[block]
            self._verified.add(block)
        return True

    def _drop_damaged(self, block: int, data: np.ndarray, failed: int) -> None:
        """Drop block ``block`` whose stripe ``failed`` fails its checksum, naming the file, the
        stripe's bytes and its rows; its rows whose stripes all pass are written back into the
        block's new part (:meth:`_salvage`), so only the damaged rows are read from the source."""
        everyone = np.arange(self._rows_in(block))
        starts, ends = self._byte_ranges(block, data, everyone)
        low, high = failed * STRIPE_BYTES, min(data.size, (failed + 1) * STRIPE_BYTES)
        hit = everyone[(starts < high) & (ends > low)] + block * self.block_rows
        rows_named = f"rows {hit.min()}-{hit.max()}" if hit.size else "no row's bytes"
        bad_before = np.concatenate(([0], np.cumsum(self._stripes[block].failing(data))))
        first, last = starts // STRIPE_BYTES, (np.maximum(ends, starts + 1) - 1) // STRIPE_BYTES
        intact = everyone[(ends == starts) | (bad_before[last + 1] == bad_before[first])]
        records: np.ndarray
        if self.ragged:
            ndim = len(self.columns[0].shape)
            table = ragged_table(data, self._rows_in(block), self._entry_words)
            records = np.empty(len(intact), dtype=object)
            for k, row in enumerate(intact.tolist()):
                entry = table[row].tolist()
                records[k] = (data[starts[row]:ends[row]].copy(), entry[1:1 + ndim], entry[1 + ndim:])
        else:
            records = data.reshape(-1, self.record_bytes)[intact].copy()
        self._drop(block, f"{self._block_path(block, 'bin')} fails its checksum in bytes {low}-{high - 1} "
                          f"({rows_named}; its bytes changed after it was written)")
        self._salvage(block, intact + block * self.block_rows, records)

    def _byte_ranges(self, block: int, data: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where ``rows`` (of block ``block``) lie in its data: their start and end bytes."""
        if not self.ragged:
            starts = rows.astype(np.int64) * self.record_bytes
            return starts, starts + self.record_bytes
        ndim = len(self.columns[0].shape)
        table = ragged_table(data, self._rows_in(block), self._entry_words)[rows]
        sizes = np.prod(table[:, 1:1 + ndim], axis=1, dtype=np.int64) * itemsize(self.columns[0].dtype)
        return table[:, 0], table[:, 0] + sizes

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
        """Block ``block``'s records (a ragged block's data), memory-mapped. At its first map its
        size and its trailer's checksum are checked (a ragged block's row table too): None (and
        the block dropped, with a warning naming the file) if one fails. Its stripes are checked
        as rows are looked at (:meth:`_check_stripes`)."""
        if block in self._maps:
            self._maps.move_to_end(block)
            return self._maps[block][1]
        size, trailer_sum = self._manifest.blocks[block]
        path = self._block_path(block, "bin")
        expected = size if self.ragged else self._rows_in(block) * self.record_bytes
        try:
            with open(path, "rb") as file:
                status = os.fstat(file.fileno())
                actual = status.st_size
                if actual != size + trailer_bytes(size) or size != expected:
                    problem = (f"{path} is {actual} bytes, the manifest says {size} and its stripe checksums "
                               f"(expected {expected})")
                    self._drop(block, problem)
                    return None
                mapped = mmap.mmap(file.fileno(), actual, access=mmap.ACCESS_READ) if actual else None
        except OSError as error:
            self._drop(block, f"{path} cannot be read ({error.strerror or error})")
            return None
        view = np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else np.empty(0, np.uint8)
        data = view[:size]
        if block not in self._verified:
            checks = self._stripes.get(block)
            if checks is None or checks.inode != status.st_ino:
                if checksum(view[size:]) != trailer_sum:
                    del view, data, mapped  # unmapped when the last reference goes
                    self._drop(block, f"{path} fails its checksum (its stripe checksums changed after it was written)")
                    return None
                self._stripes[block] = StripeChecks(status.st_ino, read_sums(view[size:]))
            problem = self._ragged_problem(block, data) if self.ragged else ""
            if problem:
                del view, data, mapped
                self._drop(block, f"{path} {problem}")
                return None
        records = data if self.ragged else data.reshape(self._rows_in(block), self.record_bytes)
        self._maps[block] = (mapped, records)
        while len(self._maps) > _OPEN_MAPS:
            self._maps.popitem(last=False)  # unmapped when the last reference goes
        return records

    def _ragged_problem(self, block: int, data: np.ndarray) -> str:
        """What is wrong with a ragged block's row table ("" if nothing), its stripes checked first."""
        rows = self._rows_in(block)
        table_start = max(0, data.size - rows * self._entry_words * 8)
        failed = self._stripes[block].check(data, np.array([table_start]), np.array([data.size]))
        if failed is not None:
            return f"fails its checksum in its row table (bytes {table_start}-{data.size - 1})"
        return ragged_table_problem(data, rows, self.columns[0])

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
