"""A deterministic map-style dataset of mixed-type samples that counts its reads (shared by tests)."""

from __future__ import annotations

import torch
import torch.utils.data as tud


class Counted(tud.Dataset):
    """Deterministic samples of mixed types; counts reads made in this process."""

    def __init__(self, n: int = 37) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        self.reads += 1
        g = torch.Generator().manual_seed(int(index))
        return {"x": torch.rand(3, generator=g), "label": int(index) % 5, "name": f"s{index}"}
