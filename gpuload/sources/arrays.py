"""In-memory arrays: the data sits in one place, each batch is one gather (``index_select``).

``detect`` recognises datasets whose samples are rows of arrays (``TensorDataset``,
``gpuload.ArrayDataset``, a bare tensor or numpy array) and proves, on sample 0, that a gather
reproduces torch's fetch + collate exactly. At the first epoch the cache plan places the arrays
(device, pinned host, or left at the source) and every batch is gathered where they live; when
they stay on the host, batches are gathered straight into the prefetcher's pinned slots.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.data import TensorDataset, default_collate, default_convert

from gpuload.augment import BatchAugmenter, image_column
from gpuload.cache import CacheSettings, StoreStats, TieredArrayStore, format_bytes
from gpuload.cache.array_store import gatherable, private_host_tier
from gpuload.datasets.arrays import ArrayDataset
from gpuload.device import device_memory, host_memory
from gpuload.distributed.group import current_context
from gpuload.distributed.shared_host import node_host_tier
from gpuload.distributed.sharded_store import ShardedArrayStore, shard_arrays
from gpuload.prefetch import Fill, TensorSpec, default_depth
from gpuload.sampling import in_range
from gpuload.sources import Indices, Schedule, Setup, Source, Work
from gpuload.transfer import batch_length

__all__ = ["ArrayColumns", "ArraySource", "ResidentColumns", "detect", "find_columns"]


def _raw_columns(dataset: Any) -> list[torch.Tensor] | None:
    if isinstance(dataset, TensorDataset) and type(dataset).__getitem__ is TensorDataset.__getitem__:
        return list(dataset.tensors)
    if isinstance(dataset, ArrayDataset) and type(dataset).__getitem__ is ArrayDataset.__getitem__:
        return list(dataset.columns.values())
    if type(dataset) is torch.Tensor:
        return [dataset]
    if type(dataset) is np.ndarray and dataset.dtype.kind in "biuf" and dataset.ndim > 0:
        try:
            return [torch.from_numpy(dataset)]
        except (ValueError, TypeError):  # negative strides, unsupported dtypes
            return None
    return None


def _same_arrays(now: list[torch.Tensor], placed: list[torch.Tensor]) -> bool:
    """Whether ``now`` are the arrays ``placed`` was made from: the same memory, shape, strides
    and dtype (numpy arrays are wrapped anew each time, so identity alone would not do; the
    placed tensors are still held, so their memory cannot have been reused)."""
    return len(now) == len(placed) and all(
        a is b
        or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)
        for a, b in zip(now, placed)
    )


def find_columns(
    dataset: Any, collate_fn: Callable[[Any], Any], batched: bool
) -> ArrayColumns | None:
    """The dataset's arrays and the batch structure, when gathering equals torch's collation.

    Returns None (use torch's path) unless the dataset is plain rows of strided arrays and
    collating sample 0 gives exactly those arrays' first rows, with the same dtypes and shapes.
    """
    columns = _raw_columns(dataset)
    if not columns or any(c.layout != torch.strided or c.dim() == 0 for c in columns):
        return None
    if columns[0].shape[0] == 0:
        return None
    sample = dataset[0]
    template = collate_fn([sample]) if batched else collate_fn(sample)
    leaves, spec = tree_flatten(template)
    if len(leaves) != len(columns):
        return None
    for leaf, column in zip(leaves, columns):
        expected = column[0:1] if batched else column[0]
        if not isinstance(leaf, torch.Tensor) or leaf.dtype != column.dtype:
            return None
        if leaf.shape != expected.shape or not torch.equal(leaf, expected):
            return None
    return ArrayColumns(columns, spec, columns[0].shape[0])


def _batch_builder(spec: TreeSpec) -> Callable[[list[torch.Tensor]], Any]:
    """A function from leaves to the batch structure; direct for a flat list, tuple or dict."""
    if spec.is_leaf():
        return lambda leaves: leaves[0]
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    flat = all(child.is_leaf() for child in children)
    if flat and spec.type is list:
        return lambda leaves: leaves
    if flat and spec.type is tuple:
        return tuple
    if flat and spec.type is dict:
        keys = list(spec.context)
        return lambda leaves: dict(zip(keys, leaves))
    return lambda leaves: tree_unflatten(leaves, spec)


@dataclass
class ArrayColumns:
    """Host arrays with one row per sample, and the tree structure a batch of them takes."""

    columns: list[torch.Tensor]
    spec: TreeSpec
    num_samples: int

    def __post_init__(self) -> None:
        self.build = _batch_builder(self.spec)

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.columns)

    def place(
        self, device: torch.device, settings: CacheSettings, owner: Hashable, batch_sampler: Any = None
    ) -> ResidentColumns:
        """Put the arrays where the cache plan says: device, pinned host, or left at the source.

        In a torch.distributed job whose ``cache_scope`` splits the dataset over ranks (and
        whose ``batch_sampler`` is torch's over a ``DistributedSampler``), a
        ``ShardedArrayStore`` holds this rank's share. ``cache="off"`` (or a plan that caches
        nothing) keeps the arrays where they are and streams every batch through the
        prefetcher's pinned slots. On a CPU device the arrays are served in place. Otherwise a
        ``TieredArrayStore`` holds the device and host tiers; in a torch.distributed job the
        node's ranks share one host tier (``distributed.shared_host``), or each keeps its own in
        its share of the node's host budget.
        """
        sharded = shard_arrays(self.columns, settings, device, batch_sampler, owner)
        if sharded is not None:
            return ResidentColumns(self, self.columns, device, sharded.plan.kind, copies_batches=False, store=sharded)
        if settings.mode.value == "off":
            return ResidentColumns(self, self.columns, device, "host-gather", copies_batches=True)
        if device.type == "cpu":
            return ResidentColumns(self, self.columns, device, "device-gather", copies_batches=False)
        shared_host = node_host_tier(settings, device, batch_sampler)  # every rank must then place
        context = current_context()
        plan = settings.array_plan(
            self.nbytes // self.num_samples, self.num_samples, device_memory(device), host_memory(),
            device=device, owner=owner,
            host_copies=context.local_world_size if context is not None and shared_host is None else 1,
        )
        if plan.device_samples + plan.host_samples == 0 and shared_host is None:
            warnings.warn(
                f"gpuload: nothing of the dataset ({format_bytes(self.nbytes)}) fits the cache "
                f"budget on {device}; batches stream from the host each step. {plan.describe()}",
                stacklevel=3,
            )
            return ResidentColumns(self, self.columns, device, "host-gather", copies_batches=True)
        store = TieredArrayStore(self.columns, plan, device, owner=owner, host_tier=shared_host or private_host_tier)
        path = "device-gather" if plan.device_samples == self.num_samples else f"tiered ({plan.kind})"
        return ResidentColumns(self, self.columns, device, path, copies_batches=False, store=store)


class ResidentColumns:
    """Arrays in their serving place (device, or host for host-gather) that batches gather from."""

    def __init__(
        self,
        source: ArrayColumns,
        columns: list[torch.Tensor],
        device: torch.device,
        path: str,
        copies_batches: bool,
        store: TieredArrayStore | ShardedArrayStore | None = None,
    ) -> None:
        self.source = source
        self.dtypes = [column.dtype for column in columns]
        self.columns = [gatherable(column) for column in columns]  # uint16/32/64 as signed views
        self.device = device
        self.path = path
        self.store = store
        self._where = columns[0].device
        self._copies_batches = copies_batches
        self._store_h2d_seen = 0

    @property
    def placed_bytes(self) -> int:
        """Bytes copied to the device to fill its tier (0 without a store)."""
        return self.store.stats.device_bytes if self.store is not None else 0

    @property
    def stats(self) -> StoreStats | None:
        """Bytes and hits per tier, when a cache store serves the batches."""
        return self.store.stats if self.store is not None else None

    def release(self) -> None:
        """Give back device and pinned memory now, even while an abandoned iterator holds this."""
        self.columns = []
        if self.store is not None:
            self.store.close()

    def shrink_to_reserve(self, settings: CacheSettings) -> int:
        """At an epoch start: give device memory back if the model has grown into the reserve."""
        if self.store is None or self.device.type != "cuda":
            return 0
        held = self.store.stats.device_bytes
        return self.store.shrink_device_tier(settings.keepable(self.device, device_memory(self.device), held))

    @property
    def copies_batches(self) -> bool:
        """True when the arrays stay on the host and every batch is copied to the device."""
        return self._copies_batches

    def checked_index(self, indices: Any) -> torch.Tensor:
        """``indices`` as a flat int64 tensor in range, failing the way torch's fetch fails."""
        if not self.columns:
            raise RuntimeError("this gpuload.DataLoader was closed; iterate a new loader instead")
        flat = in_range(indices, self.source.num_samples)
        if flat.numel() == 0:
            raise IndexError("list index out of range")  # torch collates an empty list, which fails so
        return flat

    def gather(self, indices: Any, batched: bool, checked: bool = False) -> tuple[Any, torch.Tensor, int]:
        """One batch, gathered where the arrays live: (batch, checked indices, bytes moved).

        ``checked``: the indices are an int64 tensor already known to lie in [0, len), as
        torch's RandomSampler and SequentialSampler over this dataset guarantee.
        """
        if not self.columns:
            raise RuntimeError("this gpuload.DataLoader was closed; iterate a new loader instead")
        flat = indices if checked else self.checked_index(indices)
        if self.store is not None:
            leaves = self.store.gather(flat)
            h2d = self.store.stats.h2d_bytes
            moved_bytes, self._store_h2d_seen = h2d - self._store_h2d_seen, h2d
            if not batched:
                leaves = [leaf.squeeze(0) for leaf in leaves]
            return self.source.build(leaves), flat, moved_bytes
        moved_bytes = 0
        where = flat
        if self._where != flat.device:
            where = flat.to(self._where, non_blocking=True)
            moved_bytes = flat.numel() * flat.element_size()
        leaves = [column.index_select(0, where).view(dtype) for column, dtype in zip(self.columns, self.dtypes)]
        if not batched:
            leaves = [leaf.squeeze(0) for leaf in leaves]
        if self._where != self.device:  # host arrays without the prefetcher (prefetch_depth=0)
            moved_bytes += sum(leaf.numel() * leaf.element_size() for leaf in leaves)
            leaves = [leaf.to(self.device) for leaf in leaves]
        return self.source.build(leaves), flat, moved_bytes

    def fill(self, flat: torch.Tensor, batched: bool) -> Fill:
        """A batch for the prefetcher, gathered on the host straight into its pinned slot.

        ``flat`` comes from ``checked_index``: the check runs in the loop's thread, in order.
        """
        shapes = [(flat.numel(), *c.shape[1:]) if batched else tuple(c.shape[1:]) for c in self.columns]
        layout = tree_unflatten([TensorSpec(shape, dtype) for shape, dtype in zip(shapes, self.dtypes)], self.source.spec)
        columns = self.columns

        def gather_into(slot: Any) -> None:
            targets, _ = tree_flatten(slot)
            for column, target in zip(columns, targets):
                torch.index_select(column, 0, flat, out=target.view(column.dtype).view(-1, *column.shape[1:]))

        return Fill(layout, gather_into)


def detect(setup: Setup) -> ArraySource | None:
    """An ArraySource when the dataset's batches can be gathered from its arrays, else None
    (also when a ``worker_init_fn`` asks for worker processes and no ``transforms=`` ask for
    gpuload: torch's path runs it)."""
    if not setup.map_style or setup.collate_fn not in (default_collate, default_convert):
        return None
    if setup.worker_code and not setup.transforms:
        return None
    columns = find_columns(setup.dataset, setup.collate_fn, setup.batched)
    return ArraySource(setup, columns) if columns is not None else None


class ArraySource(Source):
    """Batches gathered from in-memory arrays wherever the cache plan put them.

    With ``transforms=``, the first uint8 N,C,H,W array is transformed after each gather.
    Arrays kept on the host (``cache="off"``) stream through the prefetcher's pinned slots,
    on a CPU device too: that is what ``cache="off"`` asks for.
    """

    def __init__(self, setup: Setup, columns: ArrayColumns) -> None:
        super().__init__(setup)
        self.columns = columns
        self.resident: ResidentColumns | None = None
        self.augment = None
        if setup.transforms:
            leaf = image_column(columns.columns)
            self.augment = BatchAugmenter(setup.transforms, setup.seed, setup.device, leaf)

    def _sharded(self) -> ShardedArrayStore | None:
        store = self.resident.store if self.resident is not None else None
        return store if isinstance(store, ShardedArrayStore) else None

    def _place(self) -> bool:
        """Place the arrays where the cache plan says, once; False if they were placed already."""
        if self.resident is not None:
            return False
        setup = self.setup
        self.resident = self.columns.place(setup.device, setup.settings, setup.owner, setup.batch_sampler)
        self.h2d_bytes += self.resident.placed_bytes
        self.path = self.resident.path
        return True

    def begin_epoch(self) -> None:
        self._follow_dataset()
        if not self._place():
            self.resident.shrink_to_reserve(self.setup.settings)

    def warm(self, progress: bool) -> None:
        self._follow_dataset()
        self._place()

    def _follow_dataset(self) -> None:
        """Serve the arrays the dataset holds now: when they are other tensors, or have another
        shape, than those placed (``ds.tensors = ...``), the placement (and its cache) is
        dropped and rebuilt from them. Changes made in place to the same tensors are seen by
        ``cache="off"`` and a CPU device, not by a copy already in a cache."""
        now = _raw_columns(self.setup.dataset)
        if now is not None and _same_arrays(now, self.columns.columns):
            return
        setup = self.setup
        columns = find_columns(setup.dataset, setup.collate_fn, setup.batched)
        old = self.columns
        if columns is None or columns.spec != old.spec or [c.dtype for c in columns.columns] != [
            c.dtype for c in old.columns
        ]:
            raise ValueError(
                f"the arrays of this {type(setup.dataset).__name__} changed since the DataLoader was "
                "built, into ones gpuload cannot serve as before (another structure, dtype, or no "
                "samples); build a new gpuload.DataLoader for them"
            )
        self.close()  # the old placement and its cache hold the old arrays
        self.columns = columns

    def epoch(self, indices: Indices) -> Schedule:
        """Host arrays copied each batch run ahead (on a CPU device too: ``cache="off"`` asks for
        the pinned staging), and so may a sharded share's exchange (gloo only: ``runs_ahead``),
        which makes its batches on the device itself; arrays on the device are served in place."""
        sharded = self._sharded()
        if sharded is not None:
            # Double buffering: the exchange of the next batch while the loop computes this one.
            return Schedule(lambda ahead: self._sharded_epoch(sharded, indices, ahead), ahead=sharded.runs_ahead,
                            ahead_on_cpu=True, staged=False)
        sample_bytes = self.columns.nbytes // max(self.columns.num_samples, 1)
        return Schedule(lambda ahead: self._work(indices, ahead), ahead=self.resident.copies_batches,
                        ahead_on_cpu=True, depth=default_depth(sample_bytes * (self.setup.batch_size or 1)))

    def _work(self, request: Indices, ahead: bool) -> Work:
        resident, batched = self.resident, self.setup.batched
        indices = request.batches(ahead)
        if not ahead:
            checked = request.in_range

            def gather(index: Any) -> tuple[Any, int]:
                batch, flat, moved_bytes = resident.gather(index, batched, checked)
                self.h2d_bytes += moved_bytes
                return self._augmented(batch, flat, request.number), flat.numel()

            return Work(indices, gather)
        # The check runs once in the prefetcher's thread (the gather needs it) and once here,
        # in order, for the transforms' per-sample randomness: a bad index fails after the
        # batches before it either way.
        drawn = list(indices)
        fills = (resident.fill(resident.checked_index(index), batched) for index in drawn)
        positions = (resident.checked_index(index) for index in drawn) if self.augment is not None else None

        def finish(batch: Any) -> tuple[Any, int]:
            if positions is not None:
                batch = self._augmented(batch, next(positions), request.number)
            return batch, batch_length(batch) if batched else 1

        return Work(fills, finish)

    def _sharded_epoch(self, store: ShardedArrayStore, request: Indices, ahead: bool) -> Work:
        """Batches assembled from every rank's share (each a collective), ahead of the loop in
        the prefetcher's thread when the request runs ahead (gloo only: ``store.runs_ahead``)."""
        drawn = [torch.as_tensor(index, dtype=torch.long).reshape(-1) for index in request.batches(ahead)]
        steps = store.epoch(self.setup.batch_sampler, drawn, position=request.position, ahead=ahead,
                            loop_wait_s=self.setup.stats.wait_time_s, number=request.number)

        def finish(item: tuple[list[torch.Tensor], torch.Tensor]) -> tuple[Any, int]:
            steps.handed_over()
            leaves, flat = item
            return self._augmented(self.columns.build(leaves), flat, request.number), flat.numel()

        return Work(steps, finish)

    def _augmented(self, batch: Any, flat: torch.Tensor, epoch: int) -> Any:
        if self.augment is None:
            return batch
        batch = self.augment(batch, flat, epoch, self.setup.batched)
        self.setup.stats.extra["transform_backend"] = self.augment.backend
        return batch

    def device_cache_bytes(self) -> int:
        store = self.resident.store if self.resident is not None else None
        return store.stats.device_bytes if store is not None else 0

    def shrink_cache(self, max_device_bytes: int) -> int:
        """Device rows go first from the end of the device tier; the host tier or the arrays
        still hold them (a sharded share frees nothing, and warns: the other ranks read from it)."""
        store = self.resident.store if self.resident is not None else None
        return store.shrink_device_tier(max_device_bytes) if store is not None else 0

    def split_over_ranks(self) -> bool:
        return self._sharded() is not None

    def stats(self) -> dict[str, Any]:
        store = self.resident.store if self.resident is not None else None
        if store is None:
            return {}
        found = {"cache": store.stats.as_dict(), "cache_plan": store.plan.describe()}
        if isinstance(store, ShardedArrayStore) and store.exchange_stats.wait_s_per_epoch:
            found["exchange"] = store.describe_exchange(loop_wait_s=self.setup.stats.wait_time_s)
        return found

    def close(self) -> None:
        if self.resident is not None:
            self.resident.release()
            self.resident = None
