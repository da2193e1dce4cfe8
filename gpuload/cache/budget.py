"""How many bytes of device memory may the cache take: size parsing, resolution, the ledger.

A cache size is written by a person (keyword, environment variable or TOML file) and resolved
against the memory a device reports. ``parse_size`` turns the text into a :class:`SizeSpec`;
``resolve_budget`` turns that into bytes; :class:`BudgetLedger` makes several caches in one
process (a train and a val loader) share one budget instead of each taking all of it.

Default reserve for ``"auto"``: ``max(2 GiB, 10% of the card)`` is left for the model. 2 GiB
covers the CUDA context, cuBLAS/cuDNN workspaces and allocator fragmentation of a small model;
10% scales with the card, because bigger cards carry bigger models and activations. The
reserve is re-checked by the loader at each epoch start, so a model that grows past it gets
memory back (``Store.shrink``).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal, Union

import torch

from gpuload.device import MemoryInfo

__all__ = [
    "CacheSettingError",
    "SizeSpec",
    "SizeValue",
    "parse_size",
    "resolve_budget",
    "resolve_reserve",
    "default_reserve",
    "format_bytes",
    "BudgetLedger",
    "LEDGER",
    "available_budget",
    "DEFAULT_RESERVE_MIN_BYTES",
    "DEFAULT_RESERVE_FRACTION",
]

DEFAULT_RESERVE_MIN_BYTES = 2 << 30
DEFAULT_RESERVE_FRACTION = 0.10

SizeValue = Union[int, float, str, None]

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
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


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
        raise CacheSettingError(
            setting, original if len(str(original)) <= 40 else f"{str(original)[:20]}...({len(str(original))} characters)",
            source, "is larger than any memory (more than 2**64 bytes); " + _HOW_TO_WRITE,
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


def default_reserve(total: int) -> int:
    """Device bytes left for the model when the reserve is ``"auto"``: max(2 GiB, 10% of total)."""
    return max(DEFAULT_RESERVE_MIN_BYTES, int(total * DEFAULT_RESERVE_FRACTION))


def resolve_reserve(
    spec: SizeSpec, memory: MemoryInfo, *, setting: str = "cache_reserve", source: str = "default",
    device_name: str = "the device",
) -> int:
    """Bytes of device memory kept free for the model. A fraction is of the card's total."""
    if spec.kind == "auto":
        return default_reserve(memory.total)
    if spec.kind == "off":
        return 0
    nbytes = int(spec.amount * memory.total) if spec.kind == "fraction" else int(spec.amount)
    if nbytes > memory.total:
        raise CacheSettingError(
            setting, spec.text, source,
            f"is larger than {device_name} ({format_bytes(memory.free)} free of "
            f"{format_bytes(memory.total)} total); reserve less",
        )
    return nbytes


def resolve_budget(
    spec: SizeSpec, memory: MemoryInfo, reserve: int, *, setting: str = "cache_size",
    source: str = "default", device_name: str = "the device",
) -> int:
    """Bytes the cache may take on a device with ``memory``, given ``reserve`` kept for the model.

    ``auto`` is free minus the reserve; a fraction is of the free memory; an explicit size is
    taken as written but must not exceed the card. Whatever the spec, the placement plan never
    goes past ``free - reserve`` (see ``make_plan``), so the reserve always holds.
    """
    if spec.kind == "off":
        return 0
    if spec.kind == "auto":
        return max(0, memory.free - reserve)
    if spec.kind == "fraction":
        return int(spec.amount * memory.free)
    nbytes = int(spec.amount)
    if nbytes > memory.total:
        raise CacheSettingError(
            setting, spec.text, source,
            f"is larger than {device_name}: {format_bytes(memory.free)} free of "
            f"{format_bytes(memory.total)} total; ask for at most "
            f"{format_bytes(max(0, memory.free - reserve))} (free minus the "
            f"{format_bytes(reserve)} reserve), a fraction like 0.8, or 'auto'",
        )
    return nbytes


def _device_key(device: torch.device | str) -> str:
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", 0)
    return str(resolved)


class BudgetLedger:
    """Per-device record of the bytes each cache in this process holds or will hold.

    ``reserved`` bytes are promised to an owner (counted against the budget); ``used`` bytes
    are the part it has actually allocated (already missing from the driver's free memory).
    Thread-safe: loaders may be built from several threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, dict[Hashable, list[int]]] = {}

    def reserve(
        self, nbytes: int, owner: Hashable, *, device: torch.device | str, limit: int | None = None
    ) -> int:
        """Promise up to ``nbytes`` to ``owner`` on ``device``; return the bytes granted.

        With ``limit`` (the process-wide budget), the grant is cut so that all owners together
        stay within it. Reserving again for the same owner replaces its earlier reservation.
        """
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative number of bytes ({nbytes})")
        key = _device_key(device)
        with self._lock:
            owners = self._entries.setdefault(key, {})
            others = sum(r for o, (r, _) in owners.items() if o != owner)
            granted = nbytes if limit is None else max(0, min(nbytes, limit - others))
            used = owners.get(owner, [0, 0])[1]
            owners[owner] = [granted, min(used, granted)]
            return granted

    def set_used(self, owner: Hashable, nbytes: int, *, device: torch.device | str) -> None:
        """Record how many of ``owner``'s reserved bytes are allocated now."""
        key = _device_key(device)
        with self._lock:
            entry = self._entries.get(key, {}).get(owner)
            if entry is None:
                raise KeyError(f"{owner!r} holds no reservation on {key}; reserve() first")
            entry[1] = max(0, min(nbytes, entry[0]))

    def release(self, owner: Hashable, *, device: torch.device | str | None = None) -> int:
        """Drop ``owner``'s reservation (on ``device``, or on every device); return bytes freed."""
        keys = [_device_key(device)] if device is not None else None
        freed = 0
        with self._lock:
            for key, owners in self._entries.items():
                if keys is not None and key not in keys:
                    continue
                entry = owners.pop(owner, None)
                if entry is not None:
                    freed += entry[0]
        return freed

    def reserved(self, device: torch.device | str, *, exclude: Hashable | None = None) -> int:
        """Bytes promised on ``device`` to all owners (but ``exclude``)."""
        with self._lock:
            owners = self._entries.get(_device_key(device), {})
            return sum(r for o, (r, _) in owners.items() if o != exclude)

    def used(self, device: torch.device | str, *, exclude: Hashable | None = None) -> int:
        """Bytes allocated now on ``device`` by all owners (but ``exclude``)."""
        with self._lock:
            owners = self._entries.get(_device_key(device), {})
            return sum(u for o, (_, u) in owners.items() if o != exclude)

    def owners(self, device: torch.device | str) -> dict[Hashable, int]:
        """Each owner's reserved bytes on ``device``."""
        with self._lock:
            return {o: r for o, (r, _) in self._entries.get(_device_key(device), {}).items()}


LEDGER = BudgetLedger()
"""The process-wide ledger every gpuload cache books into."""


def available_budget(
    spec: SizeSpec,
    reserve: int,
    memory: MemoryInfo,
    *,
    device: torch.device | str,
    owner: Hashable | None = None,
    ledger: BudgetLedger = LEDGER,
    setting: str = "cache_size",
    source: str = "default",
) -> int:
    """The share of the process-wide budget still open to a new cache on ``device``.

    The budget is resolved against the memory that would be free if no gpuload cache held any
    (``memory.free`` plus what caches have allocated), then what other owners reserved is taken
    off. So a val loader built after a train loader gets what the train loader left, whether
    the train loader has filled its tier yet or not.
    """
    others_used = ledger.used(device, exclude=owner)
    seen = MemoryInfo(free=min(memory.total, memory.free + others_used), total=memory.total)
    limit = resolve_budget(spec, seen, reserve, setting=setting, source=source, device_name=str(device))
    return max(0, limit - ledger.reserved(device, exclude=owner))
