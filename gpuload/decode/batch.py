"""Batch decoding: encoded images (JPEG, PNG, ...) to uint8 (3, H, W) RGB tensors.

Backends, in the order ``backend="auto"`` picks them:

- ``"dali-mixed"``: DALI's mixed decoder (nvJPEG on the GPU), when the target device is CUDA;
- ``"dali-cpu"``: DALI's CPU decoder (libjpeg-turbo, multi-threaded), when it is the CPU;
- ``"nvjpeg"``: torchvision's batched nvJPEG decoder, on CUDA when DALI is missing (non-JPEG
  files of the batch are decoded on the CPU and copied over);
- ``"torchvision"``: ``torchvision.io.decode_image`` on the CPU, when DALI is missing;
- ``"pil"``: PIL on the CPU, when neither is installed.

Every backend gives the same pixels for the same file up to decoder rounding (tested against
PIL), applies the EXIF orientation, and reports bad files the same way: an
:class:`ImageDecodeError` naming the file, the sample index, the backend and the reason, or,
with ``on_error="skip"``, an entry in :attr:`DecodeResult.skipped`. One bad file never loses
the rest of its batch: when a GPU decoder rejects a batch, its samples are decoded one by one
to find the bad ones, and a sample it rejects but PIL reads (a GIF, a CMYK JPEG) is kept.

Before any decoder runs, every header is checked against the pixel limit
(:mod:`gpuload.decode.headers`): an image claiming more pixels is a bad file, so a
decompression bomb never reaches a decoder. A failing device (out of memory, a CUDA error) is
not a bad file: it raises :class:`DecodeDeviceError` whatever ``on_error`` says.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpuload.decode import cpu
from gpuload.decode.cpu import describe_error
from gpuload.decode.errors import DecodeDeviceError, ImageDecodeError, is_device_failure
from gpuload.decode.headers import ROI, Header, PixelLimitError, clip_roi, peek_header, resolve_max_pixels
from gpuload.device import resolve_device
from gpuload.transfer import Staging, to_device

if TYPE_CHECKING:
    from gpuload.decode._dali import DaliDecoder
    from gpuload.decode._nvjpeg import NvjpegDecoder

__all__ = [
    "BACKENDS",
    "ImageDecodeError",
    "DecodeDeviceError",
    "DecodeResult",
    "BatchDecoder",
    "decode_batch",
    "resolve_backend",
]

BACKENDS = ("auto", "dali", "dali-mixed", "dali-cpu", "nvjpeg", "torchvision", "pil")
_ON_ERROR = ("raise", "skip")
MaxPixels = int | None | str
"""A pixel limit: a number of pixels, None (no limit) or "default" (see gpuload.decode.headers)."""


@dataclass
class DecodeResult:
    """What a batch decode produced.

    ``images[k]`` is the decoded (3, H, W) uint8 tensor of input position ``kept_positions[k]``;
    ``skipped`` lists ``(index, name, reason)`` of the samples left out (``on_error="skip"``);
    ``backend`` is the backend that decoded the batch; ``roi`` says how ROIs were honoured:
    ``"none"`` (no ROIs asked), ``"decoder"`` (only the window was decoded) or ``"crop"``
    (decoded whole, then cropped); ``fallback_decoded`` counts samples the main backend
    rejected but PIL decoded; ``cpu_decoded`` counts the non-JPEG files the ``nvjpeg``
    backend decoded on the CPU.
    """

    images: list[torch.Tensor]
    kept_positions: list[int]
    skipped: list[tuple[int, str, str]] = field(default_factory=list)
    backend: str = ""
    roi: str = "none"
    fallback_decoded: int = 0
    cpu_decoded: int = 0


def _dali_installed() -> bool:
    from gpuload.decode._dali import dali_installed

    return dali_installed()


def resolve_backend(device: torch.device, backend: str = "auto") -> str:
    """The concrete backend (``dali-mixed``, ``dali-cpu``, ``nvjpeg``, ``torchvision``, ``pil``).

    Raises ValueError for an unknown name or one this machine cannot run, saying what can.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if backend in ("auto", "dali"):
        if _dali_installed():
            return "dali-mixed" if device.type == "cuda" else "dali-cpu"
        if backend == "dali":
            raise ValueError(
                "backend='dali' needs nvidia.dali, which is not installed; install "
                "gpuload[cuda13] (or gpuload[cuda12]), or use backend='auto' to fall back to nvjpeg, torchvision or PIL"
            )
        return _without_dali(device)
    if backend.startswith("dali") and not _dali_installed():
        raise ValueError(f"backend={backend!r} needs nvidia.dali, which is not installed")
    if backend in ("dali-mixed", "nvjpeg") and device.type != "cuda":
        other = "'dali-cpu'" if backend == "dali-mixed" else "'torchvision'"
        raise ValueError(
            f"backend={backend!r} decodes on a GPU but the device is {device}; use "
            f"backend={other} or 'auto'"
        )
    if backend in ("torchvision", "nvjpeg") and not cpu.torchvision_available():
        raise ValueError(f"backend={backend!r} needs torchvision, which is not installed")
    return backend


def _without_dali(device: torch.device) -> str:
    """What ``auto`` picks when DALI is missing or broken: nvJPEG on CUDA, else a CPU decoder."""
    if device.type == "cuda" and cpu.torchvision_available():
        return "nvjpeg"
    return "torchvision" if cpu.torchvision_available() else "pil"


def _screen(
    encoded: Sequence[bytes],
    names: Sequence[str],
    indices: Sequence[int],
    rois: Sequence[Sequence[int] | None] | None,
    limit: int | None,
    need_headers: bool,
    known: Sequence[Header | None] | None = None,
) -> tuple[dict[int, str], dict[int, Header], dict[int, ROI]]:
    """Failures known before decoding (empty data, unreadable headers, over the pixel limit),
    the headers (``known[k]`` when given, else read) and the ROI windows clipped to them."""
    failures: dict[int, str] = {}
    headers: dict[int, Header] = {}
    windows: dict[int, ROI] = {}
    for k, data in enumerate(encoded):
        if len(data) == 0:
            failures[k] = "the file is empty (0 bytes)"
            continue
        if rois is None and limit is None and not need_headers:
            continue
        try:
            header = (known[k] if known is not None else None) or peek_header(data)
        except Exception as error:  # PIL raises many types for garbage
            failures[k] = f"not a readable image header ({describe_error(error)})"
            continue
        if limit is not None and header.pixels > limit:
            failures[k] = str(PixelLimitError(header, limit))
            continue
        headers[k] = header
        if rois is None:
            continue
        height, width = header.upright
        roi = rois[k]
        window = (0, 0, height, width) if roi is None else clip_roi(roi, height, width)
        if window is None:  # clip_roi: no overlap
            raise ValueError(
                f"ROI {tuple(roi or ())} (y0, x0, h, w) of sample index {indices[k]} "
                f"({names[k]!r}) does not overlap its {height}x{width} image"
            )
        windows[k] = window
    return failures, headers, windows


def _device_failure(error: BaseException) -> bool:
    """An out-of-memory or CUDA error (by type where torch gives one, else by DALI's text)."""
    from gpuload.decode._dali import DaliError

    if isinstance(error, DaliError):
        return error.device
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return is_device_failure(str(error))


class BatchDecoder:
    """Decodes batches for one device with one backend, keeping GPU decoders for reuse.

    Build one per loader (``max_batch`` = its batch size) and call :meth:`decode` per batch;
    images land on ``device`` (a CPU backend's images are copied there). If DALI turns out to
    be unusable at run time under ``backend="auto"``, it warns once and decodes with nvJPEG (on
    CUDA with torchvision) or the CPU fallback instead; ``backend`` always says what is
    decoding now. ``max_pixels`` is the pixel limit every header is checked against (a number,
    None for none, or ``"default"``: ``gpuload.decode.headers.default_max_pixels()`` at
    decode time). ``channels_last=True`` lets DALI hand out its HWC images as (3, H, W) views
    (channels-last strides) instead of transposing them: for a consumer that takes any strides,
    such as the transforms, whose bilinear kernel runs channels-last (half the time per image).
    ``staging``: the route of CPU-decoded images to ``device`` (a loader's; None: one pinned copy
    on the current stream).
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        backend: str = "auto",
        max_batch: int = 256,
        num_threads: int | None = None,
        max_pixels: MaxPixels = "default",
        channels_last: bool = False,
        staging: Staging | None = None,
    ) -> None:
        self.device = resolve_device(device)
        self.staging = staging
        self.channels_last = channels_last
        self.requested = backend
        self.backend = resolve_backend(self.device, backend)
        self.max_batch = max_batch
        self.num_threads = num_threads
        resolve_max_pixels(max_pixels)  # a bad value fails here, not at the first batch
        self.max_pixels = max_pixels
        self._cpu_name = "torchvision" if cpu.torchvision_available() else "pil"
        self._dali: dict[bool, DaliDecoder] = {}  # keyed by "decodes ROIs"
        self._nvjpeg: NvjpegDecoder | None = None
        self._lock = threading.Lock()

    def _dali_decoder(self, roi: bool) -> DaliDecoder | None:
        """The DALI pipeline for ROI or whole decoding, built on first use; None if DALI broke."""
        from gpuload.decode._dali import DaliDecoder, DaliUnavailable

        with self._lock:
            if roi not in self._dali:
                try:
                    self._dali[roi] = DaliDecoder(
                        self.device, self.max_batch, self.num_threads, roi, hwc=self.channels_last
                    )
                except DaliUnavailable as error:
                    if self.requested != "auto":
                        raise
                    self.backend = _without_dali(self.device)
                    warnings.warn(f"{error}; decoding with {self.backend} instead", stacklevel=3)
                    return None
            return self._dali[roi]

    def _nvjpeg_decoder(self) -> NvjpegDecoder:
        from gpuload.decode._nvjpeg import NvjpegDecoder

        with self._lock:
            if self._nvjpeg is None:
                self._nvjpeg = NvjpegDecoder(self.device)
            return self._nvjpeg

    def decode(
        self,
        encoded: Sequence[bytes],
        names: Sequence[str],
        indices: Sequence[int],
        rois: Sequence[Sequence[int] | None] | None = None,
        on_error: str = "raise",
        max_pixels: MaxPixels = "default",
        headers: Sequence[Header | None] | None = None,
    ) -> DecodeResult:
        """Decode ``encoded[k]`` (named ``names[k]``, dataset index ``indices[k]``) for each k.

        ``rois[k] = (y0, x0, h, w)``, in pixels of the upright image, limits sample k to that
        window (intersected with the image); ``rois[k] = None`` means the whole image. With
        ``rois``, every header must be readable (the windows are clipped to the image's size).
        ``on_error="raise"`` raises :class:`ImageDecodeError` for the first bad sample;
        ``"skip"`` leaves bad ones out. ``max_pixels`` overrides the decoder's limit for this
        call. ``headers[k]``, when given and not None, is image k's header as already read
        (``HeaderTable``): it is not read again. A failing device raises
        :class:`DecodeDeviceError` either way.
        """
        n = len(encoded)
        if headers is not None and len(headers) != n:
            raise ValueError(f"decode needs one header (or None) per image: got {n} images, {len(headers)} headers")
        if len(names) != n or len(indices) != n or (rois is not None and len(rois) != n):
            raise ValueError(
                f"decode needs one name, index (and ROI) per image: got {n} images, "
                f"{len(names)} names, {len(indices)} indices"
                + ("" if rois is None else f", {len(rois)} ROIs")
            )
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error={on_error!r} is not one of 'raise', 'skip'")
        limit = resolve_max_pixels(self.max_pixels if max_pixels == "default" else max_pixels)

        dali = self._dali_decoder(rois is not None) if self.backend.startswith("dali") else None
        backend = self.backend
        failures, screened, windows = _screen(encoded, names, indices, rois, limit, backend == "nvjpeg", headers)
        todo = [k for k in range(n) if k not in failures]
        decoded: dict[int, torch.Tensor] = {}
        roi_mode = "none" if rois is None else ("decoder" if dali is not None else "crop")
        rescued = on_cpu = 0
        if dali is not None or backend == "nvjpeg":
            run, on_gpu, cpu_todo = self._gpu_stage(dali, encoded, todo, screened, windows, rois is not None)
            decoded, gpu_failures = self._decode_gpu(run, on_gpu, names, backend)
            leftovers = sorted(gpu_failures)
            second = cpu.decode_many(
                cpu.pil_decode, [encoded[k] for k in leftovers], [windows.get(k) for k in leftovers]
            )
            for k, outcome in zip(leftovers, second):
                if isinstance(outcome, Exception):
                    failures[k] = f"{gpu_failures[k]}; PIL: {describe_error(outcome)}"
                else:
                    rescued += 1
            decoded.update(self._to_device(leftovers, second))
            on_cpu = len(cpu_todo)
        else:
            cpu_todo = todo
        if cpu_todo:
            decoder = cpu.cpu_decoder(self._cpu_name if backend == "nvjpeg" else backend)
            outcomes = cpu.decode_many(decoder, [encoded[k] for k in cpu_todo], [windows.get(k) for k in cpu_todo])
            for k, outcome in zip(cpu_todo, outcomes):
                if isinstance(outcome, Exception):
                    failures[k] = describe_error(outcome)
            decoded.update(self._to_device(cpu_todo, outcomes))

        if failures and on_error == "raise":
            first = min(failures)
            raise ImageDecodeError(
                int(indices[first]), str(names[first]), backend, failures[first], len(failures) - 1
            )
        kept = sorted(decoded)
        return DecodeResult(
            images=[decoded[k] for k in kept],
            kept_positions=kept,
            skipped=[(int(indices[k]), str(names[k]), failures[k]) for k in sorted(failures)],
            backend=backend,
            roi=roi_mode,
            fallback_decoded=rescued,
            cpu_decoded=on_cpu,
        )

    def _gpu_stage(
        self,
        dali: DaliDecoder | None,
        encoded: Sequence[bytes],
        todo: list[int],
        headers: dict[int, Header],
        windows: dict[int, ROI],
        roi: bool,
    ) -> tuple[Callable[[list[int]], list[torch.Tensor]], list[int], list[int]]:
        """The GPU decoder as ``run(positions) -> images``, the positions it takes, and those
        left to the CPU (nvjpeg reads only JPEGs)."""
        if dali is not None:

            def run_dali(ks: list[int]) -> list[torch.Tensor]:
                return dali.decode([encoded[k] for k in ks], [windows[k] for k in ks] if roi else None)

            return run_dali, todo, []
        nvjpeg = self._nvjpeg_decoder()

        def run_nvjpeg(ks: list[int]) -> list[torch.Tensor]:
            return nvjpeg.decode([encoded[k] for k in ks], [headers[k] for k in ks], [windows.get(k) for k in ks])

        jpegs = [k for k in todo if headers[k].format == "JPEG"]
        return run_nvjpeg, jpegs, [k for k in todo if headers[k].format != "JPEG"]

    def _to_device(self, positions: list[int], outcomes: Sequence[torch.Tensor | Exception]) -> dict[int, torch.Tensor]:
        """The CPU-decoded images of ``positions`` (outcomes that are not errors) on the target
        device, by position. To a GPU they go in one copy through the decoder's staging (the
        loader's pinned slots and side stream; ``gpuload.transfer.to_device``): a pageable copy
        would make the host wait for everything queued on the stream (the training step). Each
        keeps its layout (an HWC decode stays channels-last), as the transforms expect."""
        images = {k: outcome for k, outcome in zip(positions, outcomes) if not isinstance(outcome, Exception)}
        return dict(zip(images, to_device(list(images.values()), self.device, self.staging, keep_layout=True)))

    @staticmethod
    def _decode_gpu(
        run: Callable[[list[int]], list[torch.Tensor]], todo: list[int], names: Sequence[str], backend: str
    ) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
        """Decode ``todo`` as one batch; if the decoder rejects it, one by one to find the culprits.

        A device failure (out of memory, CUDA) raises :class:`DecodeDeviceError` at once: it is
        no file's fault, and decoding the samples one by one or on the CPU would hide it.
        """
        label = "DALI" if backend.startswith("dali") else backend

        def reason(error: RuntimeError, ks: list[int]) -> str:
            if _device_failure(error):
                raise DecodeDeviceError(backend, str(error), [str(names[k]) for k in ks]) from error
            return f"{label}: {error}"

        if not todo:
            return {}, {}
        try:
            return dict(zip(todo, run(todo))), {}
        except RuntimeError as error:
            why = reason(error, todo)
            if len(todo) == 1:
                return {}, {todo[0]: why}
        decoded: dict[int, torch.Tensor] = {}
        failures: dict[int, str] = {}
        for k in todo:
            try:
                (decoded[k],) = run([k])
            except RuntimeError as error:
                failures[k] = reason(error, [k])
        return decoded, failures


_shared: dict[tuple[str, str], BatchDecoder] = {}
_shared_lock = threading.Lock()


def decode_batch(
    encoded: Sequence[bytes],
    names: Sequence[str],
    indices: Sequence[int],
    device: str | torch.device | None = None,
    backend: str = "auto",
    on_error: str = "raise",
    rois: Sequence[Sequence[int]] | None = None,
    max_pixels: MaxPixels = "default",
) -> DecodeResult:
    """Decode one batch with a decoder shared per (device, backend); see :class:`BatchDecoder`.

    ``device=None`` means the current CUDA device when there is one, else the CPU.
    ``max_pixels`` is the pixel limit (``"default"``: the process-wide one).
    """
    resolved = resolve_device(device)
    key = (str(resolved), backend)
    with _shared_lock:
        decoder = _shared.get(key)
        if decoder is None:
            decoder = _shared[key] = BatchDecoder(resolved, backend, max_batch=max(1, len(encoded)))
    return decoder.decode(encoded, names, indices, rois=rois, on_error=on_error, max_pixels=max_pixels)
