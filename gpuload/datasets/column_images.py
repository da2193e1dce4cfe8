"""Encoded images in an Arrow column, read by gpuload's image path like files of an image folder.

A column of images is ``binary`` (the encoded bytes of each row) or a Hugging Face
``datasets.Image()`` column: a struct of ``bytes`` and ``path``, where a row without bytes is
the local file at ``path``. :class:`ColumnImages` is an :class:`ImageFiles` over one such column,
so the image source decodes it a batch at once (DALI/nvJPEG on the GPU, PIL/torchvision on the
CPU) and its image cache keeps the decoded images; sample ``i`` is named by its column and table
row (``column 'image', row 7``) wherever a bad image is reported.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

from gpuload.datasets.images import ImageFiles
from gpuload.decode import ImageDecodeError

__all__ = ["ColumnImages", "image_column_error"]


def image_column_error(arrow_type: Any) -> str | None:
    """Why a column of ``arrow_type`` cannot hold encoded images (None: it can)."""
    import pyarrow as pa

    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return None
    if pa.types.is_struct(arrow_type) and {field.name for field in arrow_type} == {"bytes", "path"}:
        return None
    return (f"it is {arrow_type}; an image column is binary (the encoded bytes) or a struct of bytes and "
            "path (datasets' Image feature)")


class ColumnImages(ImageFiles):
    """The encoded images of ``array`` (a ``pyarrow.ChunkedArray``), sample ``i`` being table row
    ``rows[i]`` (``rows`` None: row ``i``); ``column`` names it in errors. ``rgb_only``: refuse an
    image whose own mode is not RGB (datasets gives such an image in its own channels, gpuload's
    decoders give RGB, so the batches would differ from torch's)."""

    def __init__(self, column: str, array: Any, rows: torch.Tensor | None = None, rgb_only: bool = False) -> None:
        why_not = image_column_error(array.type)
        if why_not is not None:
            raise TypeError(f"column {column!r} does not hold encoded images: {why_not}")
        self.column, self.array, self.rows, self.rgb_only = column, array, rows, rgb_only
        self.samples = []  # no files: path() and read_encoded() read the column
        self.classes, self.class_to_idx = [], {}

    def __len__(self) -> int:
        return len(self.array) if self.rows is None else len(self.rows)

    def row(self, index: int) -> int:
        """The table row of sample ``index``."""
        return index if self.rows is None else int(self.rows[index])

    def path(self, index: int) -> str:
        return f"column {self.column!r}, row {self.row(index)}"

    def label(self, index: int) -> int:
        return 0  # the table's other columns carry the labels

    def paths(self, indices: Sequence[int]) -> list[str]:
        return [self.path(index) for index in indices]

    def labels(self, indices: Sequence[int]) -> list[int]:
        return [0] * len(indices)

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        """The row's encoded bytes (read from its file where the struct names only a path)."""
        value = self.array[self.row(index)].as_py()
        if isinstance(value, dict):
            data, path = value["bytes"], value["path"]
            if data is None and path is not None:
                try:
                    with open(path, "rb") as file:
                        data = file.read()
                except OSError as error:
                    raise ImageDecodeError(index, self.path(index), "read",
                                           f"{type(error).__name__}: {error}") from error
            value = data
        if value is None:
            raise ImageDecodeError(index, self.path(index), "read", "the row is null (no image)")
        if self.rgb_only:
            self._check_rgb(index, value)
        return value, 0

    def _check_rgb(self, index: int, data: bytes) -> None:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as image:
                mode = image.mode
        except Exception:  # noqa: BLE001 - not an image: the decoder reports it with its reason
            return
        if mode != "RGB":
            raise ImageDecodeError(
                index, self.path(index), "read",
                f"the image is {mode}, which datasets gives in its own channels while gpuload decodes RGB; "
                f"cast the column to RGB: dataset.cast_column({self.column!r}, datasets.Image(mode='RGB'))")
