"""Image headers: the size and EXIF orientation of an encoded image without decoding it.

The crop windows of ROI decoding, the image cache's size estimate, the EXIF orientation the
nvJPEG backend applies and the pixel limit all start from the header: these functions read
only it. JPEG (SOF segment, EXIF in APP1) and PNG (IHDR, eXIf chunk) are parsed here; other
formats are opened with PIL, which reads their header only.

**The pixel limit.** A few hundred bytes of JPEG can claim 20000x20000 pixels and make a
decoder allocate 1.2 GB for them (a decompression bomb). Every decoder in gpuload checks the
header first and rejects an image with more pixels than the limit: ``max_pixels=`` of
:class:`~gpuload.decode.BatchDecoder` / ``decode_batch``, else the process-wide default set with
:func:`set_default_max_pixels`, else PIL's ``Image.MAX_IMAGE_PIXELS`` (89,478,485 pixels, read
at check time, so code that raises PIL's limit raises gpuload's). ``None`` turns the check off.
The default is per process: worker processes started with ``spawn`` begin from PIL's again.
PIL itself (the ``pil`` backend, and headers of formats other than JPEG and PNG) keeps its own
check on top: an image over twice ``Image.MAX_IMAGE_PIXELS`` needs PIL's limit raised too.
"""

from __future__ import annotations

import io
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ROI",
    "FOLLOW_PIL",
    "Header",
    "HeaderTable",
    "PixelLimitError",
    "peek_header",
    "peek_size",
    "clip_roi",
    "check_pixels",
    "default_max_pixels",
    "set_default_max_pixels",
    "resolve_max_pixels",
]

ROI = tuple[int, int, int, int]
"""A region of interest ``(y0, x0, height, width)`` in pixels of the upright (EXIF-applied) image."""

_EXIF_ORIENTATION = 0x0112
_TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # these swap width and height
# SOFn markers that carry the frame size (not DHT C4, JPG C8, DAC CC).
_SOF_MARKERS = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Header:
    """What an image's header says: its stored size, EXIF orientation (1-8) and format;
    ``upright``: ``(height, width)`` once the EXIF orientation is applied, and ``pixels``.

    Those two are attributes, set once, not properties: a batch reads them for every image.
    """

    width: int
    height: int
    orientation: int = 1
    format: str = ""
    upright: tuple[int, int] = field(init=False, repr=False, compare=False)
    pixels: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        transposed = self.orientation in _TRANSPOSED_ORIENTATIONS
        object.__setattr__(self, "upright", (self.width, self.height) if transposed else (self.height, self.width))
        object.__setattr__(self, "pixels", self.width * self.height)


class HeaderTable:
    """The headers of a dataset's images by position, each read once for the dataset's life.

    Every batch needs its images' headers twice (the crop windows, then the decoder's pixel
    limit and ROI clipping), every epoch; the table keeps them in 16 bytes per image (a few
    MiB for ImageNet) instead. A header that cannot be read is not kept: it fails again,
    and is reported, where it is used. One thread at a time (the one decoding batches).
    """

    #: Distinct headers handed out as one object each (a folder's images share a few sizes),
    #: so that a batch builds none; past this many, headers are built afresh.
    SHARED = 16384

    def __init__(self, num_images: int) -> None:
        self._rows = np.zeros((num_images, 4), dtype=np.int32)  # width, height, orientation, format + 1
        self._formats: list[str] = []
        self._shared: dict[tuple[int, ...], Header] = {}

    def get(self, position: int) -> Header | None:
        """The header kept for ``position``, or None when it has not been read yet."""
        if not 0 <= position < len(self._rows):
            return None
        row = tuple(self._rows[position].tolist())
        header = self._shared.get(row)
        if header is None and row[3]:
            width, height, orientation, fmt = row
            header = Header(width, height, orientation, self._formats[fmt - 1])
            if len(self._shared) < self.SHARED:
                self._shared[row] = header
        return header

    def kept(self, positions: list[int]) -> list[Header | None]:
        """:meth:`get` of each of a batch's ``positions``: the shared headers found by one
        gather of their rows, the others as :meth:`get` finds them."""
        if not positions or min(positions) < 0 or max(positions) >= len(self._rows):
            return [self.get(position) for position in positions]
        shared = self._shared
        rows = self._rows[positions].tolist()
        return [shared.get(tuple(row)) or self.get(position) for position, row in zip(positions, rows)]

    def read(self, position: int, data: bytes) -> Header:
        """``position``'s header: the kept one, else read from ``data`` (its file) and kept.

        Raises what :func:`peek_header` raises for an unreadable header."""
        header = self.get(position)
        if header is not None:
            return header
        header = peek_header(data)
        if 0 <= position < len(self._rows) and max(header.width, header.height) < 2**31:
            if header.format not in self._formats:
                self._formats.append(header.format)
            fmt = self._formats.index(header.format) + 1
            row = (header.width, header.height, header.orientation, fmt)
            self._rows[position] = row
            if len(self._shared) < self.SHARED:
                self._shared.setdefault(row, header)
        return header


class _Unparsed(ValueError):
    """The built-in parser cannot read this header; PIL gets a try."""


def _exif_orientation(tiff: bytes) -> int:
    """The orientation tag of a TIFF-structured EXIF block; 1 when absent or unreadable."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "<" if tiff[:2] == b"II" else ">"
    try:
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (count,) = struct.unpack_from(order + "H", tiff, ifd)
        for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
            tag, kind = struct.unpack_from(order + "HH", tiff, entry)
            if tag == _EXIF_ORIENTATION and kind == 3:  # SHORT
                (value,) = struct.unpack_from(order + "H", tiff, entry + 8)
                return value if 1 <= value <= 8 else 1
    except struct.error:
        return 1
    return 1


def _jpeg_header(data: bytes) -> Header:
    size: tuple[int, int] | None = None
    orientation = 1
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            raise _Unparsed("JPEG segments out of step")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # no length field
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no more header
            break
        (length,) = struct.unpack_from(">H", data, pos + 2)
        segment = data[pos + 4 : pos + 2 + length]
        if marker in _SOF_MARKERS and size is None and len(segment) >= 5:
            height, width = struct.unpack_from(">HH", segment, 1)
            size = (width, height)
        elif marker == 0xE1 and orientation == 1 and segment.startswith(b"Exif\0\0"):
            orientation = _exif_orientation(segment[6:])
        pos += 2 + length
    if size is None or size[1] == 0:  # height 0: defined later by a DNL marker
        raise _Unparsed("no JPEG frame header")
    return Header(size[0], size[1], orientation, "JPEG")


def _png_header(data: bytes) -> Header:
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise _Unparsed("no PNG IHDR chunk")
    width, height = struct.unpack_from(">II", data, 16)
    orientation = 1
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"eXIf":
            block = data[pos + 8 : pos + 8 + length]
            orientation = _exif_orientation(block[6:] if block.startswith(b"Exif\0\0") else block)
            break
        if kind == b"IEND":
            break
        pos += 12 + length
    return Header(width, height, orientation, "PNG")


def _pil_header(data: bytes) -> Header:
    from PIL import Image

    try:
        opened = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:  # PIL's own check, at twice its limit
        raise PixelLimitError(None, None, f"PIL: {error}") from None
    with opened as image:
        width, height = image.size
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
        fmt = image.format or ""
    return Header(width, height, orientation if orientation in range(1, 9) else 1, fmt)


def peek_header(data: bytes) -> Header:
    """The :class:`Header` of an encoded image, read without decoding pixels.

    Raises ValueError (or PIL's error for formats PIL reads) when there is no readable header.
    """
    try:
        if data[:3] == b"\xff\xd8\xff":
            return _jpeg_header(data)
        if data[:8] == _PNG_SIGNATURE:
            return _png_header(data)
    except (_Unparsed, struct.error):
        pass  # unusual layout: PIL has the last word
    return _pil_header(data)


def peek_size(data: bytes) -> tuple[int, int]:
    """``(height, width)`` of the upright image, read from the header only (no pixel decode).

    Use it to draw crop windows (RandomResizedCrop) before decoding with ``rois=``.
    """
    return peek_header(data).upright


def clip_roi(roi: Sequence[int], height: int, width: int) -> ROI | None:
    """Intersect ``roi = (y0, x0, h, w)`` with a ``height`` x ``width`` image; None if empty."""
    if len(roi) != 4:
        raise ValueError(f"a ROI is (y0, x0, height, width); got {tuple(roi)!r}")
    y0, x0, h, w = map(int, roi)
    top, left = max(y0, 0), max(x0, 0)
    bottom, right = min(y0 + h, height), min(x0 + w, width)
    if bottom <= top or right <= left:
        return None
    return top, left, bottom - top, right - left


# --- the pixel limit ---------------------------------------------------------------------------


class _FollowPil:
    def __repr__(self) -> str:
        return "FOLLOW_PIL"


FOLLOW_PIL = _FollowPil()
"""The default limit: PIL's ``Image.MAX_IMAGE_PIXELS`` as it is when an image is checked."""

_default_limit: int | None | _FollowPil = FOLLOW_PIL
_default_lock = threading.Lock()


class PixelLimitError(ValueError):
    """An image's header claims more pixels than the limit (a decompression bomb, or a huge scan)."""

    def __init__(self, header: Header | None, limit: int | None, claim: str = "") -> None:
        self.header, self.limit = header, limit
        if header is not None:
            claim = f"the header says {header.width}x{header.height} = {header.pixels:,} pixels"
        over = f"over the limit of {limit:,}" if limit is not None else "over PIL's limit"
        super().__init__(
            f"{claim}, {over} (a decompression bomb?); raise it with max_pixels= or "
            "gpuload.decode.set_default_max_pixels() if the image is genuine"
        )


def _check_limit(limit: object, setting: str) -> None:
    if limit is FOLLOW_PIL or limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"{setting}={limit!r}: give a positive number of pixels, None (no limit) or FOLLOW_PIL")


def set_default_max_pixels(limit: int | None | _FollowPil) -> None:
    """Set the process-wide pixel limit used where no ``max_pixels=`` is given.

    An int is the limit, ``None`` turns the check off, ``FOLLOW_PIL`` (the initial value)
    follows ``PIL.Image.MAX_IMAGE_PIXELS``.
    """
    global _default_limit
    _check_limit(limit, "set_default_max_pixels")
    with _default_lock:
        _default_limit = limit


def default_max_pixels() -> int | None:
    """The process-wide pixel limit now (PIL's, unless :func:`set_default_max_pixels` changed it)."""
    limit = _default_limit
    if limit is FOLLOW_PIL:
        from PIL import Image

        pil_limit = Image.MAX_IMAGE_PIXELS
        return None if pil_limit is None else int(pil_limit)
    return limit  # type: ignore[return-value]


def resolve_max_pixels(max_pixels: int | None | _FollowPil | str = "default") -> int | None:
    """A ``max_pixels=`` argument made concrete: ``"default"`` is :func:`default_max_pixels`."""
    if isinstance(max_pixels, str):
        if max_pixels != "default":
            raise ValueError(f"max_pixels={max_pixels!r}: give a number of pixels, None, or 'default'")
        return default_max_pixels()
    _check_limit(max_pixels, "max_pixels")
    if max_pixels is FOLLOW_PIL:
        from PIL import Image

        return None if Image.MAX_IMAGE_PIXELS is None else int(Image.MAX_IMAGE_PIXELS)
    return max_pixels  # type: ignore[return-value]


def check_pixels(data: bytes, max_pixels: int | None | str = "default") -> Header | None:
    """Raise :class:`PixelLimitError` if ``data``'s header claims more than the limit.

    Returns the header (None when there is no limit and so nothing was read). A header that
    cannot be read raises, since the limit cannot be checked then.
    """
    limit = resolve_max_pixels(max_pixels)
    if limit is None:
        return None
    header = peek_header(data)
    if header.pixels > limit:
        raise PixelLimitError(header, limit)
    return header
