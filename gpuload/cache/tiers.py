"""The tiers of the array cache, one class each: where a run of rows lives and how it is read.

A :class:`~gpuload.cache.plan.CachePlan` names its tiers in order (``plan.tiers``); the store
builds each with the class registered under that name (:func:`register_tier`), and the source's
own arrays serve every row no tier holds (:class:`SourceTier`). A tier holds rows
``[first, first + rows)`` of every array, and says whether they live on the loader's device
(``on_device``: gathered there) or in host memory (gathered on the host into the loader's
staging, then copied by the prefetcher: the one host-to-device path). Every tier is built the
same way, by its class's ``allocate`` with the store's :class:`Placing` (the device, and for a
tier kept outside memory the cache settings and what identifies the arrays): a new tier (the
disk tier is one) is one subclass plus its registration.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gpuload.cache.chain import NOTHING
from gpuload.cache.chunked_rows import take_rows

if TYPE_CHECKING:
    from gpuload.cache.disk import Fingerprint
    from gpuload.cache.settings import CacheSettings

__all__ = ["DeviceTier", "HostTier", "Placing", "RowsByKey", "SourceTier", "TIERS", "Tier", "register_tier"]


@dataclass(frozen=True)
class Placing:
    """What every tier is built with besides its rows: the loader's ``device``; for a tier kept
    outside memory (the disk tier) the cache's ``settings`` (its folder, its budget) and
    ``identity``, called once when it has rows to keep, naming what produced the arrays (the key
    of a disk entry). None where the store has none: such a tier is then empty."""

    device: torch.device
    settings: CacheSettings | None = None
    identity: Callable[[], Fingerprint] | None = None


class Tier(ABC):
    """Rows ``[first, first + rows)`` of every array, in one place.

    ``shared_by``: how many processes map this one copy (1: this process's own);
    ``release``: called once by :meth:`close` (e.g. to unmap a node's shared copy).
    """

    #: The name plans use for this tier (``TierPlan.name``).
    name: ClassVar[str] = ""
    #: True when the rows live on the loader's device (gathered there, nothing crosses PCIe).
    on_device: ClassVar[bool] = False

    def __init__(
        self, first: int, columns: list[torch.Tensor], *, shared_by: int = 1,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.first = first
        self.columns = columns
        self.shared_by = shared_by
        self._release = release

    @classmethod
    @abstractmethod
    def allocate(cls, source: list[torch.Tensor], first: int, rows: int, placing: Placing) -> Tier:
        """This tier holding rows ``[first, first + rows)`` of ``source`` (host arrays); raises
        torch's out-of-memory error when they do not fit."""

    @property
    def rows(self) -> int:
        return self.columns[0].shape[0] if self.columns else 0

    def snapshot(self) -> Tier:
        """This tier as it is now, for one batch: a shrink that replaces ``columns`` later does
        not change the rows the snapshot gathers from (it keeps the old storage alive until the
        batch is gathered), so they always agree with the index maps read with it."""
        return copy.copy(self)

    def gather(self, column: int, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``slots`` (positions in this tier, on its memory's device) of one column."""
        storage = self.columns[column]
        return storage.index_select(0, slots) if out is None else take_rows(storage, slots, out)

    def close(self) -> None:
        """Drop the rows; calls ``release`` once."""
        self.columns = []
        release, self._release = self._release, None
        if release is not None:
            release()


class RowsByKey:
    """A placed tier as a keyed tier of the chain (:mod:`gpuload.cache.chain`): the keys (dataset
    rows) it serves, ``serves = (start, stop)`` (None: every key, as the source's arrays hold
    them), are found, their rows gathered per column (on the tier's memory; ``to_slots`` moves
    the row positions there, e.g. the loader's staging for a device tier), or, with ``gathers``
    false, given as their slots in the tier for the caller to gather (the store gathers host rows
    into the loader's staging). Nothing is kept: the plan places a tier's rows once, when the
    store is built."""

    def __init__(self, tier: Tier, to_slots: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
                 serves: tuple[int, int] | None = None, gathers: bool = True) -> None:
        self.tier = tier
        self.name = tier.name
        self.serves = serves
        self._to_slots = to_slots
        self._gathers = gathers

    def lookup(self, keys: torch.Tensor) -> tuple[tuple[torch.Tensor | None, Any] | None, torch.Tensor]:
        if not keys.numel():
            return None, NOTHING
        found: torch.Tensor | None = None
        missing, slots = NOTHING, keys
        if self.serves is not None:
            start, stop = self.serves
            # A tier holding the whole batch (a device tier holding the dataset, on every batch)
            # is told so by one small op (keys are host tensors: no device sync), no positions.
            low, high = torch.aminmax(keys)
            if int(low) < start or int(high) >= stop:
                inside = (keys >= start) & (keys < stop)
                found, missing = inside.nonzero().view(-1), (~inside).nonzero().view(-1)
                if not found.numel():
                    return None, missing
                slots = keys.index_select(0, found) if missing.numel() else keys
        if self.tier.first:
            slots = slots - self.tier.first
        if self._to_slots is not None:
            slots = self._to_slots(slots)
        values = [self.tier.gather(column, slots) for column in range(len(self.tier.columns))] if self._gathers \
            else slots
        return (found if missing.numel() else None, values), missing

    def keep(self, keys: torch.Tensor, values: Any) -> int:
        return 0


TIERS: dict[str, type[Tier]] = {}
"""The tier classes by name, in the order of registration."""


def register_tier(cls: type[Tier]) -> type[Tier]:
    """Make ``cls`` the tier that plans name ``cls.name`` (a class decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name to be registered as a tier")
    TIERS[cls.name] = cls
    return cls


@register_tier
class DeviceTier(Tier):
    """Rows copied once to the loader's device; a batch gathers them there."""

    name = "device"
    on_device = True

    @classmethod
    def allocate(cls, source: list[torch.Tensor], first: int, rows: int, placing: Placing) -> DeviceTier:
        device = placing.device
        if device.type == "cpu":  # host memory is the device: a view, no copy
            return cls(first, [leaf[first : first + rows] for leaf in source] if rows else [])
        return cls(first, [leaf[first : first + rows].to(device) for leaf in source] if rows else [])


@register_tier
class HostTier(Tier):
    """This process's own copy of the rows in pageable host memory.

    Not pinned: a batch's host rows are gathered into the prefetcher's pinned staging slots
    first, so pinning the whole tier would buy nothing, and torch's pinned allocator rounds
    each block up to a power of two (a 40 GiB tier would pin 64 GiB).
    """

    name = "host"

    @classmethod
    def allocate(cls, source: list[torch.Tensor], first: int, rows: int, placing: Placing) -> HostTier:
        # one copy of the rows (a source of chunks is copied out of them a piece at a time)
        return cls(first, [leaf[first : first + rows].clone(memory_format=torch.contiguous_format)
                           for leaf in source] if rows else [])


class SourceTier(Tier):
    """The source arrays themselves (host memory: tensors, or a table column's chunks as
    :class:`~gpuload.cache.chunked_rows.ChunkedRows`): every row, read where it is. Not a cache
    tier (nothing is allocated), so not registered; the store's last resort."""

    name = "source"

    @classmethod
    def allocate(cls, source: list[torch.Tensor], first: int, rows: int, placing: Placing) -> SourceTier:
        return cls(0, list(source))
