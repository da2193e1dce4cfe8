"""Packing a split table's exchange rows: ``JoinedRows.encode`` (one gather for small rows, one
join of the pieces in row order for large ones) against the loop over rows x kinds it replaced,
run alternately in one process, on the CPU, on one thread (``--threads N`` for more).

Each case is a step's rows of two kinds, a table's array row and its decoded image, at the sizes
a table's exchange carries; the time is the best of ``REPEATS`` per implementation, the two
taking turns so the machine's load falls on both alike.

    python benchmarks/bench_joined_rows.py
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from gpuload.distributed.joined_rows import JoinedGather, JoinedRows
from gpuload.distributed.split_store import RowFormat

REPEATS = 7
# (rows in a step, array bytes per row, image bytes per row)
CASES = [(256, 3080, 3 * 32 * 32), (256, 3080, 3 * 224 * 224), (4096, 16, 3 * 8 * 8), (1024, 64, 3 * 16 * 16),
         (256, 3081, 3 * 223 * 223)]


class Encoded(RowFormat):
    """Rows of ``width`` bytes each, already encoded (the gather from the share is not timed)."""

    def __init__(self, rows: int, width: int) -> None:
        self.width = width
        self.data = torch.randint(0, 256, (rows * width,), dtype=torch.uint8)

    def sizes(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.full((positions.numel(),), self.width, dtype=torch.int64)

    def encode(self, rows: Any) -> torch.Tensor:
        return self.data

    def decode(self, data: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor) -> Any:
        return data

    def in_order(self, arrived: Any, local: Any, inverse: torch.Tensor) -> Any:
        return arrived


def looped(rows: JoinedRows, gathered: JoinedGather) -> torch.Tensor:
    """The packing ``JoinedRows.encode`` did before: each kind split per row, joined row by row."""
    sizes = rows._part_sizes(gathered.positions)
    pieces = [part.encode(g).split(sizes[:, k].tolist()) for k, (part, g) in enumerate(zip(rows.parts, gathered.parts))]
    return torch.cat([piece[row] for row in range(sizes.shape[0]) for piece in pieces])


def main() -> None:
    threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
    torch.set_num_threads(int(threads))
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}")
    for count, array_bytes, image_bytes in CASES:
        rows = JoinedRows([Encoded(count, array_bytes), Encoded(count, image_bytes)])
        positions = torch.arange(count)
        gathered = JoinedGather([positions, positions], positions)
        assert torch.equal(looped(rows, gathered), rows.encode(gathered))
        best = {"loop": float("inf"), "encode": float("inf")}
        for _ in range(REPEATS):
            for name, run in (("loop", looped), ("encode", JoinedRows.encode)):
                started = time.perf_counter()
                run(rows, gathered)
                best[name] = min(best[name], time.perf_counter() - started)
        ratio = best["loop"] / best["encode"]
        print(f"{count} rows of {array_bytes} + {image_bytes} B: loop {best['loop'] * 1e3:.2f} ms, "
              f"encode {best['encode'] * 1e3:.2f} ms ({ratio:.2f}x faster)")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
