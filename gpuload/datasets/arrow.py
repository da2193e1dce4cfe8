"""Arrow tables and Parquet files as map-style datasets: ``ArrowTable`` and ``Parquet``.

A sample is a dict of the table's columns: numbers, bools and (fixed-size or variable-length)
lists of them as tensors of the column's Arrow type, strings and bytes as they are (the columns
named in ``images=`` decoded as images), structs as dicts, nulls as None. gpuload.DataLoader
serves them column by column (``sources/arrow.py``); ``__getitem__`` is what torch's own
DataLoader would call, and what gpuload's batches equal.

pyarrow is optional (the ``arrow`` extra): it is imported when a table is first made, never by
``import gpuload``.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from gpuload.datasets.column_images import ColumnImages, image_column_error

__all__ = ["ArrowTable", "Parquet", "arrow_table", "cached_bytes", "hugging_face_dataset", "import_optional",
           "torch_dtype"]

_EXTRA = "pip install 'gpuload[arrow]'"


def import_optional(name: str) -> Any:
    """The module ``name`` (``pyarrow``, ``pyarrow.parquet`` or ``datasets``), or an ImportError
    naming the extra that brings it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"gpuload's Arrow support needs {name.split('.')[0]}: {_EXTRA}") from error


def torch_dtype(arrow_type: Any) -> torch.dtype | None:
    """The torch dtype holding an Arrow number or bool type unchanged (None for other types)."""
    pa = import_optional("pyarrow")
    if pa.types.is_boolean(arrow_type):
        return torch.bool
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        return getattr(torch, arrow_type.to_pandas_dtype().__name__)
    return None


def _numeric_leaf(arrow_type: Any) -> Any:
    """The number type inside (nested) lists of ``arrow_type``, or None when it is not one."""
    pa = import_optional("pyarrow")
    while pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(
            arrow_type):
        arrow_type = arrow_type.value_type
    return arrow_type if torch_dtype(arrow_type) is not None else None


def _fixed_width(arrow_type: Any) -> int | None:
    """Bytes per row of a fixed-width column (numbers, bools, fixed-size lists and structs of
    them), as gpuload's cache holds it; None for variable-length types."""
    pa = import_optional("pyarrow")
    if pa.types.is_struct(arrow_type):
        widths = [_fixed_width(field.type) for field in arrow_type]
        return None if None in widths else sum(width for width in widths if width is not None)
    size = 1
    while pa.types.is_fixed_size_list(arrow_type):
        size *= arrow_type.list_size
        arrow_type = arrow_type.value_type
    dtype = torch_dtype(arrow_type)
    return None if dtype is None else size * dtype.itemsize


def cached_bytes(schema: Any) -> tuple[int, str]:
    """Bytes per row the cache holds of a table with ``schema`` (its fixed-width columns: the
    others are read from the table per batch), and each column's share in words."""
    parts, per_batch, total = [], [], 0
    for field in schema:
        width = _fixed_width(field.type)
        if width is None:
            per_batch.append(f"{field.name} ({field.type})")
        else:
            total += width
            parts.append(f"{field.name} ({field.type}) {width} B")
    words = "cached per row: " + (", ".join(parts) or "nothing")
    if per_batch:
        words += "; read from the table per batch: " + ", ".join(per_batch)
    return total, words


def _sample_value(arrow_type: Any, value: Any) -> Any:
    """One cell of a row (as ``to_pylist`` gives it) as an ArrowTable sample holds it."""
    pa = import_optional("pyarrow")
    if value is None:
        return None
    if pa.types.is_struct(arrow_type):
        return {field.name: _sample_value(field.type, value[field.name]) for field in arrow_type}
    leaf = _numeric_leaf(arrow_type)
    if leaf is not None:
        try:
            return torch.tensor(value, dtype=torch_dtype(leaf))
        except (TypeError, RuntimeError, ValueError):  # a null inside a list: no tensor form
            return value
    return value


def _image_columns(table: Any, names: Sequence[str], owner: str) -> dict[str, ColumnImages]:
    """The named columns of ``table`` as images (a clear error for a missing or non-image one)."""
    if isinstance(names, str):
        raise TypeError(f"{owner}: images= takes a list of column names, not the string {names!r}")
    images = {}
    for name in names:
        if name not in table.column_names:
            raise KeyError(f"{owner}: images= names {name!r}, which is not a column of this table; it has "
                           f"{', '.join(table.column_names)}")
        why_not = image_column_error(table.schema.field(name).type)
        if why_not is not None:
            raise TypeError(f"{owner}: column {name!r} cannot hold encoded images: {why_not}")
        images[name] = ColumnImages(name, table.column(name))
    return images


def _read_arrow(path: Path) -> Any:
    """A table memory-mapped from an Arrow IPC file or stream (``save_to_disk`` writes streams)."""
    pa = import_optional("pyarrow")
    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def _arrow_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.arrow"))
        if not files:
            raise FileNotFoundError(f"ArrowTable: no .arrow files in the folder {path}")
        return files
    if not path.exists():
        raise FileNotFoundError(f"ArrowTable: no such file or folder: {path}")
    return [path]


class ArrowTable(Dataset):
    """A map-style dataset over the rows of a ``pyarrow.Table``.

    ``ArrowTable(table)`` serves a table in memory; ``ArrowTable(path)`` memory-maps an Arrow
    IPC file, or every ``.arrow`` file of a folder in name order (what ``datasets``'
    ``save_to_disk`` writes), so nothing is read until it is used. Sample ``i`` is a dict of
    the row's columns (see the module docstring); ``columns``: only these, in this order.
    ``images``: columns of encoded images (binary, or datasets' Image struct of bytes and path),
    decoded in a sample to uint8 RGB ``(3, H, W)`` as ``ImageFolder`` decodes a file, and by
    gpuload.DataLoader's image path a batch at once (its ``transforms=`` apply to them).
    ``files``: the files the table was read from (none for a table given in memory), which
    identify its decoded images on the disk tier.
    """

    def __init__(self, table: Any, columns: Sequence[str] | None = None, images: Sequence[str] = ()) -> None:
        pa = import_optional("pyarrow")
        self.files: list[str] = []
        if isinstance(table, (str, os.PathLike)):
            paths = _arrow_files(Path(table))
            self.files = [os.path.abspath(path) for path in paths]
            tables = [_read_arrow(file) for file in paths]
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        if not isinstance(table, pa.Table):
            raise TypeError(f"{type(self).__name__} takes a pyarrow.Table or a path, not a {type(table).__name__}")
        if columns is not None:
            missing = [name for name in columns if name not in table.column_names]
            if missing:
                raise KeyError(f"{type(self).__name__}: no column {', '.join(missing)} in this table; it has "
                               f"{', '.join(table.column_names)}")
            table = table.select(list(columns))
        self.table = table
        self.images = _image_columns(table, images, type(self).__name__)

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} rows")
        index %= len(self)
        row = self.table.slice(index, 1).to_pylist()[0]
        return {field.name: self.images[field.name][index][0] if field.name in self.images
                else _sample_value(field.type, row[field.name]) for field in self.table.schema}

    def __repr__(self) -> str:
        columns = ", ".join(f"{field.name}: {field.type}" for field in self.table.schema)
        return f"{type(self).__name__}({len(self)} rows; {columns})"


class Parquet(ArrowTable):
    """The rows of one Parquet file, or of every file a glob matches (in name order), as an
    :class:`ArrowTable`; the files are read memory-mapped, decompressed once (``columns``: only
    these are read)."""

    def __init__(self, path: str | os.PathLike[str], columns: Sequence[str] | None = None,
                 images: Sequence[str] = ()) -> None:
        pa = import_optional("pyarrow")
        pq = import_optional("pyarrow.parquet")
        pattern = os.fspath(path)
        files = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not files:
            raise FileNotFoundError(f"Parquet: no file matches {pattern}")
        for file in files:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"Parquet: no such file: {file}")
        tables = [pq.read_table(file, memory_map=True, columns=columns) for file in files]
        super().__init__(pa.concat_tables(tables) if len(tables) > 1 else tables[0], columns, images)
        self.files = [os.path.abspath(file) for file in files]


def hugging_face_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.Dataset`` (asked without importing ``datasets``: a
    user holding one has imported it)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.Dataset)


def arrow_table(dataset: Any) -> Any | None:
    """The Arrow table behind an ArrowTable or a ``datasets.Dataset`` (None for other datasets)."""
    if isinstance(dataset, ArrowTable):
        return dataset.table
    if hugging_face_dataset(dataset):
        return dataset.data.table
    return None
