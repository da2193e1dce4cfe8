"""Many GPUs on torch.distributed: one copy of a dataset split over the ranks' devices.

With ``cache_scope="node"`` or ``"world"`` each rank keeps only its share of the rows (arrays,
a dataset's samples, or decoded images), and each batch's rows held by other ranks come over one
``all_to_all``. Every rank can compute every other rank's batches (torch's ``DistributedSampler``
order is a pure function of its arguments), and every row's size (fixed for arrays and samples;
for images, from one table of decoded shapes swapped once), so who sends what is planned, not
negotiated.

- ``group``: the process group as gpuload sees it (rank, node size, the exchange's own groups
  and timeout);
- ``partition``: which rank holds which rows;
- ``rank_batches``: every rank's batch indices for an epoch, from shadow samplers;
- ``exchange_plan``: per batch step, what each rank sends to each other rank (pure);
- ``exchange_steps``: one epoch's steps, made by one thread at a time, ahead of the loop by
  the same bound on every rank (gloo; NCCL's are issued from the loop's thread), so ranks that
  stop at the same batch stay in step;
- ``scope``: the ``auto`` decision (rank, node, world or today's tiers) from the cache budget;
- ``scope_plan``: what each scope would hold and move on a pretended cluster (``gpuload plan``);
- ``split_store``: a split store wraps any store holding a rank's share and owns the
  exchange (:class:`SplitStore`: steps, header check, collective, batch order, counters,
  close; how rows travel as bytes: a :class:`RowFormat`), and a rank's share of the arrays;
- ``sample_shares``: a rank's share of a map-style dataset's samples, read once by column and
  served through the same exchange;
- ``image_shares``: a rank's share of an image dataset's decoded images, decoded once, each
  batch's images exchanged as ragged bytes sized from the shape table;
- ``shared_host``: one host tier per node, mapped by its ranks from shared memory.
- ``rank_waits``: every rank's wait share and top stage (``loader.timeline``), gathered every N
  steps, so the slowest rank is named on each.
"""

from gpuload.distributed.exchange_plan import StepPlan, plan_step
from gpuload.distributed.group import (
    EXCHANGE_TIMEOUT_ENV,
    DistributedContext,
    ExchangeError,
    current_context,
)
from gpuload.distributed.partition import Partition
from gpuload.distributed.rank_batches import every_rank_batches, splittable_sampler
from gpuload.distributed.scope import ScopeDecision, decide_scope
from gpuload.distributed.scope_plan import EpochBytes, ScopePlan, ScopePlans, plan_scopes
from gpuload.distributed.split_store import RowFormat, SplitStore

__all__ = [
    "EXCHANGE_TIMEOUT_ENV",
    "DistributedContext",
    "EpochBytes",
    "ExchangeError",
    "Partition",
    "ScopeDecision",
    "ScopePlan",
    "ScopePlans",
    "RowFormat",
    "SplitStore",
    "StepPlan",
    "current_context",
    "decide_scope",
    "every_rank_batches",
    "plan_scopes",
    "plan_step",
    "splittable_sampler",
]
