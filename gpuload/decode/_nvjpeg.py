"""GPU JPEG decoding without DALI: torchvision's batched nvJPEG decoder, imported lazily.

``torchvision.io.decode_jpeg(list_of_cpu_tensors, device="cuda")`` decodes a whole batch with
nvJPEG (the hardware decoder on A100/H100-class GPUs for baseline JPEGs, CUDA for the rest).
This is the backend for machines where DALI is missing (aarch64, Windows, a CUDA mismatch).

What it does not do itself, this module does:

- **EXIF orientation**: torchvision applies it on the CPU only; here each image is flipped or
  transposed on the device by the orientation read from its header (:class:`Header`).
- **ROIs**: nvJPEG decodes whole images; the window is cropped after the orientation is applied.

Streams: torchvision allocates the outputs on torch's current stream (the prefetcher's side
stream, or the loop's), then decodes into them on a stream of its own without waiting for the
current one (pytorch/vision PR 9606; nvJPEG's hardware engine ignores stream order). The caching
allocator hands out memory freed on the current stream as soon as the work that freed it is
queued, so the decoder could write pixels where queued work still reads or writes (a batch
still being transformed): corrupt images, kept for good by the image cache. So the calling
stream is drained first (:meth:`NvjpegDecoder.decode`), one host wait per decode call; memory
freed on other streams is safe already (``record_stream`` keeps it until they are done). After
the decode torchvision makes the current stream wait for its stream (and waits for it on the
host), so the outputs are ordered for the caller's stream, where the orientation and crop run
as torch ops; the prefetcher hands them to the loop's stream like any batch (an event and
``record_stream``), so nothing else waits on them.

Errors: torchvision raises one ``RuntimeError`` for the whole batch ("does not return partial
results"); the caller bisects it, and :func:`gpuload.decode.errors.is_device_failure` tells an
out-of-memory or CUDA error from a bad file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gpuload.decode.headers import ROI, Header

__all__ = ["NvjpegDecoder", "upright"]

DecodeCall = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


def _torchvision_decode(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """``image`` (C, H, W) as the EXIF ``orientation`` (1-8) says it is seen (EXIF 2.3 table)."""
    if orientation in (5, 6, 7, 8):
        image = image.transpose(-1, -2)
    flips = {2: (-1,), 3: (-1, -2), 4: (-2,), 6: (-1,), 7: (-1, -2), 8: (-2,)}.get(orientation)
    if flips:
        image = image.flip(flips)
    return image


class NvjpegDecoder:
    """Decodes batches of JPEGs with torchvision's nvJPEG onto one device.

    ``decode_call`` replaces the torchvision call (tests inject failures, or decode on the CPU
    with ``torchvision.io.decode_jpeg(..., device="cpu")``, which takes the same arguments).
    Calls are serialized by torchvision itself (one decoder per process, behind a mutex).
    """

    name = "nvjpeg"

    def __init__(self, device: torch.device, decode_call: DecodeCall | None = None) -> None:
        self.device = device
        self._call = decode_call or _torchvision_decode

    def decode(
        self, encoded: Sequence[bytes], headers: Sequence[Header], rois: Sequence[ROI | None] | None = None
    ) -> list[torch.Tensor]:
        """Decode one or more JPEGs (never none: the caller skips empty batches) into upright uint8
        (3, H, W) tensors on the device, cropped to ``rois``.

        Raises whatever the decoder raises; the caller classifies it and finds the bad file.
        """
        buffers = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in encoded]
        if self.device.type == "cuda":
            # The decoder writes its outputs out of stream order: nothing queued may still use
            # the memory they are given (see the module docstring).
            torch.cuda.current_stream(self.device).synchronize()
        images = self._call(buffers, self.device)
        out = []
        for k, (image, header) in enumerate(zip(images, headers)):
            image = upright(image, header.orientation)
            window = None if rois is None else rois[k]
            if window is not None:
                y0, x0, h, w = window
                image = image[:, y0 : y0 + h, x0 : x0 + w]
            out.append(image.contiguous())
        return out
