"""Timing primitives for the benchmark: epochs timed with the device synchronised, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["EpochTimes", "time_epochs", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a timer reads finished work, not launched work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class EpochTimes:
    """Wall-clock seconds per epoch; the first (warm-up) epoch is kept apart."""

    first_s: float
    steady_s: list[float] = field(default_factory=list)
    samples_per_epoch: int = 0

    @property
    def median_s(self) -> float:
        return statistics.median(self.steady_s) if self.steady_s else self.first_s

    @property
    def spread_s(self) -> float:
        """Half the range of the steady epochs: the +- shown beside the median."""
        return (max(self.steady_s) - min(self.steady_s)) / 2 if len(self.steady_s) > 1 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_epoch / self.median_s if self.median_s > 0 else float("inf")


def _touch(batch: Any) -> int:
    """Count a batch's samples; forces nothing beyond what the loader already produced."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _touch(next(iter(batch.values())))
    return _touch(batch[0])


def time_epochs(
    make_epoch: Callable[[], Iterable[Any]],
    device: torch.device,
    epochs: int,
    step: Callable[[Any], None] | None = None,
) -> EpochTimes:
    """Run ``epochs + 1`` epochs (one warm-up) and time each from first request to last batch."""
    times: list[float] = []
    samples = 0
    for _ in range(epochs + 1):
        synchronize(device)
        started = time.perf_counter()
        samples = 0
        for batch in make_epoch():
            samples += _touch(batch)
            if step is not None:
                step(batch)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return EpochTimes(first_s=times[0], steady_s=times[1:], samples_per_epoch=samples)
