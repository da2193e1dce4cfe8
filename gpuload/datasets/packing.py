"""PackedTokens: variable-length documents packed into rows of ``seq_len`` tokens, no padding
between them, with the boundaries attention needs to keep documents apart.

Row ``i`` is a dict of ``input_ids``, ``labels`` and ``position_ids`` (int64, ``seq_len`` each);
:func:`collate_packed` stacks rows into a batch and adds ``cu_seqlens`` (int32, the segment
boundaries of the flattened batch, as ``flash_attn_varlen_func`` takes them) and ``max_seqlen``.
A *segment* is a run of one document's tokens in a row (a document cut at a row's end goes on
in a segment of the next row), or a row's padding at its end. ``position_ids`` restart at 0 at
every segment, so ``cu_seqlens`` and ``position_ids`` say the same (transformers derives one
from the other). ``labels[t]`` is the token after ``input_ids[t]`` in the same document, and
-100 at a document's last token, on padding, and where the next token is a masked prompt token.

The packing plan (which document piece goes where) is computed once, on the host, as a few
int arrays per piece (about 40 bytes a piece); a batch is made from the batch's segments by
one gather of token positions from the flat token buffer, on whatever device holds it
(``gpuload.sources.packed`` keeps it on the GPU). The plan does not change between epochs: the
number of rows stays fixed (torch's samplers and ``DistributedSampler`` read it once), resume
needs nothing but the sampler's position, and the sampler's shuffle reorders rows each epoch.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from gpuload.datasets.tokens import (
    Shard,
    TokenFileError,
    _from_array,
    check_unchanged,
    joined_tokens,
    open_shards,
    shard_paths,
    signed_view,
    widen,
)

__all__ = ["IGNORE_INDEX", "LONG_DOCUMENTS", "STRATEGIES", "PackedTokens", "PackingPlan", "Segments",
           "collate_packed", "gather_rows"]

IGNORE_INDEX = -100  # the label torch's cross_entropy ignores by default
STRATEGIES = ("greedy", "best_fit")
LONG_DOCUMENTS = ("split", "truncate")
_SCAN_TOKENS = 1 << 24  # tokens compared with the end-of-text id at a time (a bounded temporary)


@dataclass(frozen=True)
class Segments:
    """One batch's segments, row after row, over the flattened batch (token ``t`` of the batch is
    row ``t // seq_len``). ``table`` is ``(segments, 5)`` int64: what to add to a token's flat
    index to find it in the token buffer, the segment's first flat index, the flat range whose
    tokens have a label (``[from, to)``), and whether the segment is padding."""

    table: np.ndarray
    cu_seqlens: np.ndarray  # int32, segments + 1
    rows: int

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max())


@dataclass(frozen=True)
class PackingPlan:
    """Where the pieces of every row come from. Piece ``p`` (row ``r``'s pieces are
    ``row_ptr[r]:row_ptr[r + 1]``, in row order) is ``length[p]`` tokens from ``start[p]`` of
    the flat buffer; its positions ``label_from[p] <= k < label_to[p]`` have a label."""

    seq_len: int
    row_ptr: np.ndarray
    start: np.ndarray
    length: np.ndarray
    label_from: np.ndarray
    label_to: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    @functools.cached_property
    def row_fill(self) -> np.ndarray:
        """Tokens of documents in each row (the rest of the row is padding); computed once."""
        filled = np.concatenate([[0], np.cumsum(self.length)])
        return filled[self.row_ptr[1:]] - filled[self.row_ptr[:-1]]

    def segments(self, rows: np.ndarray) -> Segments:
        """The segments of ``rows`` (in ``[0, self.rows)``), each row's pieces then its padding."""
        seq_len = self.seq_len
        first_piece = self.row_ptr[rows]
        counts = self.row_ptr[rows + 1] - first_piece
        fill = self.row_fill[rows]
        padded = fill < seq_len
        per_row = counts + padded
        row_first = np.cumsum(per_row) - per_row  # each row's first segment
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        pieces = np.repeat(first_piece, counts) + within
        placed = np.repeat(row_first, counts) + within
        length = np.zeros(int(per_row.sum()), dtype=np.int64)
        length[placed] = self.length[pieces]
        pads = row_first[padded] + counts[padded]
        length[pads] = seq_len - fill[padded]
        cu_seqlens = np.concatenate([[0], np.cumsum(length)])
        first = cu_seqlens[:-1]
        table = np.zeros((len(length), 5), dtype=np.int64)
        table[placed, 0] = self.start[pieces] - first[placed]
        table[:, 1] = first
        table[placed, 2] = first[placed] + self.label_from[pieces]
        table[placed, 3] = first[placed] + self.label_to[pieces]
        table[pads, 0] = -first[pads]  # padding reads token 0, then is overwritten
        table[pads, 4] = 1
        cu_seqlens = cu_seqlens.astype(np.int32)
        return Segments(table, cu_seqlens, len(rows))


def gather_rows(buffer: torch.Tensor, token_dtype: torch.dtype, table: torch.Tensor, cu_seqlens: torch.Tensor,
                rows: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels`` and ``position_ids`` of ``rows`` rows, ``(rows, seq_len)`` int64,
    on the device of ``buffer`` (the flat token buffer, as a gatherable signed view of
    ``token_dtype`` ids), from the rows' segments (``Segments.table`` and ``cu_seqlens`` on that
    device). The token positions are expanded on the device (no host sync: the output size is
    known: each segment's row of the table repeated for its tokens) and all ids and next ids are
    taken by one gather."""
    count = rows * seq_len
    lengths = cu_seqlens.diff().to(torch.int64)
    offset, first, label_from, label_to, pad = table.repeat_interleave(lengths, dim=0, output_size=count).unbind(1)
    flat = torch.arange(count, device=buffer.device)
    labelled = (flat >= label_from) & (flat < label_to)
    at = torch.empty(2, count, dtype=torch.int64, device=buffer.device)  # each token, then its next one
    torch.add(offset, flat, out=at[0])
    torch.add(at[0], labelled, out=at[1])
    ids = widen(buffer.index_select(0, at.view(-1)).view(token_dtype)).view(2, rows, seq_len)
    return {
        "input_ids": ids[0].masked_fill_(pad.view(rows, seq_len).bool(), pad_id),
        "labels": ids[1].masked_fill_(~labelled.view(rows, seq_len), IGNORE_INDEX),
        "position_ids": flat.sub_(first).view(rows, seq_len),
    }


def collate_packed(rows: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """Rows of :class:`PackedTokens` stacked into a batch, with ``cu_seqlens`` (int32: where each
    segment of the flattened batch starts, then the token count) and ``max_seqlen`` (an int),
    read from the ``position_ids``, which restart at 0 at every segment."""
    batch: dict[str, Any] = {key: torch.stack([row[key] for row in rows]) for key in
                             ("input_ids", "labels", "position_ids")}
    positions = batch["position_ids"].reshape(-1)
    starts = torch.nonzero(positions == 0).reshape(-1)
    cu_seqlens = torch.cat([starts, torch.tensor([positions.numel()])]).to(torch.int32)
    batch["cu_seqlens"] = cu_seqlens
    batch["max_seqlen"] = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return batch


class PackedTokens(Dataset[dict[str, torch.Tensor]]):
    """Documents packed into rows of ``seq_len`` tokens (see the module docstring); serve it with
    ``collate_fn=PackedTokens.collate`` (``gpuload.DataLoader`` then gathers batches on the device).

    ``source``: token files (a path, a list or glob of llm.c / nanoGPT shards, ``.npy``) or a
    1-D array/tensor, cut into documents at ``eot_id`` (``eot_at="start"``: each document
    begins with it, as llm.c's and the speedrun's shards write; ``"end"``: each ends with it); or
    a list of token sequences (lists, arrays, tensors) or an Arrow list column, one document
    each, with ``prompt_lengths`` (one per document) masking the labels of prompt tokens (SFT).
    Documents never cross a shard boundary.

    ``strategy="greedy"``: documents in order, each row filled to its end (a document that does
    not fit goes on in the next row): no look-ahead, no padding but the last row's.
    ``"best_fit"``: each ``window`` of documents, longest first, into the fullest row with room
    (best-fit decreasing), none cut; the rows of a window are closed when it ends.
    ``long_documents``: a document longer than ``seq_len`` is ``"split"`` into pieces of
    ``seq_len`` (each its own segment) or ``"truncate"``-d to its first ``seq_len`` tokens.
    ``pad_id``: the input id of padding (its labels are -100). ``dtype``: as for TokenWindows.
    """

    collate = staticmethod(collate_packed)

    def __init__(
        self,
        source: Any,
        seq_len: int,
        *,
        eot_id: int | None = None,
        eot_at: str = "start",
        prompt_lengths: Sequence[int] | np.ndarray | None = None,
        strategy: str = "greedy",
        window: int = 4096,
        long_documents: str = "split",
        pad_id: int = 0,
        dtype: Any = None,
    ) -> None:
        self.seq_len = _positive(seq_len, "seq_len", "tokens per row")
        self.window = _positive(window, "window", "documents packed together by best_fit")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"long_documents={long_documents!r}: choose one of {', '.join(LONG_DOCUMENTS)}")
        if eot_at not in ("start", "end"):
            raise ValueError(f"eot_at={eot_at!r}: 'start' (each document begins with eot_id) or 'end'")
        self.strategy, self.long_documents, self.pad_id = strategy, long_documents, int(pad_id)
        flat = shard_paths(source) is not None or isinstance(source, (np.ndarray, torch.Tensor))
        if flat:
            if prompt_lengths is not None:
                raise ValueError("prompt_lengths= masks prompts of a list of sequences, not of token files or arrays")
            if isinstance(eot_id, bool) or not isinstance(eot_id, (int, np.integer)) or eot_id < 0:
                raise ValueError(
                    f"eot_id={eot_id!r}: token files and arrays are cut into documents at an end-of-text id; "
                    "pass it (GPT-2: 50256, Llama 3: 128000 <|begin_of_text|>)"
                )
            self.shards, self.token_dtype = open_shards(source, dtype, "PackedTokens")
            starts, lengths = _documents_at(self.shards, int(eot_id), eot_at)
        else:
            shard, starts, lengths = _documents_of(source, dtype)
            self.shards, self.token_dtype = open_shards(shard.tokens, None, "PackedTokens")
        self.num_tokens = sum(len(shard) for shard in self.shards)
        prompts = _prompts(prompt_lengths, lengths)
        self.num_documents = len(lengths)
        self.plan, self._notes = _plan(starts, lengths, prompts, self.seq_len, strategy, self.window, long_documents)
        self._tokens: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.plan.rows

    @property
    def nbytes(self) -> int:
        """Bytes of the flat token buffer (what a cache holds)."""
        return self.num_tokens * torch.empty((), dtype=self.token_dtype).element_size()

    def tokens(self) -> torch.Tensor:
        """The flat token buffer as a 1-D CPU tensor (a single shard's memory itself)."""
        if self._tokens is None:
            self._tokens = joined_tokens(self.shards)
        return self._tokens

    def check_unchanged(self) -> None:
        """Fail, naming the file, when a token file changed since it was opened."""
        check_unchanged(self.shards, "PackedTokens")

    def packing_stats(self) -> dict[str, Any]:
        """The strategy and how well it packed: rows, documents, fill (document tokens over row
        tokens), padding (the rest), documents split over rows and tokens truncated."""
        return {"strategy": self.strategy, "long_documents": self.long_documents, "seq_len": self.seq_len,
                **({"window": self.window} if self.strategy == "best_fit" else {}), **self._notes}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        rows = self.plan.rows
        if not -rows <= index < rows:
            raise IndexError(f"row index {index} is out of range for {rows} packed rows")
        segments = self.plan.segments(np.array([index % rows]))
        batch = gather_rows(signed_view(self.tokens()), self.token_dtype, torch.from_numpy(segments.table),
                            torch.from_numpy(segments.cu_seqlens), 1, self.seq_len, self.pad_id)
        return {key: value[0] for key, value in batch.items()}

    def __repr__(self) -> str:
        notes = self._notes
        return (f"PackedTokens({self.num_documents} documents, {self.num_tokens} tokens into {self.plan.rows} rows "
                f"of seq_len={self.seq_len}, {self.strategy}, fill {notes['fill']:.4f})")


def _positive(value: Any, name: str, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int ({meaning})")
    return int(value)


def _documents_at(shards: Sequence[Shard], eot_id: int, eot_at: str) -> tuple[np.ndarray, np.ndarray]:
    """Documents of the shards (first token in the joined buffer, length), cut at ``eot_id``:
    before each one (``eot_at="start"``) or after it; a shard's edges are edges too."""
    starts, lengths, base = [], [], 0
    for shard in shards:
        tokens, size = shard.tokens, len(shard)
        found = [np.flatnonzero(np.asarray(tokens[i : i + _SCAN_TOKENS]) == eot_id) + i
                 for i in range(0, size, _SCAN_TOKENS)]
        cuts = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        edges = np.unique(np.concatenate([[0], cuts if eot_at == "start" else cuts + 1, [size]]))
        starts.append(edges[:-1] + base)
        lengths.append(np.diff(edges))
        base += size
    return np.concatenate(starts).astype(np.int64), np.concatenate(lengths).astype(np.int64)


def _documents_of(source: Any, dtype: Any) -> tuple[Shard, np.ndarray, np.ndarray]:
    """A list of token sequences, or an Arrow list column, joined into one buffer: the buffer,
    each document's first token in it and its length."""
    if hasattr(source, "combine_chunks"):  # a pyarrow ChunkedArray
        source = source.combine_chunks()
    if hasattr(source, "offsets") and hasattr(source, "flatten"):  # a pyarrow ListArray
        if source.null_count:
            raise TokenFileError(f"the Arrow column holds {source.null_count} null documents; drop them first")
        lengths = np.diff(np.asarray(source.offsets, dtype=np.int64))
        joined = np.asarray(source.flatten().to_numpy(zero_copy_only=False))
    elif isinstance(source, (list, tuple)):
        if not source:
            raise TokenFileError("PackedTokens got an empty list of documents")
        documents = [np.asarray(s.cpu() if isinstance(s, torch.Tensor) else s) for s in source]
        for number, document in enumerate(documents):
            if document.ndim != 1 or (document.size and document.dtype.kind not in "iu"):
                raise TokenFileError(
                    f"document {number}: a document is a 1-D sequence of integer token ids; "
                    f"got {document.dtype} of shape {document.shape}"
                )
        lengths = np.array([len(document) for document in documents], dtype=np.int64)
        joined = np.concatenate([document.astype(np.int64, copy=False) if document.size == 0 else document
                                 for document in documents])
    else:
        raise TypeError(
            "PackedTokens takes token files or a 1-D array/tensor (with eot_id=), or a list of token "
            f"sequences or an Arrow list column (one document each); got {type(source).__name__}"
        )
    if joined.size == 0:
        raise TokenFileError("PackedTokens: the documents hold no tokens")
    starts = np.cumsum(lengths) - lengths
    return _from_array(joined, dtype), starts, lengths


def _prompts(prompt_lengths: Any, lengths: np.ndarray) -> np.ndarray:
    if prompt_lengths is None:
        return np.zeros(len(lengths), dtype=np.int64)
    prompts = np.asarray(prompt_lengths)
    if prompts.shape != lengths.shape or (prompts.size and prompts.dtype.kind not in "iu"):
        raise ValueError(f"prompt_lengths: one int per document ({len(lengths)}); got shape {prompts.shape}")
    prompts = prompts.astype(np.int64)
    bad = np.flatnonzero((prompts < 0) | (prompts > lengths))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"prompt_lengths[{i}]={int(prompts[i])} is not within document {i}'s {int(lengths[i])} tokens")
    return prompts


def _plan(starts: np.ndarray, lengths: np.ndarray, prompts: np.ndarray, seq_len: int, strategy: str, window: int,
          long_documents: str) -> tuple[PackingPlan, dict[str, Any]]:
    """The packing plan of the documents, and what it says of itself (fill, splits)."""
    keep = lengths > 0
    starts, lengths, prompts = starts[keep], lengths[keep], prompts[keep]
    # documents -> chunks of at most seq_len (a long document split, or truncated)
    if long_documents == "split":
        counts = -(-lengths // seq_len)
    else:
        counts = np.ones(len(lengths), dtype=np.int64)
    document = np.repeat(np.arange(len(lengths)), counts)
    offset = (np.arange(len(document)) - np.repeat(np.cumsum(counts) - counts, counts)) * seq_len
    size = np.minimum(seq_len, lengths[document] - offset)
    if strategy == "greedy":
        chunk, within, length, row_ptr = _greedy(size, seq_len)
    else:
        chunk, within, length, row_ptr = _best_fit(size, seq_len, window)
    doc = document[chunk]
    at = offset[chunk] + within  # each piece's first token within its document
    plan = PackingPlan(
        seq_len, row_ptr, starts[doc] + at, length,
        np.clip(prompts[doc] - 1 - at, 0, length), np.clip(lengths[doc] - 1 - at, 0, length),
    )
    rows, packed = plan.rows, int(length.sum())
    notes = {
        "documents": int(len(lengths)), "rows": rows, "pieces": int(len(length)),
        "fill": packed / (rows * seq_len), "padding": 1 - packed / (rows * seq_len),
        "split_documents": int(np.count_nonzero(np.bincount(doc, minlength=len(lengths)) > 1)),
        "truncated_tokens": int(lengths.sum()) - packed,
        "plan_bytes": sum(a.nbytes for a in (row_ptr, plan.start, length, plan.label_from, plan.label_to)),
    }
    return plan, notes


def _greedy(size: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Chunks in order, as one stream cut every ``seq_len`` tokens: pieces (chunk, first token
    within it, length) in row order, and each row's first piece."""
    begins = np.concatenate([[0], np.cumsum(size)])
    total = int(begins[-1])
    cuts = np.union1d(begins[:-1], np.arange(0, total, seq_len))
    ends = np.append(cuts[1:], total)
    chunk = np.searchsorted(begins, cuts, side="right") - 1
    row_ptr = np.searchsorted(cuts // seq_len, np.arange(math.ceil(total / seq_len) + 1))
    return chunk, cuts - begins[chunk], ends - cuts, row_ptr


def _best_fit(size: np.ndarray, seq_len: int, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each window of chunks, longest first, into the row of this window with the least room
    that holds it (a new row when none does). One Python step per chunk (not per token)."""
    row_of = np.empty(len(size), dtype=np.int64)
    placed: list[int] = []
    rows = 0
    for begin in range(0, len(size), window):
        order = begin + np.argsort(-size[begin : begin + window], kind="stable")
        rooms: list[tuple[int, int]] = []  # (room, row), sorted
        for chunk, length in zip(order.tolist(), size[order].tolist()):
            k = bisect.bisect_left(rooms, (length, -1))
            if k < len(rooms):
                room, row = rooms.pop(k)
            else:
                room, row = seq_len, rows
                rows += 1
            row_of[chunk] = row
            placed.append(chunk)
            if room > length:
                bisect.insort(rooms, (room - length, row))
    order = np.asarray(placed, dtype=np.int64)
    chunk = order[np.argsort(row_of[order], kind="stable")]
    row_ptr = np.searchsorted(row_of[chunk], np.arange(rows + 1))
    return chunk, np.zeros(len(chunk), dtype=np.int64), size[chunk], row_ptr
