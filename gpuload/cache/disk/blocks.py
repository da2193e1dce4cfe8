"""The bytes of a disk-tier block: columns, the record of one row, ragged rows and their table.

A fixed-size row is a record of ``record_bytes``, its columns side by side (each aligned to its
item size); a block holds ``B`` consecutive records. A ragged block holds its rows back to back
(each in its own dimension order, aligned to its item size), then its table: per row, an int64
offset, shape and dimension order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

RAGGED = -1
"""A dimension of a ragged column's shape: each row has its own size there (stored per row)."""

DEFAULT_BLOCK_BYTES = 64 << 20
BLOCK_NAME = re.compile(r"^block-(\d{6,})\.(bin|part)$")


@dataclass(frozen=True)
class ColumnSpec:
    """One column of a record: its name, torch dtype and the shape of one row."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def ragged(self) -> bool:
        """Whether rows vary in shape (a :data:`RAGGED` dimension): stored one by one."""
        return RAGGED in self.shape

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize(self.dtype)

    def as_json(self) -> list[Any]:
        return [self.name, str(self.dtype).removeprefix("torch."), list(self.shape)]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def parse_columns(spec: Any) -> tuple[ColumnSpec, ...]:
    """The columns of an entry, checked: ``ColumnSpec``s or a dict name -> (shape, dtype)."""
    if isinstance(spec, Mapping):
        spec = [ColumnSpec(str(n), d, tuple(s)) for n, (s, d) in spec.items()]
    columns = tuple(spec)
    if not columns or not all(isinstance(c, ColumnSpec) for c in columns):
        raise TypeError(
            "columns must be ColumnSpec(name, dtype, shape)s or a dict name -> (shape, dtype), at least one"
        )
    for column in columns:
        if not isinstance(column.dtype, torch.dtype):
            raise TypeError(f"column {column.name!r}: dtype {column.dtype!r} is not a torch.dtype")
        if any(not isinstance(d, int) or d < RAGGED for d in column.shape):
            raise ValueError(
                f"column {column.name!r}: shape {column.shape} must be non-negative ints, or RAGGED (-1) "
                "where rows differ"
            )
    if len({c.name for c in columns}) != len(columns):
        raise ValueError(f"column names repeat: {[c.name for c in columns]}")
    if any(c.ragged for c in columns) and len(columns) != 1:
        raise ValueError("a ragged column (a RAGGED dimension) must be the entry's only column")
    return columns


def record_bytes_of(columns: tuple[ColumnSpec, ...], row_bytes: int | None) -> int:
    """Bytes of one row: the record's, or for a ragged column the caller's estimate (``row_bytes``,
    which sizes its blocks)."""
    if not columns[0].ragged:
        return record_layout(columns)[1]
    if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 1:
        raise ValueError(f"a ragged column needs row_bytes= (a positive int: typical bytes of a row), "
                         f"not {row_bytes!r}")
    return row_bytes


def record_layout(columns: tuple[ColumnSpec, ...]) -> tuple[list[int], int]:
    """Each column's byte offset in a record (aligned to its item size) and the record size
    (aligned to the largest item size, so every row of every column stays aligned)."""
    offsets, at, align = [], 0, 1
    for column in columns:
        size = itemsize(column.dtype)
        align = max(align, size)
        at = -(-at // size) * size
        offsets.append(at)
        at += column.row_bytes
    return offsets, max(align, -(-at // align) * align)


# ---------------------------------------------------------------- budget


def ragged_table(view: np.ndarray, rows: int, entry_words: int) -> np.ndarray:
    """A ragged block's row table (at its end): offset, shape and dimension order per row."""
    return view[view.size - rows * entry_words * 8:].view(np.int64).reshape(-1, entry_words)


def ragged_table_problem(view: np.ndarray, rows: int, column: ColumnSpec) -> str:
    """What is wrong with a ragged block's table ("" when every row lies in its data)."""
    ndim = len(column.shape)
    words = rows * (1 + 2 * ndim)
    if view.size < words * 8:
        return f"is {view.size} bytes, too short for its table of {rows} rows"
    data_end = view.size - words * 8
    for entry in ragged_table(view, rows, 1 + 2 * ndim).tolist():
        offset, shape, order = entry[0], entry[1:1 + ndim], entry[1 + ndim:]
        size = int(np.prod(shape, dtype=np.int64)) * itemsize(column.dtype)
        if min(shape, default=0) < 0 or sorted(order) != list(range(ndim)) or not 0 <= offset <= data_end - size:
            return "has a damaged row table"
    return ""


def pack_records(columns: tuple[ColumnSpec, ...], offsets: Sequence[int], record_bytes: int, rows: int,
                 values: Sequence[torch.Tensor]) -> np.ndarray:
    """``rows`` records of ``record_bytes`` (a uint8 array), each column's values at its offset;
    ValueError naming the column whose tensor has the wrong shape or dtype."""
    if len(values) != len(columns):
        raise ValueError(f"write got {len(values)} columns, the disk cache has {len(columns)} "
                         f"({', '.join(c.name for c in columns)})")
    records = torch.empty((rows, record_bytes), dtype=torch.uint8)
    for spec, offset, value in zip(columns, offsets, values):
        want = (rows, *spec.shape)
        if not isinstance(value, torch.Tensor) or value.dtype != spec.dtype or tuple(value.shape) != want:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"column {spec.name!r}: write needs a tensor of shape {want} and dtype "
                f"{spec.dtype}, got {got}"
            )
        if spec.row_bytes and rows:
            flat = value.detach().cpu().contiguous().reshape(rows, -1)
            records[:, offset:offset + spec.row_bytes] = flat.view(torch.uint8)
    return records.numpy()


def pack_items(spec: ColumnSpec, rows: int, items: Sequence[torch.Tensor]) -> np.ndarray:
    """Each item as (its bytes in its own dimension order, shape, order): an object array."""
    if len(items) != rows:
        raise ValueError(f"write_items got {len(items)} items for {rows} rows")
    packed = np.empty(rows, dtype=object)
    for k, item in enumerate(items):
        if (not isinstance(item, torch.Tensor) or item.dtype != spec.dtype or item.dim() != len(spec.shape)
                or any(want not in (RAGGED, got) for want, got in zip(spec.shape, item.shape))):
            got = f"{tuple(item.shape)} {item.dtype}" if isinstance(item, torch.Tensor) else type(item).__name__
            raise ValueError(f"column {spec.name!r}: write_items needs tensors of shape {spec.shape} "
                             f"(-1: any size) and dtype {spec.dtype}, got {got}")
        strides = item.stride()
        order = sorted(range(item.dim()), key=lambda d: (-strides[d], d))  # as laid out in memory
        data = item.detach().cpu().permute(order).contiguous().reshape(-1).view(torch.uint8).numpy()
        packed[k] = (data, list(item.shape), order)
    return packed


def distinct(values: np.ndarray) -> list[int]:
    """The distinct values, sorted (not ``np.unique``: its first call in a process imports
    ``numpy.ma``, 0.4 s on a busy core, inside the first batch)."""
    return sorted(set(values.tolist()))
