"""Counters a user can read from ``loader.stats``: what ran, what moved, how long the loop waited."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LoaderStats", "Tally"]


@dataclass
class LoaderStats:
    """Running totals for one loader, over all its epochs.

    ``path`` says how batches were made: ``"device-gather"`` (the whole dataset on the device,
    one gather per batch) or ``"torch"`` (torch's own fetching and collation, then moved to the
    device). ``bytes_h2d`` counts every byte copied host-to-device, including the one-time
    placement of the dataset; ``wait_time_s`` is the time the training loop spent inside
    ``next()`` waiting for a batch. ``bytes_h2d_per_epoch[k]`` is the part of ``bytes_h2d``
    counted during epoch k (the first includes filling the cache; later ones show what the
    cache saves).
    """

    path: str = ""
    device: str = ""
    epochs: int = 0
    batches: int = 0
    samples: int = 0
    bytes_h2d: int = 0
    wait_time_s: float = 0.0
    bytes_h2d_per_epoch: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict, for logging or JSON."""
        return asdict(self)

    def __str__(self) -> str:
        mib = self.bytes_h2d / 2**20
        return (
            f"{self.path} on {self.device}: {self.epochs} epoch(s), {self.batches} batches, "
            f"{self.samples} samples, {mib:.1f} MiB host-to-device, "
            f"waited {self.wait_time_s:.3f} s"
        )


class Tally:
    """Adds what a loader's source and prefetcher counted to its :class:`LoaderStats`, each
    byte once: both report running totals, read whenever ``loader.stats`` is. On a CPU device
    the prefetcher's staging is a host copy, not a transfer, and is not counted."""

    def __init__(self, stats: LoaderStats) -> None:
        self.stats = stats
        self._source = self._prefetch = 0  # the totals already added
        self._epoch_starts: list[int] = []  # bytes_h2d when each epoch began

    def begin_epoch(self, source: Any, prefetcher: Any, device_type: str) -> None:
        self.merge(source, prefetcher, device_type)
        self._epoch_starts.append(self.stats.bytes_h2d)
        self.stats.epochs += 1

    def forget(self, source: bool = False, prefetcher: bool = False) -> None:
        """Count a new source's or prefetcher's totals from 0 (the old one's were added)."""
        self._source = 0 if source else self._source
        self._prefetch = 0 if prefetcher else self._prefetch

    def merge(self, source: Any, prefetcher: Any, device_type: str) -> LoaderStats:
        """The stats with what ``source`` and ``prefetcher`` (None: none) counted since the last look."""
        stats = self.stats
        stats.bytes_h2d += source.h2d_bytes - self._source
        self._source = source.h2d_bytes
        stats.extra.update(source.stats())
        if prefetcher is not None:
            copied = prefetcher.stats.bytes_copied
            if device_type != "cpu":
                stats.bytes_h2d += copied - self._prefetch
            self._prefetch = copied
            stats.extra["prefetch"] = {
                "depth": prefetcher.depth, "bytes_staged": copied, "copy_time_s": prefetcher.stats.copy_time_s,
                "slot_allocations": prefetcher.stats.slot_allocations,
            }
        if self._epoch_starts:
            ends = [*self._epoch_starts[1:], stats.bytes_h2d]
            stats.bytes_h2d_per_epoch = [end - start for start, end in zip(self._epoch_starts, ends)]
        return stats
