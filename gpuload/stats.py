"""Counters a user can read from ``loader.stats``: what ran, what moved, how long the loop waited."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LoaderStats"]


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
