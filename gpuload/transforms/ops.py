"""The public transform ops: configuration only (what to do), validated when constructed.

Each op is a frozen dataclass: it holds arguments, checks them, and prints as it was written.
Sampling its random parameters lives in ``params.py``; applying them in ``reference.py`` (pure
torch) and ``_kernels.py`` (CuPy). Argument names and defaults follow torchvision.

A list of ops is read in two blocks, in this order (``validate_pipeline`` enforces it):

1. geometry on the uint8 image: ``RandomResizedCrop``, ``Resize``, ``CenterCrop``,
   ``RandomCrop``, ``RandomHorizontalFlip``;
2. values and layout: ``ColorJitter``, then ``ToDtype``, ``Normalize``, ``RandomErasing``,
   ``ToChannelsLast``.

Between ops pixels are kept in float32 (no rounding to uint8 in between); the output is cast
once at the end, to uint8 (rounded half to even, clamped) when there is no ``ToDtype``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Op",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomCrop",
    "RandomHorizontalFlip",
    "ColorJitter",
    "ToDtype",
    "Normalize",
    "RandomErasing",
    "ToChannelsLast",
    "GEOMETRIC_OPS",
    "validate_pipeline",
]

SizeArg = int | Sequence[int]


def _size2(name: str, op: str, size: SizeArg) -> tuple[int, int]:
    """``size`` as (height, width): an int means a square, as in torchvision."""
    if isinstance(size, bool):
        raise TypeError(f"{op}({name}={size!r}): {name} must be an int or (height, width)")
    if isinstance(size, int):
        pair = (size, size)
    elif isinstance(size, Sequence) and len(size) in (1, 2) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in size
    ):
        pair = (size[0], size[-1])
    else:
        raise TypeError(f"{op}({name}={size!r}): {name} must be an int or (height, width) of ints")
    if min(pair) <= 0:
        raise ValueError(f"{op}({name}={size!r}): sizes must be positive")
    return int(pair[0]), int(pair[1])


def _range2(name: str, op: str, value: Any, low: float = 0.0) -> tuple[float, float]:
    """A (min, max) pair of floats with low <= min <= max (``value`` as the user gave it: checked here)."""
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"{op}({name}={value!r}): {name} must be a (min, max) pair of numbers") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi or lo < low:
        raise ValueError(
            f"{op}({name}={value!r}): {name} must be finite with {low} <= min <= max"
        )
    return lo, hi


def _probability(op: str, p: float) -> float:
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}(p={p!r}): p is a probability, between 0 and 1")
    return float(p)


class Op:
    """Base class of gpuload's transform ops (for isinstance checks)."""


@dataclass(frozen=True)
class RandomResizedCrop(Op):
    """Crop a random area and aspect ratio, resized to ``size`` (torchvision's algorithm).

    ``scale`` bounds the crop area as a fraction of the image, ``ratio`` its width/height.
    The resize is bilinear without antialiasing.
    """

    size: SizeArg
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2("size", "RandomResizedCrop", self.size))
        object.__setattr__(self, "scale", _range2("scale", "RandomResizedCrop", self.scale))
        ratio = _range2("ratio", "RandomResizedCrop", self.ratio)
        if ratio[0] <= 0:
            raise ValueError(f"RandomResizedCrop(ratio={self.ratio!r}): ratios must be > 0")
        if self.scale[1] <= 0:
            raise ValueError(f"RandomResizedCrop(scale={self.scale!r}): max scale must be > 0")
        object.__setattr__(self, "ratio", ratio)


@dataclass(frozen=True)
class Resize(Op):
    """Bilinear resize (no antialiasing). An int resizes the shorter side to it, keeping the
    aspect ratio (torchvision); (height, width) resizes to exactly that."""

    size: SizeArg

    def __post_init__(self) -> None:
        if isinstance(self.size, int) and not isinstance(self.size, bool):
            if self.size <= 0:
                raise ValueError(f"Resize(size={self.size!r}): size must be positive")
        else:
            object.__setattr__(self, "size", _size2("size", "Resize", self.size))

    @property
    def shorter_side(self) -> bool:
        """True when ``size`` is one int: the shorter side's target."""
        return isinstance(self.size, int)


@dataclass(frozen=True)
class CenterCrop(Op):
    """Crop the center ``size``; a crop larger than the image pads with 0 (torchvision)."""

    size: SizeArg

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2("size", "CenterCrop", self.size))


@dataclass(frozen=True)
class RandomCrop(Op):
    """Pad by ``padding`` (with ``fill``), then crop ``size`` at a uniformly random place.

    ``padding``: an int for all sides, (left/right, top/bottom) or (left, top, right, bottom),
    as in torchvision. ``fill`` is a pixel value in 0-255.
    """

    size: SizeArg
    padding: int | Sequence[int] = 0
    fill: float = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2("size", "RandomCrop", self.size))
        pad = self.padding
        if isinstance(pad, int) and not isinstance(pad, bool):
            ltrb = (pad, pad, pad, pad)
        elif isinstance(pad, Sequence) and len(pad) == 2:
            ltrb = (pad[0], pad[1], pad[0], pad[1])
        elif isinstance(pad, Sequence) and len(pad) == 4:
            ltrb = (pad[0], pad[1], pad[2], pad[3])
        else:
            raise TypeError(
                f"RandomCrop(padding={pad!r}): padding is an int, (left/right, top/bottom) "
                "or (left, top, right, bottom)"
            )
        if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in ltrb):
            raise ValueError(f"RandomCrop(padding={pad!r}): paddings must be ints >= 0")
        object.__setattr__(self, "padding", tuple(int(p) for p in ltrb))
        if not isinstance(self.fill, (int, float)) or isinstance(self.fill, bool):
            raise TypeError(f"RandomCrop(fill={self.fill!r}): fill is one number (0-255)")
        if not 0 <= self.fill <= 255:
            raise ValueError(f"RandomCrop(fill={self.fill!r}): fill is a pixel value in 0-255")


@dataclass(frozen=True)
class RandomHorizontalFlip(Op):
    """Mirror left-right with probability ``p``."""

    p: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", _probability("RandomHorizontalFlip", self.p))


def _jitter_range(name: str, value: float | Sequence[float] | None) -> tuple[float, float] | None:
    """torchvision's factor range: b -> [max(0, 1-b), 1+b]; a pair is taken as is."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"ColorJitter({name}={value!r}): {name} must be >= 0")
        if value == 0:
            return None
        return (max(0.0, 1.0 - float(value)), 1.0 + float(value))
    lo, hi = _range2(name, "ColorJitter", value)
    return None if lo == hi == 1.0 else (lo, hi)


@dataclass(frozen=True)
class ColorJitter(Op):
    """Random brightness, contrast and saturation, in a random order per sample (torchvision).

    Each argument is ``b`` (factor uniform in [max(0, 1-b), 1+b]) or a (min, max) pair of
    factors; 0 or None leaves that property alone. Hue is not supported.
    """

    brightness: float | Sequence[float] | None = 0
    contrast: float | Sequence[float] | None = 0
    saturation: float | Sequence[float] | None = 0

    def __post_init__(self) -> None:
        for name in ("brightness", "contrast", "saturation"):
            object.__setattr__(self, name, _jitter_range(name, getattr(self, name)))


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class ToDtype(Op):
    """Cast to ``dtype`` (float16, bfloat16 or float32); ``scale=True`` maps 0-255 to [0, 1].

    All arithmetic runs in float32 and the cast to ``dtype`` happens once, at the end.
    """

    dtype: torch.dtype = torch.float32
    scale: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"ToDtype(dtype={self.dtype!r}): use torch.float16, torch.bfloat16 or "
                "torch.float32 (leave ToDtype out to keep uint8)"
            )
        if not isinstance(self.scale, bool):
            raise TypeError(f"ToDtype(scale={self.scale!r}): scale is True or False")


@dataclass(frozen=True)
class Normalize(Op):
    """``(x - mean) / std`` per channel, on the values as ``ToDtype`` left them (torchvision).

    After ``ToDtype(scale=True)`` values are in [0, 1], so ``mean``/``std`` are in [0, 1] too
    (``mean=(0.485, 0.456, 0.406)``). Numbers on the 0-255 scale (``mean=(123.675, ...)``)
    are accepted with ``value_range=255``: gpuload rescales them to the tensor's values, so
    the result is the same as passing them divided by 255.
    """

    mean: Sequence[float]
    std: Sequence[float]
    value_range: float | None = None

    def __post_init__(self) -> None:
        try:
            mean = tuple(float(m) for m in self.mean)
            std = tuple(float(s) for s in self.std)
        except (TypeError, ValueError):
            raise TypeError(
                f"Normalize(mean={self.mean!r}, std={self.std!r}): mean and std are sequences "
                "of numbers, one per channel"
            ) from None
        if not mean or len(mean) != len(std):
            raise ValueError(
                f"Normalize(mean={self.mean!r}, std={self.std!r}): give one mean and one std "
                "per channel (same lengths)"
            )
        if not all(math.isfinite(m) for m in mean) or not all(
            math.isfinite(s) and s > 0 for s in std
        ):
            raise ValueError(f"Normalize(std={self.std!r}): means finite, stds finite and > 0")
        if self.value_range not in (None, 1, 1.0, 255, 255.0):
            raise ValueError(
                f"Normalize(value_range={self.value_range!r}): use None (as the tensor holds "
                "them), 1.0 or 255"
            )
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)


@dataclass(frozen=True)
class RandomErasing(Op):
    """With probability ``p`` set a random rectangle to ``value`` (torchvision's algorithm).

    ``scale`` bounds its area as a fraction of the image, ``ratio`` its aspect ratio;
    ``value`` is one number or one per channel, in the tensor's values at this point (after
    ``Normalize``, 0 is the mean colour).
    """

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: float | Sequence[float] = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", _probability("RandomErasing", self.p))
        object.__setattr__(self, "scale", _range2("scale", "RandomErasing", self.scale))
        if self.scale[1] > 1:
            raise ValueError(f"RandomErasing(scale={self.scale!r}): scale is within [0, 1]")
        ratio = _range2("ratio", "RandomErasing", self.ratio)
        if ratio[0] <= 0:
            raise ValueError(f"RandomErasing(ratio={self.ratio!r}): ratios must be > 0")
        object.__setattr__(self, "ratio", ratio)
        if isinstance(self.value, str):
            raise ValueError(
                f"RandomErasing(value={self.value!r}): random values are not supported; "
                "give a number or one per channel"
            )
        values = (self.value,) if isinstance(self.value, (int, float)) else tuple(self.value)
        if not values or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in values
        ):
            raise ValueError(f"RandomErasing(value={self.value!r}): value is finite number(s)")
        object.__setattr__(self, "value", tuple(float(v) for v in values))


@dataclass(frozen=True)
class ToChannelsLast(Op):
    """Deliver the batch in ``torch.channels_last`` memory format (shape stays N, C, H, W).

    A separate op rather than a ToDtype flag, so uint8 outputs can be channels-last too.
    """


def size_pair(op: Op) -> tuple[int, int]:
    """The ``(height, width)`` of a crop or of a resize to an exact size: its ``size``, which the op
    made a pair when it was built (a ``Resize`` of the shorter side has none: ValueError)."""
    size = getattr(op, "size", None)
    if not isinstance(size, tuple):
        raise ValueError(f"{op!r} has no (height, width) size")
    height, width = size
    return height, width


GEOMETRIC_OPS = (RandomResizedCrop, Resize, CenterCrop, RandomCrop, RandomHorizontalFlip)
_VALUE_ORDER = (ColorJitter, ToDtype, Normalize, RandomErasing, ToChannelsLast)


class _CheckedOps(tuple):
    """An op tuple :func:`validate_pipeline` checked: ops are frozen, so it stays valid, and a
    batch's transforms, which pass it on to each step, need not check it again."""

    __slots__ = ()


def validate_pipeline(ops: Sequence[Op]) -> tuple[Op, ...]:
    """Check an op list and return it as a tuple, or raise saying what to change.

    Geometry comes first; then at most one ``ToDtype``, which must come before ``Normalize``;
    ``ColorJitter`` comes before ``ToDtype``/``Normalize``/``RandomErasing``.
    """
    if type(ops) is _CheckedOps:
        return ops
    if isinstance(ops, Op):
        ops = [ops]
    if isinstance(ops, (str, bytes, Mapping)) or not isinstance(ops, Iterable):
        raise TypeError(
            f"transforms={ops!r} is not a list of transforms (it is a {type(ops).__name__}); pass "
            "a list of gpuload transforms, "
            "e.g. transforms=[gpuload.transforms.RandomHorizontalFlip()]"
        )
    ops = tuple(ops)
    for i, op in enumerate(ops):
        if not isinstance(op, Op):
            raise TypeError(
                f"transforms[{i}] = {op!r} is not a gpuload transform; use the ops in "
                "gpuload.transforms (torchvision objects are not accepted)"
            )
    seen_value_op: Op | None = None
    for op in ops:
        if isinstance(op, GEOMETRIC_OPS):
            if seen_value_op is not None:
                raise ValueError(
                    f"{op!r} comes after {seen_value_op!r}: put geometric ops "
                    "(crops, resizes, flips) before colour, dtype and layout ops"
                )
        else:
            seen_value_op = seen_value_op or op
    dtypes = [op for op in ops if isinstance(op, ToDtype)]
    if len(dtypes) > 1:
        raise ValueError(f"more than one ToDtype ({dtypes}): keep one, it sets the output dtype")
    for i, op in enumerate(ops):
        later = ops[i + 1 :]
        if isinstance(op, Normalize) and not any(isinstance(o, ToDtype) for o in ops[:i]):
            raise ValueError(
                f"{op!r} needs floats: put ToDtype(torch.float32) (or float16/bfloat16) before it"
            )
        if isinstance(op, (ToDtype, Normalize, RandomErasing)):
            jitter = [o for o in later if isinstance(o, ColorJitter)]
            if jitter:
                raise ValueError(f"{jitter[0]!r} comes after {op!r}: put ColorJitter before it")
        if isinstance(op, ToDtype) and dtypes and op is dtypes[0]:
            early_erase = [o for o in ops[:i] if isinstance(o, RandomErasing)]
            if early_erase:
                raise ValueError(
                    f"{early_erase[0]!r} comes before {op!r}: put RandomErasing after ToDtype"
                )
        if isinstance(op, Normalize):
            _check_normalize_scale(op, dtypes[0])
    return _CheckedOps(ops)


def _check_normalize_scale(op: Normalize, to_dtype: ToDtype) -> None:
    """Catch 0-255 means applied to [0, 1] values, the usual mix-up."""
    if op.value_range is None and to_dtype.scale and max(op.mean) > 1.0:
        raise ValueError(
            f"Normalize(mean={op.mean}) looks like 0-255 values, but after "
            "ToDtype(scale=True) pixels are in [0, 1]: divide mean and std by 255 or pass "
            "Normalize(..., value_range=255)"
        )
