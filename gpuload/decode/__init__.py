"""Decoding images: batches (``batch``), headers and the pixel limit (``headers``), errors
(``errors``), CPU decoders (``cpu``), DALI (``_dali``), torchvision's nvJPEG (``_nvjpeg``).

``gpuload.decode`` re-exports what users and the image source need.
"""

from gpuload.decode.batch import (
    BACKENDS,
    BatchDecoder,
    DecodeResult,
    decode_batch,
    resolve_backend,
)
from gpuload.decode.errors import DecodeDeviceError, ImageDecodeError
from gpuload.decode.headers import (
    FOLLOW_PIL,
    ROI,
    Header,
    HeaderTable,
    PixelLimitError,
    check_pixels,
    clip_roi,
    default_max_pixels,
    peek_header,
    peek_size,
    set_default_max_pixels,
)

__all__ = [
    "BACKENDS",
    "FOLLOW_PIL",
    "ROI",
    "BatchDecoder",
    "DecodeDeviceError",
    "DecodeResult",
    "Header",
    "HeaderTable",
    "ImageDecodeError",
    "PixelLimitError",
    "check_pixels",
    "clip_roi",
    "decode_batch",
    "default_max_pixels",
    "peek_header",
    "peek_size",
    "resolve_backend",
    "set_default_max_pixels",
]
