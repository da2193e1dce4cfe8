"""How many bytes may the cache take: of device memory (resolution of sizes, the ledger), and of
the disk (:func:`disk_budget`).

A cache size is written by a person (keyword, environment variable or TOML file) and resolved
against the memory a device reports. ``parse_size`` (:mod:`gpuload.sizes`) turns the text into a :class:`SizeSpec`;
``resolve_budget`` turns that into bytes; :class:`BudgetLedger` makes several caches in one
process (a train and a val loader) share one budget instead of each taking all of it.

Default reserve for ``"auto"``: ``max(2 GiB, 10% of the card)`` is left for the model. 2 GiB
covers the CUDA context, cuBLAS/cuDNN workspaces and allocator fragmentation of a small model;
10% scales with the card, because bigger cards carry bigger models and activations. The
reserve is re-checked by the loader at each epoch start, so a model that grows past it gets
memory back (``Store.shrink``).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING

from gpuload.sizes import CacheSettingError, SizeSpec, SizeValue, format_bytes, parse_size

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
    "default_disk_reserve",
    "disk_space",
    "disk_budget",
]

if TYPE_CHECKING:  # torch loads with the ledger's first call: the settings import without it (gpuload cache)
    import torch

    from gpuload.memory import MemoryInfo

DEFAULT_RESERVE_MIN_BYTES = 2 << 30
DEFAULT_RESERVE_FRACTION = 0.10


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
    if isinstance(device, str) and re.fullmatch(r"cpu|cuda(:(0|[1-9]\d*))?", device):  # no torch for a plain name
        return "cuda:0" if device == "cuda" else device
    import torch

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
    from gpuload.memory import MemoryInfo

    others_used = ledger.used(device, exclude=owner)
    seen = MemoryInfo(free=min(memory.total, memory.free + others_used), total=memory.total)
    limit = resolve_budget(spec, seen, reserve, setting=setting, source=source, device_name=str(device))
    return max(0, limit - ledger.reserved(device, exclude=owner))


def default_disk_reserve(total_bytes: int) -> int:
    """Bytes of the file system the default budget leaves free: 5% of it, at least 64 MiB and
    at most 8 GiB (other programs, logs and checkpoints need room to write)."""
    return max(64 << 20, min(8 << 30, int(total_bytes * 0.05)))


def disk_space(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(free, total)`` bytes of the file system holding ``path``; free as an unprivileged
    writer sees it (``f_bavail``): the one reading every disk budget is resolved against."""
    status = os.statvfs(path)
    return status.f_bavail * status.f_frsize, status.f_blocks * status.f_frsize


def disk_budget(path: str | os.PathLike[str], spec: SizeSpec) -> int:
    """Bytes the disk tier may hold under ``path``: ``auto``: the file system's free space less
    :func:`default_disk_reserve`; a fraction: of the free space; bytes: as given; off: 0."""
    if spec.kind == "off":
        return 0
    if spec.kind == "bytes":
        return int(spec.amount)
    free, total = disk_space(path)
    if spec.kind == "fraction":
        return int(free * spec.amount)
    return max(0, free - default_disk_reserve(total))
