"""The torch reference: what an op list means, on any device. The CPU path and the test oracle.

Semantics (the CuPy kernels are tested against these):

- Geometry runs per image on float32 copies of the uint8 pixels (0-255), op by op. Crops that
  reach outside the image pad with the op's fill. Resizes are
  ``F.interpolate(mode="bilinear", align_corners=False, antialias=False)`` on the crop window
  (no antialiasing: the GPU kernel does plain bilinear, so downscaling by more than 2x aliases).
- Pixels stay float32 between ops: nothing is rounded to uint8 in between (torchvision on uint8
  rounds after every op, so it can differ by rounding).
- ColorJitter applies brightness, contrast and saturation in the sample's random order,
  with torchvision's formulas (blend with black, the mean grey, the per-pixel grey), clamped
  to 0-255 after each.
- ToDtype(scale=True) divides by 255; Normalize subtracts and divides; RandomErasing writes its
  value; the output is cast once at the end: to uint8 (rounded half to even, clamped) when
  there is no ToDtype, else to its dtype. ToChannelsLast sets ``torch.channels_last``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F

from gpuload.transfer import Staging, to_device
from gpuload.transforms.ops import (
    GEOMETRIC_OPS,
    CenterCrop,
    ColorJitter,
    Normalize,
    Op,
    RandomCrop,
    RandomErasing,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToChannelsLast,
    ToDtype,
    size_pair,
)
from gpuload.transforms.params import BatchParams

__all__ = [
    "Batch",
    "apply_reference",
    "apply_value_ops",
    "batch_sizes",
    "output_format",
    "grayscale",
]

Batch = torch.Tensor | Sequence[torch.Tensor]

_GREY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights


def output_format(ops: Sequence[Op]) -> tuple[torch.dtype, bool]:
    """(dtype, channels_last) of the batch an op list produces."""
    dtype = next((op.dtype for op in ops if isinstance(op, ToDtype)), torch.uint8)
    return dtype, any(isinstance(op, ToChannelsLast) for op in ops)


def batch_sizes(batch: Batch) -> torch.Tensor:
    """(N, 2) int64 (height, width) of a uint8 NCHW tensor or a list of CHW tensors."""
    if isinstance(batch, torch.Tensor):
        _check_images(batch, "batch", ndim=4)
        return torch.tensor([batch.shape[-2:]], dtype=torch.int64).expand(len(batch), 2).clone()
    # One pass for the whole list; the first image that is not uint8 C,H,W is then named.
    wrong = [i for i, image in enumerate(batch)
             if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.dim() != 3]
    if wrong:
        _check_images(batch[wrong[0]], f"batch[{wrong[0]}]", ndim=3)
    return torch.tensor([tuple(image.shape[-2:]) for image in batch], dtype=torch.int64).reshape(-1, 2)


def _check_images(t: torch.Tensor, name: str, ndim: int) -> None:
    layout = "N, C, H, W" if ndim == 4 else "C, H, W"
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != ndim:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
        raise TypeError(f"{name} must be a uint8 tensor ({layout}), got {got}")


def apply_reference(params: BatchParams, batch: Batch, *, staging: Staging | None = None) -> torch.Tensor:
    """Apply ``params.ops`` with the drawn ``params`` to ``batch`` on the batch's device; the
    parameters a value op needs there are copied through ``staging`` (the loader's)."""
    ops = params.ops
    images = list(batch.unbind(0)) if isinstance(batch, torch.Tensor) else list(batch)
    if len(images) != len(params.indices):
        raise ValueError(f"{len(images)} images but parameters for {len(params.indices)} samples")
    params.output_size()  # raises if the outputs cannot be stacked
    n_geo = sum(isinstance(op, GEOMETRIC_OPS) for op in ops)
    if images:
        canvas = torch.stack([_geometry(ops[:n_geo], params, k, img) for k, img in enumerate(images)])
    else:
        channels = batch.shape[1] if isinstance(batch, torch.Tensor) else 3
        h, w = params.output_size()
        canvas = torch.empty((0, channels, h, w), dtype=torch.float32)
    return apply_value_ops(ops[n_geo:], params.per_op[n_geo:], canvas, staging=staging)


def _geometry(ops: Sequence[Op], params: BatchParams, k: int, image: torch.Tensor) -> torch.Tensor:
    x = image.to(torch.float32)
    for op, p in zip(ops, params.per_op):
        if isinstance(op, RandomResizedCrop):
            x = crop(x, int(p["top"][k]), int(p["left"][k]), int(p["height"][k]), int(p["width"][k]))
            x = resize(x, size_pair(op))
        elif isinstance(op, Resize):
            x = resize(x, (int(p["height"][k]), int(p["width"][k])))
        elif isinstance(op, (CenterCrop, RandomCrop)):
            fill = float(op.fill) if isinstance(op, RandomCrop) else 0.0
            x = crop(x, int(p["top"][k]), int(p["left"][k]), *size_pair(op), fill)
        elif isinstance(op, RandomHorizontalFlip):
            if bool(p["flip"][k]):
                x = x.flip(-1)
        else:  # pragma: no cover - validate_pipeline keeps other ops out of this block
            raise TypeError(f"{op!r} is not a geometric op")
    return x


def crop(x: torch.Tensor, top: int, left: int, height: int, width: int, fill: float = 0.0) -> torch.Tensor:
    """The (height, width) window at (top, left) of a CHW image; outside the image is ``fill``."""
    _, h, w = x.shape
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return x[:, top : top + height, left : left + width]
    out = torch.full((x.shape[0], height, width), fill, dtype=x.dtype, device=x.device)
    y0, y1 = max(top, 0), min(top + height, h)
    x0, x1 = max(left, 0), min(left + width, w)
    if y0 < y1 and x0 < x1:
        out[:, y0 - top : y1 - top, x0 - left : x1 - left] = x[:, y0:y1, x0:x1]
    return out


def resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear, align_corners=False, no antialiasing, on a float CHW image."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x[None], size=size, mode="bilinear", align_corners=False, antialias=False)[0]


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """torchvision's luma of an N3HW batch, shape N1HW."""
    r, g, b = x.unbind(1)
    return (r * _GREY[0] + g * _GREY[1] + b * _GREY[2]).unsqueeze(1)


def apply_value_ops(
    ops: Sequence[Op],
    per_op: Sequence[dict[str, torch.Tensor]],
    x: torch.Tensor,
    cast_output: bool = True,
    owned: bool = False,
    *,
    staging: Staging | None = None,
) -> torch.Tensor:
    """Colour, dtype and layout ops on a float32 NCHW batch of 0-255 pixels; returns the output
    (or, with ``cast_output=False``, the float32 values before the final cast and layout).
    ``owned=True``: ``x`` is the caller's scratch, which the ops may update in place. ``x``
    may be uint8 when the first op is ``ToDtype(scale=True)`` (its division makes the floats).
    ``staging``: the route of the ops' per-batch parameters to ``x``'s device (the loader's).

    Shared by the reference, the GPU path's colour pass and the batched path.
    """
    dtype, channels_last = output_format(ops)
    scaled = False  # True once ToDtype(scale=True) divided by 255
    # owned: x is a tensor made here (or given as scratch), which later ops may update in place
    for op, p in zip(ops, per_op):
        if isinstance(op, ColorJitter):
            x = color_jitter(x, p, staging)
            owned = False
        elif isinstance(op, ToDtype):
            if op.scale:
                x = x.div_(255.0) if owned else x / 255.0
                scaled = owned = True
        elif isinstance(op, Normalize):
            mean, std = to_device(normalize_constants(op, scaled, x.shape[1]), x.device, staging)
            mean, std = per_channel(mean, x), per_channel(std, x)
            x = (x.sub_(mean) if owned else x - mean).div_(std)  # same rounding as (x - m) / s
            owned = True
        elif isinstance(op, RandomErasing):
            x = erase(x, p, erase_values(op, x.shape[1]), staging)
    if not cast_output:
        return x
    layout = torch.channels_last if channels_last else torch.contiguous_format
    if dtype == torch.uint8:
        return x.round().clamp_(0, 255).to(torch.uint8, memory_format=layout)
    return x.to(dtype, memory_format=layout)


def per_channel(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-channel ``values`` shaped to broadcast over the N, C, H, W batch ``x``.

    For a channels-last ``x`` they are expanded to one whole image in its layout: a (1, C, 1, 1)
    operand broadcast along the innermost dimension (C) makes the op go element by element,
    measured 2.5x slower on a CPU. The values, and so the results, are the same.
    """
    values = values.view(1, -1, 1, 1)
    if x.shape[1] > 1 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        values = values.expand(1, *x.shape[1:]).contiguous(memory_format=torch.channels_last)
    return values


@functools.lru_cache(maxsize=64)
def normalize_constants(op: Normalize, scaled: bool, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel float32 (mean, std) in the tensor's values (rescaled per ``value_range``).

    Cached per (op, scaled, channels), so the CPU tensors are shared: read them, never write."""
    if len(op.mean) not in (1, channels):
        raise ValueError(f"{op!r} has {len(op.mean)} means for {channels}-channel images")
    mean = torch.tensor(op.mean, dtype=torch.float64).expand(channels)
    std = torch.tensor(op.std, dtype=torch.float64).expand(channels)
    if op.value_range is not None:
        factor = (1.0 if scaled else 255.0) / float(op.value_range)
        mean, std = mean * factor, std * factor
    return mean.to(torch.float32), std.to(torch.float32)


def erase_values(op: RandomErasing, channels: int) -> torch.Tensor:
    values = cast("tuple[float, ...]", op.value)  # one or one per channel, made a tuple when built
    if len(values) not in (1, channels):
        raise ValueError(f"{op!r} has {len(values)} values for {channels}-channel images")
    return torch.tensor(values, dtype=torch.float32).expand(channels).clone()


def erase(x: torch.Tensor, p: dict[str, torch.Tensor], values: torch.Tensor, staging: Staging | None) -> torch.Tensor:
    """Set each sample's rectangle (where ``apply``) to ``values`` (one per channel)."""
    dev = x.device
    top, left, height, width, apply, values = to_device(
        [p["top"], p["left"], p["height"], p["width"], p["apply"], values], dev, staging
    )
    top, left = top.view(-1, 1, 1), left.view(-1, 1, 1)
    bottom, right = top + height.view(-1, 1, 1), left + width.view(-1, 1, 1)
    rows = torch.arange(x.shape[2], device=dev).view(1, -1, 1)
    cols = torch.arange(x.shape[3], device=dev).view(1, 1, -1)
    inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
    inside &= apply.view(-1, 1, 1)
    return torch.where(inside[:, None], values.view(1, -1, 1, 1), x)


def color_jitter(x: torch.Tensor, p: dict[str, torch.Tensor], staging: Staging | None) -> torch.Tensor:
    """Brightness, contrast, saturation in each sample's order; 0-255 pixels, clamped.

    Each step computes every adjustment for the whole batch and keeps, per sample, the one its
    order names (``torch.where``): no data-dependent indexing, so no host sync on a GPU.
    """
    order, *factors = to_device(
        [p["order"], *(p[name].to(torch.float32) for name in ("brightness", "contrast", "saturation"))],
        x.device, staging,
    )
    for step in range(3):
        for kind in range(3):
            chosen = (order[:, step] == kind).view(-1, 1, 1, 1)
            x = torch.where(chosen, _ADJUST[kind](x, factors[kind].view(-1, 1, 1, 1)), x)
    return x


def _brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (x * f).clamp_(0, 255)


def _contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    grey = grayscale(x) if x.shape[1] == 3 else x
    # Rows first, then their sums: each sum is one thread's, so the mean does not depend on how
    # many threads torch (or gpuload.cpu_threads, by the machine's load) gives the reduction.
    mean = grey.sum(dim=3, keepdim=True).sum(dim=(1, 2), keepdim=True) / grey[0].numel()
    return (f * x + (1.0 - f) * mean).clamp_(0, 255)


def _saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:  # torchvision leaves grey images alone
        return x
    return (f * x + (1.0 - f) * grayscale(x)).clamp_(0, 255)


_ADJUST = (_brightness, _contrast, _saturation)
