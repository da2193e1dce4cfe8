"""A rank's share of an image dataset's decoded images, and the ragged exchange of each batch.

When ``cache_scope`` splits the dataset (the same partition and decision as for arrays, from
the decoded size the headers of a few files estimate), each rank reads and decodes its block of
images once, whole, before its first epoch (:func:`shard_images`), and keeps them packed as
bytes, in their decoded memory layout. The ranks then swap one table, once: every image's
decoded shape and whether its file was bad. From it and the epoch's index order every rank
computes, for each step, how many bytes it sends to and receives from each rank (images differ
in size), so no message is spent deciding who sends what; the step itself is one
``all_to_all_single`` of bytes (:class:`ShardedImageStore`, on the exchange pieces the arrays
use). The transforms then run on the receiving rank as on the unsplit path.

Reading the block up front (not decoding each image for the batch that first needs it) keeps
every step's sizes known before any step runs, including a file that turns out corrupt only
when decoded, and measured no slower: the decoding is the same work, done in batches. The
block is checked against the room (the device cache room on CUDA, the host room on a CPU
device) as it fills; a rank whose share does not fit, or whose read failed, makes all ranks
fall back together to each rank's own image cache, with a warning when a split was asked for.

Bad files behave as on the unsplit path on every rank: with ``on_error="skip"`` each rank's
batch leaves them out (and the reader counts them, named); with ``"raise"`` every rank stops
at the step where any rank's batch holds one: that rank raises the decoder's error naming the
file, the others an :class:`ExchangeError` naming the file and the rank, so no rank waits for
another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpuload.cache import LEDGER, CacheSettings, StoreStats, format_bytes
from gpuload.cache.budget import BudgetLedger
from gpuload.distributed.exchange_plan import plan_step
from gpuload.distributed.group import DistributedContext, ExchangeError, release_groups
from gpuload.distributed.sharded_store import (
    ShardExchange,
    ShardPlan,
    agree_on_split,
    decline_split,
    split_context,
    split_obstacle,
)

__all__ = ["BadFile", "ExchangedImages", "ReadImages", "ShardedImageStore", "WholeImages", "shard_images"]

BadFile = tuple[int, str, str]
"""``(dataset position, backend, reason)`` of a file that could not be read (backend
``"read"``) or decoded."""


@dataclass
class WholeImages:
    """Some files read and decoded whole: the kept images with their positions, and the bad ones."""

    positions: list[int]
    images: list[torch.Tensor]
    bad: list[BadFile] = field(default_factory=list)


#: Reads and decodes the files of some dataset positions, whole, skipping bad ones.
ReadImages = Callable[[list[int]], WholeImages]

_OK, _FAILED, _TOO_BIG = 0, 1, 2
_GOOD, _BAD = 0, 1
_COLUMNS = 5  # per image: status, stored shape (3 numbers), layout
_AS_STORED, _STORED_HWC = 0, 1  # layout: the stored shape is the image's, or (H, W, C) of a (C, H, W) view


@dataclass
class ExchangedImages:
    """One step's batch of this rank: its images in batch order (whole, decoded), their dataset
    positions, and the bad files its batch held (left out, ``on_error="skip"``)."""

    images: list[torch.Tensor]
    positions: list[int]
    skipped: list[BadFile]


class ShardedImageStore(ShardExchange):
    """This rank's block of decoded images, packed as bytes on ``device``, and the table of
    every image's stored shape, layout and status (the same on every rank).

    ``views[k]``: the bytes of block row ``k`` (None for a bad file); ``table``: (images, 5)
    int64 rows of status, stored shape, layout; ``bad``: every bad file as ``position ->
    (backend, reason)``; ``on_error``: ``"skip"`` or ``"raise"``; ``name(position)``: the file,
    for messages; ``failure(bad files of this rank's batch, in batch order)``: the error this
    rank raises for them (the unsplit path's); ``read_s``: the time the block took to decode.
    """

    def __init__(
        self,
        chunks: list[torch.Tensor],
        views: list[torch.Tensor | None],
        table: torch.Tensor,
        bad: dict[int, tuple[str, str]],
        plan: ShardPlan,
        device: torch.device,
        groups: tuple[Any, Any],
        *,
        on_error: str,
        name: Callable[[int], str],
        failure: Callable[[list[BadFile]], Exception],
        owner: Hashable,
        ledger: BudgetLedger = LEDGER,
        read_s: float = 0.0,
    ) -> None:
        super().__init__(plan, device, groups, owner=owner, ledger=ledger)
        self._chunks, self._views = chunks, views
        self.read_s = read_s  # seconds this rank spent reading and decoding its block
        self._shapes = [tuple(row[1:4]) for row in table.tolist()]
        self._layouts = table[:, 4].tolist()
        self._good = table[:, 0] == _GOOD
        self._sizes = table[:, 1:4].prod(dim=1) * self._good
        self._bad, self._on_error, self._name, self._failure = bad, on_error, name, failure
        self._nbytes = sum(chunk.numel() for chunk in chunks)
        self._rows = sum(view is not None for view in views)

    @property
    def shard_bytes(self) -> int:
        """Bytes of decoded images this rank holds."""
        return self._nbytes if not self._closed else 0

    @property
    def stats(self) -> StoreStats:
        """The share as a cache tier (``device_bytes`` counts only what is held on CUDA)."""
        rows = self._rows if not self._closed else 0
        held = self.shard_bytes if self.device.type == "cuda" else 0
        return StoreStats(device_samples=rows, device_bytes=held, fill_bytes=held, device_hits=self._hits)

    def summary(self) -> dict[str, Any]:
        """For ``loader.stats.extra["cache"]``: this rank's share of the decoded images."""
        start, stop = self.plan.partition.rows_of(self._rank)
        return {"kind": "images", "mode": "decoded", "scope": self.plan.decision.scope,
                "entries": self.stats.device_samples, "bytes": self.shard_bytes, "rows": [start, stop],
                "num_samples": self.plan.partition.num_samples, "bad_files": len(self._bad),
                "hits": self._hits, "read_s": self.read_s, "complete": not self._closed}

    def _share_tensors(self) -> list[torch.Tensor]:
        return self._chunks if self.device.type == "cuda" else []

    def _drop(self) -> None:
        self._chunks, self._views = [], [None] * len(self._views)

    def gather(self, indices: Any) -> list[torch.Tensor]:
        """The decoded images of this rank's share at dataset ``indices`` (CHW views, as the
        decoder gave them); ``IndexError`` for a bad file or an index outside the share."""
        images = []
        for row in self._share_positions(indices).tolist():
            view = self._views[row]
            if view is None:
                raise IndexError(f"dataset index {row + self._start} is a bad file: {self._name(row + self._start)}")
            images.append(self._image(view, row + self._start))
        return images

    def _image(self, data: torch.Tensor, position: int) -> torch.Tensor:
        """Bytes of ``position``'s image as the decoder gave it (shape and memory layout)."""
        image = data.view(self._shapes[position])
        return image.permute(2, 0, 1) if self._layouts[position] == _STORED_HWC else image

    def _screen(self, batches: list[torch.Tensor], header: tuple[int, ...]) -> list[torch.Tensor]:
        """Every rank's batch without its bad files; with ``on_error="raise"``, the step's error
        on every rank instead when any rank's batch holds one."""
        if not self._bad:
            return batches
        kept = [batch[self._good[batch]] for batch in batches]
        if self._on_error == "skip" or all(k.numel() == b.numel() for k, b in zip(kept, batches)):
            return kept
        mine = batches[self._rank]
        if kept[self._rank].numel() < mine.numel():
            raise self._failure(self._bad_in(mine))
        rank = next(r for r, (k, b) in enumerate(zip(kept, batches)) if k.numel() < b.numel())
        position, backend, reason = self._bad_in(batches[rank])[0]
        raise ExchangeError(
            f"gpuload: rank {rank}'s batch {header[1] + 1} of epoch {header[0]} holds image "
            f"{self._name(position)!r} (sample index {position}), which could not be "
            f"{'read' if backend == 'read' else 'decoded'}: {reason}. With on_error='raise' every rank "
            f"stops at that batch (rank {rank} raises the file's error); pass on_error='skip' to skip "
            "bad samples and count them"
        )

    def _bad_in(self, batch: torch.Tensor) -> list[BadFile]:
        return [(p, *self._bad[p]) for p in batch.tolist() if p in self._bad]

    def _step(self, batches: list[torch.Tensor], header: tuple[int, ...], slot: int) -> ExchangedImages:
        """This rank's batch of whole images: the ones other ranks hold come in one ragged
        ``all_to_all_single`` of bytes, sized from the table (on CUDA ordered on the current
        stream, like the arrays' exchange)."""
        mine = batches[self._rank]
        kept = self._screen(batches, header)
        plan = plan_step(self._rank, kept, self.plan.partition)
        began = time.perf_counter()
        self._check_peers(plan, header)
        grouped = torch.empty_like(kept[self._rank])
        grouped[plan.inverse] = kept[self._rank]  # batch rows in the order they arrive
        incoming = grouped[: plan.received]
        recv_sizes = self._sizes[incoming]
        send_rows = plan.send_rows.tolist()
        send_bytes = [int(part.sum()) for part in self._sizes[plan.send_rows + self._start].split(plan.send_splits)]
        recv_bytes = [int(part.sum()) for part in recv_sizes.split(plan.recv_splits)]
        views = self._views
        if send_rows:
            outgoing = torch.cat([views[row] for row in send_rows])
        else:
            outgoing = torch.empty(0, dtype=torch.uint8, device=self.device)
        received = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=self.device)
        self._swap(received, outgoing, recv_bytes, send_bytes, header)
        arrived = [self._image(data, p) for data, p in zip(received.split(recv_sizes.tolist()), incoming.tolist())]
        local = [self._image(views[row], row + self._start) for row in plan.local_rows.tolist()]
        in_order = arrived + local
        images = [in_order[g] for g in plan.inverse.tolist()]
        self._count(slot, plan, sum(send_bytes), sum(recv_bytes), began)
        skipped = self._bad_in(mine) if kept[self._rank].numel() < mine.numel() else []
        return ExchangedImages(images, kept[self._rank].tolist(), skipped)


def shard_images(
    num_images: int,
    settings: CacheSettings,
    device: torch.device,
    batch_sampler: Any,
    owner: Hashable,
    *,
    estimate: Callable[[], int],
    room: Callable[[], int],
    read: ReadImages,
    chunk_size: int,
    on_error: str,
    name: Callable[[int], str],
    failure: Callable[[list[BadFile]], Exception],
    context: DistributedContext | None = None,
    ledger: BudgetLedger = LEDGER,
) -> ShardedImageStore | None:
    """This rank's share of the decoded images when the scope splits them, else None.

    ``estimate()``: the decoded bytes of the whole dataset (from a few headers); ``room()``: the
    bytes a share may take on this rank; ``read`` reads and decodes this rank's block in chunks
    of ``chunk_size`` positions. Every rank must call this at the same point, as for arrays.
    """
    context = split_context(settings, device, context)
    if context is None:
        return None
    why_not = split_obstacle(settings, batch_sampler, num_images, context) or settings.off_reason()
    if why_not is None and num_images == 0:
        why_not = "the dataset is empty"
    if why_not is not None:
        decline_split(settings, why_not, stacklevel=7)
        return None
    limit = room()
    per_image = -(-estimate() // num_images)
    agreed = agree_on_split(settings, device, batch_sampler, owner, context, num_images, per_image, room=limit)
    if agreed is None:
        return None
    plan, groups = agreed
    start, stop = plan.partition.rows_of(context.rank)
    on_cuda = device.type == "cuda"
    if on_cuda:
        ledger.reserve(limit, owner, device=device)
    began = time.perf_counter()
    try:
        outcome, why, block = _read_block(read, start, stop, chunk_size, limit, device)
    except Exception as error:  # noqa: BLE001 - the unsplit path meets it again, at that batch
        outcome, why, block = _FAILED, f"{type(error).__name__}: {error}", None
    read_s = time.perf_counter() - began
    control = groups[0]
    table, outcomes = _swap_tables(plan, context, control, outcome, block)
    failed = [(rank, code) for rank, code in enumerate(outcomes) if code != _OK]
    if failed:
        block = None
        if on_cuda:
            ledger.release(owner, device=device)
        release_groups(groups)
        rank, code = failed[0]
        first, end = plan.partition.rows_of(rank)
        what = (f"rank {rank}'s share of the decoded images (rows [{first}, {end})) does not fit its room "
                f"({format_bytes(limit)})" if code == _TOO_BIG else
                f"rank {rank} could not read its share of the images (rows [{first}, {end}))")
        decline_split(settings, what + (f": {why}" if rank == context.rank and why else ""), stacklevel=7)
        return None
    chunks, views, _, bad = block
    if bool((table[:, 0] == _BAD).any()):
        everyone: list[Any] = [None] * context.world_size
        dist.all_gather_object(everyone, bad, group=control)
        for theirs in everyone:
            bad.update(theirs)
    store = ShardedImageStore(chunks, views, table, bad, plan, device, groups, on_error=on_error, name=name,
                              failure=failure, owner=owner, ledger=ledger, read_s=read_s)
    if on_cuda:
        ledger.reserve(store.shard_bytes, owner, device=device)
        ledger.set_used(owner, store.shard_bytes, device=device)
        # Once, before any step: the exchange reads the share on whichever stream it runs on
        # (the prefetcher's side stream), so the decoding and packing must be done by then.
        torch.cuda.current_stream(device).synchronize()
    return store


#: A rank's block: the packed chunks, each row's bytes (None: bad file), each row's stored
#: shape and layout (None: bad file), the bad files.
_Block = tuple[list[torch.Tensor], list[torch.Tensor | None], list[tuple[int, ...] | None], dict[int, tuple[str, str]]]


def _read_block(
    read: ReadImages, start: int, stop: int, chunk_size: int, limit: int, device: torch.device
) -> tuple[int, str, _Block | None]:
    """``(outcome, why, block)`` for rows ``[start, stop)``: each chunk's images packed in one
    buffer, ``views[k]`` row ``k``'s bytes in it; stops at ``limit`` bytes."""
    chunks: list[torch.Tensor] = []
    views: list[torch.Tensor | None] = [None] * (stop - start)
    shapes: list[tuple[int, ...] | None] = [None] * (stop - start)
    bad: dict[int, tuple[str, str]] = {}
    held = 0
    for first in range(start, stop, max(chunk_size, 1)):
        found = read(list(range(first, min(first + chunk_size, stop))))
        for position, backend, reason in found.bad:
            bad[position] = (backend, reason)
        if not found.images:
            continue
        if any(image.dim() != 3 for image in found.images):
            raise ValueError("the decoder gave an image that is not (channels, height, width)")
        stored = [_stored(image) for image in found.images]
        held += sum(image.numel() for image, _ in stored)
        if held > limit:
            return _TOO_BIG, f"{format_bytes(held)} read so far", None
        chunk = torch.cat([image.reshape(-1) for image, _ in stored]).to(device)
        chunks.append(chunk)
        offset = 0
        for position, (image, layout) in zip(found.positions, stored):
            views[position - start] = chunk[offset : offset + image.numel()]
            shapes[position - start] = (*image.shape, layout)
            offset += image.numel()
    return _OK, "", (chunks, views, shapes, bad)


def _stored(image: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``image`` as stored, and its layout: itself when contiguous, its (H, W, C) when it is a
    (C, H, W) view of one (DALI's HWC output: the batch keeps the decoder's memory layout),
    else a contiguous copy."""
    if not image.is_contiguous() and image.permute(1, 2, 0).is_contiguous():
        return image.permute(1, 2, 0), _STORED_HWC
    return image.contiguous(), _AS_STORED


def _swap_tables(
    plan: ShardPlan, context: DistributedContext, control: Any, outcome: int, block: _Block | None
) -> tuple[torch.Tensor, list[int]]:
    """Every image's (status, stored shape, layout) row and every rank's read outcome, from one
    gloo ``all_gather`` of each rank's block (padded to the largest block)."""
    partition = plan.partition
    widest = max(stop - start for start, stop in map(partition.rows_of, range(partition.group_size)))
    start, stop = partition.rows_of(context.rank)
    rows = torch.zeros((widest, _COLUMNS), dtype=torch.int64)
    if block is not None:
        rows[: stop - start, 0] = _BAD
        for row, shape in enumerate(block[2]):
            if shape is not None:
                rows[row] = torch.tensor([_GOOD, *shape])
    mine = torch.cat([torch.tensor([outcome], dtype=torch.int64), rows.reshape(-1)])
    everyone = [torch.empty_like(mine) for _ in range(context.world_size)]
    try:
        dist.all_gather(everyone, mine, group=control)
    except RuntimeError as error:
        raise ExchangeError(
            f"gpuload: rank {context.rank} read its share of the images but another rank did not report "
            f"its own (it stopped or died). Cause: {error}"
        ) from error
    table = torch.zeros((partition.num_samples, _COLUMNS), dtype=torch.int64)
    for rank, theirs in enumerate(everyone):
        first, end = partition.rows_of(rank)
        table[first:end] = theirs[1:].view(widest, _COLUMNS)[: end - first]
    return table, [int(theirs[0]) for theirs in everyone]
