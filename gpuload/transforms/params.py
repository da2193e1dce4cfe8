"""Per-sample random parameters by counter: a pure function of (seed, epoch, index, op, draw).

Every random number is a SplitMix64 hash of its coordinates, computed with uint64 arithmetic
(wrapping multiply, logical shifts), so a sample's parameters do not depend on which batch it
is in, its position there, the prefetch depth or the device; resuming at any batch is exact.
Parameters are drawn on the CPU (a few numbers per sample) and applied anywhere.

Sampling is separate from applying (as in kornia): ``sample_params`` resolves every op of the
list into plain per-sample tensors, following each op's torchvision algorithm, and tracks the
image size through the list so that later ops see the size earlier ops produce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from gpuload.transforms.ops import (
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
    validate_pipeline,
)

__all__ = ["BatchParams", "sample_params", "uniform", "mix64"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

# Draw slots per op: a sample's k-th random number for an op is slot k.
_ATTEMPTS = 10  # torchvision's RandomResizedCrop / RandomErasing tries


_M1_U, _M2_U, _GOLDEN_U = np.uint64(_M1), np.uint64(_M2), np.uint64(_GOLDEN)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (numpy's uint64 arithmetic wraps as C's does)."""
    x = (x ^ (x >> np.uint64(30))) * _M1_U
    x = (x ^ (x >> np.uint64(27))) * _M2_U
    return x ^ (x >> np.uint64(31))


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on an int64 tensor (bit-exact with the uint64 original), on the CPU."""
    bits = x.to(device="cpu", dtype=torch.int64).contiguous().numpy().view(np.uint64)
    return torch.from_numpy(_mix64_np(bits).view(np.int64))


def _mix64_int(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, epoch: int, indices: torch.Tensor, op_pos: int, slots: int) -> torch.Tensor:
    """Uniform float64 numbers in [0, 1), shape (len(indices), slots): slot k of sample i is a
    pure function of (seed, epoch, indices[i], op_pos, k).

    Computed in numpy: a few hundred numbers per op and batch, where each torch op would cost
    more in dispatch than in arithmetic."""
    key = _mix64_int(_mix64_int(_mix64_int(seed + _GOLDEN) ^ (epoch * _M1)) ^ (op_pos * _M2))
    idx = indices.to(device="cpu", dtype=torch.int64).reshape(-1, 1).contiguous().numpy().view(np.uint64)
    per_sample = _mix64_np(idx * _GOLDEN_U + np.uint64(key))
    slot = np.arange(1, slots + 1, dtype=np.uint64) * _GOLDEN_U
    bits = _mix64_np(per_sample ^ slot)
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * (2.0**-53))


def _randint(u: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Integers uniform in [0, high) from uniforms u in [0, 1)."""
    return torch.minimum((u * high).floor().to(torch.int64), high - 1)


@dataclass(frozen=True)
class BatchParams:
    """Resolved parameters of an op list for one batch.

    ``per_op[k]`` holds op k's per-sample tensors (CPU, first dim = batch); ``sizes[k]`` is the
    (N, 2) int64 (height, width) each sample has before op k, and ``sizes[-1]`` after the last.
    """

    ops: tuple[Op, ...]
    per_op: tuple[dict[str, torch.Tensor], ...]
    sizes: tuple[torch.Tensor, ...]
    indices: torch.Tensor

    @property
    def output_sizes(self) -> torch.Tensor:
        return self.sizes[-1]

    def output_size(self) -> tuple[int, int]:
        """The one (height, width) every output has, or ValueError if they differ."""
        final = self.sizes[-1]
        if len(final) and not bool((final == final[0]).all()):
            sizes = sorted({tuple(s) for s in final.tolist()})[:4]
            raise ValueError(
                f"the transforms give images of different sizes ({sizes} ...), so they cannot "
                "form one batch: end the geometry with a fixed-size op such as CenterCrop(224), "
                "RandomResizedCrop(224) or Resize((h, w))"
            )
        return (int(final[0, 0]), int(final[0, 1])) if len(final) else (0, 0)


def _as_sizes(image_sizes: torch.Tensor | Sequence[Sequence[int]], n: int) -> torch.Tensor:
    sizes = torch.as_tensor(image_sizes, dtype=torch.int64).reshape(-1, 2).cpu()
    if len(sizes) != n:
        raise ValueError(f"{len(sizes)} image sizes for {n} indices: give one (height, width) each")
    if len(sizes) and int(sizes.min()) <= 0:
        raise ValueError(f"image sizes must be positive, got {sizes.min().item()}")
    return sizes


def sample_params(
    ops: Sequence[Op],
    seed: int,
    epoch: int,
    indices: torch.Tensor | Sequence[int],
    image_sizes: torch.Tensor | Sequence[Sequence[int]],
) -> BatchParams:
    """Draw every op's parameters for the samples ``indices`` whose (H, W) are ``image_sizes``."""
    ops = validate_pipeline(ops)
    indices = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).cpu()
    size = _as_sizes(image_sizes, len(indices))
    per_op: list[dict[str, torch.Tensor]] = []
    sizes = [size]
    for pos, op in enumerate(ops):
        params, size = _sample_one(op, pos, seed, epoch, indices, size)
        per_op.append(params)
        sizes.append(size)
    return BatchParams(ops, tuple(per_op), tuple(sizes), indices)


def _sample_one(
    op: Op, pos: int, seed: int, epoch: int, indices: torch.Tensor, size: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n = len(indices)
    h, w = size[:, 0], size[:, 1]
    if isinstance(op, RandomResizedCrop):
        u = uniform(seed, epoch, indices, pos, 2 * _ATTEMPTS + 2)
        top, left, ch, cw = _resized_crop_box(op, u, h, w)
        out = torch.tensor(size_pair(op), dtype=torch.int64).expand(n, 2).clone()
        return {"top": top, "left": left, "height": ch, "width": cw}, out
    if isinstance(op, Resize):
        if isinstance(op.size, int):  # op.shorter_side
            short, long = torch.minimum(h, w), torch.maximum(h, w)
            new_long = (op.size * long) // short  # int(size * long / short), as torchvision
            new_h = torch.where(w <= h, new_long, torch.full_like(h, op.size))
            new_w = torch.where(w <= h, torch.full_like(w, op.size), new_long)
        else:
            exact_h, exact_w = size_pair(op)
            new_h, new_w = torch.full_like(h, exact_h), torch.full_like(w, exact_w)
        out = torch.stack([new_h, new_w], 1)
        return {"height": new_h, "width": new_w}, out
    if isinstance(op, CenterCrop):
        th, tw = size_pair(op)
        top = _center_offset(h, th)
        left = _center_offset(w, tw)
        out = torch.tensor(size_pair(op), dtype=torch.int64).expand(n, 2).clone()
        return {"top": top, "left": left}, out
    if isinstance(op, RandomCrop):
        th, tw = size_pair(op)
        pl, pt, pr, pb = cast("tuple[int, int, int, int]", op.padding)  # (left, top, right, bottom) once built
        ph, pw = h + pt + pb, w + pl + pr
        small = (ph < th) | (pw < tw)
        if bool(small.any()):
            k = int(small.nonzero()[0, 0])
            raise ValueError(
                f"{op!r}: sample {int(indices[k])} is {int(h[k])}x{int(w[k])} "
                f"({int(ph[k])}x{int(pw[k])} padded), smaller than the crop {th}x{tw}; "
                "add padding or resize first"
            )
        u = uniform(seed, epoch, indices, pos, 2)
        top = _randint(u[:, 0], ph - th + 1) - pt
        left = _randint(u[:, 1], pw - tw + 1) - pl
        out = torch.tensor(size_pair(op), dtype=torch.int64).expand(n, 2).clone()
        return {"top": top, "left": left}, out
    if isinstance(op, RandomHorizontalFlip):
        u = uniform(seed, epoch, indices, pos, 1)
        return {"flip": u[:, 0] < op.p}, size
    if isinstance(op, ColorJitter):
        u = uniform(seed, epoch, indices, pos, 6)
        params = {}
        for k, name in enumerate(("brightness", "contrast", "saturation")):
            bounds = getattr(op, name)
            if bounds is None:
                params[name] = torch.ones(n, dtype=torch.float32)
            else:
                params[name] = (bounds[0] + (bounds[1] - bounds[0]) * u[:, k]).to(torch.float32)
        params["order"] = torch.argsort(u[:, 3:6], dim=1)  # a uniform random permutation
        return params, size
    if isinstance(op, RandomErasing):
        u = uniform(seed, epoch, indices, pos, 2 * _ATTEMPTS + 3)
        apply, top, left, eh, ew = _erasing_box(op, u, h, w)
        return {"apply": apply, "top": top, "left": left, "height": eh, "width": ew}, size
    if isinstance(op, (ToDtype, Normalize, ToChannelsLast)):
        return {}, size
    raise TypeError(f"no parameter sampler for {op!r}")


def _center_offset(length: torch.Tensor, target: int) -> torch.Tensor:
    """torchvision's center_crop offset; negative where it pads (crop larger than image)."""
    inside = torch.round((length - target).to(torch.float64) / 2.0).to(torch.int64)
    padded = -((target - length) // 2)
    return torch.where(length >= target, inside, padded)


def _log_uniform_attempts(
    u_scale: torch.Tensor, u_ratio: torch.Tensor, area: torch.Tensor, scale, ratio
) -> tuple[torch.Tensor, torch.Tensor]:
    target_area = area[:, None] * (scale[0] + (scale[1] - scale[0]) * u_scale)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u_ratio)
    return target_area, aspect


def _first_true(ok: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    first = torch.argmax(ok.to(torch.int8), dim=1, keepdim=True)
    return values.gather(1, first)[:, 0]


def _resized_crop_box(op: RandomResizedCrop, u: torch.Tensor, h: torch.Tensor, w: torch.Tensor):
    """torchvision's RandomResizedCrop.get_params: 10 tries, then a center crop."""
    a = _ATTEMPTS
    hf, wf = h.to(torch.float64), w.to(torch.float64)
    target_area, aspect = _log_uniform_attempts(u[:, :a], u[:, a : 2 * a], hf * wf, op.scale, op.ratio)
    cw = torch.round(torch.sqrt(target_area * aspect)).to(torch.int64)
    ch = torch.round(torch.sqrt(target_area / aspect)).to(torch.int64)
    ok = (cw > 0) & (cw <= w[:, None]) & (ch > 0) & (ch <= h[:, None])
    found = ok.any(dim=1)
    ch, cw = _first_true(ok, ch), _first_true(ok, cw)
    top = _randint(u[:, 2 * a], (h - ch + 1).clamp(min=1))
    left = _randint(u[:, 2 * a + 1], (w - cw + 1).clamp(min=1))
    # Fallback: the whole image with its aspect ratio clamped into ``ratio``, centered.
    rmin, rmax = op.ratio
    in_ratio = wf / hf
    fb_w = torch.where(
        in_ratio > rmax, torch.round(hf * rmax).to(torch.int64), w
    )
    fb_h = torch.where(in_ratio < rmin, torch.round(wf / rmin).to(torch.int64), h)
    fb_w = torch.where(in_ratio < rmin, w, fb_w)
    fb_h = torch.where(in_ratio > rmax, h, fb_h)
    ch, cw = torch.where(found, ch, fb_h), torch.where(found, cw, fb_w)
    top = torch.where(found, top, (h - ch) // 2)
    left = torch.where(found, left, (w - cw) // 2)
    return top, left, ch, cw


def _erasing_box(op: RandomErasing, u: torch.Tensor, h: torch.Tensor, w: torch.Tensor):
    """torchvision's RandomErasing.get_params: 10 tries, else nothing is erased."""
    a = _ATTEMPTS
    hf, wf = h.to(torch.float64), w.to(torch.float64)
    erase_area, aspect = _log_uniform_attempts(u[:, :a], u[:, a : 2 * a], hf * wf, op.scale, op.ratio)
    eh = torch.round(torch.sqrt(erase_area * aspect)).to(torch.int64)
    ew = torch.round(torch.sqrt(erase_area / aspect)).to(torch.int64)
    ok = (eh < h[:, None]) & (ew < w[:, None])
    found = ok.any(dim=1)
    eh, ew = _first_true(ok, eh), _first_true(ok, ew)
    eh, ew = torch.where(found, eh, 0), torch.where(found, ew, 0)
    top = _randint(u[:, 2 * a], h - eh + 1)
    left = _randint(u[:, 2 * a + 1], w - ew + 1)
    apply = (u[:, 2 * a + 2] < op.p) & found & (eh > 0) & (ew > 0)
    return apply, top, left, eh, ew
