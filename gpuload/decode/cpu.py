"""CPU image decoding without DALI: torchvision.io when installed, else PIL.

Both give what ``torchvision.io.decode_image(data, mode=ImageReadMode.RGB,
apply_exif_orientation=True)`` gives: a uint8 RGB tensor shaped (3, H, W), with the EXIF
orientation applied, grey images spread to three channels and alpha dropped. This module is
also the decoder behind ``ImageFiles.__getitem__`` (plain torch DataLoader workers) and the
second opinion when DALI rejects a sample.
"""

from __future__ import annotations

import importlib.util
import io
import re
from collections.abc import Callable, Sequence

import numpy as np
import torch

from gpuload.cpu_threads import image_pool
from gpuload.decode.headers import ROI

__all__ = [
    "ROI",
    "pil_decode",
    "torchvision_available",
    "torchvision_decode",
    "cpu_decoder",
    "crop",
    "to_uint8",
    "decode_many",
    "describe_error",
]


def pil_decode(data: bytes, roi: ROI | None = None) -> torch.Tensor:
    """Decode an encoded image with PIL into a uint8 (3, H, W) RGB tensor, EXIF-upright.

    ``roi`` (inside the upright image) crops before the colour conversion and the HWC to CHW
    copy, so only the window is converted. Raises whatever PIL raises for bytes it cannot
    decode (truncated files included: gpuload never sets ``ImageFile.LOAD_TRUNCATED_IMAGES``).
    """
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as opened:
        image = ImageOps.exif_transpose(opened)
        if roi is not None:
            y0, x0, h, w = roi
            image = image.crop((x0, y0, x0 + w, y0 + h))
        if image.mode.startswith("I") or image.mode == "F":
            # 16/32-bit grey (16-bit PNG): scale the 16-bit range to 8 bits, as DALI does.
            wide = np.asarray(image, dtype=np.float32)
            image = Image.fromarray(np.clip(np.rint(wide / 257.0), 0, 255).astype(np.uint8), "L")
        rgb = np.asarray(image.convert("RGB"))
    return torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1)))


def torchvision_available() -> bool:
    """True when torchvision is installed (checked without importing it)."""
    return importlib.util.find_spec("torchvision") is not None


def torchvision_decode(data: bytes, roi: ROI | None = None) -> torch.Tensor:
    """Decode with ``torchvision.io.decode_image`` (RGB, EXIF applied) into a (3, H, W) tensor.

    torchvision has no ROI decoding: ``roi`` crops after the full decode.
    """
    from torchvision.io import ImageReadMode, decode_image

    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    image = decode_image(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    if image.dtype == torch.uint16:  # 16-bit PNG: torchvision keeps 16 bits even in RGB mode
        image = to_uint8(image)
    return image if roi is None else crop(image, roi)


def to_uint8(wide: torch.Tensor) -> torch.Tensor:
    """16-bit samples scaled to 8 bits by rounding ``v / 257`` (65535 -> 255), as DALI does.

    PIL cannot do this for 16-bit RGB PNGs: it opens them as 8-bit RGB, keeping the high byte
    (``v >> 8``), which is up to 1 lower. Backends that see the 16 bits (DALI, torchvision)
    round; the ``pil`` backend gives PIL's value.
    """
    return torch.round(wide.to(torch.float32) / 257.0).clamp_(0, 255).to(torch.uint8)


def cpu_decoder(backend: str) -> Callable[[bytes, ROI | None], torch.Tensor]:
    """The decode function behind the name ``"torchvision"`` or ``"pil"``."""
    if backend == "torchvision":
        return torchvision_decode
    if backend == "pil":
        return pil_decode
    raise ValueError(f"no CPU fallback decoder named {backend!r}; use 'torchvision' or 'pil'")


def crop(image: torch.Tensor, roi: ROI) -> torch.Tensor:
    """The ``roi`` window of a (C, H, W) image, as a contiguous tensor."""
    y0, x0, h, w = roi
    return image[:, y0 : y0 + h, x0 : x0 + w].contiguous()


def decode_many(
    decode: Callable[[bytes, ROI | None], torch.Tensor],
    encoded: Sequence[bytes],
    rois: Sequence[ROI | None] | None = None,
) -> list[torch.Tensor | Exception]:
    """Decode each buffer (within its ROI, if given) on a thread pool; PIL releases the GIL.

    Returns one entry per input, in order: the image, or the exception that decoding raised.
    """
    windows = list(rois) if rois is not None else [None] * len(encoded)

    def attempt(job: tuple[bytes, ROI | None]) -> torch.Tensor | Exception:
        try:
            return decode(*job)
        except Exception as error:  # reported per sample by the caller
            return error

    jobs = list(zip(encoded, windows))
    if len(jobs) <= 1:
        return [attempt(job) for job in jobs]
    return list(image_pool().map(attempt, jobs))


def describe_error(error: Exception) -> str:
    """``"Type: message"`` for a decoder's exception, without PIL's ``<_io.BytesIO ...>`` noise."""
    message = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(error))
    return f"{type(error).__name__}: {message}"
