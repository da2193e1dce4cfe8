"""A store split over ranks: any store holding a rank's share, wrapped by the exchange that
assembles each of its batches (:class:`SplitStore`), and the share of in-memory arrays.

:func:`split_arrays` decides, with every rank together, whether the dataset is split (the
scope), and wraps a store holding this rank's contiguous block of rows on its device
(:func:`array_share`: a :class:`~gpuload.cache.TieredArrayStore` whose device tier holds it
whole). :meth:`SplitStore.epoch` then makes each batch of the epoch with two collectives on
the exchange's own groups: a small header over gloo (epoch, step, batch size, position in the
epoch's order, row counts: ranks that ran different numbers of batches, or changed the batch
size at different batches, fail here, with an :class:`ExchangeError`, never a wrong batch) and
one ``all_to_all_single`` carrying the rows (of every array at once, packed as bytes:
:class:`ArrayRows`); the rows this rank holds itself are gathered from its share. The batch is
exactly the one torch's DataLoader with the same ``DistributedSampler`` gives.

Over gloo (CPU tensors) the steps may run ahead of the loop, in the prefetcher's thread
(:mod:`gpuload.distributed.exchange_steps` keeps the ranks' collectives in step). Over NCCL
they are issued from the loop's thread, on its current stream, and waited for by that stream,
never by the host: NCCL does not allow two threads to issue operations on two communicators of
one device at once, and a thread running ahead would do so beside DDP's all-reduces, in an
order that differs between ranks (NCCL user guide, "Thread Safety" and "Using multiple NCCL
communicators concurrently"). From the loop's thread every rank issues the exchange and DDP's
collectives in its program order, the same on every rank.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpuload.cache import LEDGER, CacheSettings, StoreStats, TieredArrayStore, format_bytes
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.oom import CacheFallbackWarning
from gpuload.cache.plan import CachePlan, TierPlan
from gpuload.cache.store import Store
from gpuload.device import device_memory
from gpuload.distributed.exchange_plan import StepPlan, plan_step
from gpuload.distributed.exchange_steps import (
    ExchangeSteps,
    LoaderClosedError,
    wait_work,
)
from gpuload.distributed.group import (
    EXCHANGE_TIMEOUT_ENV,
    DistributedContext,
    ExchangeError,
    agree_on_scope,
    current_context,
    exchange_groups,
    exchange_timeout,
    loader_identity,
    peers_answer,
    release_groups,
)
from gpuload.distributed.partition import Partition
from gpuload.distributed.rank_batches import (
    every_rank_batches,
    sampler_fingerprint,
    splittable_sampler,
)
from gpuload.distributed.scope import ScopeDecision, decide_scope
from gpuload.transfer import Staging, to_device

__all__ = [
    "ArrayRows", "ExchangeStats", "RowFormat", "SplitPlan", "SplitStore", "agree_on_split", "array_share",
    "decline_split", "split_arrays", "split_array_store", "split_context", "split_obstacle",
]

_LET_GO_S = 2.0  # how long close() waits for a thread inside the exchange to abandon it
_SETTLE_S = 30.0  # how long close() waits for a stopped epoch's steps to be completed
_SCOPE_CODES = {"auto": 0, "rank": 1, "node": 2, "world": 3}
# What each step swaps first (gloo, host): where every rank is, then the rows it sends. The batch
# size and the step's first position in the epoch's sample order catch ranks that changed the
# batch size at different batches, or only some of them (set_batch_size).
_HEADER = ("sampler epoch", "batch", "batches in the epoch", "seed", "batch size", "first sample", "rows")


@dataclass
class ExchangeStats:
    """This rank's exchange counters, per epoch: rows' bytes sent to and received from other
    ranks; ``wait_s_per_epoch``: host time spent in the exchange itself, in whichever thread
    made it (waiting for the other ranks included); the loop's own wait for its batches is
    measured by the loader: ``loop_wait_marks`` holds its running total at each epoch start."""

    bytes_sent_per_epoch: list[int] = field(default_factory=list)
    bytes_received_per_epoch: list[int] = field(default_factory=list)
    wait_s_per_epoch: list[float] = field(default_factory=list)
    local_rows: int = 0
    received_rows: int = 0
    loop_wait_marks: list[float] = field(default_factory=list)
    ahead: bool = False
    epoch_numbers: list[int | None] = field(default_factory=list)

    def begin_epoch(self, loop_wait_s: float = 0.0, ahead: bool = False, number: int | None = None) -> int:
        """Open the next epoch's counters (``number``: the loader's epoch); returns its position
        in the per-epoch lists."""
        self.epoch_numbers.append(number)
        self.bytes_sent_per_epoch.append(0)
        self.bytes_received_per_epoch.append(0)
        self.wait_s_per_epoch.append(0.0)
        self.loop_wait_marks.append(loop_wait_s)
        self.ahead = ahead
        return len(self.wait_s_per_epoch) - 1

    def as_dict(self, loop_wait_s: float | None = None) -> dict[str, Any]:
        """The counters; ``loop_wait_s``: the loop's running wait total now, for the per-epoch
        ``loop_wait_s_per_epoch`` (the time the loop waited for its batches in each epoch)."""
        marks = self.loop_wait_marks
        ends = [*marks[1:], loop_wait_s if loop_wait_s is not None else (marks[-1] if marks else 0.0)]
        loop_wait = [max(end - start, 0.0) for start, end in zip(marks, ends)]
        return {
            "ahead": self.ahead,
            "bytes_sent": sum(self.bytes_sent_per_epoch),
            "bytes_received": sum(self.bytes_received_per_epoch),
            "exchange_s": sum(self.wait_s_per_epoch),
            "loop_wait_s": sum(loop_wait),
            "wait_s": sum(self.wait_s_per_epoch),
            "bytes_sent_per_epoch": list(self.bytes_sent_per_epoch),
            "bytes_received_per_epoch": list(self.bytes_received_per_epoch),
            "exchange_s_per_epoch": list(self.wait_s_per_epoch),
            "loop_wait_s_per_epoch": loop_wait,
            "wait_s_per_epoch": list(self.wait_s_per_epoch),
            "local_rows": self.local_rows,
            "received_rows": self.received_rows,
        }


@dataclass(frozen=True)
class SplitPlan:
    """The decision and the partition, printable like a :class:`~gpuload.cache.CachePlan`."""

    decision: ScopeDecision
    partition: Partition
    rank: int
    bytes_per_sample: int
    device: str

    @property
    def kind(self) -> str:
        return f"sharded-{self.decision.scope}"

    def describe(self) -> str:
        return (
            f"cache plan: {self.kind} on {self.device} (cache_scope={self.decision.requested}): "
            f"{self.decision.reason}; {self.partition.describe(self.rank, self.bytes_per_sample)}"
        )

    __str__ = describe


def split_arrays(
    columns: list[torch.Tensor],
    settings: CacheSettings,
    device: torch.device,
    batch_sampler: Any,
    owner: Hashable,
    context: DistributedContext | None = None,
    staging: Staging | None = None,
    beside: Callable[[], int] | None = None,
) -> SplitStore | None:
    """This rank's share of ``columns`` when the scope splits them, else None (today's path);
    ``staging``: the loader's route to the device for the indices a step moves there;
    ``beside()``: the bytes per sample of what splits with them (a table's decoded images), which
    the scope's decision counts with the arrays' own.

    None without an initialized process group, for ``cache_scope="rank"``, for caches that keep
    no device tier (``cache="off"``/``"host"``), for ``auto`` on a CPU device, and when the
    loader's sampler is not torch's ``DistributedSampler`` over all ranks (with a warning when a
    split was asked for). Otherwise every rank must call this at the same point: the ranks check
    they agree (sizes, sampler, scope) and decide the scope from the smallest device room.
    """
    num_samples = columns[0].shape[0]
    context = split_context(settings, device, context, loader_identity(num_samples, batch_sampler))
    if context is None:
        return None
    why_not = split_obstacle(settings, batch_sampler, num_samples, context)
    if why_not is not None:
        decline_split(settings, why_not)
        return None
    bytes_per_sample = sum(c[0].numel() * c.element_size() for c in columns) + (beside() if beside else 0)
    agreed = agree_on_split(settings, device, batch_sampler, owner, context, num_samples, bytes_per_sample)
    if agreed is None:
        return None
    plan, groups = agreed
    start, stop = plan.partition.rows_of(plan.rank)
    block = [column[start:stop] if device.type == "cuda" else column[start:stop].clone() for column in columns]
    return split_array_store(block, plan, device, groups, owner=owner, staging=staging)


def split_context(
    settings: CacheSettings, device: torch.device, context: DistributedContext | None = None,
    loader: str | None = None,
) -> DistributedContext | None:
    """The process group when ``cache_scope`` may split the dataset, else None: no initialized
    group, ``cache_scope="rank"``, or ``auto`` on a CPU device (which means ``rank``). ``loader``
    (:func:`loader_identity`): the ranks first check they ask for the same scope for it
    (:func:`agree_on_scope`), so a disagreement fails at once instead of at the exchange timeout."""
    context = context or current_context()
    if context is None:
        return None
    requested = settings.scope.value
    splits = not (requested == "rank" or (requested == "auto" and device.type != "cuda"))
    if loader is not None and dist.is_initialized():
        agree_on_scope(requested, settings.scope.source, splits, context, loader)
    return context if splits else None


def split_obstacle(settings: CacheSettings, batch_sampler: Any, num_samples: int,
                   context: DistributedContext) -> str | None:
    """Why the cache cannot be split whatever the sizes (for a warning), else None: a cache that
    keeps no device tier, or a sampler whose every rank's batches cannot be computed here."""
    if settings.mode.value not in ("auto", "device"):
        return f"cache={settings.mode.value!r} keeps no device tier to split"
    return splittable_sampler(batch_sampler, num_samples, context.world_size, context.rank)


def decline_split(settings: CacheSettings, why_not: str, stacklevel: int = 5) -> None:
    """Warn that an explicit ``node``/``world`` scope is not used, and why (``auto``: silent)."""
    requested = settings.scope.value
    if requested != "auto":
        warnings.warn(
            f"gpuload: cache_scope={requested!r} ({settings.scope.source}) is not used: {why_not}; "
            "each rank caches the whole dataset", stacklevel=stacklevel,
        )


def agree_on_split(
    settings: CacheSettings,
    device: torch.device,
    batch_sampler: Any,
    owner: Hashable,
    context: DistributedContext,
    num_samples: int,
    bytes_per_sample: int,
    room: int | None = None,
    declined: str | None = None,
) -> tuple[SplitPlan, tuple[Any, Any]] | None:
    """The plan and the exchange's ``(control, data)`` groups when the ranks split the dataset,
    else None (the groups released). Every rank must call this at the same point: the ranks
    check they agree (sizes, sampler, scope) and decide the scope from the smallest room.
    ``room``: the bytes a share may take on this rank; None: the device cache room on CUDA,
    no limit on a CPU device (arrays are served in place there).

    ``declined``: why this rank found its samples cannot be split (what it read of them: a
    random probe, a failed read), else None. A rank that declines still comes here, so that
    every rank declines with it and says why, rather than the others waiting for it in the
    exchange until the timeout.
    """
    requested = settings.scope.value
    if room is None and device.type == "cuda":
        room = settings.device_room(device, device_memory(device), owner)
    limited = room is not None
    room = room if room is not None else -1
    control, data = exchange_groups(device, exchange_timeout())
    mine = [_SCOPE_CODES[requested], room, num_samples, bytes_per_sample, context.local_world_size,
            *[v for i, v in enumerate(sampler_fingerprint(batch_sampler)) if i != 1], int(declined is not None)]
    everyone = [torch.empty(len(mine), dtype=torch.int64) for _ in range(context.world_size)]
    with peers_answer(f"gpuload: rank {context.rank} could not agree on the split cache with the other ranks "
                      f"(cache_scope={requested!r}): a rank did not build its loader the same way, or died."):
        dist.all_gather(everyone, torch.tensor(mine, dtype=torch.int64), group=control)
    rows = [row.tolist()[:-1] for row in everyone]
    decliners = [rank for rank, row in enumerate(everyone) if int(row[-1])]
    mine = mine[:-1]

    def compared(row: list[int]) -> list[int]:  # room may differ; a rank that declined knows no sample size
        return row[:1] + row[2:3] + ([] if decliners else row[3:4]) + row[4:]

    differ = [rank for rank, row in enumerate(rows) if compared(row) != compared(mine)]
    if differ:
        raise ExchangeError(
            f"gpuload: ranks disagree on the split cache: (scope, room, samples, bytes per sample, "
            f"node size, sampler seed/shuffle/drop_last/length, batch size, drop_last) is {mine} on rank "
            f"{context.rank} but {rows[differ[0]]} on rank {differ[0]}; every rank must build the "
            "loader with the same dataset, sampler and cache_scope"
        )
    if decliners:
        reasons: list[Any] = [None] * context.world_size
        with peers_answer(f"gpuload: rank {context.rank} could not learn why rank {decliners[0]} declined the "
                          f"split cache (cache_scope={requested!r}): a rank died."):
            dist.all_gather_object(reasons, declined, group=control)
        release_groups((control, data))
        decline_split(settings, declined if declined is not None
                      else f"on rank {decliners[0]}, {reasons[decliners[0]]}", stacklevel=6)
        return None
    smallest_room = min(row[1] for row in rows) if limited else None
    decision = decide_scope(requested, num_samples, bytes_per_sample, smallest_room,
                            context.local_world_size, context.world_size)
    if not decision.split or decision.group_size == 1:
        if requested != "auto" and requested != decision.scope:
            warnings.warn(f"gpuload: {decision.reason}", stacklevel=5)
        release_groups((control, data))
        return None
    partition = Partition(num_samples, context.world_size, decision.group_size)
    return SplitPlan(decision, partition, context.rank, bytes_per_sample, str(device)), (control, data)


class RowFormat(ABC):
    """How one kind of share's rows travel between ranks as bytes: the one thing a
    :class:`SplitStore` asks of what it wraps besides the :class:`Store` interface.

    Rows are named by dataset position; each row's size is known on every rank (fixed for
    arrays, from the table of decoded shapes for images), so a step's byte counts are planned,
    not negotiated.
    """

    @abstractmethod
    def sizes(self, positions: torch.Tensor) -> torch.Tensor:
        """The bytes of each row at dataset ``positions`` (int64, on the host)."""

    @abstractmethod
    def encode(self, rows: Any) -> torch.Tensor:
        """Rows as the inner store gathered them, as one flat uint8 tensor (row after row)."""

    @abstractmethod
    def decode(self, data: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor) -> Any:
        """Received bytes (rows at dataset ``positions``, of ``sizes`` bytes each) as rows."""

    @abstractmethod
    def in_order(self, arrived: Any, local: Any, inverse: torch.Tensor) -> Any:
        """The received rows followed by the local ones, put in batch order (``inverse``: the
        grouped position of each batch position, on the host)."""

    def screen(self, batches: list[torch.Tensor], rank: int, header: tuple[int, ...]) -> list[torch.Tensor]:
        """Every rank's batch of one step as exchanged (default: whole)."""
        return batches

    def item(self, rows: Any, kept: torch.Tensor, drawn: torch.Tensor) -> Any:
        """One step's item for the source: ``(rows, this rank's batch indices)`` by default."""
        return rows, drawn


class SplitStore(Store):
    """A rank's share of a dataset split over ranks (any :class:`Store` holding the share's rows,
    by share row), and the exchange that assembles each of its batches from every rank's share.

    The wrapper owns what every kind of share has in common: which rows a dataset index names
    (``gather``; an index outside the share is an ``IndexError``), the epoch's steps (run ahead
    or not, kept in step over ranks by :class:`ExchangeSteps`), the per-step header check, the
    collective that carries the rows, putting them back in batch order, the counters, and
    ``close``. ``rows`` says how the share's rows travel as bytes (:class:`RowFormat`). On
    CUDA the inner store protects its tensors on every stream that gathered from them, the
    exchange's included, when they are dropped.
    """

    split_over_ranks = True

    def __init__(
        self, inner: Store, rows: RowFormat, plan: SplitPlan, device: torch.device, groups: tuple[Any, Any],
        *, share_bytes: int,
    ) -> None:
        self.inner = inner
        self.rows = rows
        self.plan = plan
        self.device = device
        self._control, self._data = groups
        self._rank = plan.rank
        self._start = plan.partition.rows_of(plan.rank)[0]
        self._share_bytes = share_bytes
        self._closed = False
        self._hits = 0
        self.exchange_stats = ExchangeStats()
        self._issuing = threading.Lock()  # one thread at a time issues the exchange's collectives
        self._steps: ExchangeSteps | None = None  # the latest epoch's

    @property
    def share_bytes(self) -> int:
        """Bytes of the dataset this rank holds (0 once closed)."""
        return self._share_bytes if not self._closed else 0

    @property
    def stats(self) -> StoreStats:
        """The share as a device tier (``device_bytes`` counts only what was copied to CUDA)."""
        if self._closed:
            return StoreStats(device_hits=self._hits)
        held = self.inner.device_bytes
        rows = self.inner.stats.device_samples
        return StoreStats(device_samples=rows, device_bytes=held, fill_bytes=held, device_hits=self._hits)

    @property
    def device_bytes(self) -> int:
        return self.inner.device_bytes if not self._closed else 0

    @property
    def closed(self) -> bool:
        return self._closed

    def gather(self, indices: Any) -> Any:
        """The rows of this rank's share at dataset ``indices``, as the inner store gives them."""
        return self.inner.gather(self._share_positions(indices))

    def _share_positions(self, indices: Any) -> torch.Tensor:
        """``indices`` as rows of this rank's share; ``IndexError`` for one outside it (the
        other ranks hold it: a batch of them is an exchange, see :meth:`epoch`)."""
        if self._closed:
            raise RuntimeError("this gpuload.DataLoader was closed; iterate a new loader instead")
        start, stop = self.plan.partition.rows_of(self._rank)
        flat = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        outside = ((flat < start) | (flat >= stop)).nonzero().view(-1)
        if outside.numel():
            raise IndexError(f"dataset index {int(flat[outside[0]])} is not in rank {self._rank}'s share "
                             f"[{start}, {stop}); the other ranks' rows come through the exchange")
        return flat - start

    def describe_exchange(self, loop_wait_s: float | None = None) -> dict[str, Any]:
        """For ``loader.stats.extra["exchange"]``; ``loop_wait_s``: the loader's running total of
        the loop's wait (see :meth:`ExchangeStats.as_dict`)."""
        return {
            "scope": self.plan.decision.scope,
            "ranks_per_copy": self.plan.decision.group_size,
            "shard_rows": self.stats.device_samples,
            "shard_bytes": self.share_bytes,
            **self.exchange_stats.as_dict(loop_wait_s),
        }

    @property
    def control(self) -> Any:
        """The exchange's gloo group for what the ranks swap beside the steps (before the first)."""
        return self._control

    def carrying(self, inner: Store, rows: RowFormat, share_bytes: int) -> SplitStore:
        """A store over ``inner`` and ``rows`` (this share and more, split by the same plan) that
        takes over this one's exchange groups, before any epoch ran: one exchange per batch for
        them all. This store is done: closing it does nothing (the new one closes ``inner``)."""
        if self._closed or self._steps is not None:
            raise RuntimeError("a split store is carried by another only before its first epoch")
        self._closed = True
        return SplitStore(inner, rows, self.plan, self.device, (self._control, self._data), share_bytes=share_bytes)

    @property
    def runs_ahead(self) -> bool:
        """Whether the exchange may run in the prefetcher's thread: gloo's, not NCCL's (see the
        module docstring)."""
        return self.device.type != "cuda"

    def shrink(self, max_bytes: int) -> int:
        """A share cannot shrink on one rank alone (every rank's exchange plan reads rows from it
        there): frees nothing, and warns when less than the share was asked for."""
        if max_bytes < self.share_bytes and not self._closed:
            warnings.warn(
                f"gpuload: shrink_cache({max_bytes}) freed nothing: rank {self._rank} holds "
                f"{format_bytes(self.share_bytes)} of a dataset split over ranks "
                f"(cache_scope={self.plan.decision.scope!r}), and every rank's exchange reads its rows "
                "from that share, so it cannot shrink on one rank. For less device memory per rank, build "
                "the loaders with cache_scope='world' (smaller shares) or let each rank keep its own "
                "tiers (cache_scope='rank')", stacklevel=4,
            )
        return 0

    def close(self) -> None:
        """Drop the share, its ledger booking and the exchange's groups. Safe to call twice.

        After the loop stopped an epoch, the steps every rank completes are let end first (up
        to 30 s). Otherwise an exchange waiting for other ranks in another thread (run ahead) is
        abandoned: it notices within a fraction of a second, and the groups are released after
        it let go.
        """
        if self._closed:
            return
        if self._steps is not None and self._steps.stopped:
            # The loop stopped the epoch at a batch every rank stops at: its steps are being
            # completed to the same step everywhere (at most RUN_AHEAD_LIMIT). Let them end
            # rather than leave a collective in flight when the groups are destroyed.
            self._steps.settle(_SETTLE_S)
        self._closed = True
        if self._steps is not None:
            self._steps.cancel()
        let_go = self._issuing.acquire(timeout=_LET_GO_S)
        try:
            self.inner.close()
            release_groups((self._control, self._data))
        finally:
            if let_go:
                self._issuing.release()

    def epoch(
        self, batch_sampler: Any, drawn: list[torch.Tensor], *, position: tuple[int, int, int] | None = None,
        ahead: bool = False, loop_wait_s: float = 0.0, number: int | None = None,
    ) -> ExchangeSteps[Any]:
        """What :meth:`_step` makes for each of ``drawn``, this rank's batches of the epoch as
        its loader drew them (the last ones only, after a resume).

        ``batch_sampler`` is the loader's, after ``set_epoch``: every rank's batches are
        computed from it. ``position``: ``(batches done, samples done, batch size)`` when
        ``drawn`` is the rest of the epoch's order from that sample cut at that size (after
        ``set_batch_size``, which every rank makes at the same batch); every rank's rest is cut
        alike, so the exchange is planned again without a message. Each step exchanges with the
        other ranks, which must run the same steps; the first ``next()`` already checks the
        epoch, the batch size and the position against them. ``ahead``: the steps run in the
        prefetcher's thread, ahead of the loop, which calls ``handed_over()`` on the result for
        each batch it receives (:class:`ExchangeSteps`). The previous steps, if they were stopped
        early (an epoch, or the batches made ahead before a batch-size change), are completed
        first, the same way on every rank. ``loop_wait_s``: the loader's running total of the
        loop's wait, at this epoch's start; ``number``: the loader's epoch (the rest of an epoch
        after a batch-size change is counted with it).
        """
        if position is None:
            done, first, size = 0, 0, int(batch_sampler.batch_size)
            everyone = every_rank_batches(batch_sampler)
        else:
            done, first, size = position
            everyone = every_rank_batches(batch_sampler, rest=(first, size))
        mine = everyone[self._rank]
        skipped = len(mine) - len(drawn)
        if skipped < 0 or any(not torch.equal(a, b) for a, b in zip(mine[skipped:], drawn)):
            raise ExchangeError(
                f"gpuload: rank {self._rank}'s batches differ from the ones its DistributedSampler "
                "gives; the split cache needs torch's BatchSampler over torch's DistributedSampler, "
                "unchanged during the epoch (change the batch size with loader.set_batch_size)"
            )
        if self._closed:
            raise RuntimeError("this gpuload.DataLoader was closed; iterate a new loader instead")
        previous, self._steps = self._steps, None
        if previous is not None:
            previous.cancel()
            previous.close()
        stats = self.exchange_stats
        if position is not None and number is not None and stats.epoch_numbers[-1:] == [number]:
            slot = len(stats.epoch_numbers) - 1  # the same epoch goes on at another batch size
        else:
            slot = stats.begin_epoch(loop_wait_s, ahead, number)
        # Read now: the steps may be made later (ahead, or completing a stopped epoch) than a
        # set_epoch() the loop makes for its next epoch.
        sampler_epoch, seed = int(batch_sampler.sampler.epoch), int(batch_sampler.sampler.seed)
        total = done + len(mine)

        def make(step: int) -> Any:
            if self._closed:
                raise RuntimeError("this gpuload.DataLoader was closed; iterate a new loader instead")
            at = step - done
            header = (sampler_epoch, step, total, seed, size, first + at * size)
            return self._step([batches[at] for batches in everyone], header, slot)

        self._steps = ExchangeSteps(range(done + skipped, total), make, self._issuing, ahead, lambda: self._closed)
        return self._steps

    def _step(self, batches: list[torch.Tensor], header: tuple[int, ...], slot: int) -> Any:
        """One step's item, where rank ``r`` reads ``batches[r]``; ``header``: (sampler epoch,
        step, steps in the epoch, seed, batch size, first sample of the step in the epoch's
        order); ``slot``: the epoch's place in the counters. The rows other ranks hold come in
        one ``all_to_all_single`` of bytes sized by ``rows`` (on CUDA ordered on the current
        stream, see the module docstring); this rank's own rows are gathered from its share."""
        mine = batches[self._rank]
        kept = self.rows.screen(batches, self._rank, header)
        plan = plan_step(self._rank, kept, self.plan.partition)
        began = time.perf_counter()
        self._check_peers(plan, header)
        grouped = torch.empty_like(kept[self._rank])
        grouped[plan.inverse] = kept[self._rank]  # batch rows in the order they arrive
        incoming = grouped[: plan.received]
        recv_sizes = self.rows.sizes(incoming)
        send_bytes = [int(part.sum()) for part in self.rows.sizes(plan.send_rows + self._start).split(plan.send_splits)]
        recv_bytes = [int(part.sum()) for part in recv_sizes.split(plan.recv_splits)]
        if plan.sent:
            outgoing = self.rows.encode(self.inner.gather(plan.send_rows))
        else:
            outgoing = torch.empty(0, dtype=torch.uint8, device=self.device)
        received = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=self.device)
        self._swap(received, outgoing, recv_bytes, send_bytes, header)
        arrived = self.rows.decode(received, incoming, recv_sizes)
        batch = self.rows.in_order(arrived, self.inner.gather(plan.local_rows), plan.inverse)
        self._count(slot, plan, sum(send_bytes), sum(recv_bytes), began)
        return self.rows.item(batch, kept[self._rank], mine)

    def _swap(self, received: torch.Tensor, outgoing: torch.Tensor, recv_splits: list[int],
              send_splits: list[int], header: tuple[int, ...]) -> None:
        """The step's one collective: ``outgoing`` split by ``send_splits`` to the ranks, into
        ``received`` split by ``recv_splits`` (on CUDA ordered on the current stream)."""
        on_host = self.device.type != "cuda"
        try:
            work = dist.all_to_all_single(received, outgoing, recv_splits, send_splits,
                                          group=self._data, async_op=True)
            # NCCL: the current stream waits, and the work keeps outgoing/received alive until then.
            wait_work(work, on_host, lambda: self._closed)
        except LoaderClosedError:
            raise
        except RuntimeError as error:
            raise self._stopped(header, error) from error

    def _count(self, slot: int, plan: StepPlan, sent: int, received: int, began: float) -> None:
        """One step's counters: ``sent``/``received`` bytes, since ``began`` (perf_counter)."""
        stats = self.exchange_stats
        stats.bytes_sent_per_epoch[slot] += sent
        stats.bytes_received_per_epoch[slot] += received
        stats.received_rows += plan.received
        stats.local_rows += plan.local_rows.numel()
        stats.wait_s_per_epoch[slot] += time.perf_counter() - began
        self._hits += plan.local_rows.numel()

    def _check_peers(self, plan: StepPlan, header: tuple[int, ...]) -> None:
        """Swap ``header`` and row counts with the ranks this step exchanges with (gloo, host)."""
        world, width = self.plan.partition.world_size, len(_HEADER)
        peers = [r for r in self.plan.partition.group_of(self._rank) if r != self._rank]
        splits = [width if r in peers else 0 for r in range(world)]
        outgoing = torch.tensor([[*header, plan.send_splits[r]] for r in peers], dtype=torch.int64).reshape(-1)
        incoming = torch.empty(len(peers) * width, dtype=torch.int64)
        try:
            work = dist.all_to_all_single(incoming, outgoing, splits, splits, group=self._control, async_op=True)
            wait_work(work, True, lambda: self._closed)
        except LoaderClosedError:
            raise
        except RuntimeError as error:
            raise self._stopped(header, error) from error
        for peer, theirs in zip(peers, incoming.view(-1, width).tolist()):
            expected = [*header, plan.recv_splits[peer]]
            # the same epoch cut otherwise (not a rank that ran fewer batches at the same size)
            cut_otherwise = theirs[4] != header[4] or (theirs[1] == header[1] and theirs[5] != header[5])
            if cut_otherwise and (theirs[0], theirs[3]) == (header[0], header[3]):
                raise ExchangeError(
                    f"gpuload: rank {self._rank} makes batch {header[1] + 1} of epoch {header[0]} at batch "
                    f"size {header[4]} (from sample {header[5]} of its epoch order) but rank {peer} makes "
                    f"batch {theirs[1] + 1} at batch size {theirs[4]} (from sample {theirs[5]}): "
                    "set_batch_size was called on some ranks only, at different batches or with different "
                    "sizes. With a split cache, call loader.set_batch_size(n) on every rank at the same "
                    "batch with the same n (agree on n with dist.all_reduce first; README: Multi-GPU and "
                    "multi-node)"
                )
            if theirs[:-1] != expected[:-1]:
                raise ExchangeError(
                    f"gpuload: rank {self._rank} is at batch {header[1] + 1} of {header[2]} of epoch "
                    f"{header[0]} (seed {header[3]}) but rank {peer} is at batch {theirs[1] + 1} of "
                    f"{theirs[2]} of epoch {theirs[0]} (seed {theirs[3]}): the ranks ran different numbers "
                    "of batches (one stopped an epoch early) or their samplers differ (set_epoch on every "
                    "rank). With a split cache every rank runs every batch of each epoch; to stop early, "
                    "stop all ranks at the same batch (README: Multi-GPU and multi-node)" + (
                        f". Rank {self._rank} cuts its batches at batch size {header[4]}, rank {peer} at batch "
                        f"size {theirs[4]}: set_batch_size must be called on every rank at the same batch"
                        if theirs[4] != header[4] else "")
                )
            if theirs[-1] != expected[-1]:
                raise ExchangeError(
                    f"gpuload: rank {peer} sends {theirs[-1]} rows at batch {header[1] + 1} of epoch "
                    f"{header[0]} where rank {self._rank} planned {expected[-1]}: the ranks' datasets "
                    "or samplers differ"
                )

    def _stopped(self, header: tuple[int, ...], error: Exception) -> ExchangeError:
        timeout = exchange_timeout().total_seconds()
        return ExchangeError(
            f"gpuload: rank {self._rank} waited (up to {timeout:g} s, {EXCHANGE_TIMEOUT_ENV}) for the "
            f"other ranks at batch {header[1] + 1} of {header[2]} of epoch {header[0]} "
            f"at batch size {header[4]} (cache_scope={self.plan.decision.scope}) and they did not come: a "
            "rank stopped this epoch early (a break, an exception) or died, or the ranks' set_batch_size "
            "calls differ (a rank that did not make this one may have ended the epoch already). With a "
            "sharded cache every rank runs every batch of each epoch; to stop early or change the batch "
            "size, do it on all ranks at the same batch (README: Multi-GPU and multi-node). "
            f"Cause: {error}"
        )


class ArrayRows(RowFormat):
    """Rows of fixed-shape arrays (``like``: one tensor per array, any rows), each row packed as
    the bytes of every array's row in turn, so a step carries every array at once. ``staging``:
    the loader's route to the device for the order that puts a step's rows back."""

    def __init__(self, like: list[torch.Tensor], staging: Staging | None = None) -> None:
        self.staging = staging
        self._shapes = [(tuple(c.shape[1:]), c.dtype) for c in like]
        self._row_bytes = [math.prod(c.shape[1:]) * c.element_size() for c in like]
        self.width = sum(self._row_bytes)

    def sizes(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.full((positions.numel(),), self.width, dtype=torch.int64)

    def encode(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([_as_bytes(column) for column in rows], dim=1).reshape(-1)

    def decode(self, data: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor) -> list[torch.Tensor]:
        """One contiguous tensor per array (each its own allocation: aligned for its dtype)."""
        grouped = data.view(positions.numel(), self.width)
        leaves, offset = [], 0
        for (shape, dtype), row_bytes in zip(self._shapes, self._row_bytes):
            rows = grouped[:, offset : offset + row_bytes].clone(memory_format=torch.contiguous_format)
            leaves.append(rows.view(dtype).view(rows.shape[0], *shape))
            offset += row_bytes
        return leaves

    def in_order(self, arrived: list[torch.Tensor], local: list[torch.Tensor],
                 inverse: torch.Tensor) -> list[torch.Tensor]:
        if arrived and arrived[0].is_cuda:
            (inverse,) = to_device([inverse], arrived[0].device, self.staging)
        return [torch.cat([a, b]).index_select(0, inverse) for a, b in zip(arrived, local)]


def array_share(
    block: list[torch.Tensor], plan: SplitPlan, device: torch.device, *, owner: Hashable, ledger: BudgetLedger = LEDGER,
    staging: Staging | None = None,
) -> TieredArrayStore:
    """This rank's rows of every array (``block``: rows ``plan.partition.rows_of(rank)``, in
    order) held whole in ``device``'s tier of a :class:`TieredArrayStore` (a copy booked in
    ``ledger`` under ``owner`` on CUDA; on a CPU device the block itself). A share that does not
    fit is an :class:`ExchangeError`: other ranks read their rows from it, so no row may fall
    back to another tier."""
    rows = block[0].shape[0]
    bytes_per_sample = sum(math.prod(c.shape[1:]) * c.element_size() for c in block)
    tier = TierPlan("device", 0, rows, bytes_per_sample)
    share = CachePlan(mode="device", target=device.type, bytes_per_sample=bytes_per_sample, num_samples=rows,
                      tiers=(tier,), budget=tier.bytes, reserve=0, host_reserve=0, device_free=0, device_total=None,
                      host_free=0, host_total=None, notes=(f"rank {plan.rank}'s share of a dataset split over ranks",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheFallbackWarning)  # said below, as the exchange's error
        store = TieredArrayStore(block, share, device, ledger=ledger, owner=owner, staging=staging)
    if store.stats.fallbacks:
        store.close()
        raise ExchangeError(
            f"gpuload: out of memory placing rank {plan.rank}'s share of the dataset "
            f"({format_bytes(tier.bytes)}) on {device}; lower the model's memory, use "
            "cache_scope='world' (smaller shares) or 'rank'"
        )
    return store


def split_array_store(
    block: list[torch.Tensor], plan: SplitPlan, device: torch.device, groups: tuple[Any, Any], *,
    owner: Hashable, ledger: BudgetLedger = LEDGER, staging: Staging | None = None,
) -> SplitStore:
    """The exchange over this rank's ``block`` of every array (rows ``plan.partition.rows_of``,
    in row order, read by the caller or sliced from whole arrays); ``staging``: the loader's
    route to the device for the indices each step moves there."""
    start, stop = plan.partition.rows_of(plan.rank)
    inner = array_share(block, plan, device, owner=owner, ledger=ledger, staging=staging)
    rows = ArrayRows(block, staging)
    return SplitStore(inner, rows, plan, device, groups, share_bytes=(stop - start) * rows.width)


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as a contiguous uint8 matrix, one row of raw bytes per sample."""
    return rows.contiguous().reshape(rows.shape[0], math.prod(rows.shape[1:])).view(torch.uint8)
