"""Decoding images: batches (``batch``), headers (``headers``), CPU decoders (``cpu``), DALI (``_dali``).

``gpuload.decode`` re-exports what users and the image source need.
"""

from gpuload.decode.batch import (
    BACKENDS,
    BatchDecoder,
    DecodeResult,
    ImageDecodeError,
    decode_batch,
    resolve_backend,
)
from gpuload.decode.headers import ROI, clip_roi, peek_size

__all__ = [
    "BACKENDS",
    "ROI",
    "BatchDecoder",
    "DecodeResult",
    "ImageDecodeError",
    "clip_roi",
    "decode_batch",
    "peek_size",
    "resolve_backend",
]
