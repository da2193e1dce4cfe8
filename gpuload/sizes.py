"""Sizes as people write them (``"12GiB"``, ``0.8``, ``"80%"``, ``"auto"``, ``"off"``): parsing and printing.

Kept apart from the cache's budget arithmetic and free of torch, so that the ``gpuload``
command checks a size argument before it imports anything heavy. ``gpuload.cache`` re-exports
all of it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["CacheSettingError", "SizeSpec", "SizeValue", "parse_size", "format_bytes"]

SizeValue = int | float | str | None

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# No memory is larger: a size past it is a typo (a 400-digit number), not a budget.
_LARGEST_SIZE = 2**64
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)
_HOW_TO_WRITE = (
    "write a byte count (12884901888), a size with a unit ('12GiB', '500MB', '1.5 GB'; "
    "B/KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024), a fraction of free "
    "device memory in (0, 1] (0.8 or '80%'), 'auto', or 0/'off'"
)


class CacheSettingError(ValueError):
    """A cache setting has a value gpuload cannot use; the message names it and its source."""

    def __init__(self, setting: str, value: object, source: str, problem: str) -> None:
        self.setting = setting
        self.value = value
        self.source = source
        super().__init__(f"{setting}={value!r} (from {source}) {problem}")


@dataclass(frozen=True)
class SizeSpec:
    """A parsed size: ``bytes`` (``amount`` bytes), ``fraction`` (of a memory pool), ``auto``
    or ``off``. ``text`` keeps what the user wrote, for messages."""

    kind: Literal["bytes", "fraction", "auto", "off"]
    amount: float = 0
    text: str = ""

    def __str__(self) -> str:
        if self.kind == "bytes":
            return format_bytes(int(self.amount))
        if self.kind == "fraction":
            return f"{self.amount:g} of free memory"
        return self.kind


def format_bytes(nbytes: int | float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (``'1.50 GiB'``)."""
    value = float(nbytes)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.2f} {unit}"
    return f"{value / 1024:.2f} TiB"


def parse_size(value: SizeValue, *, setting: str = "cache_size", source: str = "keyword") -> SizeSpec:
    """Parse a size as a person writes it; raise :class:`CacheSettingError` naming the source.

    Accepted: an int byte count; a string with a unit (``"12GiB"``, ``"500MB"``, ``"1.5 GB"``,
    case-insensitive); a float or string fraction in (0, 1] or a percentage (``"80%"``);
    ``"auto"``; ``0``, ``"0"``, ``None`` or ``"off"`` for off.
    """
    original = value
    if value is None:
        return SizeSpec("off", text="None")
    if isinstance(value, bool):
        raise CacheSettingError(setting, original, source, f"is a bool, not a size; {_HOW_TO_WRITE}")
    if isinstance(value, int):
        if value < 0:
            raise CacheSettingError(setting, original, source, f"is negative; {_HOW_TO_WRITE}")
        return _byte_count(value, setting, original, source, str(value))
    if isinstance(value, float):
        return _fraction(value, setting, original, source)
    if not isinstance(value, str):
        raise CacheSettingError(
            setting, original, source, f"is a {type(value).__name__}, not a size; {_HOW_TO_WRITE}"
        )
    text = value.strip()
    lowered = text.lower()
    if lowered in ("auto",):
        return SizeSpec("auto", text=text)
    if lowered in ("off", "none", "0", "false", "no"):
        return SizeSpec("off", text=text)
    if lowered.endswith("%"):
        try:
            percent = float(lowered[:-1])
        except ValueError:
            raise CacheSettingError(setting, original, source, f"is not a size; {_HOW_TO_WRITE}") from None
        return _fraction(percent / 100, setting, original, source, text)
    match = _SIZE_RE.match(lowered)
    if not match:
        raise CacheSettingError(setting, original, source, f"is not a size; {_HOW_TO_WRITE}")
    number, unit = match.groups()
    if unit == "":
        if "." in number:
            return _fraction(float(number), setting, original, source, text)
        return _byte_count(int(number), setting, original, source, text)
    if unit not in _UNITS:
        raise CacheSettingError(
            setting, original, source, f"has an unknown unit {unit!r}; {_HOW_TO_WRITE}"
        )
    scaled = float(number) * _UNITS[unit]
    nbytes = int(round(scaled)) if math.isfinite(scaled) and scaled <= _LARGEST_SIZE else _LARGEST_SIZE + 1
    return _byte_count(nbytes, setting, original, source, text)


def _byte_count(nbytes: int, setting: str, original: object, source: str, text: str) -> SizeSpec:
    if nbytes > _LARGEST_SIZE:
        shown = original if len(str(original)) <= 40 else f"{str(original)[:20]}...({len(str(original))} characters)"
        raise CacheSettingError(
            setting, shown, source, "is larger than any memory (more than 2**64 bytes); " + _HOW_TO_WRITE,
        )
    return SizeSpec("off", text=text) if nbytes == 0 else SizeSpec("bytes", nbytes, text)


def _fraction(fraction: float, setting: str, original: object, source: str, text: str = "") -> SizeSpec:
    if math.isnan(fraction) or not 0 <= fraction <= 1:
        raise CacheSettingError(
            setting,
            original,
            source,
            "is a number outside [0, 1]: a float is a fraction of free device memory; "
            f"for an absolute size {_HOW_TO_WRITE}",
        )
    if fraction == 0:
        return SizeSpec("off", text=text or str(original))
    return SizeSpec("fraction", fraction, text or str(original))
