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
takes 2. Its ``cu_seqlens`` and ``max_seqlen`` come from a host-side table of each row's segment
starts and longest segment (:meth:`PackedRows.cu_seqlens`: one take of the batch's rows and a
few numpy operations over them), so nothing per token crosses to the device and nothing syncs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

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
    name, stored dtype and first column in ``block`` viewed as that dtype; ``segments``: each
    row's segment starts within the row (int32, as many columns as the row with the most
    segments has, -1 past a row's last), then its longest segment: 4 bytes a column a row, 56
    for the bench's corpus (documents of median 400 tokens in rows of 2048), against 10 a token
    in ``block``; one row of very short documents widens every row."""

    seq_len: int
    block: torch.Tensor
    layout: tuple[tuple[str, torch.dtype, int], ...]
    segments: np.ndarray
    _base: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of ``block`` (what a cache holds)."""
        return self.block.numel() * self.block.element_size()

    def cu_seqlens(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
        """``cu_seqlens`` (int32) of the batch of ``rows`` and its ``max_seqlen``, on the host."""
        count = len(rows)
        base = self._base.get(count)
        if base is None:  # each row's first flat index in the batch
            base = self._base.setdefault(count, np.arange(0, count * self.seq_len, self.seq_len)[:, None])
        picked = self.segments[rows]
        starts = picked[:, :-1]
        found = (starts + base)[starts >= 0]
        edges = np.empty(len(found) + 1, dtype=np.int32)
        edges[:-1] = found
        edges[-1] = count * self.seq_len
        return edges, int(picked[:, -1].max())

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
        segment_rows = np.cumsum(segment_starts == 0) - 1
        first = np.searchsorted(segment_rows, segment_rows)  # each segment's row's first segment
        table = np.full((count, int(np.bincount(segment_rows, minlength=count).max()) + 1), -1, dtype=np.int32)
        table[segment_rows, np.arange(len(segment_rows)) - first] = segment_starts
        table[:, -1] = longest
        return cls(seq_len, block, tuple(layout), table)


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
