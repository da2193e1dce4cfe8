"""Which rank holds which rows: contiguous blocks of the dataset over groups of ranks.

Ranks form groups of ``group_size`` consecutive ranks (torchrun numbers a node's ranks
consecutively): a node's ranks for ``cache_scope="node"``, all ranks for ``"world"``. Each
group holds one whole copy of the dataset, split into ``group_size`` contiguous blocks, block
``i`` on the group's ``i``-th rank; a rank only ever asks its own group for rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Partition"]


@dataclass(frozen=True)
class Partition:
    """``num_samples`` rows over ``world_size`` ranks in groups of ``group_size`` ranks."""

    num_samples: int
    world_size: int
    group_size: int

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.world_size % self.group_size:
            raise ValueError(
                f"{self.world_size} ranks cannot be split into groups of {self.group_size}: the node "
                "size (LOCAL_WORLD_SIZE) must divide the world size"
            )
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")

    @property
    def bounds(self) -> torch.Tensor:
        """Block starts and the end: block ``i`` is rows ``[bounds[i], bounds[i + 1])``."""
        parts = torch.arange(self.group_size + 1, dtype=torch.int64)
        return parts * self.num_samples // self.group_size

    def group_of(self, rank: int) -> range:
        """The ranks whose rows ``rank`` reads: its group."""
        first = rank - rank % self.group_size
        return range(first, first + self.group_size)

    def rows_of(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the rows ``rank`` holds."""
        bounds = self.bounds
        block = rank % self.group_size
        return int(bounds[block]), int(bounds[block + 1])

    def owners(self, reader: int, indices: torch.Tensor) -> torch.Tensor:
        """For each of ``indices`` (int64, in range), the rank of ``reader``'s group holding it."""
        block = torch.searchsorted(self.bounds[1:-1], indices, right=True)
        return block + (reader - reader % self.group_size)

    def describe(self, rank: int, bytes_per_sample: int) -> str:
        start, stop = self.rows_of(rank)
        groups = self.world_size // self.group_size
        return (
            f"rank {rank} holds rows [{start}, {stop}) of {self.num_samples} "
            f"({(stop - start) * bytes_per_sample} bytes); {groups} cop{'y' if groups == 1 else 'ies'} "
            f"of the dataset, each split over {self.group_size} ranks"
        )
