"""The geometry of an op list as one map per sample: pure torch, shared by every backend.

Any chain of crops, one resize and flips reduces to one map per sample (``geometry_plan``):
a source window, resized to a canvas, a crop of that canvas (an offset and the box where
pixels are valid, outside is the fill), and a final mirror. Flips commute with the other ops
once later crop offsets are mirrored, and bilinear resize with align_corners=False is
symmetric. Batches the map cannot express (two resizes, padding before a resize, different
fills) get None, and the caller runs the torch reference.

The CuPy kernels (``_kernels.py``) read the map per output pixel; the batched torch path
(``batched.py``) turns it into gathers. Without a resize the map is usually a plain window
per sample (``crop_windows``): output pixel (y, x) reads source pixel (y + dy, x + dx), of
the mirrored image for a flipped sample, and the fill exactly where that lies outside.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpuload.transforms.ops import GEOMETRIC_OPS, RandomCrop, RandomHorizontalFlip, RandomResizedCrop, Resize, size_pair
from gpuload.transforms.params import BatchParams

__all__ = ["PLAN_COLUMNS", "geometry_plan", "crop_windows"]

# The columns of a plan's per-sample row (int64).
PLAN_COLUMNS = (
    "win_y0", "win_x0", "win_h", "win_w", "canvas_h", "canvas_w",
    "off_y", "off_x", "box_y0", "box_y1", "box_x0", "box_x1", "flip",
)  # fmt: skip


def geometry_plan(
    params: BatchParams, source_sizes: torch.Tensor
) -> tuple[torch.Tensor, float] | None:
    """Reduce the batch's geometric ops to one map per sample: ((N, 13) int64 in
    ``PLAN_COLUMNS`` order, fill), or None for what the map cannot express (two resizes,
    padding before a resize, crops with different fills)."""
    ops = params.ops
    geo = [k for k, op in enumerate(ops) if isinstance(op, GEOMETRIC_OPS)]
    resizes = [k for k in geo if isinstance(ops[k], (RandomResizedCrop, Resize))]
    if len(resizes) > 1:
        return None
    n = len(source_sizes)
    i64: dict[str, Any] = {"dtype": torch.int64}
    h, w = source_sizes[:, 0].clone(), source_sizes[:, 1].clone()
    zeros = torch.zeros(n, **i64)
    win = [zeros.clone(), zeros.clone(), h.clone(), w.clone()]  # y0, x0, h, w (unmirrored)
    flip = torch.zeros(n, dtype=torch.bool)
    resize_at = resizes[0] if resizes else -1
    # Before the resize: crops move the window and must stay inside the image.
    for k in geo:
        if k >= resize_at:
            break
        op, p = ops[k], params.per_op[k]
        if isinstance(op, RandomHorizontalFlip):
            flip ^= p["flip"]
            continue
        height, width = size_pair(op)
        th, tw = torch.full((n,), height, **i64), torch.full((n,), width, **i64)
        top, left = p["top"], p["left"]
        if bool(((top < 0) | (left < 0) | (top + th > win[2]) | (left + tw > win[3])).any()):
            return None  # padding before a resize: the map cannot express it
        left = torch.where(flip, win[3] - left - tw, left)
        win = [win[0] + top, win[1] + left, th, tw]
    if resize_at >= 0:
        op, p = ops[resize_at], params.per_op[resize_at]
        if isinstance(op, RandomResizedCrop):
            top, left, ch, cw = p["top"], p["left"], p["height"], p["width"]
            left = torch.where(flip, win[3] - left - cw, left)
            win = [win[0] + top, win[1] + left, ch, cw]
            height, width = size_pair(op)
            canvas = [torch.full((n,), height, **i64), torch.full((n,), width, **i64)]
        else:
            canvas = [p["height"].clone(), p["width"].clone()]
    else:
        canvas = [win[2].clone(), win[3].clone()]
    # After the resize (or from the start without one): crops move an offset into the canvas
    # and shrink the box of valid pixels; outside it is the fill.
    off = [zeros.clone(), zeros.clone()]
    box = [zeros.clone(), canvas[0].clone(), zeros.clone(), canvas[1].clone()]
    cur = [canvas[0].clone(), canvas[1].clone()]
    fills: set[float] = set()
    for k in geo:
        if k <= resize_at:
            continue
        op, p = ops[k], params.per_op[k]
        if isinstance(op, RandomHorizontalFlip):
            flip ^= p["flip"]
            continue
        crop_h, crop_w = size_pair(op)
        top, left = p["top"], p["left"]
        left = torch.where(flip, cur[1] - left - crop_w, left)
        pads = (top < 0) | (left < 0) | (top + crop_h > cur[0]) | (left + crop_w > cur[1])
        if bool(pads.any()):
            fills.add(float(op.fill) if isinstance(op, RandomCrop) else 0.0)
        off = [off[0] + top, off[1] + left]
        box = [
            (box[0] - top).clamp(min=0), torch.minimum(box[1] - top, torch.full_like(top, crop_h)),
            (box[2] - left).clamp(min=0), torch.minimum(box[3] - left, torch.full_like(left, crop_w)),
        ]
        cur = [torch.full((n,), crop_h, **i64), torch.full((n,), crop_w, **i64)]
    if len(fills) > 1:
        return None
    # A mirrored output reads the unmirrored map at OW - 1 - x; box and offsets stay as they are.
    table = torch.stack([*win, *canvas, *off, *box, flip.to(torch.int64)], dim=1)
    return table, (fills.pop() if fills else 0.0)


def crop_windows(
    table: torch.Tensor, out_size: tuple[int, int], image_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The plan of a batch of ``image_size`` (height, width) images as one window per sample,
    or None when it is not one.

    Returns (N,) int64 ``top``, ``left`` and bool ``mirror``: output pixel (y, x) of sample n is
    pixel (top + y, left + x) of its image, mirrored left-right first where ``mirror``, and the
    fill exactly where that pixel lies outside the image. A plan with a resize, or whose box
    of valid pixels is not the image's extent (a crop of an earlier crop's padding), is None.
    """
    h, w = image_size
    oh, ow = out_size
    t = table.numpy()  # a few hundred rows: numpy's small-array ops cost less than torch's dispatch
    if not (t[:, :6] == (0, 0, h, w, h, w)).all():
        return None
    top, left, flip = t[:, 6], t[:, 7], t[:, 12].astype(bool)
    # Rows: the box must be exactly where top + y lies in [0, h); columns likewise in the
    # unmirrored output coordinate (the plan mirrors last).
    if not (_box_is_extent(t[:, 8], t[:, 9], top, h, oh) and _box_is_extent(t[:, 10], t[:, 11], left, w, ow)):
        return None
    # Mirrored, column x reads unmirrored column ow - 1 - x, which is column
    # w - 1 - (ow - 1 - x + left) = x + (w - ow - left) of the mirrored image.
    mirrored_left = np.where(flip, w - ow - left, left)
    return torch.from_numpy(top.copy()), torch.from_numpy(mirrored_left), torch.from_numpy(flip)


def _box_is_extent(start: np.ndarray, stop: np.ndarray, offset: np.ndarray, size: int, out: int) -> bool:
    """Whether the box [start, stop) of every sample is where ``offset + i`` lies in [0, size),
    for i in [0, out) (two empty ranges are equal)."""
    lo, hi = np.clip(-offset, 0, out), np.clip(size - offset, 0, out)
    start, stop = np.clip(start, 0, out), np.clip(stop, 0, out)
    empty = (lo >= hi) & (start >= stop)
    return bool((empty | ((lo == start) & (hi == stop))).all())
