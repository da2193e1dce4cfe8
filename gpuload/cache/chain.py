"""One read path for every kind of cached data: tiers asked in order, each asked only for what
the tiers above it lack, and what a lower tier gave kept by the tiers above it.

A sample cache (memory, then ``cache_dir``'s disk, then the dataset), the decoded-image cache
(memory, disk, then the files decoded) and array rows (device, host, disk, then the source
arrays) are each a chain of keyed tiers read by :func:`read_through`; only how a batch is put
together from the tiers' answers is the kind's own. A tier answers :meth:`KeyedTier.lookup`
and takes :meth:`KeyedTier.keep`; a new tier is one class with those two methods.

Values are each tier's own representation of the keys it found (the memory tier's slots, a
disk tier's rows, a source's samples); ``keep`` takes what the tiers below it return. Answers
are plain tuples, not objects: :func:`read_through` is on every batch's path, and a cached
batch stays a few Python calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["NOTHING", "Found", "Hit", "KeyedTier", "Lookup", "read_through"]

Found = tuple[torch.Tensor | None, Any]
"""``(positions, values)``: the positions (int64, in the keys asked) a tier holds, None for all
of them, and its values for those keys, in that order."""

Lookup = tuple[Found | None, torch.Tensor]
"""What :meth:`KeyedTier.lookup` answers: what was found (None: nothing), and the positions (in
the keys asked, int64) of the keys it lacks (empty: none)."""

Hit = tuple[int, torch.Tensor | None, Any]
"""One tier's share of a read: ``(depth, positions, values)``. ``depth``: the tier's place in
the chain (the source's is ``len(tiers)``); ``positions``: where its keys are in the keys read
(None: all of them); ``values``: what its lookup gave for them."""

NOTHING = torch.zeros(0, dtype=torch.int64)
"""No positions: the ``missing`` of a lookup that found every key."""


class KeyedTier(Protocol):
    """A tier of a chain: keeps values by integer key (a dataset index)."""

    #: The tier's name in stats and in the timeline (``"device"``, ``"host"``, ``"disk"``, ...).
    name: str

    def lookup(self, keys: torch.Tensor) -> Lookup:
        """What this tier holds of ``keys`` (int64, 1-D): ``(found, missing)`` (see :data:`Lookup`)."""
        ...

    def keep(self, keys: torch.Tensor, values: Any) -> int:
        """Keep ``values`` (what a lower tier's lookup gave for ``keys``) as far as the tier's
        budget allows; how many keys it kept now (0: full, closed, or not this tier's kind)."""
        ...


def read_through(tiers: Sequence[KeyedTier], keys: torch.Tensor, source: KeyedTier) -> tuple[list[Hit], torch.Tensor]:
    """``keys`` read through ``tiers`` in order, then ``source``: each is asked for what the
    ones before it lack, and the values a tier finds are kept by every tier above it (the
    nearest first: a lower tier keeps before a faster one, as a disk entry is written before
    memory takes what fits). Returns the hits, in chain order, and the positions (in ``keys``)
    that no tier nor the source had (e.g. a file skipped as unreadable)."""
    hits: list[Hit] = []
    asked: torch.Tensor | None = None  # positions of the keys asked at this depth (None: all)
    for depth, tier in enumerate((*tiers, source)):
        found, missing = tier.lookup(keys if asked is None else keys.index_select(0, asked))
        if found is not None:
            where, values = found
            at = asked if where is None else where if asked is None else asked.index_select(0, where)
            hits.append((depth, at, values))
            if depth:
                kept = keys if at is None else keys.index_select(0, at)
                for upper in reversed(tiers[:depth]):
                    upper.keep(kept, values)
        if not missing.numel():
            return hits, NOTHING
        asked = missing if asked is None else asked.index_select(0, missing)
    assert asked is not None
    return hits, asked
