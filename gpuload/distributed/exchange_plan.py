"""What each rank sends to each other rank at one batch step: a pure plan, no processes.

Given every rank's batch for the step and the :class:`~gpuload.distributed.partition.Partition`,
rank ``me`` sends each reader in its group the rows of that reader's batch it holds (in the
reader's batch order, duplicates included), and receives its own batch's rows from their
holders. Received rows arrive grouped by sender in rank order; the rows ``me`` holds itself are
gathered locally after them; ``inverse`` puts the grouped rows back in batch order. The same
numbers come out on every rank, so the exchange needs no messages to agree on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpuload.distributed.partition import Partition

__all__ = ["StepPlan", "plan_step"]


@dataclass(frozen=True)
class StepPlan:
    """Rank ``me``'s part of one step's exchange.

    ``send_rows``: offsets into ``me``'s share, grouped by reader in rank order, with
    ``send_splits[r]`` of them for rank ``r``; ``recv_splits[r]``: rows ``me`` receives from
    ``r`` (0 for itself); ``local_rows``: share offsets of the batch rows ``me`` holds, in the
    order they follow the received ones; ``inverse``: grouped position of each batch position.
    """

    send_rows: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    local_rows: torch.Tensor
    inverse: torch.Tensor

    @property
    def received(self) -> int:
        return sum(self.recv_splits)

    @property
    def sent(self) -> int:
        return sum(self.send_splits)


def plan_step(me: int, batches: Sequence[torch.Tensor], partition: Partition) -> StepPlan:
    """Rank ``me``'s plan for a step where rank ``r`` reads ``batches[r]`` (int64, in range)."""
    world = partition.world_size
    if len(batches) != world:
        raise ValueError(f"need one batch per rank ({world}), got {len(batches)}")
    start, _ = partition.rows_of(me)
    send_splits = [0] * world
    sends = []
    for reader in partition.group_of(me):
        if reader == me:
            continue
        wanted = batches[reader]
        rows = wanted[partition.owners(reader, wanted) == me]
        send_splits[reader] = rows.numel()
        sends.append(rows - start)
    send_rows = torch.cat(sends) if sends else torch.empty(0, dtype=torch.int64)

    mine = batches[me]
    owners = partition.owners(me, mine)
    counts = torch.bincount(owners, minlength=world).tolist()
    recv_splits = [0 if rank == me else count for rank, count in enumerate(counts)]
    # The rows held here go last: the received ones fill the front of one buffer in rank order.
    key = torch.where(owners == me, torch.full_like(owners, world), owners)
    order = torch.argsort(key, stable=True)
    local_rows = mine.index_select(0, order[sum(recv_splits):]) - start
    return StepPlan(send_rows, send_splits, recv_splits, local_rows, torch.argsort(order))
