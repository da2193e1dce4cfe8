"""Image headers: the upright size of an encoded image without decoding it, and ROI clipping.

The crop windows of ROI decoding, the image cache's size estimate and the pixel limit all
start from the header: these functions read only it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

__all__ = ["ROI", "peek_size", "clip_roi"]

ROI = tuple[int, int, int, int]
"""A region of interest ``(y0, x0, height, width)`` in pixels of the upright (EXIF-applied) image."""

_EXIF_ORIENTATION = 0x0112
_TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # these swap width and height


def peek_size(data: bytes) -> tuple[int, int]:
    """``(height, width)`` of the upright image, read from the header only (no pixel decode).

    Use it to draw crop windows (RandomResizedCrop) before decoding with ``rois=``.
    """
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    if orientation in _TRANSPOSED_ORIENTATIONS:
        return width, height
    return height, width


def clip_roi(roi: Sequence[int], height: int, width: int) -> ROI | None:
    """Intersect ``roi = (y0, x0, h, w)`` with a ``height`` x ``width`` image; None if empty."""
    if len(roi) != 4:
        raise ValueError(f"a ROI is (y0, x0, height, width); got {tuple(roi)!r}")
    y0, x0, h, w = (int(v) for v in roi)
    top, left = max(y0, 0), max(x0, 0)
    bottom, right = min(y0 + h, height), min(x0 + w, width)
    if bottom <= top or right <= left:
        return None
    return top, left, bottom - top, right - left
