"""The rows of a packing plan made once, each field at the width its values need, so a batch of
packed rows is a gather of rows and one widening a field.

A :class:`~gpuload.datasets.packing.PackingPlan` does not change between epochs, so what each of
its rows holds is computed once (by ``gather_rows``, the per-row reference, a chunk of rows at a
time) and kept as one int64 array, ``block``: a row is its ``labels``, ``input_ids`` and
``position_ids`` (``seq_len`` each, final values: -100 and the truncated documents' labels
included), each stored in the narrowest signed dtype that holds every value it takes in this
corpus (int16, int32 or int64: ids below 32,768 and positions below 32,768 fit int16), widest
first so every field is aligned, the row padded to 8 bytes. A batch is then one gather of rows
and three sign-extending widenings on its device, each a new contiguous int64 tensor (no mask,
no fill: the kernels torch has for every dtype on every device), see :meth:`PackedRows.batch`.

A row takes ``seq_len`` times the three fields' bytes: 10 bytes a token for GPT-2's 50,257 ids
(int32 labels and ids, int16 positions), 6 for a vocabulary under 32,768; a uint16 token buffer
takes 2. Its ``cu_seqlens`` and ``max_seqlen`` come from host-side segment data of the batch's
rows (:meth:`PackedRows.cu_seqlens`), so nothing per token crosses to the device and nothing syncs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from gpuload.datasets.packing import IGNORE_INDEX, PackedTokens, PackingPlan, gather_rows
from gpuload.datasets.tokens import signed_view, widen

__all__ = ["FIELDS", "PackedRows", "packed_rows"]

FIELDS = ("labels", "input_ids", "position_ids")  # a batch's per-token tensors, in the dict's order
_CHUNK_TOKENS = 1 << 20  # tokens made (or scanned) at a time while building: bounds the int64 temporaries
_WIDTHS = (torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class PackedRows:
    """What every row of a packing plan holds (see the module docstring). ``layout``: each field's
    name, stored dtype and first column in ``block`` viewed as that dtype;
    ``segment_ptr``/``segment_starts``: each row's segment starts within the row (CSR over rows);
    ``row_max_seqlen``: each row's longest segment."""

    seq_len: int
    block: torch.Tensor
    layout: tuple[tuple[str, torch.dtype, int], ...]
    segment_ptr: np.ndarray
    segment_starts: np.ndarray
    row_max_seqlen: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes of ``block`` (what a cache holds)."""
        return self.block.numel() * self.block.element_size()

    def cu_seqlens(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
        """``cu_seqlens`` (int32) of the batch of ``rows`` and its ``max_seqlen``, on the host."""
        first = self.segment_ptr[rows]
        counts = self.segment_ptr[rows + 1] - first
        ends = np.cumsum(counts)
        taken = np.arange(int(ends[-1])) + np.repeat(first - ends + counts, counts)
        edges = np.empty(len(taken) + 1, dtype=np.int32)
        np.add(self.segment_starts[taken], np.repeat(np.arange(0, len(rows) * self.seq_len, self.seq_len), counts),
               out=edges[:-1], casting="unsafe")
        edges[-1] = len(rows) * self.seq_len
        return edges, int(self.row_max_seqlen[rows].max())

    def batch(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """``input_ids``, ``labels`` and ``position_ids`` (int64, ``(rows, seq_len)``, each a new
        contiguous tensor) from a batch's rows of ``block`` (gathered, on any device)."""
        seq_len = self.seq_len
        made = {name: block.view(dtype)[:, column : column + seq_len].to(
                    torch.int64, copy=True, memory_format=torch.contiguous_format)
                for name, dtype, column in self.layout}
        return {"input_ids": made["input_ids"], "labels": made["labels"], "position_ids": made["position_ids"]}

    @classmethod
    def build(cls, buffer: torch.Tensor, token_dtype: torch.dtype, plan: PackingPlan, pad_id: int) -> PackedRows:
        """Every row of ``plan`` made by ``gather_rows`` from ``buffer`` (the flat token buffer's
        signed view, on the host), a chunk of rows at a time, each field stored at its width."""
        seq_len, count = plan.seq_len, plan.rows
        low, high = _id_range(buffer, token_dtype)
        dtypes = {"labels": _narrowest(min(low, IGNORE_INDEX), high),
                  "input_ids": _narrowest(min(low, pad_id), max(high, pad_id)),
                  "position_ids": _narrowest(0, seq_len - 1)}
        layout, offset = [], 0  # widest first: each field's byte offset is a multiple of its itemsize
        for name in sorted(FIELDS, key=lambda field: -dtypes[field].itemsize):
            layout.append((name, dtypes[name], offset // dtypes[name].itemsize))
            offset += seq_len * dtypes[name].itemsize
        block = torch.zeros(count, -(-offset // 8), dtype=torch.int64)
        starts: list[np.ndarray] = []
        longest = np.empty(count, dtype=np.int64)
        step = max(1, _CHUNK_TOKENS // seq_len)
        for begin in range(0, count, step):
            rows = np.arange(begin, min(count, begin + step))
            segments = plan.segments(rows)
            made = gather_rows(buffer, token_dtype, torch.from_numpy(segments.table),
                               torch.from_numpy(segments.cu_seqlens), len(rows), seq_len, pad_id)
            for name, dtype, column in layout:
                block[begin : begin + len(rows)].view(dtype)[:, column : column + seq_len] = made[name]
            edges = segments.cu_seqlens.astype(np.int64)
            starts.append(edges[:-1] % seq_len)
            first_of_row = np.flatnonzero(edges[:-1] % seq_len == 0)
            longest[rows] = np.maximum.reduceat(np.diff(edges), first_of_row)
        segment_starts = np.concatenate(starts)
        segment_ptr = np.append(np.flatnonzero(segment_starts == 0), len(segment_starts))
        return cls(seq_len, block, tuple(layout), segment_ptr, segment_starts.astype(np.int32), longest)


def _id_range(buffer: torch.Tensor, token_dtype: torch.dtype) -> tuple[int, int]:
    """The smallest and largest id of the flat token ``buffer`` (its signed view), scanned a chunk
    at a time; ``(0, 0)`` for an empty buffer."""
    low, high = 0, 0
    for begin in range(0, buffer.numel(), _CHUNK_TOKENS):
        chunk_low, chunk_high = torch.aminmax(widen(buffer[begin : begin + _CHUNK_TOKENS].view(token_dtype)))
        low, high = (int(chunk_low), int(chunk_high)) if begin == 0 else (min(low, int(chunk_low)),
                                                                           max(high, int(chunk_high)))
    return low, high


def _narrowest(low: int, high: int) -> torch.dtype:
    """The narrowest of int16, int32 and int64 that holds every value in ``[low, high]``."""
    return next(dtype for dtype in _WIDTHS if torch.iinfo(dtype).min <= low and high <= torch.iinfo(dtype).max)


_BUILT: weakref.WeakKeyDictionary[PackedTokens, PackedRows] = weakref.WeakKeyDictionary()


def packed_rows(dataset: PackedTokens) -> PackedRows:
    """The rows of ``dataset``'s plan, made on first use and kept while the dataset lives (its
    loaders share them)."""
    rows = _BUILT.get(dataset)
    if rows is None:
        rows = PackedRows.build(signed_view(dataset.tokens()), dataset.token_dtype, dataset.plan, dataset.pad_id)
        _BUILT[dataset] = rows
    return rows
