"""Real-photo test images, encoded every way a decoder has to handle.

The pixels come from matplotlib's ``mpl-data/sample_data/grace_hopper.jpg`` (a photograph:
real edges, skin, flat and textured regions), cropped to an odd size (251 x 203) so that
partial MCUs and odd chroma columns are exercised, and re-encoded with PIL.
"""

from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from gpuload.datasets import ImageList

PHOTO = "grace_hopper.jpg"
WIDTH, HEIGHT = 203, 251  # odd, not multiples of 8 or 16


def photo_path() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "sample_data" / PHOTO


@lru_cache(maxsize=1)
def photo() -> Image.Image:
    """The photograph, cropped around the face and shrunk to WIDTH x HEIGHT, RGB."""
    with Image.open(photo_path()) as source:
        return source.convert("RGB").crop((40, 20, 480, 560)).resize((WIDTH, HEIGHT), Image.BICUBIC)


def encode(image: Image.Image, fmt: str = "JPEG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


# name -> (mode, PIL JPEG options); subsampling 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0
JPEG_KINDS: dict[str, tuple[str, dict]] = {
    "baseline-444": ("RGB", {"quality": 90, "subsampling": 0}),
    "baseline-422": ("RGB", {"quality": 90, "subsampling": 1}),
    "baseline-420": ("RGB", {"quality": 90, "subsampling": 2}),
    "progressive-444": ("RGB", {"quality": 90, "subsampling": 0, "progressive": True}),
    "progressive-422": ("RGB", {"quality": 90, "subsampling": 1, "progressive": True}),
    "progressive-420": ("RGB", {"quality": 90, "subsampling": 2, "progressive": True}),
    "grayscale": ("L", {"quality": 90}),
    "grayscale-progressive": ("L", {"quality": 90, "progressive": True}),
}


def jpeg(kind: str) -> bytes:
    mode, options = JPEG_KINDS[kind]
    return encode(photo().convert(mode), "JPEG", **options)


def jpeg_with_orientation(orientation: int, subsampling: int = 2) -> bytes:
    """A JPEG whose EXIF says ``orientation`` (1-8); its stored pixels are those of photo()."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(photo(), "JPEG", quality=90, subsampling=subsampling, exif=exif)


def png(mode: str) -> bytes:
    """photo() as a PNG in PIL ``mode`` (RGB, RGBA with a real alpha ramp, L, LA, P)."""
    image = photo()
    if mode in ("RGBA", "LA"):
        alpha = Image.linear_gradient("L").resize(image.size)
        image = image.convert("RGBA")
        image.putalpha(alpha)
    return encode(image.convert(mode), "PNG")


def pil_reference(data: bytes) -> torch.Tensor:
    """What PIL decodes: EXIF applied, RGB, as a (3, H, W) uint8 tensor. The parity oracle."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()


def upright(stored: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply EXIF ``orientation`` to a (C, H, W) image by the EXIF 2.3 table (no PIL involved)."""
    h_flip = lambda t: t.flip(-1)  # noqa: E731
    v_flip = lambda t: t.flip(-2)  # noqa: E731
    transpose = lambda t: t.transpose(-1, -2)  # noqa: E731
    ops = {
        1: lambda t: t,
        2: h_flip,
        3: lambda t: h_flip(v_flip(t)),
        4: v_flip,
        5: transpose,  # mirror across the main diagonal
        6: lambda t: h_flip(transpose(t)),  # rotate 90 degrees clockwise
        7: lambda t: h_flip(v_flip(transpose(t))),  # mirror across the anti-diagonal
        8: lambda t: v_flip(transpose(t)),  # rotate 90 degrees counter-clockwise
    }
    return ops[orientation](stored).contiguous()


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(mean, max) absolute difference of two uint8 images of the same shape."""
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    d = (a.cpu().int() - b.cpu().int()).abs()
    return float(d.float().mean()), int(d.max())


def corrupt_inputs() -> dict[str, bytes]:
    """Bad files of every kind a dataset turns up with."""
    good = jpeg("baseline-420")
    return {
        "truncated.jpg": good[: len(good) // 2],
        "header-only.jpg": good[:100],
        "not-an-image.jpg": b"this is a text file that someone named .jpg\n" * 20,
        "empty.jpg": b"",
    }


def garbled_jpeg() -> bytes:
    """Headers intact, the second half of the entropy-coded data replaced by noise, EOI kept.

    libjpeg may decode this with warnings (garbage pixels) or reject it: either is fine, as
    long as nothing crashes or hangs.
    """
    good = jpeg("baseline-420")
    half = len(good) // 2
    noise = np.random.default_rng(0).integers(0, 255, len(good) - half - 2, dtype=np.uint8)
    return good[:half] + bytes(noise) + b"\xff\xd9"


def bomb_jpeg(width: int = 20000, height: int = 20000) -> bytes:
    """A tiny real JPEG whose SOF0 header claims ``width`` x ``height`` (a decompression bomb).

    The frame header of a baseline JPEG is ``FF C0, length, precision, height, width``; only
    the two sizes are rewritten, so every parser reads the claim and no decoder is needed.
    """
    data = bytearray(encode(photo().resize((8, 8)), "JPEG", quality=50))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def png16_rgb(seed: int = 0, width: int = 30, height: int = 20) -> tuple[bytes, np.ndarray]:
    """A 16-bit RGB PNG of random samples, written by hand (PIL cannot write one), and its samples."""
    import struct
    import zlib

    samples = np.random.default_rng(seed).integers(0, 65536, (height, width, 3), dtype=np.uint16)
    raw = b"".join(b"\x00" + samples[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    return png, samples


def png_with_orientation(orientation: int) -> bytes:
    """photo() as an RGB PNG with an eXIf chunk saying ``orientation``."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(photo(), "PNG", exif=exif)


class CountingList(ImageList):
    """An ImageList that counts the files it reads."""

    def __init__(self, samples) -> None:
        super().__init__(samples)
        self.reads = 0

    def read_encoded(self, index: int):
        self.reads += 1
        return super().read_encoded(index)


def assert_close_epochs(ours: list[list], theirs: list[list]) -> None:
    """Epochs of (images, labels) batches from cached whole images against ones from ROI-decoded
    windows: equal labels, images apart by decoder rounding at window edges only."""
    for epoch, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for (images, labels), (ref_images, ref_labels) in zip(a, b, strict=True):
            assert torch.equal(labels, ref_labels), epoch
            torch.testing.assert_close(images, ref_images, atol=0.1, rtol=0)
            assert (images - ref_images).abs().mean() < 2e-3
