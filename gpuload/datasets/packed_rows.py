"""The rows of a packing plan made once, stored narrow, so a batch of packed rows is a gather of rows.

A :class:`~gpuload.datasets.packing.PackingPlan` does not change between epochs, so what each of
its rows holds is computed once (by ``gather_rows``, the per-row reference, a chunk of rows at a
time) and kept as one array, ``block``, of ``rows`` rows of two parts:

- ids, ``seq_len + 1`` columns: the row's input ids (``pad_id`` on its padding), then the label
  of its last token. A token's label is the id in the next column: the next token of a document
  is the next one in the row, or, at the row's end, the extra column. The one exception, a
  truncated document ending inside a row (greedy with ``long_documents="truncate"``: its last
  token's label is the document's next token, which no row holds), is kept apart (``fixes``);
- meta, ``seq_len`` columns: each token's position in its segment, with the sign bit set where
  the token has no label (-100).

``block`` has the token buffer's dtype (its signed view), or int64 where ``pad_id`` or ``seq_len`` do
not fit it: ``(2 * seq_len + 1) * itemsize`` bytes a row, about twice the token buffer. A batch is
then one gather of rows, one widening and a few element-wise kernels on its device (no masked
fill: on a CPU it costs 20x an add), see :meth:`PackedRows.batch`;
its ``cu_seqlens`` and ``max_seqlen`` come from host-side segment data of the batch's rows
(:meth:`PackedRows.cu_seqlens`), so nothing per token crosses to the device and nothing syncs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from gpuload.datasets.packing import IGNORE_INDEX, PackedTokens, PackingPlan, gather_rows
from gpuload.datasets.tokens import signed_view

__all__ = ["PackedRows", "packed_rows"]

_CHUNK_TOKENS = 1 << 20  # tokens of rows made at a time while building (bounds the int64 temporaries)


@dataclass(frozen=True)
class PackedRows:
    """What every row of a packing plan holds (see the module docstring). ``id_mask``: what widened
    ids are masked with (uint16/uint32 ids are stored as their signed bit pattern; -1 for others);
    ``segment_ptr``/``segment_starts``: each row's segment starts within the row (CSR over rows);
    ``row_max_seqlen``: each row's longest segment; ``fix_ptr``/``fix_column``/``fix_label``: the
    labels the next column does not hold (CSR over rows, empty but for greedy truncation)."""

    seq_len: int
    block: torch.Tensor
    id_mask: int
    segment_ptr: np.ndarray
    segment_starts: np.ndarray
    row_max_seqlen: np.ndarray
    fix_ptr: np.ndarray
    fix_column: np.ndarray
    fix_label: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes of ``block`` (what a cache holds)."""
        return self.block.numel() * self.block.element_size()

    @property
    def host_nbytes(self) -> int:
        """Bytes of the host-side segment data and label fixes."""
        return sum(a.nbytes for a in (self.segment_ptr, self.segment_starts, self.row_max_seqlen, self.fix_ptr,
                                      self.fix_column, self.fix_label))

    def cu_seqlens(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
        """``cu_seqlens`` (int32) of the batch of ``rows`` and its ``max_seqlen``, on the host."""
        first = self.segment_ptr[rows]
        counts = self.segment_ptr[rows + 1] - first
        ends = np.cumsum(counts)
        within = np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)
        starts = self.segment_starts[np.repeat(first, counts) + within]
        starts += np.repeat(np.arange(len(rows), dtype=np.int64) * self.seq_len, counts)
        edges = np.empty(len(starts) + 1, dtype=np.int32)
        edges[:-1], edges[-1] = starts, len(rows) * self.seq_len
        return edges, int(self.row_max_seqlen[rows].max())

    def fixes(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The batch's labels the next column does not hold: flat positions in the batch and their
        labels (int64), or None (always, but for greedy truncation)."""
        if not len(self.fix_column):
            return None
        first = self.fix_ptr[rows]
        counts = self.fix_ptr[rows + 1] - first
        if not counts.any():
            return None
        ends = np.cumsum(counts)
        taken = np.repeat(first, counts) + np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)
        flat = self.fix_column[taken] + np.repeat(np.arange(len(rows), dtype=np.int64) * self.seq_len, counts)
        return flat, self.fix_label[taken]

    def batch(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """``input_ids``, ``labels`` and ``position_ids`` (int64, ``(rows, seq_len)``) from a batch's
        rows of ``block`` (gathered, on any device), without the label fixes."""
        seq_len = self.seq_len
        wide = block.to(torch.int64)
        meta = wide[:, seq_len + 1 :]
        unlabelled = meta >> (torch.iinfo(block.dtype).bits - 1)  # -1 where the flag (sign) bit is set, else 0
        labels = (wide[:, 1 : seq_len + 1] & self.id_mask).bitwise_or_(unlabelled)  # -1 where unlabelled
        return {
            "input_ids": wide[:, :seq_len] & self.id_mask,
            "labels": labels.sub_(unlabelled & (-1 - IGNORE_INDEX)),
            "position_ids": meta & torch.iinfo(block.dtype).max,
        }

    @classmethod
    def build(cls, buffer: torch.Tensor, token_dtype: torch.dtype, plan: PackingPlan, pad_id: int) -> PackedRows:
        """Every row of ``plan`` made by ``gather_rows`` from ``buffer`` (the flat token buffer's
        signed view, on the host), a chunk of rows at a time, stored narrow."""
        seq_len, count = plan.seq_len, plan.rows
        stored = token_dtype if _holds(token_dtype, pad_id, seq_len) else torch.int64
        physical = signed_view(torch.empty(0, dtype=stored)).dtype
        block = torch.empty(count, 2 * seq_len + 1, dtype=physical)
        ids, meta = block[:, : seq_len + 1], block[:, seq_len + 1 :]
        starts: list[np.ndarray] = []
        longest = np.empty(count, dtype=np.int64)
        fix_rows: list[np.ndarray] = []
        fix_columns: list[np.ndarray] = []
        fix_labels: list[np.ndarray] = []
        step = max(1, _CHUNK_TOKENS // seq_len)
        for begin in range(0, count, step):
            rows = np.arange(begin, min(count, begin + step))
            segments = plan.segments(rows)
            made = gather_rows(buffer, token_dtype, torch.from_numpy(segments.table),
                               torch.from_numpy(segments.cu_seqlens), len(rows), seq_len, pad_id)
            input_ids, labels, positions = made["input_ids"], made["labels"], made["position_ids"]
            labelled = labels != IGNORE_INDEX
            ids[begin : begin + len(rows), :seq_len] = _narrow(input_ids, stored)
            ids[begin : begin + len(rows), seq_len] = _narrow(labels[:, -1].where(labelled[:, -1], 0), stored)
            unlabelled = torch.iinfo(physical).min * (~labelled).to(torch.int64)
            meta[begin : begin + len(rows)] = (positions + unlabelled).to(physical)
            apart = labelled[:, :-1] & (labels[:, :-1] != input_ids[:, 1:])
            row, column = (t.numpy() for t in torch.nonzero(apart, as_tuple=True))
            fix_rows.append(row + begin)
            fix_columns.append(column)
            fix_labels.append(labels[:, :-1][apart].numpy())
            edges = segments.cu_seqlens.astype(np.int64)
            starts.append(edges[:-1] % seq_len)
            first_of_row = np.flatnonzero(edges[:-1] % seq_len == 0)
            longest[rows] = np.maximum.reduceat(np.diff(edges), first_of_row)
        segment_starts = np.concatenate(starts)
        segment_ptr = np.append(np.flatnonzero(segment_starts == 0), len(segment_starts))
        fixed_rows = np.concatenate(fix_rows)
        id_mask = (1 << torch.iinfo(physical).bits) - 1 if stored != physical else -1
        return cls(seq_len, block, id_mask, segment_ptr, segment_starts.astype(np.int32), longest,
                   np.searchsorted(fixed_rows, np.arange(count + 1)), np.concatenate(fix_columns).astype(np.int64),
                   np.concatenate(fix_labels).astype(np.int64))


def _holds(token_dtype: torch.dtype, pad_id: int, seq_len: int) -> bool:
    """Whether ``token_dtype`` stores ``pad_id``, and its signed view (a signed dtype) a position
    below ``seq_len`` with the sign bit free."""
    physical = signed_view(torch.empty(0, dtype=token_dtype)).dtype
    return (torch.iinfo(token_dtype).min <= pad_id <= torch.iinfo(token_dtype).max and physical.is_signed
            and seq_len - 1 <= torch.iinfo(physical).max)


def _narrow(values: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
    """int64 ``values`` (in ``stored``'s range) as ``stored``'s signed view."""
    return signed_view(values.to(stored))


_BUILT: weakref.WeakKeyDictionary[PackedTokens, PackedRows] = weakref.WeakKeyDictionary()


def packed_rows(dataset: PackedTokens) -> PackedRows:
    """The rows of ``dataset``'s plan, made on first use and kept while the dataset lives (its
    loaders share them)."""
    rows = _BUILT.get(dataset)
    if rows is None:
        rows = PackedRows.build(signed_view(dataset.tokens()), dataset.token_dtype, dataset.plan, dataset.pad_id)
        _BUILT[dataset] = rows
    return rows
