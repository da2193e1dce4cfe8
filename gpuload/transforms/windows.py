"""Decode windows: the part of each image a transform list reads, known before decoding.

When the list starts with a crop (``RandomResizedCrop``, ``CenterCrop`` or ``RandomCrop``),
that crop's per-sample box depends only on (seed, epoch, index) and the image size, which the
file header gives. So the box can be drawn first and only that window decoded; the list then
runs on the window with the first crop's offsets moved into the window's pixels. The output
is the same as decoding the whole image and running the list on it: every op after the first
crop only ever sees the crop's pixels, and a crop reaching outside the image pads with its fill
either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from gpuload.transforms.ops import CenterCrop, Op, RandomCrop, RandomResizedCrop, size_pair, validate_pipeline
from gpuload.transforms.params import BatchParams, sample_params

__all__ = ["Window", "starts_with_crop", "decode_windows", "params_in_windows"]

Window = tuple[int, int, int, int]
"""``(y0, x0, height, width)`` in pixels of the upright image (the decoders' ROI)."""


def starts_with_crop(ops: Sequence[Op]) -> bool:
    """True when the list's first op is a crop whose box can be drawn from the image size."""
    ops = validate_pipeline(ops)
    return bool(ops) and isinstance(ops[0], (RandomResizedCrop, CenterCrop, RandomCrop))


def _first_crop_box(params: BatchParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top, left, height, width) of op 0's box per sample, in the image's pixels."""
    op, p = params.ops[0], params.per_op[0]
    if isinstance(op, RandomResizedCrop):
        return p["top"], p["left"], p["height"], p["width"]
    n = len(params.indices)
    height, width = size_pair(op)
    return p["top"], p["left"], torch.full((n,), height), torch.full((n,), width)


def decode_windows(
    ops: Sequence[Op],
    seed: int,
    epoch: int,
    indices: torch.Tensor | Sequence[int],
    image_sizes: Sequence[tuple[int, int]],
) -> list[Window]:
    """The window of each image (of upright ``image_sizes``) that ``ops`` reads.

    The first crop's box, intersected with the image (a padded ``CenterCrop``/``RandomCrop``
    box reaches outside it). Raises ValueError unless ``starts_with_crop(ops)``.
    """
    ops = validate_pipeline(ops)
    if not starts_with_crop(ops):
        raise ValueError(f"the transform list does not start with a crop (first op: {ops[0] if ops else None!r})")
    if not len(image_sizes):
        return []
    params = sample_params(ops[:1], seed, epoch, indices, image_sizes)  # op 0 draws only its own slots
    top, left, height, width = _first_crop_box(params)
    sizes = params.sizes[0]
    y0, x0 = top.clamp(min=0), left.clamp(min=0)
    y1 = torch.minimum(top + height, sizes[:, 0])
    x1 = torch.minimum(left + width, sizes[:, 1])
    return [tuple(row) for row in torch.stack([y0, x0, y1 - y0, x1 - x0], 1).tolist()]


def params_in_windows(params: BatchParams, windows: Sequence[Window]) -> BatchParams:
    """``params`` (drawn for whole images) for a batch of the ``windows`` of those images.

    Op 0's offsets move into window pixels and the input sizes become the windows' sizes;
    every other parameter stays as drawn.
    """
    if len(windows) != len(params.indices):
        raise ValueError(f"{len(windows)} windows for {len(params.indices)} samples")
    if not starts_with_crop(params.ops):
        raise ValueError("decode windows need a transform list that starts with a crop")
    window = torch.as_tensor(windows, dtype=torch.int64).reshape(-1, 4)
    first = dict(params.per_op[0])
    first["top"] = first["top"] - window[:, 0]
    first["left"] = first["left"] - window[:, 1]
    return replace(
        params,
        per_op=(first, *params.per_op[1:]),
        sizes=(window[:, 2:].clone(), *params.sizes[1:]),
    )
