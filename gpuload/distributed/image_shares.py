"""A rank's share of an image dataset's decoded images, and the ragged exchange of each batch.

When ``cache_scope`` splits the dataset (the same partition and decision as for arrays, from
the decoded size the headers of a few files estimate), each rank reads and decodes its block of
images once, whole, before its first epoch (:func:`split_images`), and keeps them packed as
bytes, in their decoded memory layout. The ranks then swap one table, once: every image's
decoded shape and whether its file was bad. From it and the epoch's index order every rank
computes, for each step, how many bytes it sends to and receives from each rank (images differ
in size), so no message is spent deciding who sends what; the step itself is one
``all_to_all_single`` of bytes (a :class:`~gpuload.distributed.split_store.SplitStore` over
the :class:`DecodedShare`, rows as :class:`ImageRows`). The transforms then run on the
receiving rank as on the unsplit path.

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
from gpuload.cache.store import Store, StreamGuard
from gpuload.distributed.group import DistributedContext, ExchangeError, loader_identity, peers_answer, release_groups
from gpuload.distributed.split_store import (
    RowFormat,
    SplitPlan,
    SplitStore,
    agree_on_split,
    decline_split,
    split_context,
    split_obstacle,
)

__all__ = ["BadFile", "DecodedShare", "ExchangedImages", "ImageRows", "ReadImages", "SplitImages", "WholeImages",
           "image_share", "read_share", "split_images"]

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


class DecodedShare(Store):
    """This rank's block of decoded images, packed as bytes on ``device``, by share row.

    ``views[k]``: the bytes of block row ``k`` (None for a bad file); ``shapes[k]``: its
    stored shape and layout; ``start``: the dataset position of row 0 and ``name(position)``
    the file, for messages; ``read_s``: the time the block took to decode. On CUDA the block is
    booked in ``ledger`` under ``owner`` (by :func:`split_images`) until :meth:`close`.
    """

    def __init__(
        self, chunks: list[torch.Tensor], views: list[torch.Tensor | None], shapes: list[tuple[int, ...]],
        device: torch.device, *, start: int, name: Callable[[int], str], owner: Hashable,
        ledger: BudgetLedger = LEDGER, read_s: float = 0.0,
    ) -> None:
        self.device = device
        self._chunks, self._views, self._shapes = chunks, views, shapes
        self._start, self._name, self._owner, self._ledger = start, name, owner, ledger
        self.read_s = read_s
        self.nbytes = sum(chunk.numel() for chunk in chunks)
        self._rows = sum(view is not None for view in views)
        self._streams = StreamGuard(device)
        self._closed = False

    @property
    def stats(self) -> StoreStats:
        rows = self._rows if not self._closed else 0
        return StoreStats(device_samples=rows, device_bytes=self.device_bytes, fill_bytes=self.device_bytes)

    @property
    def device_bytes(self) -> int:
        return self.nbytes if self.device.type == "cuda" and not self._closed else 0

    @property
    def closed(self) -> bool:
        return self._closed

    def gather(self, indices: Any) -> list[torch.Tensor]:
        """The decoded images of share rows ``indices`` (CHW views, as the decoder gave them);
        ``IndexError`` for a bad file."""
        if self._closed:
            raise RuntimeError("this gpuload.DataLoader was closed; iterate a new loader instead")
        self._streams.use()
        images = []
        for row in torch.as_tensor(indices).reshape(-1).tolist():
            view = self._views[row]
            if view is None:
                raise IndexError(f"dataset index {row + self._start} is a bad file: {self._name(row + self._start)}")
            images.append(_image(view, self._shapes[row]))
        return images

    def shrink(self, max_device_bytes: int) -> int:
        return 0  # the wrapper says why a share cannot shrink on one rank

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._streams.replaced(self._chunks)  # reserved until every stream that read them is done
        self._chunks, self._views = [], [None] * len(self._views)
        if self.device.type == "cuda":
            self._ledger.release(self._owner)


def _image(data: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes of an image as the decoder gave it; ``shape``: its stored shape and layout."""
    image = data.view(shape[:3])
    return image.permute(2, 0, 1) if shape[3] == _STORED_HWC else image


class ImageRows(RowFormat):
    """Decoded images as exchanged: ragged rows sized from the table of every image's stored
    shape, layout and status (the same on every rank).

    ``table``: (images, 5) int64 rows of status, stored shape, layout; ``bad``: every bad file
    as ``position -> (backend, reason)``; ``on_error``: ``"skip"`` or ``"raise"``;
    ``name(position)``: the file, for messages; ``failure(bad files of this rank's batch, in
    batch order)``: the error this rank raises for them (the unsplit path's).
    """

    def __init__(
        self, table: torch.Tensor, bad: dict[int, tuple[str, str]], *, on_error: str,
        name: Callable[[int], str], failure: Callable[[list[BadFile]], Exception],
    ) -> None:
        self.shapes = [tuple(row[1:]) for row in table.tolist()]
        self._good = table[:, 0] == _GOOD
        self._sizes = table[:, 1:4].prod(dim=1) * self._good
        self.bad, self._on_error, self._name, self._failure = bad, on_error, name, failure

    def sizes(self, positions: torch.Tensor) -> torch.Tensor:
        return self._sizes[positions]

    def encode(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([_stored(image)[0].reshape(-1) for image in rows])

    def decode(self, data: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor) -> list[torch.Tensor]:
        return [_image(part, self.shapes[p]) for part, p in zip(data.split(sizes.tolist()), positions.tolist())]

    def in_order(self, arrived: list[torch.Tensor], local: list[torch.Tensor],
                 inverse: torch.Tensor) -> list[torch.Tensor]:
        grouped = arrived + local
        return [grouped[g] for g in inverse.tolist()]

    def screen(self, batches: list[torch.Tensor], rank: int, header: tuple[int, ...]) -> list[torch.Tensor]:
        """Every rank's batch without its bad files; with ``on_error="raise"``, the step's error
        on every rank instead when any rank's batch holds one."""
        if not self.bad:
            return batches
        kept = [batch[self._good[batch]] for batch in batches]
        if self._on_error == "skip" or all(k.numel() == b.numel() for k, b in zip(kept, batches)):
            return kept
        mine = batches[rank]
        if kept[rank].numel() < mine.numel():
            raise self._failure(self._bad_in(mine))
        theirs = next(r for r, (k, b) in enumerate(zip(kept, batches)) if k.numel() < b.numel())
        position, backend, reason = self._bad_in(batches[theirs])[0]
        raise ExchangeError(
            f"gpuload: rank {theirs}'s batch {header[1] + 1} of epoch {header[0]} holds image "
            f"{self._name(position)!r} (sample index {position}), which could not be "
            f"{'read' if backend == 'read' else 'decoded'}: {reason}. With on_error='raise' every rank "
            f"stops at that batch (rank {theirs} raises the file's error); pass on_error='skip' to skip "
            "bad samples and count them"
        )

    def _bad_in(self, batch: torch.Tensor) -> list[BadFile]:
        return [(p, *self.bad[p]) for p in batch.tolist() if p in self.bad]

    def item(self, rows: list[torch.Tensor], kept: torch.Tensor, drawn: torch.Tensor) -> ExchangedImages:
        skipped = self._bad_in(drawn) if kept.numel() < drawn.numel() else []
        return ExchangedImages(rows, kept.tolist(), skipped)


class SplitImages:
    """This rank's share of the decoded images (``store``) as the image source holds it: what
    it reports of it, as :class:`~gpuload.sources.image_cache.CachedImages` does of a cache."""

    cache = None  # no image cache to read from or fill: a batch's images come over the exchange
    keeps = ""

    def __init__(self, store: SplitStore) -> None:
        self.store = store

    @property
    def path(self) -> str:
        return self.store.plan.kind

    def describe(self) -> str:
        """For ``loader.stats.extra["image_cache_decision"]``."""
        plan = self.store.plan
        return f"{plan.kind}: {plan.describe()}; decoded here: {format_bytes(self.store.share_bytes)}"

    def begin_epoch(self, keepable: Any) -> None:
        """Nothing to give back: a share cannot shrink on one rank (``SplitStore.shrink``)."""

    def summary(self) -> dict[str, Any]:
        """For ``loader.stats.extra["cache"]``: this rank's share of the decoded images."""
        store = self.store
        start, stop = store.plan.partition.rows_of(store.plan.rank)
        share, rows = store.inner, store.rows
        return {"kind": "images", "mode": "decoded", "scope": store.plan.decision.scope,
                "entries": store.stats.device_samples, "bytes": store.share_bytes, "rows": [start, stop],
                "num_samples": store.plan.partition.num_samples, "bad_files": len(getattr(rows, "bad", ())),
                "hits": store.stats.device_hits, "read_s": getattr(share, "read_s", 0.0),
                "complete": not store.closed}

    def entries(self) -> dict[str, Any]:
        return {"cache": self.summary()}

    def close(self) -> dict[str, Any]:
        """Drop the share; its summary as released."""
        self.store.close()
        return dict(self.summary(), released=True)


def image_share(
    chunks: list[torch.Tensor], views: list[torch.Tensor | None], table: torch.Tensor, bad: dict[int, tuple[str, str]],
    plan: SplitPlan, device: torch.device, groups: tuple[Any, Any], *, on_error: str, name: Callable[[int], str],
    failure: Callable[[list[BadFile]], Exception], owner: Hashable, ledger: BudgetLedger = LEDGER, read_s: float = 0.0,
) -> SplitStore:
    """The exchange over this rank's block of decoded images (``views``: each share row's bytes
    in ``chunks``, None for a bad file; ``table``: every image's status, stored shape, layout)."""
    rows = ImageRows(table, bad, on_error=on_error, name=name, failure=failure)
    start, stop = plan.partition.rows_of(plan.rank)
    inner = DecodedShare(chunks, views, rows.shapes[start:stop], device, start=start, name=name, owner=owner,
                         ledger=ledger, read_s=read_s)
    return SplitStore(inner, rows, plan, device, groups, share_bytes=inner.nbytes)


def split_images(
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
) -> SplitImages | None:
    """This rank's share of the decoded images when the scope splits them, else None.

    ``estimate()``: the decoded bytes of the whole dataset (from a few headers); ``room()``: the
    bytes a share may take on this rank; ``read`` reads and decodes this rank's block in chunks
    of ``chunk_size`` positions. Every rank must call this at the same point, as for arrays.
    """
    context = split_context(settings, device, context, loader_identity(num_images, batch_sampler))
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
    found = read_share(plan, context, groups[0], settings, device, limit=limit, read=read, chunk_size=chunk_size,
                       on_error=on_error, name=name, failure=failure, owner=owner, ledger=ledger)
    if found is None:
        release_groups(groups)
        return None
    share, rows = found
    return SplitImages(SplitStore(share, rows, plan, device, groups, share_bytes=share.nbytes))


def read_share(
    plan: SplitPlan, context: DistributedContext, control: Any, settings: CacheSettings, device: torch.device, *,
    limit: int, read: ReadImages, chunk_size: int, on_error: str, name: Callable[[int], str],
    failure: Callable[[list[BadFile]], Exception], owner: Hashable, ledger: BudgetLedger = LEDGER,
) -> tuple[DecodedShare, ImageRows] | None:
    """This rank's block of ``plan``'s images read and decoded (``read``, in chunks of
    ``chunk_size`` positions, at most ``limit`` bytes), and how every rank's images travel,
    from one swap of every image's shape over ``control``; None when a rank's block did not fit
    or could not be read (every rank learns it in that swap, and warns). Every rank of the
    plan calls this at the same point; the caller owns the exchange's groups."""
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
    table, outcomes = _swap_tables(plan, context, control, outcome, block)
    failed = [(rank, code) for rank, code in enumerate(outcomes) if code != _OK]
    if failed:
        block = None
        if on_cuda:
            ledger.release(owner, device=device)
        rank, code = failed[0]
        first, end = plan.partition.rows_of(rank)
        what = (f"rank {rank}'s share of the decoded images (rows [{first}, {end})) does not fit its room "
                f"({format_bytes(limit)})" if code == _TOO_BIG else
                f"rank {rank} could not read its share of the images (rows [{first}, {end}))")
        decline_split(settings, what + (f": {why}" if rank == context.rank and why else ""), stacklevel=8)
        return None
    assert block is not None  # every rank read its share, this one too
    chunks, views, _, bad = block
    if bool((table[:, 0] == _BAD).any()):
        everyone: list[Any] = [None] * context.world_size
        dist.all_gather_object(everyone, bad, group=control)
        for theirs in everyone:
            bad.update(theirs)
    rows = ImageRows(table, bad, on_error=on_error, name=name, failure=failure)
    share = DecodedShare(chunks, views, rows.shapes[start:stop], device, start=start, name=name, owner=owner,
                         ledger=ledger, read_s=read_s)
    if on_cuda:
        ledger.reserve(share.nbytes, owner, device=device)
        ledger.set_used(owner, share.nbytes, device=device)
        # Once, before any step: the exchange reads the share on whichever stream it runs on
        # (the prefetcher's side stream), so the decoding and packing must be done by then.
        torch.cuda.current_stream(device).synchronize()
    return share, rows


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
    plan: SplitPlan, context: DistributedContext, control: Any, outcome: int, block: _Block | None
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
    with peers_answer(f"gpuload: rank {context.rank} read its share of the images but another rank did not report "
                      "its own (it stopped or died)."):
        dist.all_gather(everyone, mine, group=control)
    table = torch.zeros((partition.num_samples, _COLUMNS), dtype=torch.int64)
    for rank, theirs in enumerate(everyone):
        first, end = partition.rows_of(rank)
        table[first:end] = theirs[1:].view(widest, _COLUMNS)[: end - first]
    return table, [int(theirs[0]) for theirs in everyone]
