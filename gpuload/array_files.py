"""What a user's ``.npy``/``.npz`` file holds, read from its headers without loading its data.

Free of torch, so that ``gpuload bench --data`` and ``gpuload plan`` refuse a file they cannot
use at once, in one line naming it, before anything heavy is imported or any output is
written. Each array is one column of the same samples: one row per sample.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

__all__ = ["ArrayFile", "read_array_file"]


@dataclass(frozen=True)
class ArrayFile:
    """The arrays of one file: name -> (shape, dtype), all with ``rows`` rows."""

    path: Path
    columns: dict[str, tuple[tuple[int, ...], np.dtype]]
    rows: int

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one sample over every array."""
        return sum(int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize for shape, dtype in self.columns.values())

    def describe(self) -> str:
        listed = ", ".join(f"{name} {shape} {dtype}" for name, (shape, dtype) in self.columns.items())
        return f"arrays in {self.path}: {listed}"


def _header(handle: IO[bytes], size: int, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from an .npy header; ValueError when it is not one or its data is cut short."""
    try:
        version = np.lib.format.read_magic(handle)
    except ValueError:
        raise ValueError(f"{what} is not a NumPy array (it does not start with NumPy's .npy header)") from None
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = reader(handle)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise ValueError(f"{what} holds Python objects (dtype {dtype}); give numeric arrays")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = size - handle.tell()
    if found < expected:
        raise ValueError(f"{what} is cut short: its header promises {expected} bytes of data, the file has {found}")
    return tuple(int(n) for n in shape), dtype


def _columns(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    if path.suffix == ".npy":
        with open(path, "rb") as handle:
            return {path.stem: _header(handle, os.fstat(handle.fileno()).st_size, "the file")}
    if path.suffix != ".npz":
        raise ValueError("it is not an .npy or .npz file")
    if not zipfile.is_zipfile(path):
        raise ValueError("it is not a NumPy .npz file (not a zip archive)")
    columns = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.filename.endswith(".npy"):
                name = info.filename.removesuffix(".npy")
                with archive.open(info) as member:
                    columns[name] = _header(member, info.file_size, f"array {name!r}")
    return columns


def read_array_file(path: str | os.PathLike[str]) -> ArrayFile:
    """The file's arrays from their headers; ``ValueError`` naming the file and what is wrong.

    Refused: a missing or unreadable file, one that is not NumPy's format (a text file named
    ``.npy``), Python objects, a cut-short file, no arrays, a 0-d array, arrays whose row
    counts differ, and zero rows.
    """
    where = Path(path)
    try:
        columns = _columns(where)
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ValueError(f"cannot read {path} as {where.suffix or '.npy/.npz'} arrays: {reason}") from None
    if not columns:
        raise ValueError(f"{path} holds no arrays")
    for name, (shape, _) in columns.items():
        if len(shape) == 0:
            raise ValueError(f"array {name!r} in {path} is 0-dimensional; each array needs one row per sample")
    rows = {name: shape[0] for name, (shape, _) in columns.items()}
    if len(set(rows.values())) != 1:
        listed = ", ".join(f"{name}: {count}" for name, count in rows.items())
        raise ValueError(f"the arrays in {path} must have the same number of rows (one per sample); got {listed}")
    count = next(iter(rows.values()))
    if count == 0:
        raise ValueError(f"{path} holds 0 rows: each row is a sample and there must be at least one")
    return ArrayFile(where, columns, count)
