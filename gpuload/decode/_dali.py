"""DALI image decoding: the only gpuload module that imports ``nvidia.dali``, and only lazily.

One pipeline per (device, ROI or not) is built on first use and reused: encoded bytes go in
through ``external_source``, ``fn.decoders.image`` (or ``fn.decoders.image_slice`` for ROIs)
decodes them, ``fn.transpose`` lays them out CHW (or, with ``hwc=True``, they stay HWC in
memory and are handed out as CHW views: channels-last strides, no transpose). On a CUDA device the decoder runs as
``device="mixed"`` (nvJPEG, the hardware JPEG decoder where the GPU has one); without one it
runs on the CPU (libjpeg-turbo) in a pipeline with ``device_id=None``. DALI applies the EXIF
orientation itself (``adjust_orientation=True``, the default); ROIs are in upright coordinates.

**Streams.** On a CUDA device a batch runs with ``pipe.run(stream)``, ``stream`` being torch's
current stream: DALI makes that stream wait for its outputs (no host wait) and orders the
release of their memory after the work queued on it, so the ``feed_ndarray`` copies into torch
tensors, enqueued on the same stream, read them before DALI can reuse them. The torch tensors
are allocated on that stream too, so the caller's later work on it is ordered after the copies.

**Errors.** DALI raises ``RuntimeError`` for a bad file and for a failing device alike;
:class:`DaliError` keeps DALI's reason and ``device`` says which it was
(:func:`gpuload.decode.errors.is_device_failure`): an out-of-memory or CUDA error must never be
taken for a bad file. A pipeline that cannot be built is a device failure whatever DALI's text
says: no file has reached it yet.

**Console.** DALI prints its own ``[ERROR]`` line for every file it rejects; those lines are
kept off the console during a run and logged to ``gpuload.decode.dali`` instead, and the last
few are added to the error's reason (:mod:`gpuload.decode._stderr` says how, and when not).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gpuload.decode._stderr import quiet_native_stderr, take_native_lines
from gpuload.decode.errors import is_device_failure
from gpuload.device import usable_cpu_count

__all__ = ["DaliError", "DaliUnavailable", "dali_installed", "DaliDecoder"]


class DaliUnavailable(RuntimeError):
    """DALI is not installed, or it is installed but cannot be imported on this machine."""


class DaliError(RuntimeError):
    """DALI failed on a batch; the message is DALI's own reason, trimmed of pipeline noise.

    ``device`` is True when the reason is an out-of-memory or CUDA error rather than the input.
    """

    def __init__(self, reason: str, device: bool = False) -> None:
        super().__init__(reason)
        self.device = device


def dali_installed() -> bool:
    """True when the ``nvidia.dali`` package is present (checked without importing it)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):
        return False


def _import_dali() -> tuple[Any, Any, Any, Any, Any]:
    try:
        import nvidia.dali.fn as fn
        import nvidia.dali.types as types
        from nvidia.dali import pipeline_def
        from nvidia.dali.plugin.pytorch import feed_ndarray
        from nvidia.dali.tensors import TensorListCPU
    except Exception as error:  # a broken install raises all sorts
        raise DaliUnavailable(
            f"nvidia.dali could not be imported ({type(error).__name__}: {error}); install "
            "gpuload[cuda13] (or gpuload[cuda12]), or decode with backend='torchvision' or backend='pil'"
        ) from error
    from nvidia.dali import Pipeline, __version__

    if "cuda_stream" not in inspect.signature(Pipeline.run).parameters:
        raise DaliUnavailable(
            f"nvidia.dali {__version__} is too old: gpuload binds each run to torch's stream "
            "(Pipeline.run(cuda_stream), exec_dynamic), which DALI has since 1.44; upgrade it: "
            "pip install -U 'gpuload[cuda13]' (or [cuda12]), or decode with backend='nvjpeg', 'torchvision' or 'pil'"
        )
    return fn, types, pipeline_def, feed_ndarray, TensorListCPU


# nvimgcodecStatus_t, for DALI messages that only say "nvImageCodec failure: '#4'".
_NVIMGCODEC_STATUS = {
    1: "not initialized",
    2: "invalid parameter",
    3: "bad codestream: corrupt or truncated data",
    4: "codestream unsupported: not an image format DALI can read",
    5: "allocator failure",
    6: "execution failed",
    7: "architecture mismatch",
    8: "internal error",
    9: "implementation unsupported",
}


def _reason(error: BaseException) -> str:
    """The useful part of a DALI pipeline error: what the decoder said, without the traceback."""
    text = str(error)
    if "encountered:" in text:
        text = text.split("encountered:", 1)[1]
    text = text.split("Current pipeline object is no longer valid", 1)[0]
    text = re.sub(r"\s+", " ", text).strip().rstrip(":").strip()
    text = re.sub(
        r"nvImageCodec failure: '#(\d+)'",
        lambda m: f"nvImageCodec status {m[1]} ({_NVIMGCODEC_STATUS.get(int(m[1]), 'unknown')})",
        text,
    )
    return text or type(error).__name__


def _dali_error(failure: Exception, logged: list[str]) -> DaliError:
    """The DaliError for a failed run: DALI's reason, the last lines it logged, device or file."""
    reason = _reason(failure)
    if logged:
        reason += f" (DALI logged: {'; '.join(logged[-3:])})"
    error = DaliError(reason, device=is_device_failure(f"{reason} {failure}"))
    error.__cause__ = failure
    return error


def _build_error(failure: Exception, logged: list[str], name: str, batch: int) -> DaliError:
    """The DaliError for a pipeline DALI could not build: a device failure whatever its text.

    No input has reached the pipeline, so no file can be to blame; decoding the batch again
    sample by sample would only build the same failing pipeline once per sample.
    """
    reason = _reason(failure)
    if logged:
        reason += f" (DALI logged: {'; '.join(logged[-3:])})"
    error = DaliError(
        f"DALI could not build its {name} decoding pipeline (batch size {batch}): {reason}; no "
        "file is to blame. Check the install with `gpuload doctor`, or decode with "
        "backend='nvjpeg', 'torchvision' or 'pil'",
        device=True,
    )
    error.__cause__ = failure
    return error


class DaliDecoder:
    """A reusable DALI decoding pipeline for one device, with or without ROI decoding.

    ``decode`` takes up to any number of encoded buffers: the pipeline's batch size is the
    largest batch seen so far (``max_batch`` to start with), smaller batches reuse it, a larger
    one rebuilds it once at the new size. After a failed batch the pipeline is rebuilt, since
    DALI declares it invalid. Calls are serialized by a lock (a pipeline is not re-entrant).
    """

    def __init__(
        self, device: torch.device, max_batch: int = 256, num_threads: int | None = None, roi: bool = False,
        hwc: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.device = device
        self.mixed = device.type == "cuda"
        self.roi = roi
        self.hwc = hwc
        self.max_batch = max_batch
        # DALI's CPU stages (the whole decode on a CPU device, Huffman decoding with nvJPEG)
        # get one thread per usable core, up to 8.
        self.num_threads = num_threads or min(8, usable_cpu_count())
        self.name = "dali-mixed" if self.mixed else "dali-cpu"
        self._lock = threading.Lock()
        self._pipe: Any = None
        self._pipe_batch = 0
        self._dali = _import_dali()

    def _build(self, batch: int) -> None:
        fn, types, pipeline_def, _, _ = self._dali
        decoder_device = "mixed" if self.mixed else "cpu"
        roi, hwc = self.roi, self.hwc
        options: dict[str, Any] = {"device": decoder_device, "output_type": types.RGB}
        if self.mixed:
            # nvJPEG's default upsampling of 4:2:x chroma differs from libjpeg-turbo's; the
            # "fancy" (triangular) one is what PIL and torchvision use.
            options["jpeg_fancy_upsampling"] = True

        @pipeline_def(
            batch_size=batch,
            num_threads=self.num_threads,
            device_id=self.device.index if self.mixed else None,
            exec_dynamic=True,
            prefetch_queue_depth=1,
        )
        def graph():
            data = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            if roi:
                anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)
                shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
                image = fn.decoders.image_slice(data, anchor, shape, axis_names="HW", **options)
            else:
                image = fn.decoders.image(data, **options)
            return image if hwc else fn.transpose(image, perm=[2, 0, 1])

        pipe = graph()
        pipe.build()
        self._pipe, self._pipe_batch = pipe, batch

    def decode(
        self, encoded: Sequence[bytes], rois: Sequence[tuple[int, int, int, int]] | None = None
    ) -> list[torch.Tensor]:
        """Decode a batch into uint8 (3, H, W) tensors on ``self.device`` (views of (H, W, 3)
        memory with ``hwc``); DaliError on failure.

        With ``roi=True`` each image is only decoded inside its ``(y0, x0, h, w)`` window, which
        must lie inside the upright image.
        """
        if not encoded:
            return []
        if self.roi != (rois is not None):
            raise ValueError(
                f"this DALI decoder was built with roi={self.roi}; "
                f"{'pass' if self.roi else 'do not pass'} rois="
            )
        if rois is not None and len(rois) != len(encoded):
            raise ValueError(f"{len(rois)} ROIs for {len(encoded)} images; pass one per image")
        _, _, _, feed_ndarray, tensor_list = self._dali
        with self._lock:
            stream = torch.cuda.current_stream(self.device) if self.mixed else None
            # The error is kept in a list and popped, never in a local: a local holding it would
            # make a cycle through its traceback (frame -> error -> traceback -> frame) that keeps
            # the dead pipeline for the garbage collector, which may then run in a forked worker,
            # where DALI's destructor waits forever for threads the child does not have.
            failed: list[Exception] = []
            building = False
            with quiet_native_stderr():
                try:
                    if self._pipe is None or len(encoded) > self._pipe_batch:
                        building = True
                        self._build(max(self.max_batch, len(encoded), self._pipe_batch))
                        building = False
                    pipe = self._pipe
                    # One TensorListCPU per input: DALI checks a list's samples one by one in Python.
                    pipe.feed_input("encoded", tensor_list([np.frombuffer(data, dtype=np.uint8) for data in encoded]))
                    if rois is not None:
                        windows = np.array(rois, dtype=np.int32).reshape(-1, 4)
                        pipe.feed_input("anchor", tensor_list(np.ascontiguousarray(windows[:, :2])))
                        pipe.feed_input("shape", tensor_list(np.ascontiguousarray(windows[:, 2:])))
                    (batch,) = self._run(pipe, stream)
                except Exception as error:
                    failed.append(error)
            logged = take_native_lines()
            if failed:
                self._pipe = pipe = None  # DALI says the pipeline is no longer valid: rebuild next time
                if building:
                    raise _build_error(failed.pop(), logged, self.name, len(encoded))
                raise _dali_error(failed.pop(), logged)
            if stream is None:  # host memory the next run reuses: each sample copied out
                images = [torch.from_numpy(np.array(batch[i])) for i in range(len(batch))]
            else:
                images = []
                for i in range(len(batch)):
                    sample = batch[i]
                    out = torch.empty(tuple(sample.shape()), dtype=torch.uint8, device=self.device)
                    feed_ndarray(sample, out, cuda_stream=stream)
                    images.append(out)
            return [image.permute(2, 0, 1) for image in images] if self.hwc else images

    @staticmethod
    def _run(pipe: Any, stream: torch.cuda.Stream | None) -> Any:
        """One pipeline run, its outputs bound to ``stream`` (None: host-synchronous, CPU)."""
        return pipe.run(stream) if stream is not None else pipe.run()
