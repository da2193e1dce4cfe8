"""A rank's share of a map-style dataset's samples, read once and exchanged like arrays.

When ``cache_scope`` splits the dataset (the same decision as for arrays, from the sample's
bytes as the probe read them) and the samples read the same twice and collate to fixed-shape
tensor columns (``gpuload.cache.columns``), each rank reads only its partition's rows, once,
and keeps them by column in a store the arrays' exchange wraps (``split_store.split_array_store``).
Every batch then comes over the arrays' exchange and is rebuilt in the structure torch's
``default_collate`` gives. Otherwise (random samples, leaves that are not fixed-shape columns,
a custom ``collate_fn``, whatever stops arrays from splitting) each rank keeps its own sample
cache as before, with a warning when a split was asked for.

With ``cache_dir``, a rank reads its rows from the disk tier where it has them (the entry the
unsplit sample cache uses, keyed by the dataset's fingerprint) and writes the rows it reads
from the dataset there: the node's ranks fill one copy between them, each its own rows, and a
later job (any scope) reads none of them from the dataset.

The probe sees a few samples only: one whose structure, dtype or shape differs from them shows
up while a rank reads its block, after the ranks agreed to split. The ranks then agree once
more (one small gloo ``all_gather`` after every read) and fall back all together; a read that
raised falls back too, and raises again when torch's path reaches that sample's batch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from gpuload.cache import CacheSettings, looks_deterministic
from gpuload.cache.columns import Part, column_rows, layout, prepare, rebuild
from gpuload.cache.disk_tier import DiskRows
from gpuload.distributed.group import DistributedContext, loader_identity, peers_answer, release_groups
from gpuload.distributed.split_store import (
    SplitStore,
    agree_on_split,
    decline_split,
    split_array_store,
    split_context,
    split_obstacle,
)
from gpuload.transfer import Staging

__all__ = ["ReadBlock", "SplitSamples", "split_samples"]

#: Reads chunks of dataset indices; yields each chunk's samples prepared for the column store.
ReadBlock = Callable[[list[list[int]]], AbstractContextManager[Iterable[Part]]]

_READ_OK, _LAYOUT_DIFFERS, _READ_FAILED = 0, 1, 2


class SplitSamples:
    """This rank's share of the samples (``store``) and the structure their batches take, as the
    sample source holds it: what it reports of it, as ``CachedSamples`` does of a cache."""

    def __init__(self, store: SplitStore, template: Part, disk: dict[str, Any] | None = None) -> None:
        self.store = store
        self._template = template
        self._disk = disk  # cache_dir's disk tier as the share's read left it, or None
        self.h2d_bytes = store.stats.device_bytes  # the share, copied to the device once

    @property
    def path(self) -> str:
        return self.store.plan.kind

    def describe(self) -> str:
        """For ``loader.stats.extra["sample_cache_decision"]``."""
        return self.store.plan.describe()

    def begin_epoch(self, keepable: Any) -> None:
        """Nothing to give back: a share cannot shrink on one rank (``SplitStore.shrink``)."""

    def warm(self, progress: bool, num_workers: int, worker_options: dict[str, Any]) -> int:
        """Nothing to fill: the share was read whole when it was made."""
        return 0

    def entries(self) -> dict[str, Any]:
        """The sample source's entries in ``loader.stats.extra``."""
        cache = self.store.stats.as_dict()
        if self._disk is not None:
            cache["disk"] = self._disk
        return {"cache": cache, "cache_plan": self.store.plan.describe(), "sample_cache_decision": self.describe()}

    def batch(self, rows: list[torch.Tensor]) -> Any:
        """The batch ``default_collate`` gives for one exchanged batch's columns."""
        return rebuild(self._template, rows)

    def close(self) -> None:
        """Drop the share (the stats of a closed loader say nothing of it)."""
        self.store.close()


def split_samples(
    dataset: Any,
    settings: CacheSettings,
    device: torch.device,
    batch_sampler: Any,
    owner: Hashable,
    *,
    default_collate: bool,
    read: ReadBlock,
    chunk_size: int,
    context: DistributedContext | None = None,
    probe: Callable[[Any], tuple[bool, str]] = looks_deterministic,
    staging: Staging | None = None,
) -> SplitSamples | None:
    """This rank's share of ``dataset``'s samples when the scope splits them, else None.

    ``default_collate``: the loader collates with torch's ``default_collate`` (auto-collation);
    ``read`` reads this rank's rows in chunks of ``chunk_size`` (in this process, or with the
    loader's workers). Every rank must call this at the same point, as for arrays.
    """
    num_samples = len(dataset)
    context = split_context(settings, device, context, loader_identity(num_samples, batch_sampler))
    if context is None:
        return None
    why_not = split_obstacle(settings, batch_sampler, num_samples, context)
    if why_not is not None:  # from the settings and the sampler: every rank finds it alike
        decline_split(settings, why_not, stacklevel=6)
        return None
    # The disk tier's key first: taken before any read, as a rank's own cache takes it.
    fingerprint = DiskRows.identify(dataset, settings) if default_collate else None
    declined, template = _columns_of(dataset, settings, default_collate, probe)
    bytes_per_sample = 0 if template is None else sum(
        rows[0].numel() * rows.element_size() for rows in column_rows(template))
    agreed = agree_on_split(settings, device, batch_sampler, owner, context, num_samples, bytes_per_sample,
                            declined=declined)
    if agreed is None:
        return None
    assert template is not None  # the ranks agreed to split: none declined, this one included
    plan, groups = agreed
    start, stop = plan.partition.rows_of(context.rank)
    chunks = [list(range(first, min(first + chunk_size, stop))) for first in range(start, stop, chunk_size)]
    raised, disk = "", None
    try:  # every rank reports its outcome below, whatever this raises
        disk = DiskRows.open(dataset, settings, fingerprint)
        block = _read_block(template, chunks, read, disk)
        outcome = _READ_OK if block is not None else _LAYOUT_DIFFERS
    except Exception as error:  # noqa: BLE001 - torch's path raises it again, at that sample's batch
        block, outcome, raised = None, _READ_FAILED, f": {type(error).__name__}: {error}"
    finally:
        disk_stats = disk.stats() if disk is not None else None
        if disk is not None:
            disk.close()
    failed = _failed_ranks(outcome, groups[0], context)
    if failed:
        release_groups(groups)
        rank, code = failed[0]
        what = ("has a sample whose structure, dtype or shape differs from the probed ones"
                if code == _LAYOUT_DIFFERS else "could not read a sample of its share")
        if rank == context.rank:
            what += raised
        first, end = plan.partition.rows_of(rank)
        decline_split(settings, f"rank {rank} {what} (among rows [{first}, {end}))", stacklevel=6)
        return None
    assert block is not None  # every rank read its share, this one too
    return SplitSamples(split_array_store(block, plan, device, groups, owner=owner, staging=staging), template,
                          disk_stats)


class _FirstReads:
    """A dataset as the probe reads it, keeping the first read of each index."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.samples: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        sample = self.dataset[index]
        self.samples.setdefault(index, sample)
        return sample


def _columns_of(
    dataset: Any, settings: CacheSettings, default_collate: bool, probe: Callable[[Any], tuple[bool, str]]
) -> tuple[str | None, Part | None]:
    """(None, a prepared batch of the probed samples) when the samples can be split by column,
    else (why not, None)."""
    off = settings.off_reason()
    if off:
        return off, None
    if not default_collate:
        return "its batches are not made by torch's default_collate (a custom collate_fn)", None
    if len(dataset) == 0:
        return "the dataset is empty", None
    seen = _FirstReads(dataset)
    try:
        deterministic, why = probe(seen)
    except Exception as error:  # noqa: BLE001 - reported, and raised again by torch's path
        return f"reading its samples for the determinism probe failed ({type(error).__name__}: {error})", None
    if not deterministic:
        return why, None
    template = prepare(list(seen.samples.values()))
    if layout(template) is None:
        return ("its samples do not collate to fixed-shape tensors (a leaf is a string, an object or varies in shape)",
                None)
    return None, template


def _read_block(
    template: Part, chunks: list[list[int]], read: ReadBlock, disk: DiskRows | None = None,
) -> list[torch.Tensor] | None:
    """This rank's rows by column, chunk by chunk: from ``disk`` (``cache_dir``'s disk tier of
    the dataset's samples) where it has a whole chunk, the others read from the dataset (and
    written to ``disk``); None when a chunk's layout differs from ``template``'s. A read that
    yields another number of parts than the chunks it was given is a ``ValueError``."""
    expected = layout(template)
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + len(chunk))
    block = [torch.empty((starts[-1], *column.shape[1:]), dtype=column.dtype) for column in column_rows(template)]

    def put(k: int, part: Part) -> bool:
        if layout(part) != expected:
            return False
        for column, values in zip(block, column_rows(part)):
            column[starts[k] : starts[k + 1]] = values
        return True

    pending = []
    for k, chunk in enumerate(chunks):
        stored = disk.read(torch.tensor(chunk)) if disk is not None else None
        if stored is None or not put(k, stored):
            pending.append(k)
    if not pending:
        return block
    with read([chunks[k] for k in pending]) as parts:
        for k, part in zip(pending, parts, strict=True):
            if not put(k, part):
                return None
            if disk is not None:
                disk.write(torch.tensor(chunks[k]), part)
    return block


def _failed_ranks(outcome: int, control: Any, context: DistributedContext) -> list[tuple[int, int]]:
    """Every rank's read outcome (gloo), as ``(rank, outcome)`` of the ranks whose read failed."""
    everyone = [torch.empty(1, dtype=torch.int64) for _ in range(context.world_size)]
    with peers_answer(f"gpuload: rank {context.rank} read its share of the samples but another rank did not "
                      "report its own (it stopped or died)."):
        dist.all_gather(everyone, torch.tensor([outcome], dtype=torch.int64), group=control)
    return [(rank, int(code)) for rank, code in enumerate(everyone) if int(code) != _READ_OK]

