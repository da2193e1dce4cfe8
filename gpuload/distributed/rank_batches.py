"""Every rank's batch indices for an epoch, computed on any rank.

torch's ``DistributedSampler`` orders an epoch by ``(seed, epoch, num_replicas, rank, shuffle,
drop_last, len(dataset))`` alone, so one rank can build a shadow sampler for each other rank
and draw, with :func:`gpuload.sampling.epoch_batches`, exactly the batches that rank's loader
will draw. Shadows never touch a random generator the loop uses. After ``set_batch_size`` the
rest of an epoch is each rank's sample order from the same position cut at the new size, which
every rank computes alike too (the ranks change at the same batch).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from gpuload.sampling import cut_order, epoch_batches, epoch_order

__all__ = ["every_rank_batches", "sampler_fingerprint", "splittable_sampler"]


def splittable_sampler(batch_sampler: Any, num_samples: int, world_size: int, rank: int) -> str | None:
    """None when every rank's batches can be computed here, else why not (for a warning).

    That needs torch's own ``BatchSampler`` over torch's own ``DistributedSampler`` of this
    dataset, with one replica per rank of the process group and this process's rank.
    """
    if type(batch_sampler) is not BatchSampler:
        return "the batch sampler is not torch's BatchSampler (or batch_size=None)"
    sampler = batch_sampler.sampler
    if type(sampler) is not DistributedSampler:
        return f"the sampler is a {type(sampler).__name__}, not torch's DistributedSampler"
    if sampler.num_replicas != world_size or sampler.rank != rank:
        return (
            f"the DistributedSampler has num_replicas={sampler.num_replicas}, rank={sampler.rank} "
            f"but the process group has {world_size} ranks and this is rank {rank}"
        )
    dataset_size = len(cast(Sized, sampler.dataset))  # DistributedSampler took len() of it
    if dataset_size != num_samples:
        return f"the DistributedSampler's dataset has {dataset_size} samples, the arrays {num_samples}"
    return None


def sampler_fingerprint(batch_sampler: BatchSampler) -> list[int]:
    """The numbers every rank's epoch order depends on, for checking that all ranks agree."""
    sampler = _distributed(batch_sampler)
    return [
        int(sampler.seed), int(sampler.epoch), int(sampler.shuffle), int(sampler.drop_last),
        len(cast(Sized, sampler.dataset)), int(batch_sampler.batch_size), int(batch_sampler.drop_last),
    ]


def every_rank_batches(
    batch_sampler: BatchSampler, rest: tuple[int, int] | None = None
) -> list[list[torch.Tensor]]:
    """This epoch's batches (int64 tensors) of every rank, in rank order.

    ``batch_sampler`` is this rank's (checked by :func:`splittable_sampler`), after the loop's
    ``set_epoch``. ``rest``: ``(samples done, batch size)`` after a ``set_batch_size``: only
    the batches of the rest of each rank's sample order, from that position, cut at that size
    (as ``BatchSampler`` cuts: ``drop_last`` leaves out a shorter last batch).
    """
    mine = _distributed(batch_sampler)
    everyone = []
    for rank in range(mine.num_replicas):
        shadow: DistributedSampler[int] = DistributedSampler(
            mine.dataset, num_replicas=mine.num_replicas, rank=rank, shuffle=mine.shuffle,
            seed=mine.seed, drop_last=mine.drop_last,
        )
        shadow.set_epoch(mine.epoch)
        if rest is None:
            batches = list(epoch_batches(BatchSampler(shadow, batch_sampler.batch_size, batch_sampler.drop_last)))
        else:
            done, size = rest
            order = torch.as_tensor(epoch_order(shadow), dtype=torch.int64)
            batches = cut_order(order[done:], size, batch_sampler.drop_last)
        everyone.append(batches)
    return everyone


def _distributed(batch_sampler: BatchSampler) -> DistributedSampler[Any]:
    """The ``DistributedSampler`` under ``batch_sampler``, as :func:`splittable_sampler` checked."""
    return cast("DistributedSampler[Any]", batch_sampler.sampler)
