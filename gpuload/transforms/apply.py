"""Run an op list on a batch: draw the parameters, then the CuPy kernels, the batched torch
ops or the torch reference.

The kernels run when the batch's target device is CUDA and CuPy works there; otherwise the
batched torch ops (``batched.py``) run, on the same device; the reference runs when asked for
and for the rare geometry the per-sample map cannot express. Either way the parameters are the
same, so the results agree to float rounding.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpuload.timeline import stage
from gpuload.transfer import Staging, to_device
from gpuload.transforms import _kernels, batched, reference
from gpuload.transforms.ops import (
    CenterCrop,
    Op,
    RandomCrop,
    RandomResizedCrop,
    Resize,
    size_pair,
    validate_pipeline,
)
from gpuload.transforms.params import BatchParams, sample_params
from gpuload.transforms.windows import Window, params_in_windows

__all__ = ["OutputPlan", "apply_transforms", "transform_batch", "plan_output", "choose_backend"]

_BACKENDS = ("auto", "cupy", "batched", "torch")
_warned: set[str] = set()


@dataclass(frozen=True)
class OutputPlan:
    """What a transform list delivers: dtype, layout and (height, width) when it is fixed."""

    dtype: torch.dtype
    channels_last: bool
    size: tuple[int, int] | None  # None: depends on the input size (Resize(int) last)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def shape(self, batch_size: int, channels: int = 3) -> tuple[int, int, int, int]:
        if self.size is None:
            raise ValueError("the output size depends on the input size; pass input_size")
        return (batch_size, channels, *self.size)


def plan_output(ops: Sequence[Op], input_size: tuple[int, int] | None = None) -> OutputPlan:
    """The output dtype, layout and size of ``ops`` (for images of ``input_size``, if given)."""
    ops = validate_pipeline(ops)
    dtype, channels_last = reference.output_format(ops)
    if input_size is not None:
        params = sample_params(ops, 0, 0, torch.zeros(1, dtype=torch.int64), [input_size])
        return OutputPlan(dtype, channels_last, params.output_size())
    size: tuple[int, int] | None = None
    for op in ops:
        if isinstance(op, (RandomResizedCrop, CenterCrop, RandomCrop)):
            size = size_pair(op)
        elif isinstance(op, Resize):
            size = None if op.shorter_side else size_pair(op)
    return OutputPlan(dtype, channels_last, size)


def choose_backend(device: torch.device | str, backend: str = "auto") -> tuple[str, str]:
    """("cupy", "batched" or "torch", why) for batches delivered on ``device``."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {_BACKENDS}")
    device = torch.device(device)
    if backend == "torch":
        return "torch", "asked for the torch reference"
    if backend == "batched":
        return "batched", "asked for the batched torch ops"
    ok, reason = _kernels.available(device)
    if ok:
        return "cupy", f"CuPy kernels on {device}"
    if backend == "cupy":
        raise RuntimeError(f"backend='cupy' but {reason}; use backend='auto', 'batched' or 'torch'")
    if device.type == "cuda" and str(device) not in _warned:
        _warned.add(str(device))
        warnings.warn(f"gpuload transforms use batched torch ops on {device}: {reason}", stacklevel=3)
    return "batched", reason


def transform_batch(
    ops: Sequence[Op],
    batch: reference.Batch,
    seed: int,
    epoch: int,
    indices: torch.Tensor | Sequence[int],
    device: torch.device | str | None = None,
    backend: str = "auto",
    *,
    windows: Sequence[Window] | None = None,
    image_sizes: Sequence[tuple[int, int]] | None = None,
    staging: Staging | None = None,
) -> tuple[torch.Tensor, str]:
    """``apply_transforms`` that also says which backend ran ("cupy", "batched" or "torch").

    With ``windows`` (see ``transforms.windows``), ``batch[k]`` is only the ``windows[k]`` part
    of an image of ``image_sizes[k]`` (height, width): parameters are drawn for the whole image
    and the result is what the whole image would give. ``staging``: the route of host images
    and per-batch tables to ``device`` (the loader's; None: one pinned copy on the current stream).
    """
    with stage("transform"):
        return _transform_batch(ops, batch, seed, epoch, indices, device, backend, windows, image_sizes, staging)


def _transform_batch(
    ops: Sequence[Op],
    batch: reference.Batch,
    seed: int,
    epoch: int,
    indices: torch.Tensor | Sequence[int],
    device: torch.device | str | None,
    backend: str,
    windows: Sequence[Window] | None,
    image_sizes: Sequence[tuple[int, int]] | None,
    staging: Staging | None,
) -> tuple[torch.Tensor, str]:
    ops = validate_pipeline(ops)
    if device is None:
        device = batch.device if isinstance(batch, torch.Tensor) else (
            batch[0].device if len(batch) else torch.device("cpu")
        )
    device = torch.device(device)
    sizes = reference.batch_sizes(batch)
    if windows is None:
        params = sample_params(ops, seed, epoch, indices, sizes)
    else:
        params = _windowed_params(ops, seed, epoch, indices, sizes, windows, image_sizes)
    batch = _to_device(batch, device, staging)
    name, _ = choose_backend(device, backend)
    if name == "cupy" and len(sizes):
        try:
            out = _kernels.run(params, batch, device, staging)
        except _kernels.KernelUnavailable as exc:
            # The kernels cannot build or launch here: use the batched torch ops from now on.
            # Anything else (out of memory, a CUDA error) is not the backend's fault and propagates.
            if backend == "cupy":
                raise
            _kernels.mark_unavailable(device, str(exc))
            warnings.warn(
                f"gpuload transforms fall back to batched torch ops on {device}: {exc}",
                stacklevel=2,
            )
            out = None
        if out is not None:
            return out, "cupy"
        if backend == "cupy":
            raise RuntimeError(
                "backend='cupy' but this batch's geometry needs the reference (two resizes, "
                "padding before a resize, or crops with different fills); use backend='auto'"
            )
    if name != "torch" and len(sizes):
        out = batched.run(params, batch, staging=staging)
        if out is not None:
            return out, "batched"
    return reference.apply_reference(params, batch, staging=staging), "torch"


def apply_transforms(
    ops: Sequence[Op],
    batch: reference.Batch,
    seed: int,
    epoch: int,
    indices: torch.Tensor | Sequence[int],
    device: torch.device | str | None = None,
    backend: str = "auto",
    *,
    staging: Staging | None = None,
) -> torch.Tensor:
    """Transform a batch of uint8 images into one N, C, H, W tensor on ``device``.

    ``batch`` is a uint8 N, C, H, W tensor or a list of uint8 C, H, W tensors (sizes may
    differ); ``indices`` are the samples' dataset indices, which with ``seed`` and ``epoch``
    fix every random parameter. ``device`` defaults to the batch's device; a CPU batch bound
    for CUDA is moved there as uint8 first. ``backend``: "auto", "cupy", "batched" or "torch"
    (the reference). ``staging``: how host tensors reach ``device`` (a loader's; None: one
    non-blocking copy from pinned memory on the current stream).
    """
    return transform_batch(ops, batch, seed, epoch, indices, device, backend, staging=staging)[0]


def _windowed_params(
    ops: Sequence[Op],
    seed: int,
    epoch: int,
    indices: torch.Tensor | Sequence[int],
    sizes: torch.Tensor,
    windows: Sequence[Window],
    image_sizes: Sequence[tuple[int, int]] | None,
) -> BatchParams:
    if image_sizes is None:
        raise ValueError("windows= needs image_sizes=: the (height, width) of the whole images")
    params = params_in_windows(sample_params(ops, seed, epoch, indices, image_sizes), windows)
    if not torch.equal(params.sizes[0], sizes):
        k = int((params.sizes[0] != sizes).any(1).nonzero()[0, 0])
        raise ValueError(
            f"image {k} is {tuple(sizes[k].tolist())} but its window {tuple(windows[k])} "
            f"(y0, x0, h, w) is {tuple(params.sizes[0][k].tolist())}: pass the decoded windows"
        )
    return params


def _to_device(batch: reference.Batch, device: torch.device, staging: Staging | None) -> reference.Batch:
    """The batch on ``device``. Host images bound for CUDA go in one copy through ``staging``
    (from pinned memory): a copy from pageable memory would wait for the stream (a host sync
    every batch)."""
    images = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    from_host = {k for k, image in enumerate(images) if image.device.type == "cpu" and device.type == "cuda"}
    staged = iter(to_device([images[k] for k in sorted(from_host)], device, staging))
    moved = [next(staged) if k in from_host else image.to(device, non_blocking=True)
             for k, image in enumerate(images)]
    return moved[0] if isinstance(batch, torch.Tensor) else moved
