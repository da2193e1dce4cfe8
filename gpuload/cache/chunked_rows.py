"""Rows of a host array held in several pieces, read where they lie: an Arrow column's chunks.

A table's fixed-width column of many chunks (a ``save_to_disk`` folder's record batches), or one
read through an index mapping (sample ``i`` is table row ``rows[i]``), is not one tensor. Joining
it into one would take a host copy of the whole column before any tier is filled, and keep it
as the rows the tiers do not hold. :class:`ChunkedRows` is that column as the array tiers' source
instead: the tiers copy their rows out of the chunks a piece at a time (a device tier straight to
the device, so host memory grows by about one chunk, not the column), and the rows no tier holds
are gathered from the chunks per batch.

It answers the few tensor questions the array path asks of its source arrays (``shape``,
``dtype``, ``view`` to a same-width dtype, slicing rows, ``index_select``, ``to``, ``clone``);
:func:`take_rows` and :func:`copy_rows` gather into and copy into a given tensor, for a tensor
or a :class:`ChunkedRows` alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PIECE_BYTES", "ChunkedRows", "copy_rows", "gatherable", "take_rows"]

PIECE_BYTES = 8 << 20
"""Most bytes of rows copied out of the chunks at a time (a host piece, freed after its copy)."""


class ChunkedRows:
    """Rows ``[start, start + length)`` of an array whose table rows are ``chunks`` one after the
    other (each a tensor of rows of the same shape and dtype), sample ``i`` being table row
    ``rows[i]`` (``rows`` None: row ``i``)."""

    def __init__(self, chunks: Sequence[torch.Tensor], rows: torch.Tensor | None = None,
                 start: int = 0, length: int | None = None) -> None:
        if not chunks:
            raise ValueError("ChunkedRows needs at least one chunk")
        self.chunks = list(chunks)
        self.rows = rows
        sizes = torch.tensor([len(chunk) for chunk in self.chunks], dtype=torch.int64)
        self._starts = torch.cumsum(sizes, 0) - sizes  # each chunk's first table row
        total = int(sizes.sum()) if rows is None else len(rows)
        self.start = start
        self.length = total - start if length is None else length
        first = self.chunks[0]
        row_bytes = max(1, math.prod(first.shape[1:]) * first.element_size())
        # rows copied at a time: a chunk's worth, at most PIECE_BYTES (one chunk under a mapping)
        self._piece = max(1, min(int(sizes.max()), PIECE_BYTES // row_bytes))
        self.shape = torch.Size((self.length, *first.shape[1:]))
        self.dtype = first.dtype

    # -- what the array path asks of a source array ---------------------------------------

    device = torch.device("cpu")
    layout = torch.strided
    is_cuda = False

    def __len__(self) -> int:
        return self.length

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.chunks[0].element_size()

    def view(self, dtype: torch.dtype) -> ChunkedRows:
        """The same rows as ``dtype`` of the same width (the gather kernels' signed views)."""
        return ChunkedRows([chunk.view(dtype) for chunk in self.chunks], self.rows, self.start, self.length)

    def __getitem__(self, key: int | slice) -> Any:
        """Rows ``key`` (a slice of step 1: the same chunks, nothing copied) or row ``key`` (a tensor)."""
        if isinstance(key, int):
            index = key + self.length if key < 0 else key
            if not 0 <= index < self.length:
                raise IndexError(f"row {key} is out of range for {self.length} rows")
            return self.index_select(0, torch.tensor([index]))[0]
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"ChunkedRows takes a row or a slice of rows, not {key!r}")
        first, stop, _ = key.indices(self.length)
        return ChunkedRows(self.chunks, self.rows, self.start + first, max(0, stop - first))

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` as a new host tensor."""
        if dim != 0:
            raise ValueError("ChunkedRows gathers rows (dim 0) only")
        out = torch.empty((index.numel(), *self.shape[1:]), dtype=self.dtype)
        self.gather(index, out)
        return out

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (host int64) written into ``out`` (host, ``len(index)`` rows): one
        ``index_select`` per chunk they fall in."""
        index = index.reshape(-1).to(torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.length):
            raise IndexError(f"rows {index.tolist()[:8]} reach past the {self.length} rows")
        samples = index + self.start
        out = gatherable(out)  # index_copy_ has no uint16/32/64 kernels: the same bits, signed
        table = samples if self.rows is None else self.rows.index_select(0, samples)
        chunk = torch.searchsorted(self._starts, table, right=True) - 1
        if not chunk.numel() or len(self.chunks) == 1 or bool((chunk == chunk[0]).all()):
            which = int(chunk[0]) if chunk.numel() else 0
            torch.index_select(gatherable(self.chunks[which]), 0, table - self._starts[which], out=out)
            return out.view(self.dtype)
        order = torch.argsort(chunk, stable=True)
        counts = torch.bincount(chunk, minlength=len(self.chunks)).tolist()
        begin = 0
        for which, count in enumerate(counts):
            if not count:
                continue
            slots = order[begin:begin + count]
            begin += count
            local = table.index_select(0, slots) - self._starts[which]
            out.index_copy_(0, slots, gatherable(self.chunks[which]).index_select(0, local))
        return out.view(self.dtype)

    def to(self, device: torch.device | str) -> torch.Tensor:
        """The rows as one tensor on ``device``, copied a chunk's worth at a time."""
        out = torch.empty(tuple(self.shape), dtype=self.dtype, device=device)
        copy_rows(out, self)
        return out

    def clone(self, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        """The rows as one new contiguous host tensor."""
        return self.to("cpu")

    def contiguous(self) -> torch.Tensor:
        return self.clone()


# Unsigned dtypes torch has only partial kernels for (index_copy_ on the CPU, index_select
# on CUDA): rows are moved through a signed view of the same width, bit for bit.
_SIGNED_VIEW = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def gatherable(array: Any) -> Any:
    """``array`` (a tensor or :class:`ChunkedRows`) as a dtype every gather kernel supports: a
    same-width signed view of a uint16/32/64 array (same bits), else the array itself. View the
    result back with ``.view(array.dtype)``."""
    signed = _SIGNED_VIEW.get(array.dtype)
    return array if signed is None else array.view(signed)


def take_rows(source: torch.Tensor | ChunkedRows, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``source`` written into ``out`` (host)."""
    if isinstance(source, ChunkedRows):
        return source.gather(index, out)
    return torch.index_select(source, 0, index, out=out)


def copy_rows(out: torch.Tensor, source: torch.Tensor | ChunkedRows) -> torch.Tensor:
    """``out`` (any device) filled with every row of ``source``; from a :class:`ChunkedRows` in
    table order each chunk's rows copied straight in, under a mapping a piece at a time, each
    gathered on the host then copied (a pageable copy: the piece may be freed once ``copy_``
    returns)."""
    if not isinstance(source, ChunkedRows):
        return out.copy_(source)
    if source.rows is None:  # in table order: each chunk's part straight into its place
        for chunk, begin in zip(source.chunks, source._starts.tolist()):
            low, high = max(begin, source.start), min(begin + len(chunk), source.start + source.length)
            if low < high:
                out[low - source.start:high - source.start].copy_(chunk[low - begin:high - begin])
        return out
    for first in range(0, source.length, source._piece):
        stop = min(first + source._piece, source.length)
        out[first:stop].copy_(source.index_select(0, torch.arange(first, stop)))
    return out
