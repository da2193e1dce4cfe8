"""Several kinds of rows in one exchange: a table's array rows and its decoded images, split over
the ranks by one partition, travel in the same ``all_to_all_single`` of each step.

:class:`JoinedShare` holds this rank's share of each kind (one :class:`~gpuload.cache.Store`
each, by share row) and :class:`JoinedRows` packs a row as the bytes of each kind's row in turn
(array bytes, then each image), so a destination rank's part of the step holds exactly its
rows, whatever each kind's row sizes are. A :class:`~gpuload.distributed.split_store.SplitStore`
over them (:func:`joined`) then runs one header check and one collective per batch,
not one per kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpuload.cache import StoreStats
from gpuload.cache.store import Store
from gpuload.distributed.split_store import RowFormat, SplitStore

__all__ = ["JoinedGather", "JoinedRows", "JoinedShare", "joined"]


@dataclass
class JoinedGather:
    """Rows of each kind gathered from a :class:`JoinedShare`, and their dataset positions."""

    parts: list[Any]
    positions: torch.Tensor


class JoinedShare(Store):
    """This rank's share of several kinds of rows (``parts``, each by share row); ``start``: the
    dataset position of share row 0. Counted as its first part (the rows) with every part's bytes."""

    def __init__(self, parts: list[Store], start: int) -> None:
        self.parts = parts
        self.start = start

    @property
    def stats(self) -> StoreStats:
        first = self.parts[0].stats
        held = self.device_bytes
        return StoreStats(device_samples=first.device_samples, device_bytes=held, fill_bytes=held,
                          device_hits=first.device_hits)

    @property
    def device_bytes(self) -> int:
        return sum(part.device_bytes for part in self.parts)

    def gather(self, indices: Any) -> JoinedGather:
        rows = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        return JoinedGather([part.gather(rows) for part in self.parts], rows + self.start)

    def shrink(self, max_device_bytes: int) -> int:
        return 0  # a share cannot shrink on one rank (SplitStore.shrink says why)

    def close(self) -> None:
        for part in self.parts:
            part.close()


class JoinedRows(RowFormat):
    """Rows of several kinds (``parts``, one :class:`RowFormat` each) as one row of bytes: each
    kind's bytes of the row in turn. A step's item is each kind's item, in ``parts``' order."""

    def __init__(self, parts: list[RowFormat]) -> None:
        self.parts = parts

    def _part_sizes(self, positions: torch.Tensor) -> torch.Tensor:
        """(rows, kinds) bytes of each kind's row at dataset ``positions``."""
        return torch.stack([part.sizes(positions) for part in self.parts], dim=1)

    def sizes(self, positions: torch.Tensor) -> torch.Tensor:
        return self._part_sizes(positions).sum(dim=1)

    def encode(self, rows: JoinedGather) -> torch.Tensor:
        sizes = self._part_sizes(rows.positions)
        pieces = [part.encode(gathered).split(sizes[:, k].tolist())
                  for k, (part, gathered) in enumerate(zip(self.parts, rows.parts))]
        return torch.cat([piece[row] for row in range(sizes.shape[0]) for piece in pieces])

    def decode(self, data: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor) -> list[Any]:
        part_sizes = self._part_sizes(positions)
        kinds = len(self.parts)
        pieces = data.split(part_sizes.reshape(-1).tolist()) if positions.numel() else ()
        decoded = []
        for k, part in enumerate(self.parts):
            mine = pieces[k::kinds]
            packed = torch.cat(mine) if mine else data.new_empty(0)
            decoded.append(part.decode(packed, positions, part_sizes[:, k]))
        return decoded

    def in_order(self, arrived: list[Any], local: JoinedGather, inverse: torch.Tensor) -> list[Any]:
        return [part.in_order(a, b, inverse) for part, a, b in zip(self.parts, arrived, local.parts)]

    def screen(self, batches: list[torch.Tensor], rank: int, header: tuple[int, ...]) -> list[torch.Tensor]:
        """Each kind screens the step in turn (images raise for a bad file on every rank); a
        kind that left rows out would part the kinds' rows, so none may."""
        for part in self.parts:
            kept = part.screen(batches, rank, header)
            if any(k.numel() != b.numel() for k, b in zip(kept, batches)):
                raise RuntimeError("a table's rows cannot skip a bad image: the other columns hold that row")
        return batches

    def item(self, rows: list[Any], kept: torch.Tensor, drawn: torch.Tensor) -> list[Any]:
        return [part.item(r, kept, drawn) for part, r in zip(self.parts, rows)]


def joined(store: SplitStore, shares: list[tuple[Store, RowFormat, int]]) -> SplitStore:
    """``store``'s exchange carrying, beside its rows, each of ``shares`` (this rank's share of
    another kind of rows, split by ``store``'s plan: its store by share row, its rows' format,
    its bytes); ``store`` is handed over to the result."""
    start = store.plan.partition.rows_of(store.plan.rank)[0]
    inner = JoinedShare([store.inner, *(share for share, _, _ in shares)], start)
    rows = JoinedRows([store.rows, *(rows for _, rows, _ in shares)])
    return store.carrying(inner, rows, store.share_bytes + sum(nbytes for _, _, nbytes in shares))
