"""Batch decoding: encoded images (JPEG, PNG, ...) to uint8 (3, H, W) RGB tensors.

Decode batches of encoded images (JPEG, PNG, ...) into uint8 (3, H, W) RGB tensors.

Backends, in the order ``backend="auto"`` picks them:

- ``"dali-mixed"``: DALI's mixed decoder (nvJPEG on the GPU), when the target device is CUDA;
- ``"dali-cpu"``: DALI's CPU decoder (libjpeg-turbo, multi-threaded), when it is the CPU;
- ``"torchvision"``: ``torchvision.io.decode_image`` on the CPU, when DALI is missing;
- ``"pil"``: PIL on the CPU, when neither is installed.

Every backend gives the same pixels for the same file up to decoder rounding (tested against
PIL), applies the EXIF orientation, and reports bad files the same way: an
:class:`ImageDecodeError` naming the file, the sample index, the backend and the reason, or,
with ``on_error="skip"``, an entry in :attr:`DecodeResult.skipped`. One bad file never loses
the rest of its batch: when DALI rejects a batch, its samples are decoded one by one to find
the bad ones, and a sample DALI rejects but PIL reads (an unusual WebP, say) is kept.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpuload.decode import cpu
from gpuload.decode.cpu import describe_error
from gpuload.decode.headers import ROI, clip_roi, peek_size
from gpuload.device import resolve_device

if TYPE_CHECKING:
    from gpuload.decode._dali import DaliDecoder

__all__ = [
    "BACKENDS",
    "ImageDecodeError",
    "DecodeResult",
    "BatchDecoder",
    "decode_batch",
    "resolve_backend",
]

BACKENDS = ("auto", "dali", "dali-mixed", "dali-cpu", "torchvision", "pil")
_ON_ERROR = ("raise", "skip")


class ImageDecodeError(RuntimeError):
    """A sample's image could not be read or decoded.

    ``index`` is the sample index in the dataset, ``name`` the file (or whatever names the
    sample), ``backend`` what tried (``"read"`` when the file could not even be read) and
    ``reason`` the underlying error.
    """

    def __init__(self, index: int, name: str, backend: str, reason: str, others: int = 0) -> None:
        self.index, self.name, self.backend, self.reason = index, name, backend, reason
        more = f" ({others} more sample(s) in this batch failed too)" if others else ""
        verb = "read" if backend == "read" else f"decode (backend {backend})"
        super().__init__(
            f"could not {verb} image {name!r}, sample index {index}: {reason}{more}. Check or "
            "remove the file, or pass on_error='skip' to skip bad samples and count them"
        )


@dataclass
class DecodeResult:
    """What a batch decode produced.

    ``images[k]`` is the decoded (3, H, W) uint8 tensor of input position ``kept_positions[k]``;
    ``skipped`` lists ``(index, name, reason)`` of the samples left out (``on_error="skip"``);
    ``backend`` is the backend that decoded the batch; ``roi`` says how ROIs were honoured:
    ``"none"`` (no ROIs asked), ``"decoder"`` (only the window was decoded) or ``"crop"``
    (decoded whole, then cropped); ``fallback_decoded`` counts samples the main backend
    rejected but PIL decoded.
    """

    images: list[torch.Tensor]
    kept_positions: list[int]
    skipped: list[tuple[int, str, str]] = field(default_factory=list)
    backend: str = ""
    roi: str = "none"
    fallback_decoded: int = 0


def _dali_installed() -> bool:
    from gpuload.decode._dali import dali_installed

    return dali_installed()


def resolve_backend(device: torch.device, backend: str = "auto") -> str:
    """The concrete backend (``dali-mixed``, ``dali-cpu``, ``torchvision``, ``pil``) for a device.

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
                "nvidia-dali-cuda120, or use backend='auto' to fall back to torchvision or PIL"
            )
        return "torchvision" if cpu.torchvision_available() else "pil"
    if backend.startswith("dali") and not _dali_installed():
        raise ValueError(f"backend={backend!r} needs nvidia.dali, which is not installed")
    if backend == "dali-mixed" and device.type != "cuda":
        raise ValueError(
            f"backend='dali-mixed' decodes on a GPU but the device is {device}; use "
            "backend='dali-cpu' or 'auto'"
        )
    if backend == "torchvision" and not cpu.torchvision_available():
        raise ValueError("backend='torchvision' needs torchvision, which is not installed")
    return backend


def _screen(
    encoded: Sequence[bytes],
    names: Sequence[str],
    indices: Sequence[int],
    rois: Sequence[Sequence[int] | None] | None,
) -> tuple[dict[int, str], dict[int, ROI]]:
    """Failures known before decoding (empty data, unreadable headers) and clipped ROI windows."""
    failures: dict[int, str] = {}
    windows: dict[int, ROI] = {}
    for k, data in enumerate(encoded):
        if len(data) == 0:
            failures[k] = "the file is empty (0 bytes)"
            continue
        if rois is None:
            continue
        try:
            height, width = peek_size(data)
        except Exception as error:
            failures[k] = f"not a readable image header ({describe_error(error)})"
            continue
        window = (0, 0, height, width) if rois[k] is None else clip_roi(rois[k], height, width)
        if window is None:
            raise ValueError(
                f"ROI {tuple(rois[k])} (y0, x0, h, w) of sample index {indices[k]} "
                f"({names[k]!r}) does not overlap its {height}x{width} image"
            )
        windows[k] = window
    return failures, windows


class BatchDecoder:
    """Decodes batches for one device with one backend, keeping DALI pipelines for reuse.

    Build one per loader (``max_batch`` = its batch size) and call :meth:`decode` per batch;
    images land on ``device`` (a CPU backend's images are copied there). If DALI turns out to
    be unusable at run time under ``backend="auto"``, it warns once and decodes with the CPU
    fallback instead; :attr:`backend` always says what is decoding now.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        backend: str = "auto",
        max_batch: int = 256,
        num_threads: int | None = None,
    ) -> None:
        self.device = resolve_device(device)
        self.requested = backend
        self.backend = resolve_backend(self.device, backend)
        self.max_batch = max_batch
        self.num_threads = num_threads
        self._cpu_name = "torchvision" if cpu.torchvision_available() else "pil"
        self._dali: dict[bool, DaliDecoder] = {}  # keyed by "decodes ROIs"
        self._lock = threading.Lock()

    def _dali_decoder(self, roi: bool) -> DaliDecoder | None:
        """The DALI pipeline for ROI or whole decoding, built on first use; None if DALI broke."""
        from gpuload.decode._dali import DaliDecoder, DaliUnavailable

        with self._lock:
            if roi not in self._dali:
                try:
                    self._dali[roi] = DaliDecoder(self.device, self.max_batch, self.num_threads, roi)
                except DaliUnavailable as error:
                    if self.requested != "auto":
                        raise
                    warnings.warn(f"{error}; decoding with {self._cpu_name} instead", stacklevel=3)
                    self.backend = self._cpu_name
                    return None
            return self._dali[roi]

    def decode(
        self,
        encoded: Sequence[bytes],
        names: Sequence[str],
        indices: Sequence[int],
        rois: Sequence[Sequence[int] | None] | None = None,
        on_error: str = "raise",
    ) -> DecodeResult:
        """Decode ``encoded[k]`` (named ``names[k]``, dataset index ``indices[k]``) for each k.

        ``rois[k] = (y0, x0, h, w)``, in pixels of the upright image, limits sample k to that
        window (intersected with the image); ``rois[k] = None`` means the whole image. With
        ``rois``, every header must be readable (the windows are clipped to the image's size).
        ``on_error="raise"`` raises
        :class:`ImageDecodeError` for the first bad sample; ``"skip"`` leaves bad ones out.
        """
        n = len(encoded)
        if len(names) != n or len(indices) != n or (rois is not None and len(rois) != n):
            raise ValueError(
                f"decode needs one name, index (and ROI) per image: got {n} images, "
                f"{len(names)} names, {len(indices)} indices"
                + ("" if rois is None else f", {len(rois)} ROIs")
            )
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error={on_error!r} is not one of 'raise', 'skip'")

        failures, windows = _screen(encoded, names, indices, rois)
        todo = [k for k in range(n) if k not in failures]
        decoded: dict[int, torch.Tensor] = {}
        dali = self._dali_decoder(rois is not None) if self.backend.startswith("dali") else None
        backend = self.backend
        roi_mode = "none" if rois is None else ("decoder" if dali is not None else "crop")
        rescued = 0
        if dali is not None:
            decoded, dali_failures = self._decode_dali(dali, encoded, todo, windows, rois is not None)
            leftovers = sorted(dali_failures)
            second = cpu.decode_many(
                cpu.pil_decode, [encoded[k] for k in leftovers], [windows.get(k) for k in leftovers]
            )
            for k, outcome in zip(leftovers, second):
                if isinstance(outcome, Exception):
                    failures[k] = f"{dali_failures[k]}; PIL: {describe_error(outcome)}"
                else:
                    decoded[k] = self._to_device(outcome)
                    rescued += 1
        else:
            outcomes = cpu.decode_many(
                cpu.cpu_decoder(backend), [encoded[k] for k in todo], [windows.get(k) for k in todo]
            )
            for k, outcome in zip(todo, outcomes):
                if isinstance(outcome, Exception):
                    failures[k] = describe_error(outcome)
                else:
                    decoded[k] = self._to_device(outcome)

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
        )

    def _to_device(self, image: torch.Tensor) -> torch.Tensor:
        return image.to(self.device) if image.device != self.device else image

    @staticmethod
    def _decode_dali(
        dali: DaliDecoder,
        encoded: Sequence[bytes],
        todo: list[int],
        windows: dict[int, ROI],
        roi: bool,
    ) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
        """Decode ``todo`` as one DALI batch; if DALI rejects it, one by one to find the culprits."""
        from gpuload.decode._dali import DaliError

        def run(ks: list[int]) -> list[torch.Tensor]:
            return dali.decode([encoded[k] for k in ks], [windows[k] for k in ks] if roi else None)

        try:
            return dict(zip(todo, run(todo))), {}
        except DaliError as error:
            if len(todo) == 1:
                return {}, {todo[0]: f"DALI: {error}"}
        decoded: dict[int, torch.Tensor] = {}
        failures: dict[int, str] = {}
        for k in todo:
            try:
                (decoded[k],) = run([k])
            except DaliError as error:
                failures[k] = f"DALI: {error}"
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
) -> DecodeResult:
    """Decode one batch with a decoder shared per (device, backend); see :class:`BatchDecoder`.

    ``device=None`` means the current CUDA device when there is one, else the CPU.
    """
    resolved = resolve_device(device)
    key = (str(resolved), backend)
    with _shared_lock:
        decoder = _shared.get(key)
        if decoder is None:
            decoder = _shared[key] = BatchDecoder(resolved, backend, max_batch=max(1, len(encoded)))
    return decoder.decode(encoded, names, indices, rois=rois, on_error=on_error)
